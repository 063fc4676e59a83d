"""`tessera demo`: a whole swarm on this machine, a generation, a node killed mid-generation.

1. write a small Llama-style checkpoint;
2. start a coordinator and three node agents on loopback and import the model;
3. generate through the three-stage pipeline and print the route;
4. generate again and `kill -9`, after a few tokens, the node serving this run's middle
   stage (a new session gets its own route, so that need not be step 3's): the driver
   fails over to a replica, replays the history, and the output is identical;
5. print tokens/s, the stall, and which node served what;
6. train a small model from random weights on a counting task through a three-stage
   pipeline, kill -9 a stage node mid-training (the job re-plans the stage and rolls back
   to the last consistent checkpoint), then serve the trained model and measure it.

Every process started here is stopped on exit, Ctrl-C included.

examples:
  tessera demo                                # the whole tour, about a minute
  tessera demo --no-training --tokens 24      # only the fail-over, shorter
  tessera demo --workdir /tmp/tessera-demo    # keep the logs and state afterwards
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

from client import cli_args
from client.api import Client, GeneratedToken, GenerationResult
from client.demo_checkpoint import write_demo_checkpoint
from client.demo_training import layers_text, run_training_demo
from client.errors import TesseraError
from client.local_swarm import (
    LocalProcess,
    LocalSwarm,
    SwarmError,
    clear_state,
    wait_for_replicas,
)
from client.records import HopRecord, StageTiming

MODEL = "demo-llama"
PROMPT = "The swarm says: "
NODES = ("alpha", "bravo", "charlie")
SPARE_NODE = "delta"


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="run a local swarm, generate, kill a node mid-generation, show the fail-over",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--tokens",
        type=cli_args.positive_int,
        default=48,
        metavar="N",
        help="tokens to generate in each run (default 48)",
    )
    parser.add_argument(
        "--kill-after",
        type=cli_args.positive_int,
        default=12,
        metavar="N",
        help="kill the middle stage's node after this many tokens, fewer than --tokens "
        "(default 12)",
    )
    parser.add_argument(
        "--workdir",
        type=Path,
        metavar="DIR",
        help="keep logs and state here; an earlier demo's state there is cleared first "
        "(default: a temporary folder, removed at the end)",
    )
    parser.add_argument(
        "--no-training", action="store_true", help="only the inference part (skip step 6)"
    )
    parser.add_argument(
        "--train-steps",
        type=cli_args.positive_int,
        default=40,
        metavar="N",
        help="optimizer steps to train (default 40)",
    )
    parser.set_defaults(func=run, command_parser=parser)


def _say(text: str) -> None:
    print(text, flush=True)


def _route_text(result: GenerationResult, names: dict[str, str], initial: bool = True) -> str:
    return _hops_text(result.initial_route if initial else result.route, names)


def _hops_text(hops: Sequence[HopRecord | StageTiming], names: dict[str, str]) -> str:
    return "  ->  ".join(
        f"{names.get(h.node_id, h.node_id)} [{layers_text(h.start, h.end)}]" for h in hops
    )


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def run(args: argparse.Namespace) -> int:
    if args.kill_after >= args.tokens:
        # Otherwise the kill never comes and step 4 shows no fail-over at all.
        args.command_parser.error(
            f"--kill-after ({args.kill_after}) must be less than --tokens ({args.tokens})"
        )
    if args.workdir is not None:
        try:
            args.workdir.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            reason = err.strerror or err
            print(
                f"tessera demo: cannot use --workdir {args.workdir} ({reason}); give a directory "
                "this user can write, or leave --workdir out",
                file=sys.stderr,
            )
            return 2
    signal.signal(signal.SIGTERM, _terminate)
    # The demo narrates fail-overs itself; the driver's own warnings would repeat them.
    logging.basicConfig(level=logging.ERROR)
    with tempfile.TemporaryDirectory(prefix="tessera-demo-") as tmp:
        workdir = args.workdir or Path(tmp)
        try:
            return _demo(workdir, args.tokens, args.kill_after, args)
        except KeyboardInterrupt:
            _say("\ninterrupted: stopping every process the demo started")
            return 130
        except (SwarmError, TesseraError, OSError) as err:
            # A temporary workdir (and the logs in it) is gone once this returns.
            where = (
                f"the logs are in {workdir / 'logs'}"
                if args.workdir
                else "run it again with --workdir DIR to keep the logs"
            )
            print(f"tessera demo failed: {err}\n{where}", file=sys.stderr)
            return 1


def _demo(workdir: Path, tokens: int, kill_after: int, args: argparse.Namespace) -> int:
    t0 = time.monotonic()
    if clear_state(workdir):
        # Its coordinator's database would already hold the model.
        _say(f"0. cleared an earlier demo's coordinator, nodes and logs from {workdir}")
    checkpoint = write_demo_checkpoint(workdir / "checkpoint")
    _say(f"1. wrote a small Llama-style checkpoint to {checkpoint}")
    # Three stages even though the model is small, so the pipeline is visible.
    with LocalSwarm(
        workdir,
        coordinator_args=["--min-stages", "3", "--replicas", "2", "--heartbeat-interval", "1"],
    ) as swarm:
        address = swarm.start_coordinator()
        _say(f"2. coordinator serving on {address}; starting nodes {', '.join(NODES)}")
        nodes = [swarm.start_node(name) for name in NODES]
        swarm.wait_registered(nodes)
        names = {p.node_id: p.name for p in nodes}
        for p in nodes:
            _say(f"   node {p.name:8s} registered as {p.node_id}")
        swarm.add_model(checkpoint, MODEL)
        _say(f"   imported the checkpoint as model {MODEL!r}; nodes are loading their shards")
        with Client(address) as client:
            wait_for_replicas(client, MODEL, replicas=2)
            _say(f"   model available after {time.monotonic() - t0:.1f}s")

            _say(f"\n3. generating {tokens} tokens through the pipeline")
            reference = _generate(client, tokens)
            _say(f"   route: {_route_text(reference, names)}")
            _say(
                f"   {reference.pushed_steps} of {len(reference.token_ids)} steps pushed: each "
                "node handed its output straight to the next; the client verified every answer"
            )
            _say(
                f"   {reference.ring_steps} of them started by the last node, which drew the "
                "next token itself; the client drew the same token and checked it"
            )
            _say(f"   output: {reference.text!r}")
            _say("   (the weights are random, so the text is noise; what matters is that it")
            _say("   comes out the same, token for token, through any route)")

            middle = _middle_stage(reference.granted_stages)
            _say(
                f"\n4. generating again, a step at a time; the node serving the middle stage "
                f"({layers_text(middle.start, middle.end)}) is killed after {kill_after} tokens"
            )
            victim: LocalProcess | None = None

            def on_token(token: GeneratedToken) -> None:
                nonlocal victim
                if token.index + 1 != kill_after:
                    return
                # This session's own route: the router may have picked other nodes than
                # step 3's, so the victim is whoever computed the middle stage just now.
                victim = swarm.node(_node_at(token, middle.start) or middle.node_id)
                victim.kill9()
                _say(f"   route so far: {_hops_text(_computed(token), names)}")
                _say(f"   kill -9 {victim.name} (pid {victim.popen.pid}) after {kill_after} tokens")

            faulty = _generate(client, tokens, on_token)
            for event in faulty.failovers:
                replacement = ", ".join(names.get(n, n) for n in event.replacement_node_ids)
                _say(
                    f"   fail-over at position {event.position}: "
                    f"{layers_text(event.start, event.end)} "
                    f"moved from {names.get(event.failed_node_id, event.failed_node_id)} to "
                    f"{replacement} via {event.via}, replayed {event.replayed_tokens} tokens, "
                    f"stalled {event.stalled_ms:.0f} ms ({event.reason})"
                )
            _say(f"   route after: {_route_text(faulty, names, initial=False)}")
            same = faulty.token_ids == reference.token_ids
            _say(f"   output: {faulty.text!r}")
            _say(f"   identical to the run without a failure: {'yes' if same else 'NO'}")

            _say("\n5. summary")
            _summary(reference, faulty, names)

            if not args.no_training:
                _say("\n6. training a model from random weights through the swarm")
                # The victim is step 3's middle node when the run ended before the kill.
                killed = victim.name if victim else swarm.node(middle.node_id).name
                _train(swarm, client, workdir, killed, args.train_steps)
        if not same:
            _say(
                "the outputs differ: this is a bug, please report it with the logs in "
                f"{workdir / 'logs'}"
            )
            return 1
        _say(f"\ndone in {time.monotonic() - t0:.1f}s; stopping the swarm")
    return 0


def _train(swarm: LocalSwarm, client: Client, workdir: Path, killed: str, steps: int) -> None:
    # The node killed in step 4 comes back, and a fourth joins: a stage that dies during
    # training then has somewhere to go.
    nodes = [swarm.start_node(killed), swarm.start_node(SPARE_NODE)]
    swarm.wait_registered(nodes)
    _say(f"   restarted {killed} and started {SPARE_NODE}: four nodes for three stages")
    result = run_training_demo(
        swarm,
        client,
        workdir,
        _say,
        steps=steps,
        kill_at=min(25, steps - 5),
        wait_served=lambda c, model: wait_for_replicas(c, model, replicas=1),
    )
    _say(
        f"   accuracy {result.accuracy_before:.0%} -> {result.accuracy_after:.0%}; "
        f"{result.replans} re-plan(s), {result.steps_redone} step(s) redone; "
        f"{result.seconds:.0f}s for this part"
    )


def _middle_stage(stages: list[HopRecord]) -> HopRecord:
    """The session's middle stage as granted (a hop may run two stages of one node)."""
    return stages[len(stages) // 2]


def _computed(token: GeneratedToken) -> list[StageTiming]:
    """The requests that computed this token's step (replays after a fail-over aside)."""
    return [t for t in token.stage_timings if not t.replay]


def _node_at(token: GeneratedToken, layer: int) -> str | None:
    """The node that computed ``layer`` for this token."""
    return next((t.node_id for t in _computed(token) if t.start <= layer < t.end), None)


def _generate(
    client: Client, tokens: int, on_token: Callable[[GeneratedToken], None] | None = None
) -> GenerationResult:
    # With a node to kill, step on demand: a generation left to run ahead may have computed
    # every token before the one the kill waits for is shown, and then nothing fails over.
    stream = client.generate(
        MODEL, prompt=PROMPT, max_new_tokens=tokens, stop_at_eos=False, run_ahead=on_token is None
    )
    for token in stream:
        if on_token is not None:
            on_token(token)
    assert client.last_run is not None
    return client.last_run


def _checked(result: GenerationResult) -> str:
    stats = result.verification
    if stats is None:
        return "no calls checked"
    calls, checked = sum(stats.calls.values()), sum(stats.checked.values())
    audited = sum(stats.audited.values())
    text = f"{checked} of {calls} calls checked on a second node"
    # A checker's catch-up, and a fail-over's replay, also compare the unchecked steps
    # they recompute (an audit).
    return text + (f", {audited} more audited by catch-ups and replays" if audited else "")


def _summary(reference: GenerationResult, faulty: GenerationResult, names: dict[str, str]) -> None:
    _say(
        f"   without failure: {reference.tokens_per_s:6.1f} tokens/s, first token after "
        f"{reference.first_token_s * 1000:.0f} ms; {_checked(reference)}"
    )
    _say(
        f"   with a kill -9:  {faulty.tokens_per_s:6.1f} tokens/s, first token after "
        f"{faulty.first_token_s * 1000:.0f} ms; {_checked(faulty)}"
    )
    _say(
        "   (the coordinator checks every call of a node new to it on a second node, and\n"
        "   fewer as the node earns trust, audits included: the second run is checked less.\n"
        "   It steps token by token, without the ring, so that the kill lands mid-way)"
    )
    stall = sum(e.stalled_ms for e in faulty.failovers)
    _say(f"   stall caused by the failure: {stall:.0f} ms in {len(faulty.failovers)} fail-over(s)")
    served: dict[tuple[str, int, int], int] = {}
    for t in reference.timings + faulty.timings:
        key = (t.node_id, t.start, t.end)
        served[key] = served.get(key, 0) + t.tokens
    _say("   who served what (both runs):")
    for (node_id, start, end), count in sorted(served.items(), key=lambda kv: kv[0][1]):
        _say(f"     {names.get(node_id, node_id):8s} {layers_text(start, end)}: {count} tokens")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tessera")  # the subcommand adds "demo"
    sub = parser.add_subparsers()
    add_parser(sub)
    args = parser.parse_args(["demo", *(argv or [])])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
