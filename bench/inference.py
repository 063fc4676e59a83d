"""Inference benchmark: one model, one prompt, run locally and through a 3-stage swarm.

In ONE run, on this machine, with the same weights, prompt and greedy decoding:

  local   the whole model as one `node_agent.runtime.StageModel` (layers [0, L), first and
          last) with its KV cache, greedy decoding in a plain loop in this process: the
          "one machine" baseline, fp32 on CPU.
  swarm   a coordinator and three node agents on loopback (`--min-stages 3 --replicas 2`,
          so every stage has an alternate), driven by `client.Client.generate`, with all
          of the product's verification: every reply's signature is checked, and some calls
          also run on a second node and are compared (every call of a node that is new to
          the coordinator, fewer as it earns trust; each round prints how many).
  hop by hop  the same swarm driven the way Petals drives one: the client sends each
          stage its input and waits for its answer (DriverConfig(push=False)). The swarm
          run pushes steps instead: the nodes hand hidden states on to each other and each
          answers the client directly (client/driver.py), 4 transits a token, not 6.
          Both step on demand, to take turns token by token, and so run no ring (the
          last node drawing the next token itself, the driver's default when a caller lets
          the generation run ahead): bench/push_pipeline.py --direct --full compares that
          one generation by generation.
  pipes   for reference, the floor of any 3-process pipeline on this machine: the same
          three layer spans in three plain Python processes joined by multiprocessing
          pipes (no gRPC, no validation, no signatures, no fail-over). swarm/pipes shows
          what Tessera's data path costs; pipes/local what splitting the model over
          processes costs on this machine, whatever carries the tensors.
  kill    the swarm again, with the middle stage's primary node kill -9'd a third of the
          way in: the stall from the kill to the next token, in median token times.

The route has three stages; when the router puts two consecutive stages on one node the
client runs them as one hop (one round trip), so the swarm may make 2 hops per token.
The pipes floor always runs the three stages as three processes.

Cold and warm. Round 1 runs against nodes new to the coordinator, which checks every
one of their calls on a second node: that round is printed as the COLD figure. Trust is
earned by passing checks: after round 1 the swarm generates, untimed, until the
coordinator checks every node at its floor rate (5% of calls by default; 5-10
generations, 10-30 s here), as it checks the nodes of a long-running swarm. The later
rounds then see that steady state: the median of them is the WARM figure, and the last
line. Both ratios are printed; with --rounds 1 only the cold one exists and the last line
is that.

The greedy token ids of every run must be identical (exit status 1 if not). The LAST line
is exactly `swarm/local tokens/s ratio: X` (the warm steady state, see above).

    .venv/bin/python bench/inference.py            # about 2-3 minutes on 2 cores
    .venv/bin/python bench/inference.py --quick    # a smaller model, fewer tokens, ~1 min

What is fair, and why:
  * Threads. Every torch process, this one for the local run and each node agent, gets
    the same intra-op thread count (--threads, default 1): torch.set_num_threads here,
    OMP_NUM_THREADS/MKL_NUM_THREADS for the nodes, which inherit our environment. One
    generation walks the pipeline one stage at a time, so at any moment one process
    computes, with the same threads the local loop has. One thread is the default
    because on a small machine that others share, several processes each running a
    multi-threaded OpenMP pool fight over the same cores and the numbers turn to noise;
    OMP_WAIT_POLICY=PASSIVE (set for all of them) keeps idle pools from spinning when
    you ask for more threads.
  * No overlap, same conditions. In each of --rounds rounds the three runs take turns
    token by token (local token 1, pipes token 1, swarm token 1, local token 2, ...;
    who goes first rotates), never at the same time: the others' processes sit idle
    meanwhile. Each run's clock counts only its own steps. Taking turns per token, not
    per generation, makes the sides see the same load on a machine that others share,
    where the load drifts within seconds; ratios then compare like with like.
  * Warm-up. Each side first generates a few tokens untimed (torch kernels, gRPC
    channels and streams, the nodes' lazy per-span views).
  * Same definition of speed. tokens/s = (generated tokens - 1) / (time from the first
    token to the last, on the run's own clock), computed the same way for every run; the
    time to the first token (the prefill, and for the swarm the session's opening) is
    reported on its own, and so is the whole generation's time, first token included
    (the swarm's checkers catch up on the prompt while the primaries prefill: that cost
    is in the first token, not in tokens/s). The swarm is timed around `client.generate`
    as a user sees it.
    Of the warm rounds (all but the first) the one with the median ratio is reported,
    which keeps a busy neighbour on a shared machine from deciding the result; of an even
    number of them (the default 4), the lower of the two middle ones.
  * Same work. fp32 on CPU, KV cache on, the same prompt and token count on both sides;
    all three compute logits for the last position only and sample from them (the LM
    head skips the prompt's other positions: StageModel's last_position_only, which the
    swarm's last hop gets from ForwardRequest.last_position_only).
"""

from __future__ import annotations

import argparse
import gc
import logging
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
# Read by OpenMP when torch loads, here and in every node agent we start (they inherit
# it): idle OpenMP workers sleep instead of spinning on cores another process needs.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from greedy import greedy_steps  # noqa: E402  (bench/greedy.py)
from text_table import table  # noqa: E402  (bench/text_table.py)

from client.api import Client, GenerationResult  # noqa: E402
from client.demo_checkpoint import DemoShape, write_demo_checkpoint  # noqa: E402
from client.driver import DriverConfig  # noqa: E402
from client.local_swarm import LocalSwarm, clear_state, wait_for_replicas  # noqa: E402
from client.records import HopRecord  # noqa: E402
from client.tokenizer import load_tokenizer  # noqa: E402
from coordinator.settings import Settings  # noqa: E402
from node_agent.runtime import load_stage_model  # noqa: E402

MODEL = "bench-llama"
PROMPT = "In a swarm of community GPUs, every stage keeps its own cache and "
NODES = ("alpha", "bravo", "charlie")
FULL_SHAPE = DemoShape(layers=12, hidden=1024, heads=16, kv_heads=8, intermediate=2816)
SETTLE_S = 0.002
QUICK_SHAPE = DemoShape(layers=6, hidden=768, heads=12, kv_heads=4, intermediate=2048)


@dataclass
class Run:
    """One timed generation: token ids and when each arrived (seconds after the start)."""

    label: str
    token_ids: list[int] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)
    result: GenerationResult | None = None  # the client's record, for swarm runs
    # Index of the first token whose step went through a fail-over (swarm runs).
    first_failover: int | None = None

    @property
    def first_token_s(self) -> float:
        return self.arrivals[0]

    @property
    def token_times(self) -> list[float]:
        return [b - a for a, b in zip(self.arrivals, self.arrivals[1:], strict=False)]

    @property
    def tokens_per_s(self) -> float:
        decode_s = self.arrivals[-1] - self.arrivals[0]
        return (len(self.arrivals) - 1) / decode_s if decode_s > 0 else 0.0

    @property
    def median_token_ms(self) -> float:
        return statistics.median(self.token_times) * 1000.0

    @property
    def p90_token_ms(self) -> float:
        times = sorted(self.token_times)
        return times[int(0.9 * (len(times) - 1))] * 1000.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="bench/inference.py",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--quick", action="store_true", help="a smaller model, fewer tokens, two rounds"
    )
    parser.add_argument(
        "--tokens", type=int, help="tokens to generate per run (default 40, --quick 24)"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        help="rounds of local, pipes, swarm; the first is the cold one, and of the others "
        "the round with the median swarm/local ratio counts (default 5, --quick 2)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads for the local run and for every node (default: "
        "%(default)s; see 'Threads' below)",
    )
    parser.add_argument("--layers", type=int, help="decoder layers (default 12, --quick 6)")
    parser.add_argument(
        "--hidden",
        type=int,
        help="hidden size, a multiple of 128 (default 1024, --quick 768); heads of 64",
    )
    parser.add_argument(
        "--workdir",
        type=Path,
        help="keep the checkpoint, node state and logs here; state from an earlier run is "
        "cleared first (default: a temporary folder)",
    )
    parser.add_argument(
        "--check-floor",
        type=float,
        metavar="P",
        help="for a breakdown only, not the headline: the coordinator checks a node's calls "
        "at probability P once it has 1 verified result (serve --verify-warmup 1 "
        "--verify-min-probability P) instead of its defaults, e.g. 0.001 to see the swarm "
        "with almost no redundant checks",
    )
    parser.add_argument("--verbose", action="store_true", help="show the client's log")
    args = parser.parse_args(argv)
    if args.check_floor is not None and not 0.0 < args.check_floor <= 1.0:
        parser.error(f"--check-floor must be in (0, 1], got {args.check_floor}")
    shape = QUICK_SHAPE if args.quick else FULL_SHAPE
    if args.layers or args.hidden:
        hidden = args.hidden or shape.hidden
        if hidden % 128:
            parser.error(f"--hidden must be a multiple of 128, got {hidden}")
        shape = DemoShape(
            layers=args.layers or shape.layers,
            hidden=hidden,
            heads=hidden // 64,
            kv_heads=hidden // 128,
            intermediate=hidden * 11 // 4,
        )
    args.shape = shape
    args.tokens = args.tokens or (24 if args.quick else 40)
    args.rounds = args.rounds or (2 if args.quick else 5)
    if args.tokens < 6:
        parser.error("--tokens must be at least 6 (the kill happens a third of the way in)")
    if shape.layers < 3:
        parser.error("--layers must be at least 3: the swarm splits the model into 3 stages")
    if args.rounds < 1 or args.threads < 1:
        parser.error("--rounds and --threads must be at least 1")
    return args


def say(text: str = "") -> None:
    print(text, flush=True)


# ---- the ways to generate -----------------------------------------------------------------
#
# Each is an iterator that computes one token per next(): the runs of a round take turns
# token by token (see "No overlap" above), timed by `interleave`.


def swarm_steps(client: Client, prompt_ids: list[int], tokens: int) -> Iterator[int]:
    """Greedy decoding through the swarm with the client library, as a user would; each
    step starts when its turn comes (run_ahead=False), never while another run computes."""
    stream = client.generate(
        MODEL, token_ids=prompt_ids, max_new_tokens=tokens, stop_at_eos=False, run_ahead=False
    )
    for token in stream:
        yield token.id


def interleave(steps: dict[str, Iterator[int]], tokens: int) -> dict[str, Run]:
    """Take one token from each run in turn; each run's clock counts only its own steps."""
    runs = {label: Run(label) for label in steps}
    order = list(steps)
    for index in range(tokens):
        # Rotate who goes first, so no run always follows the same neighbour.
        shift = index % len(order)
        for label in order[shift:] + order[:shift]:
            # A pause, untimed: work a run leaves behind after its token (a node's send
            # completing, a pipe process going back to sleep) must not land in the next
            # run's time.
            time.sleep(SETTLE_S)
            run = runs[label]
            began = time.monotonic()
            token = next(steps[label])
            elapsed = time.monotonic() - began
            run.arrivals.append((run.arrivals[-1] if run.arrivals else 0.0) + elapsed)
            run.token_ids.append(token)
    for iterator in steps.values():
        for _ in iterator:  # lets the swarm's generator end its session, untimed
            pass
    return runs


def generate_swarm(
    client: Client,
    prompt_ids: list[int],
    tokens: int,
    label: str = "swarm",
    on_token: Callable[[int], None] | None = None,
    run_ahead: bool = True,
) -> Run:
    """One swarm generation alone, timed from the call (the warm-up and the kill run)."""
    run = Run(label)
    began = time.monotonic()
    stream = client.generate(
        MODEL,
        token_ids=prompt_ids,
        max_new_tokens=tokens,
        stop_at_eos=False,
        run_ahead=run_ahead,
    )
    for token in stream:
        run.arrivals.append(time.monotonic() - began)
        run.token_ids.append(token.id)
        if token.failovers and run.first_failover is None:
            run.first_failover = token.index
        if on_token is not None:
            on_token(token.index)
    run.result = client.last_run
    return run


class PipePipeline:
    """The floor: layer spans in plain processes, tensors pickled through pipes.

    main -> stage 0 -> stage 1 -> ... -> main; each stage keeps its own KV cache. Only
    the last position's logits come back, as with the swarm's driver.
    """

    def __init__(self, checkpoint: Path, spans: Sequence[tuple[int, int]], threads: int) -> None:
        # spawn, not fork: this process runs gRPC threads, which fork would corrupt.
        context = multiprocessing.get_context("spawn")
        pipes = [context.Pipe() for _ in range(len(spans) + 1)]
        self._send, self._receive = pipes[0][0], pipes[-1][1]
        self._processes = [
            context.Process(
                target=_pipe_stage,
                args=(str(checkpoint), start, end, threads, pipes[i][1], pipes[i + 1][0]),
                daemon=True,
            )
            for i, (start, end) in enumerate(spans)
        ]
        for process in self._processes:
            process.start()

    def steps(self, prompt_ids: list[int], tokens: int) -> Iterator[int]:
        self._send.send(("new", len(prompt_ids) + tokens))
        self._receive.recv()  # every stage has its cache (and its weights) now
        x = np.array([prompt_ids], dtype=np.int64)
        position = 0
        for _ in range(tokens):
            self._send.send((position, x))
            logits = self._receive.recv()
            position += x.shape[1]
            token = int(np.argmax(logits))
            yield token
            x = np.array([[token]], dtype=np.int64)

    def close(self) -> None:
        self._send.send(None)
        for process in self._processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()


def _pipe_stage(
    checkpoint: str, start: int, end: int, threads: int, rx: Connection, tx: Connection
) -> None:
    torch.set_num_threads(threads)
    model = load_stage_model(checkpoint, start, end).eval()
    gc.freeze()
    cache = model.new_cache(1)
    with torch.inference_mode():
        while (message := rx.recv()) is not None:
            if message[0] == "new":
                cache = model.new_cache(message[1])
                tx.send(message)
                continue
            position, x = message
            out = model(torch.from_numpy(x), cache, position, last_position_only=True)
            tx.send((position, out.numpy()) if not model.is_last else out[0, -1].numpy())
    tx.send(None)


# ---- report -------------------------------------------------------------------------------


def decode_compute_ms(run: Run) -> float:
    """Median over decode steps of the nodes' own compute time, summed over the route.

    Not the stages' wall times: in a pushed step the client sees when each stage's answer
    arrives, not when the stage started, and the driver never counts a stage's wall as
    less than its compute, so the walls of a pushed step need not add up to the token
    (their sum exceeded it by 3 ms in a run of 2026-12-04)."""
    assert run.result is not None
    steps: dict[int, float] = {}
    for t in run.result.timings:
        if t.tokens == 1 and not t.replay:
            steps[t.step] = steps.get(t.step, 0.0) + t.compute_ms
    return statistics.median(steps.values())


def check_split(run: Run) -> str:
    """Median token time of the decode tokens one of whose calls also ran on a checker,
    and of the others: what a sampled check costs the token it lands on."""
    assert run.result is not None and run.result.verification is not None
    steps = sorted({t.step for t in run.result.timings if t.tokens == 1 and not t.replay})
    if len(steps) != len(run.token_times):
        return "tokens with and without a check: not told apart (a fail-over ran extra steps)"
    checked = set(run.result.verification.check_steps)
    times: dict[bool, list[float]] = {True: [], False: []}
    for step, seconds in zip(steps, run.token_times, strict=True):
        times[step in checked].append(seconds * 1000.0)

    def median(values: list[float]) -> str:
        return f"{statistics.median(values):.1f} ms" if values else "-"

    return (
        f"tokens with a call checked on a second node: median {median(times[True])} "
        f"({len(times[True])} tokens), the others {median(times[False])} "
        f"({len(times[False])})"
    )


def checker_work(run: Run) -> str:
    """What the checkers computed beside the pipeline, against the pipeline's own work (both
    in layer-positions, the prefill included), and how much of it was catch-ups: a span's
    first check in a session replays the whole history so far on its checker."""
    assert run.result is not None and run.result.verification is not None
    stats = run.result.verification
    pipeline = sum(t.tokens * (t.end - t.start) for t in run.result.timings if not t.replay)
    if not stats.checker_layer_tokens or not pipeline:
        return "checkers computed nothing beside the pipeline"
    return (
        f"checkers computed {stats.checker_layer_tokens / pipeline:.0%} of the pipeline's "
        f"layer-positions beside it, {stats.catch_up_layer_tokens / stats.checker_layer_tokens:.0%}"
        " of that catching their caches up to the checked calls; those catch-ups audited "
        f"{stats.audited_layer_tokens / pipeline:.0%} of the pipeline's layer-positions "
        f"(steps without a check of their own), {len(stats.findings)} finding(s)"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.ERROR,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    torch.set_num_threads(args.threads)
    # The node agents are our children: torch starts there with these.
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    os.environ["MKL_NUM_THREADS"] = str(args.threads)
    with tempfile.TemporaryDirectory(prefix="tessera-bench-inference-") as tmp:
        return bench(args, args.workdir or Path(tmp))


def load_note(at_start: float) -> str:
    """The machine's load around the run: a shared machine's neighbours skew any ratio."""
    cores = os.cpu_count() or 1
    now = os.getloadavg()[0]
    text = f"load average {at_start:.1f} at the start, {now:.1f} at the end, on {cores} cores"
    if max(at_start, now) > cores:
        text += (
            ": busier than the cores can serve, so every run waited for CPU time and the "
            "ratios are unreliable (waking processes get scheduled ahead of a busy one, "
            "which favours the multi-process runs); rerun on a quieter machine"
        )
    return text


def bench(args: argparse.Namespace, workdir: Path) -> int:
    t0 = time.monotonic()
    load_at_start = os.getloadavg()[0]
    shape: DemoShape = args.shape
    clear_state(workdir)
    checkpoint = write_demo_checkpoint(workdir / "checkpoint", shape)
    tokenizer = load_tokenizer((checkpoint / "tokenizer.json").read_bytes())
    assert tokenizer is not None
    prompt_ids = tokenizer.encode(PROMPT)
    prompt = torch.tensor([prompt_ids])  # the local run's input
    local_model = load_stage_model(checkpoint, 0, shape.layers).eval()
    local_model.requires_grad_(False)
    gc.freeze()  # as the node agents do after loading a shard: same collector work per step
    params = sum(p.numel() for p in local_model.parameters())
    say(
        f"model: {shape.layers} layers, hidden {shape.hidden}, {shape.heads} heads "
        f"({shape.kv_heads} KV), intermediate {shape.intermediate}: {params / 1e6:.0f}M params, "
        f"fp32 on CPU; prompt {len(prompt_ids)} tokens, {args.tokens} generated; "
        f"{args.threads} torch thread(s) per process; {args.rounds} round(s)"
    )
    rounds: list[tuple[Run, Run, Run, Run]] = []  # (local, pipes, swarm, hop by hop)
    coordinator_args = ["--min-stages", "3", "--replicas", "2"]
    check_floor = Settings.verify_min_probability  # the coordinator's default
    if args.check_floor is not None:
        coordinator_args += ["--verify-warmup", "1", "--verify-min-probability",
                             str(args.check_floor)]  # fmt: skip
        say(f"checks: --check-floor {args.check_floor} (not the coordinator's defaults)")
        check_floor = args.check_floor
    with LocalSwarm(workdir, coordinator_args=coordinator_args) as swarm:
        swarm.start_coordinator()
        nodes = [swarm.start_node(name) for name in NODES]
        swarm.wait_registered(nodes)
        names = {p.node_id: p.name for p in nodes}
        swarm.add_model(checkpoint, MODEL)
        with (
            Client(swarm.address) as client,
            Client(swarm.address, driver_config=DriverConfig(push=False)) as hop_client,
        ):
            wait_for_replicas(client, MODEL, timeout_s=300)
            say(f"swarm of {len(nodes)} nodes ready after {time.monotonic() - t0:.0f} s")
            warm = max(4, args.tokens // 6)
            warm_run = generate_swarm(client, prompt_ids, warm)
            assert warm_run.result is not None
            route = warm_run.result.initial_route
            say("route: " + route_text(warm_run.result, names))
            stages = [(h.start, h.end) for h in warm_run.result.granted_stages]
            pipes = PipePipeline(checkpoint, stages, args.threads)
            try:
                for _ in pipes.steps(prompt_ids, warm):
                    pass
                for _ in greedy_steps(local_model, prompt, warm):
                    pass
                generate_swarm(hop_client, prompt_ids, warm)
                for r in range(args.rounds):
                    runs = interleave(
                        {
                            "local": greedy_steps(local_model, prompt, args.tokens),
                            "pipes (floor)": pipes.steps(prompt_ids, args.tokens),
                            "swarm": swarm_steps(client, prompt_ids, args.tokens),
                            "swarm, hop by hop": swarm_steps(hop_client, prompt_ids, args.tokens),
                        },
                        args.tokens,
                    )
                    local, floor, plain = runs["local"], runs["pipes (floor)"], runs["swarm"]
                    hop = runs["swarm, hop by hop"]
                    plain.result, hop.result = client.last_run, hop_client.last_run
                    rounds.append((local, floor, plain, hop))
                    assert plain.result is not None
                    say(
                        f"round {r + 1}: tokens/s local {local.tokens_per_s:6.2f}, pipes "
                        f"{floor.tokens_per_s:6.2f} ({ratio(floor, local):.2f}), swarm "
                        f"{plain.tokens_per_s:6.2f} ({ratio(plain, local):.2f}; "
                        f"{plain.result.pushed_steps} steps pushed), hop by hop "
                        f"{hop.tokens_per_s:6.2f} ({ratio(hop, local):.2f}) over "
                        f"{len(plain.result.initial_route)} hops; {checked_text(plain)}"
                    )
                    if r == 0 and args.rounds > 1:
                        say(season(client, prompt_ids, args.tokens, check_floor))
            finally:
                pipes.close()
            faulty, victim_id, kill_after, stall_s = run_with_kill(client, swarm, prompt_ids, args)
    every = [run for runs in rounds for run in runs] + [faulty]
    cold = rounds[0]
    warm_rounds = sorted(rounds[1:] or rounds, key=lambda runs: ratio(runs[2], runs[0]))
    # The lower middle of an even count: the headline never leans on the better half.
    local, floor, plain, hop = warm_rounds[(len(warm_rounds) - 1) // 2]
    same = all(run.token_ids == local.token_ids for run in every)

    say()
    if len(rounds) > 1:
        say(
            f"warm: of the {len(warm_rounds)} rounds after the first, the one with the median "
            "swarm/local ratio:"
        )
    rows = [["run", "tokens/s", "vs local", "first token ms", "median ms/token", "p90 ms/token"]]
    for run in (local, floor, plain, hop, faulty):
        rows.append(
            [
                run.label,
                f"{run.tokens_per_s:.2f}",
                f"{run.tokens_per_s / local.tokens_per_s:.2f}",
                f"{run.first_token_s * 1000:.0f}",
                f"{run.median_token_ms:.1f}",
                f"{run.p90_token_ms:.1f}",
            ]
        )
    say(table(rows))
    whole_local, whole_swarm = local.arrivals[-1], plain.arrivals[-1]
    say(
        f"whole generations, first token included: local {whole_local:.2f} s, swarm "
        f"{whole_swarm:.2f} s (swarm/local speed {whole_local / whole_swarm:.2f}; work "
        "moved into the first token shows here)"
    )
    say()
    compute_ms = decode_compute_ms(plain)
    stages = len(plain.result.route) if plain.result else len(route)
    say(
        f"a swarm token (medians): {plain.median_token_ms:.1f} ms, of which the nodes "
        f"computed {compute_ms:.1f} ms (the local token takes {local.median_token_ms:.1f}); "
        f"the other {plain.median_token_ms - compute_ms:.1f} ms are the data path: {stages} "
        "stages' messages on the wire and in the nodes, and the client's own work"
    )
    say(f"verification in that round: {checked_text(plain)}; every reply's signature checked")
    say(check_split(plain))
    say(checker_work(plain))
    say(
        f"swarm/pipes tokens/s: {plain.tokens_per_s / floor.tokens_per_s:.2f} (what Tessera's "
        "data path costs over plain pipes between the same processes)"
    )
    assert plain.result is not None
    if plain.result.push_off:
        say(f"the swarm run stopped pushing steps: {plain.result.push_off}")
    say(
        f"pushed/hop by hop tokens/s: {ratio(plain, hop):.2f} (nodes handing hidden states "
        "on to each other vs the client relaying every stage's output)"
    )
    median_ms = plain.median_token_ms
    assert faulty.result is not None
    for event in faulty.result.failovers:
        say(
            f"fail-over: layers [{event.start}, {event.end}) of "
            f"{names.get(event.failed_node_id, event.failed_node_id)} -> "
            f"{', '.join(names.get(n, n) for n in event.replacement_node_ids)} via {event.via}, "
            f"replayed {event.replayed_tokens} tokens, stalled {event.stalled_ms:.0f} ms "
            f"({event.stalled_ms / median_ms:.1f} token times)"
        )
    if not faulty.result.failovers:
        say("fail-over: none recorded, although a node was killed")
    say(
        f"kill -9 {names.get(victim_id, victim_id)} (middle stage) after {kill_after} tokens: "
        f"the first token computed after it came {stall_s * 1000:.0f} ms later = "
        f"{stall_s * 1000 / median_ms:.1f} "
        f"x the median token time ({median_ms:.1f} ms)"
    )
    say(f"greedy token ids identical in all {len(every)} timed runs: {'yes' if same else 'NO'}")
    say(load_note(load_at_start))
    if not same:
        for run in (local, floor, plain, hop, faulty):
            say(f"  {run.label:16s} {run.token_ids}")
    say(f"total time {time.monotonic() - t0:.0f} s")
    say(
        f"cold (round 1, nodes new to the coordinator, {checked_text(cold[2])}): swarm/local "
        f"tokens/s {ratio(cold[2], cold[0]):.2f}"
    )
    if len(rounds) > 1:
        say(
            f"warm (median of rounds 2-{len(rounds)}, {checked_text(plain)}): swarm/local "
            f"tokens/s {ratio(plain, local):.2f}"
        )
    if args.check_floor is None:
        say(f"swarm/local tokens/s ratio: {ratio(plain, local):.2f}")
    else:  # not the headline: the coordinator did not run with its own checking rates
        say(
            f"swarm/local tokens/s ratio with --check-floor {args.check_floor}: "
            f"{ratio(plain, local):.2f}"
        )
    return 0 if same else 1


def season(client: Client, prompt_ids: list[int], tokens: int, floor: float) -> str:
    """Generate, untimed, until the coordinator checks every node at ``floor``, the rate at
    which it checks the nodes of a long-running swarm once they have earned its trust; at
    most SEASON_LIMIT_S. What it took, as a line to print."""
    began = time.monotonic()
    generations = 0
    while True:
        chances = {n.name or n.node_id: n.trust.check_probability for n in client.nodes()}
        above = {name: p for name, p in chances.items() if p > floor * (1 + 1e-6)}
        spent = time.monotonic() - began
        if not above or spent > SEASON_LIMIT_S:
            break
        generate_swarm(client, prompt_ids, tokens)
        generations += 1
    rates = ", ".join(f"{name} {p:.0%}" for name, p in sorted(chances.items()))
    if above:
        return (
            f"after {generations} untimed generations ({spent:.0f} s) some nodes are still "
            f"checked above the floor of {floor:.0%} ({rates}): the warm rounds check more "
            "than a long-running swarm does"
        )
    return (
        f"{generations} untimed generations ({spent:.0f} s) until the coordinator checks every "
        f"node at its floor of {floor:.0%}, as in a long-running swarm ({rates})"
    )


SEASON_LIMIT_S = 180.0


def ratio(run: Run, baseline: Run) -> float:
    return run.tokens_per_s / baseline.tokens_per_s


def checked_text(run: Run) -> str:
    """How many of the run's calls the client also sent to a checker (the coordinator sets
    the rate per node: every call of a new node, falling as it earns trust)."""
    assert run.result is not None
    stats = run.result.verification
    calls, checked = sum(stats.calls.values()), sum(stats.checked.values())
    return f"{checked} of {calls} calls checked on a second node"


def route_text(result: GenerationResult, names: dict[str, str]) -> str:
    def path(hops: Sequence[HopRecord]) -> str:
        return "  ->  ".join(
            f"{names.get(h.node_id, h.node_id)} [{h.start}, {h.end})" for h in hops
        )

    hops = result.initial_route
    if len(hops) == len(result.granted_stages):
        return path(hops)
    return f"{path(result.granted_stages)}  (run as {len(hops)} hops: {path(hops)})"


def run_with_kill(
    client: Client, swarm: LocalSwarm, prompt_ids: list[int], args: argparse.Namespace
) -> tuple[Run, str, int, float]:
    """Generate while kill -9'ing the middle stage's primary a third of the way in.

    Returns the run, the victim, after how many tokens it died, and the seconds from the
    kill to the first token computed after it. The kill lands between two steps
    (run_ahead=False), but a token is held back until the checks of its step have
    settled while the next step already runs (Client.generate): tokens computed before
    the kill can still come out after it, at once. The stall is therefore measured to the
    first token whose step went through the fail-over, not to the next token out (which
    read 0 ms whenever a check was pending at the kill).
    """
    kill_after = max(2, args.tokens // 3)
    killed: list[tuple[str, float]] = []

    def kill(index: int) -> None:
        if index + 1 != kill_after:
            return
        # This session's own stages: the router may pick other primaries than last time.
        assert client.last_run is not None
        stages = client.last_run.granted_stages
        victim_id = stages[len(stages) // 2].node_id
        swarm.node(victim_id).kill9()
        killed.append((victim_id, time.monotonic()))

    began = time.monotonic()
    run = generate_swarm(client, prompt_ids, args.tokens, "swarm + kill -9", kill, run_ahead=False)
    victim_id, killed_at = killed[0]
    after = run.first_failover if run.first_failover is not None else kill_after
    return run, victim_id, kill_after, began + run.arrivals[after] - killed_at


if __name__ == "__main__":
    sys.exit(main())
