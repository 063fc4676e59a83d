"""Training benchmark: one model and dataset, trained locally and through 3 stage nodes.

In ONE run, on this machine, with the same weights, batches and hyper-parameters:

  local   the whole model as one `node_agent.runtime.training.StageTrainer` in this
          process: the same schedule of math as the swarm (micro-batch losses scaled by
          1/M, one global-norm clip, AdamW), fp32 on CPU. The "one machine" baseline.
  swarm   a coordinator and four node agents on loopback (`--min-stages 3 --replicas 2`,
          so a failed stage has a ready replacement), a job
          submitted with `AsyncClient.submit_training` and driven by the job runner
          (client/jobs.py -> TrainingDriver, 1F1B over the micro-batches), which reports
          every step to the coordinator like `tessera train` does.
  kill    the same job again with a checkpoint every --checkpoint-every steps, and the
          middle stage's node kill -9'd after --kill-at steps: the job re-plans the stage,
          rolls back to the last consistent checkpoint and finishes. Reported: seconds
          lost against the clean swarm run, and steps redone.

samples/s = sequences trained / time from the end of the warm-up steps (--warmup, not
timed on either side: kernels, channels, first allocations) to the end of the last step.
Checkpoints are off in the timed runs (the final one comes after the last step). Every
torch process gets --threads intra-op threads (default 1; OMP_WAIT_POLICY=PASSIVE), and
the runs take turns, never overlapping. The losses of the swarm run must match the local
run's (exit status 1 if the largest relative difference exceeds 1e-3). The LAST line is
exactly `swarm/local training samples/s ratio: X`.

    .venv/bin/python bench/training.py            # about 3-4 minutes on 2 cores
    .venv/bin/python bench/training.py --quick    # a smaller model and fewer steps
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from text_table import table  # noqa: E402  (bench/text_table.py)

from client.api import AsyncClient, Client  # noqa: E402
from client.datasets import BatchSampler, TokenDataset  # noqa: E402
from client.demo_checkpoint import DemoShape, write_demo_checkpoint  # noqa: E402
from client.jobs import JobEvent, TrainSpec  # noqa: E402
from client.local_swarm import LocalSwarm, wait_for_replicas  # noqa: E402
from node_agent.runtime import load_stage_model  # noqa: E402
from node_agent.runtime.training import StageTrainer, clip_scale  # noqa: E402

MODEL = "bench-train"
NODES = ("alpha", "bravo", "charlie", "delta")
FULL_SHAPE = DemoShape(layers=6, hidden=512, heads=8, kv_heads=4, intermediate=1376)
QUICK_SHAPE = DemoShape(layers=6, hidden=256, heads=8, kv_heads=4, intermediate=688)


@dataclass
class Run:
    label: str
    losses: list[float] = field(default_factory=list)
    ends: list[float] = field(default_factory=list)  # monotonic time each step finished
    started: float = 0.0
    finished: float = 0.0
    replans: int = 0
    steps_redone: int = 0

    def samples_per_s(self, warmup: int, batch: int) -> float:
        timed = len(self.ends) - warmup
        return timed * batch / (self.ends[-1] - self.ends[warmup - 1])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="bench/training.py",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="smaller model, fewer steps")
    parser.add_argument("--steps", type=int, help="optimizer steps (default 24, --quick 12)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed first steps")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--checkpoint-every", type=int, default=4)
    parser.add_argument(
        "--kill-at", type=int, help="kill after this step (default: 2/3 in, between checkpoints)"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--keep", type=Path, help="keep the work directory here")
    parser.add_argument("--verbose", action="store_true")
    return parser.parse_args(argv)


def say(text: str = "") -> None:
    print(text, flush=True)


def dataset(vocab: int, seq_len: int, examples: int = 512) -> TokenDataset:
    rng = np.random.default_rng(0)
    starts = rng.integers(3, vocab - seq_len - 1, size=examples)
    rows = np.stack([np.arange(s, s + seq_len + 1) for s in starts]).astype(np.int32)
    return TokenDataset("bench", rows.reshape(-1), seq_len + 1)


def spec(args: argparse.Namespace, checkpoint_every: int = 0) -> TrainSpec:
    return TrainSpec(
        steps=args.steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        lr=1e-3,
        micro_batches=args.micro_batches,
        checkpoint_every=checkpoint_every,
        seed=1,
    )


def train_local(checkpoint: Path, layers: int, data: TokenDataset, s: TrainSpec) -> Run:
    h = s.hyper()
    trainer = StageTrainer(
        load_stage_model(checkpoint, 0, layers),
        "full",
        lr=h.lr,
        betas=(h.beta1, h.beta2),
        eps=h.eps,
        weight_decay=h.weight_decay,
        seed=h.seed,
        num_micro_batches=h.micro_batches,
    )
    sampler = BatchSampler(data, s.seq_len, s.batch_size, s.seed)
    run = Run("local (one process)", started=time.monotonic())
    for step in range(s.steps):
        inputs, labels = sampler.batch(step)
        losses = []
        parts = zip(
            np.split(inputs, s.micro_batches), np.split(labels, s.micro_batches), strict=True
        )
        for mb, (x, y) in enumerate(parts):
            losses.append(float(trainer.forward(mb, torch.from_numpy(x), torch.from_numpy(y))))
            trainer.backward(mb)
        trainer.step(clip_scale(trainer.grad_sq_norm(), h.max_grad_norm), trainer.version)
        run.losses.append(sum(losses) / len(losses))
        run.ends.append(time.monotonic())
    run.finished = time.monotonic()
    return run


def train_swarm(
    swarm: LocalSwarm, data: TokenDataset, s: TrainSpec, label: str, kill_at: int = 0
) -> Run:
    run = Run(label)
    killed: list[str] = []

    def on_event(event: JobEvent) -> None:
        if event.kind == "step":
            if len(run.losses) >= event.step:  # a redone step after a rollback
                del run.losses[event.step - 1 :], run.ends[event.step - 1 :]
            run.losses.append(event.loss)
            run.ends.append(time.monotonic())
        elif event.kind == "replan":
            run.replans += 1
            run.steps_redone += kill_at - event.step

    async def main() -> None:
        async with AsyncClient(swarm.address) as client:
            info, _ = await client.submit_training(MODEL, data, s)

            async def after_step(step: int) -> None:
                if kill_at and step == kill_at and not killed:
                    job = await client.job(info.job_id)
                    victim = swarm.node(job.stages[len(job.stages) // 2].node_id)
                    killed.append(victim.name)
                    victim.kill9()

            run.started = time.monotonic()
            await client.run_job(
                info.job_id, dataset=data, on_event=on_event, after_step=after_step
            )
            run.finished = time.monotonic()

    asyncio.run(main())
    if killed:
        run.label += f" (kill -9 {killed[0]} after step {kill_at})"
    return run


def heal(swarm: LocalSwarm) -> None:
    alive = {p.name for p in swarm.processes if p.alive() and p.name in NODES}
    restarted = [swarm.start_node(name) for name in NODES if name not in alive]
    swarm.wait_registered(restarted)
    with Client(swarm.address) as client:
        wait_for_replicas(client, MODEL, timeout_s=300)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.steps = args.steps or (12 if args.quick else 24)
    # Halfway between two checkpoints, so the rollback redoes some steps.
    args.kill_at = args.kill_at or (2 * args.steps) // 3 + args.checkpoint_every // 2
    logging.basicConfig(level=logging.INFO if args.verbose else logging.ERROR)
    torch.set_num_threads(args.threads)
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(args.threads)
    workdir = args.keep or Path(tempfile.mkdtemp(prefix="tessera-bench-train-"))
    try:
        return bench(args, workdir)
    finally:
        if args.keep is None:
            shutil.rmtree(workdir, ignore_errors=True)


def bench(args: argparse.Namespace, workdir: Path) -> int:
    shape = QUICK_SHAPE if args.quick else FULL_SHAPE
    checkpoint = write_demo_checkpoint(workdir / "checkpoint", shape, seed=2)
    data = dataset(99, args.seq_len)
    say(
        f"model: {shape.layers} layers, hidden {shape.hidden}; batch {args.batch_size} x "
        f"{args.seq_len} tokens in {args.micro_batches} micro-batches; {args.steps} steps "
        f"({args.warmup} untimed); {args.threads} torch thread(s) per process"
    )
    local = train_local(checkpoint, shape.layers, data, spec(args))
    say(f"local: {local.samples_per_s(args.warmup, args.batch_size):.2f} samples/s")
    with LocalSwarm(
        workdir / "swarm",
        coordinator_args=["--min-stages", "3", "--replicas", "2", "--heartbeat-interval", "1"],
    ) as swarm:
        swarm.start_coordinator()
        swarm.wait_registered([swarm.start_node(name) for name in NODES])
        swarm.add_model(checkpoint, MODEL)
        heal(swarm)
        clean = train_swarm(swarm, data, spec(args), "swarm, 3 stages")
        say(f"swarm: {clean.samples_per_s(args.warmup, args.batch_size):.2f} samples/s")
        heal(swarm)
        faulty = train_swarm(
            swarm, data, spec(args, args.checkpoint_every), "swarm, 3 stages", kill_at=args.kill_at
        )
    worst = max(
        abs(a - b) / max(abs(b), 1e-12) for a, b in zip(clean.losses, local.losses, strict=True)
    )
    same_after = max(
        abs(a - b) / max(abs(b), 1e-12) for a, b in zip(faulty.losses, local.losses, strict=True)
    )
    rows = [["run", "samples/s", "vs local", "wall s", "final loss"]]
    base = local.samples_per_s(args.warmup, args.batch_size)
    for run in (local, clean, faulty):
        rate = run.samples_per_s(args.warmup, args.batch_size)
        rows.append(
            [
                run.label,
                f"{rate:.2f}",
                f"{rate / base:.2f}",
                f"{run.finished - run.started:.1f}",
                f"{run.losses[-1]:.4f}",
            ]
        )
    say()
    say(table(rows))
    lost = (faulty.finished - faulty.started) - (clean.finished - clean.started)
    say()
    say(
        f"one stage failure cost {lost:.1f} s and {faulty.steps_redone} step(s) redone "
        f"({faulty.replans} re-plan; checkpoint every {args.checkpoint_every} steps)"
    )
    say(
        f"losses vs local: largest relative difference {worst:.1e} (clean), "
        f"{same_after:.1e} (after the failure)"
    )
    ratio = clean.samples_per_s(args.warmup, args.batch_size) / base
    say(f"swarm/local training samples/s ratio: {ratio:.2f}")
    return 0 if max(worst, same_after) <= 1e-3 else 1


if __name__ == "__main__":
    sys.exit(main())
