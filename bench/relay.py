"""Relay benchmark: what serving a node through the coordinator's relay costs.

In ONE run, on loopback, two swarms of one coordinator and one node agent, each serving the
same model whole:

  direct   the node's data plane is dialed directly, as for any node with an open port;
  relayed  the node advertises an address nobody answers on (a closed port, as behind
           NAT), so the coordinator cannot dial it back; the node dials out a tunnel to the
           coordinator's relay (`serve --relay-host`), and clients reach it through a port
           of the relay that carries every byte through that tunnel
           (coordinator/nat_relay.py, node_agent/nat_tunnel.py).

The two generate the same greedy tokens, taking turns generation by generation so that both
see the same load, in two modes: running ahead (the client's default: the node draws the
next token itself, so the relay is off the path between tokens) and stepping on demand
(every token waits for the client, so it crosses the relay twice: the worst case). It
prints decode tokens/s and time to first token of each, the time the relay adds to a
token, and, as its last line, `relayed/direct tokens/s ratio: X` for stepping on demand
(medians over the rounds after the first, which warms everything up). Greedy ids must be
identical (exit status 1 if not). About a minute; `--tokens` and `--rounds` trade time for
noise.
"""

from __future__ import annotations

import argparse
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from text_table import table  # noqa: E402  (bench/text_table.py)

from client.api import Client, GenerationResult  # noqa: E402
from client.demo_checkpoint import DemoShape, write_demo_checkpoint  # noqa: E402
from client.local_swarm import LocalSwarm, wait_for_replicas  # noqa: E402

MODEL = "bench-relay"
PROMPT = "The relay carries every byte of this prompt. "


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="bench/relay.py",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--tokens", type=int, default=48, help="tokens per generation")
    parser.add_argument("--rounds", type=int, default=6, help="generations per swarm")
    parser.add_argument("--hidden", type=int, default=512, help="hidden size (heads of 64)")
    parser.add_argument("--layers", type=int, default=8, help="decoder layers")
    parser.add_argument(
        "--workdir", type=Path, help="keep checkpoint and logs here (an earlier run's are cleared)"
    )
    args = parser.parse_args(argv)
    if args.tokens < 2 or args.rounds < 2 or args.hidden % 64 or args.layers < 1:
        parser.error("need --tokens >= 2, --rounds >= 2, --layers >= 1, --hidden a multiple of 64")
    return args


def closed_port() -> int:
    """A loopback port nothing listens on: the node's address that nobody can dial."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(work: Path, checkpoint: Path, *, relayed: bool) -> LocalSwarm:
    args = ["--replicas", "1", "--heartbeat-interval", "1"]
    if relayed:
        args += ["--relay-host", "127.0.0.1"]
    swarm = LocalSwarm(work, coordinator_args=args)
    swarm.start_coordinator()
    node_args = ["--advertise", f"127.0.0.1:{closed_port()}"] if relayed else []
    node = swarm.start_node("relayed" if relayed else "direct", node_args)
    swarm.wait_registered([node])
    swarm.add_model(checkpoint, MODEL)
    return swarm


def generate(swarm: LocalSwarm, tokens: int, run_ahead: bool) -> GenerationResult:
    with Client(swarm.address) as client:
        return client.generate_all(
            MODEL, prompt=PROMPT, max_new_tokens=tokens, stop_at_eos=False, run_ahead=run_ahead
        )


# Run ahead: the client's default; the last node draws the next token itself (the ring),
# so no client round trip sits between tokens. On demand: every token waits for the client
# to ask, so each token crosses the relay twice on its critical path (the worst case).
MODES = {"run ahead (ring)": True, "step on demand": False}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    shape = DemoShape(
        layers=args.layers,
        hidden=args.hidden,
        heads=args.hidden // 64,
        kv_heads=max(1, args.hidden // 128),
        intermediate=args.hidden * 8 // 3 // 16 * 16,
    )
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tessera-bench-relay-") as scratch:
        work = args.workdir or Path(scratch)
        for old in ("checkpoint", "direct", "relayed"):  # state of an earlier run
            shutil.rmtree(work / old, ignore_errors=True)
        checkpoint = write_demo_checkpoint(work / "checkpoint", shape)
        print(
            f"model: {shape.layers} layers, hidden {shape.hidden}; prompt "
            f"{len(PROMPT)} characters, {args.tokens} tokens a generation, {args.rounds} "
            "rounds; one node agent per swarm, on loopback"
        )
        with (
            start(work / "direct", checkpoint, relayed=False) as direct,
            start(work / "relayed", checkpoint, relayed=True) as relayed,
        ):
            for swarm in (direct, relayed):
                with Client(swarm.address) as client:
                    wait_for_replicas(client, MODEL)
            runs: dict[tuple[str, str], list[GenerationResult]] = {}
            for _ in range(args.rounds):
                for mode, run_ahead in MODES.items():
                    for name, swarm in (("direct", direct), ("relayed", relayed)):
                        result = generate(swarm, args.tokens, run_ahead)
                        runs.setdefault((mode, name), []).append(result)
            address = runs[("step on demand", "relayed")][-1].route[0].address
            print(f"relayed route: {address} (the relay's port for the node), direct: "
                  f"{runs[('step on demand', 'direct')][-1].route[0].address}")  # fmt: skip
    reference = next(iter(runs.values()))[0].token_ids
    same = all(r.token_ids == reference for rs in runs.values() for r in rs)
    rows = [["run", "mode", "tokens/s", "ms/token", "first token ms"]]
    ratio: dict[str, float] = {}
    for mode in MODES:
        warm = {name: runs[(mode, name)][1:] for name in ("direct", "relayed")}
        for name, results in warm.items():
            rate = statistics.median(r.tokens_per_s for r in results)
            first = statistics.median(r.first_token_s for r in results) * 1000
            rows.append([name, mode, f"{rate:.1f}", f"{1000 / rate:.2f}", f"{first:.0f}"])
        pairs = list(zip(warm["direct"], warm["relayed"], strict=True))
        ratio[mode] = statistics.median(r.tokens_per_s / d.tokens_per_s for d, r in pairs)
        added = statistics.median(1000 / r.tokens_per_s - 1000 / d.tokens_per_s for d, r in pairs)
        print(f"{mode}: the relay adds {added:.2f} ms a token, relayed/direct {ratio[mode]:.2f} "
              f"(medians of {len(pairs)} paired rounds)")  # fmt: skip
    print(table(rows))
    total = sum(len(rs) for rs in runs.values())
    print(f"greedy token ids identical in all {total} runs: {'yes' if same else 'NO'}")
    print(f"total time {time.perf_counter() - began:.0f} s")
    print(f"relayed/direct tokens/s ratio: {ratio['step on demand']:.2f}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
