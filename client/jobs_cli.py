"""`tessera train` and `tessera jobs` (wired into client/cli.py)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from google.protobuf import json_format

from client import billing, cli_args
from client.api import COORDINATOR_ENV, Client, default_coordinator
from client.jobs import JobEvent, TrainingJob
from client.training_driver import TrainingDriverConfig
from protos.tessera.v1 import jobs_pb2

STATE_NAMES = {
    jobs_pb2.JOB_STATE_QUEUED: "queued",
    jobs_pb2.JOB_STATE_RUNNING: "running",
    jobs_pb2.JOB_STATE_PAUSED: "paused",
    jobs_pb2.JOB_STATE_FAILED: "failed",
    jobs_pb2.JOB_STATE_DONE: "done",
}

_DRIVER = TrainingDriverConfig()
_GIVEN_UP = f"max({_DRIVER.step_deadline_floor_s:g} s, {_DRIVER.step_deadline_factor:g}x"
TRAIN_EXAMPLES = f"""\
examples:
  # fine-tune on a .npy of token ids (1-D stream, or 2-D: one example per row)
  tessera train --model llama-tiny --data tokens.npy --steps 200 --batch-size 8 \\
      --seq-len 64 --lr 3e-4 --micro-batches 4 --checkpoint-every 20
  # LoRA on a text file (tokenized with the model's tokenizer), saved as a new model
  tessera train --model llama-tiny --data corpus.txt --steps 100 --batch-size 4 \\
      --seq-len 128 --lr 1e-3 --mode lora --output-model llama-tiny-lora
  # the runner died (Ctrl-C, a crash): continue from the last consistent checkpoint
  tessera train --resume j0123456789abcdef
  # nodes that ask a training price: pay from ~/.tessera/client.key, at most 50000 units
  tessera train --model llama-tiny --data tokens.npy --steps 200 --batch-size 8 \\
      --seq-len 64 --lr 3e-4 --max-price 50000

The dataset is uploaded once and kept by the coordinator, so --resume needs no file: it
downloads the dataset once to ~/.cache/tessera/datasets (or $TESSERA_CACHE_DIR/datasets).
A .npy file is memory-mapped, never read into memory whole, so it may be larger than RAM.
If a stage node fails, or stops answering (given up after {_GIVEN_UP} its recent calls of
the same kind)), the job re-plans that stage and rolls back to the last checkpoint.
A priced job escrows its quote when it opens, pays per sample-layer at every checkpoint
from receipts both sides signed, and refunds the rest at the end (docs/ledger.md).
"""


def add_training_commands(commands: Any) -> None:
    train = commands.add_parser(
        "train",
        help="train a model through the swarm (pipeline-sharded)",
        description="Submit a training job and run it: every stage node trains its own "
        "layers and keeps its optimizer state; checkpoints go to the coordinator.",
        epilog=TRAIN_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _coordinator(train)
    train.add_argument(
        "--resume", metavar="JOB_ID", help="continue this job instead (see `tessera jobs`)"
    )
    train.add_argument("--model", help="the model to train (see `tessera models`)")
    train.add_argument(
        "--data",
        metavar="FILE",
        help=".npy of token ids (1-D stream, or 2-D: one example per row), or a text file the "
        "model's tokenizer encodes",
    )
    train.add_argument("--steps", type=cli_args.positive_int, metavar="N", help="optimizer steps")
    train.add_argument(
        "--batch-size", type=cli_args.positive_int, metavar="N", help="sequences per step"
    )
    train.add_argument(
        "--seq-len", type=cli_args.positive_int, metavar="N", help="tokens per sequence"
    )
    train.add_argument(
        "--lr", type=cli_args.positive_float, metavar="LR", help="AdamW learning rate, e.g. 3e-4"
    )
    train.add_argument(
        "--micro-batches",
        type=cli_args.positive_int,
        default=1,
        metavar="M",
        help="split each batch into M pipelined micro-batches; M must divide --batch-size "
        "(default 1)",
    )
    train.add_argument(
        "--checkpoint-every",
        type=cli_args.non_negative_int,
        default=0,
        metavar="K",
        help="checkpoint every K steps (default 0: only at the end)",
    )
    train.add_argument(
        "--mode",
        choices=("full", "lora"),
        default="full",
        help="train every weight, or LoRA adapters (default full)",
    )
    train.add_argument(
        "--lora-rank",
        type=cli_args.positive_int,
        default=8,
        metavar="R",
        help="LoRA rank, with --mode lora (default 8)",
    )
    train.add_argument(
        "--lora-alpha",
        type=cli_args.positive_float,
        default=16.0,
        metavar="A",
        help="LoRA alpha, with --mode lora: adapters are scaled by A / R (default 16)",
    )
    train.add_argument(
        "--weight-decay",
        type=cli_args.non_negative_float,
        default=0.0,
        metavar="WD",
        help="AdamW weight decay (default 0)",
    )
    train.add_argument(
        "--max-grad-norm",
        type=cli_args.non_negative_float,
        default=1.0,
        metavar="NORM",
        help="clip the global gradient norm to this (0: off; default 1)",
    )
    train.add_argument(
        "--seed",
        type=cli_args.seed,
        default=0,
        metavar="N",
        help="batch order and LoRA init seed (default 0)",
    )
    train.add_argument(
        "--output-model",
        metavar="NAME",
        help="register the trained weights as a new model when done",
    )
    train.add_argument("--account", default="", help="account billed for the job")
    train.add_argument(
        "--key",
        type=Path,
        default=None,
        metavar="PATH",
        help=f"client key that owns the job, and pays for it where nodes ask a price: only "
        f"this key can open the job's sessions, --resume included (default: ${billing.KEY_ENV}"
        " or ~/.tessera/client.key, created on first use)",
    )
    train.add_argument(
        "--max-price",
        type=cli_args.credit_units,
        default=0,
        metavar="UNITS",
        help="refuse the job if its quote (steps x batch x layers x the nodes' prices) is "
        "above this many credit units (default: no cap)",
    )
    train.add_argument("--json", action="store_true", help="print the final job as JSON")
    train.set_defaults(command_parser=train)

    jobs = commands.add_parser(
        "jobs",
        help="list training jobs",
        description="List training jobs, newest first: state, step, loss, last checkpoint.",
        epilog="example: tessera jobs --json",
    )
    _coordinator(jobs)
    jobs.add_argument(
        "--limit",
        type=cli_args.positive_int,
        default=50,
        metavar="N",
        help="at most this many (default 50)",
    )
    jobs.add_argument("--json", action="store_true", help="print JSON for scripts")


def _coordinator(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--coordinator",
        default=None,
        metavar="HOST:PORT",
        type=cli_args.coordinator_address,
        help=f"coordinator address (default: ${COORDINATOR_ENV} or {default_coordinator()})",
    )


def train_command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if args.resume is None:
        missing = [
            f"--{n.replace('_', '-')}"
            for n in ("model", "data", "steps", "batch_size", "seq_len", "lr")
            if getattr(args, n) is None
        ]
        if missing:
            parser.error(f"train needs {', '.join(missing)} (or --resume JOB_ID)")
        # Checked here, before the dataset is uploaded and a job is submitted: the
        # coordinator would refuse both too, but only after the upload.
        if args.batch_size % args.micro_batches:
            parser.error(
                f"--micro-batches {args.micro_batches} does not divide --batch-size "
                f"{args.batch_size}; pick a divisor"
            )
        data = Path(args.data)
        if not data.exists():
            parser.error(f"--data {args.data}: no such file")
        if not data.is_file():
            parser.error(
                f"--data {args.data} is not a file; give a .npy of token ids or a text file"
            )
    from client.cli import load_client_key  # here: cli imports this module

    # The key owns the job: without one, anyone who lists the job ids could take it over.
    key = load_client_key(args.key or billing.default_key_path(), create=args.key is None)
    with (
        Client(args.coordinator, account=args.account, key=key, max_price=args.max_price) as client,
        _TransferBars(quiet=args.json) as bars,
    ):
        if args.resume:
            info = client.job(args.resume)
            handle = client.resume(args.resume, progress=bars)
        else:
            handle = client.train(
                args.model,
                args.data,
                steps=args.steps,
                batch_size=args.batch_size,
                seq_len=args.seq_len,
                lr=args.lr,
                micro_batches=args.micro_batches,
                checkpoint_every=args.checkpoint_every,
                mode=args.mode,
                lora_rank=args.lora_rank,
                lora_alpha=args.lora_alpha,
                weight_decay=args.weight_decay,
                max_grad_norm=args.max_grad_norm,
                seed=args.seed,
                output_model=args.output_model or "",
                account=args.account,
                progress=bars,
            )
            info = client.job(handle.job_id)
        bars.close()
        print(
            f"job {handle.job_id}: {info.model}, {info.steps} steps "
            f"(tessera train --resume {handle.job_id} continues it)",
            file=sys.stderr,
        )
        try:
            _follow(handle, info, quiet=args.json)
        except KeyboardInterrupt:
            handle.cancel()
            print(
                f"\npaused; continue with: tessera train --resume {handle.job_id}", file=sys.stderr
            )
            return 130
        final = client.job(handle.job_id)
    if args.json:
        print(json.dumps(job_json(final), indent=2))
    else:
        saved = f", saved as model {final.output_model}" if final.output_model else ""
        print(
            f"job {final.job_id} {STATE_NAMES.get(final.state, '?')} at step {final.step}, "
            f"loss {final.last_loss:.4f}{saved}"
        )
    return 0


class _TransferBars:
    """A progress bar, in bytes, for each part of moving the dataset: hashing and uploading
    it, or downloading it for --resume."""

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet
        self._what = ""
        self._bar: Any = None

    def __call__(self, what: str, done: int, total: int) -> None:
        from tqdm import tqdm  # the client extra; only the progress bar needs it

        if what != self._what:
            self.close()
            self._what = what
            self._bar = tqdm(total=total, desc=what, unit="B", unit_scale=True,
                             unit_divisor=1024, disable=self.quiet, dynamic_ncols=True,
                             file=sys.stderr)  # fmt: skip
        self._bar.update(done - self._bar.n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar, self._what = None, ""

    def __enter__(self) -> _TransferBars:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _follow(handle: TrainingJob, info: jobs_pb2.JobInfo, quiet: bool) -> None:
    from tqdm import tqdm  # the client extra; only the progress bar needs it

    bar = tqdm(
        total=info.steps,
        initial=info.step,
        unit="step",
        disable=quiet,
        dynamic_ncols=True,
        file=sys.stderr,
    )

    def write(text: str) -> None:  # above the bar; stdout stays clean for --json
        bar.write(text, file=sys.stderr)

    try:
        for event in handle.events():
            _show(event, bar, write)
        handle.wait()
    finally:
        bar.close()


def _show(event: JobEvent, bar: Any, write: Callable[[str], None]) -> None:
    if event.kind == "step":
        bar.n = event.step
        bar.set_postfix(loss=f"{event.loss:.4f}", tok_s=f"{event.tokens_per_s:.0f}")
    elif event.kind == "checkpoint":
        write(f"checkpoint at step {event.step}")
    elif event.kind == "replan":
        write(f"stage failed, re-planned: {event.detail}; rolling back to step {event.step}")
    elif event.kind == "resume":
        bar.n = event.step
        bar.refresh()
        write(f"resumed at step {event.step} ({event.detail})")


def jobs_command(args: argparse.Namespace) -> int:
    from client import cli  # formatting helpers (imported here: cli imports this module)

    with Client(args.coordinator) as client:
        jobs = client.jobs(args.limit)
    if args.json:
        print(json.dumps([job_json(j) for j in jobs], indent=2))
        return 0
    if not jobs:
        print("no jobs yet (start one with `tessera train`)")
        return 0
    now_ms = time.time() * 1000
    rows = [
        [
            j.job_id,
            j.model,
            STATE_NAMES.get(j.state, "?"),
            f"{j.step}/{j.steps}",
            f"{j.last_loss:.4f}" if j.step else "-",
            str(j.checkpoint_step or "-"),
            str(j.replans),
            j.output_model or "-",
            cli._ago(now_ms - j.updated_unix_ms),
        ]
        for j in jobs
    ]
    header = ["ID", "MODEL", "STATE", "STEP", "LOSS", "CHECKPOINT", "REPLANS", "OUTPUT", "UPDATED"]
    print(cli._table(header, rows))
    return 0


def job_json(info: jobs_pb2.JobInfo) -> dict[str, Any]:
    data = json_format.MessageToDict(info, preserving_proto_field_name=True)
    data["state"] = STATE_NAMES.get(info.state, "?")
    return data
