"""Ring, push pipeline and hop by hop, over links with real latency, side by side in one run.

Three node agents serve a 3-stage pipeline (`--min-stages 3 --replicas 2`), each behind
its own link emulator (tests/support/link_emulator.py; `tc netem` is not available here)
that adds a one-way delay to every byte in and out of the node: the client, the
coordinator and the other nodes all reach a node through its link, as on a real network
where every volunteer PC sits behind its own access line. Three clients of the same swarm
take turns generation by generation (the same prompt, greedy, all verification on):

  ring        the driver's default: the last node also draws the next token and starts its
              step at the first node (exo's ring); the client gets every answer, draws the
              same token itself and adopts the step. Per token: node 1 -> node 2 -> node 3
              -> node 1, 3 link crossings, and no client round trip.
  pushed      DriverConfig(ring=False): the step goes to the first stage with the rest of
              the route; each node hands its output straight to the next and answers the
              client on its Deliveries stream, and the client sends the next token. Per
              token: client -> node 1 -> node 2 -> node 3 -> client, 4 link crossings.
  hop by hop  DriverConfig(push=False), how Petals drives a pipeline: the client sends
              each stage its input and waits for the answer before the next stage.
              Per token: 3 round trips, 6 link crossings.

They take turns by whole generations, not token by token as bench/inference.py's runs
do: a ring computes the next token before the client asks for it, so a run that steps
on demand cannot have one. Who goes first rotates each round. Each delay in --delays-ms
is measured in its own rounds on the same swarm (the links are changed while it runs);
0 shows what the proxies themselves cost. The token ids of every run must be identical
(exit status 1 if not). The last line is `ring/hop by hop tokens/s at D ms a link: X` for
the largest delay D; the line before it gives pushed/hop by hop.

    .venv/bin/python bench/push_pipeline.py             # about 1.5 minutes
    .venv/bin/python bench/push_pipeline.py --direct --full --tokens 40
                 # plain loopback and bench/inference.py's model: what the ring does there
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "tests"))  # the link emulator lives with the tests

import inference  # noqa: E402  (bench/inference.py: the model, the runs, the report)
from support.link_emulator import LinkEmulator  # noqa: E402
from support.ports import reserved_ports  # noqa: E402

from client.api import Client  # noqa: E402
from client.demo_checkpoint import write_demo_checkpoint  # noqa: E402
from client.driver import DriverConfig  # noqa: E402
from client.local_swarm import LocalSwarm, wait_for_replicas  # noqa: E402
from client.tokenizer import load_tokenizer  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="bench/push_pipeline.py",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--delays-ms",
        default="0,5,20",
        help="one-way delays to add on every node's link, comma-separated (default "
        "%(default)s; a LAN is well under 1 ms, a consumer WAN path 5-50 ms)",
    )
    parser.add_argument(
        "--direct",
        action="store_true",
        help="no link emulators: the nodes listen on plain loopback, as in bench/inference.py "
        "(then --delays-ms is 0)",
    )
    parser.add_argument(
        "--full",
        action="store_true",
        help="bench/inference.py's full model (12 layers, hidden 1024) instead of its --quick one",
    )
    parser.add_argument("--tokens", type=int, default=24, help="tokens per run (default 24)")
    parser.add_argument(
        "--rounds", type=int, default=5, help="rounds per delay; the median counts (default 5)"
    )
    args = parser.parse_args(argv)
    try:
        args.delays = [float(d) for d in args.delays_ms.split(",") if d.strip()]
    except ValueError:
        parser.error(f"--delays-ms must be numbers separated by commas, got {args.delays_ms!r}")
    if not args.delays or any(d < 0 or d > 500 for d in args.delays):
        parser.error("--delays-ms needs at least one delay, each in [0, 500] ms")
    if args.direct:
        args.delays = [0.0]
    if args.tokens < 3 or args.rounds < 1:
        parser.error("--tokens must be at least 3 and --rounds at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="tessera-push-bench-") as tmp:
        return bench(args, Path(tmp))


def bench(args: argparse.Namespace, workdir: Path) -> int:
    t0 = time.monotonic()
    shape = inference.FULL_SHAPE if args.full else inference.QUICK_SHAPE
    checkpoint = write_demo_checkpoint(workdir / "checkpoint", shape)
    tokenizer = load_tokenizer((checkpoint / "tokenizer.json").read_bytes())
    assert tokenizer is not None
    prompt_ids = tokenizer.encode(inference.PROMPT)
    say = inference.say
    say(
        f"model: {shape.layers} layers, hidden {shape.hidden}, fp32 on CPU; prompt "
        f"{len(prompt_ids)} tokens, {args.tokens} generated; 3 nodes, "
        + ("on plain loopback (no link emulators)" if args.direct else "each behind its own link")
    )
    links: list[LinkEmulator] = []
    rows = [["one-way delay", "ring tok/s", "pushed tok/s", "hop by hop tok/s", "ring/pushed",
             "pushed/hop by hop", "ms/token ring / pushed / hop by hop"]]  # fmt: skip
    ring_ratios: dict[float, float] = {}
    push_ratios: dict[float, float] = {}
    same = True
    try:
        layout = ["--min-stages", "3", "--replicas", "2"]
        with LocalSwarm(workdir, coordinator_args=layout) as swarm:
            swarm.start_coordinator()
            nodes = []
            if args.direct:
                nodes = [swarm.start_node(name) for name in inference.NODES]
            else:
                with reserved_ports(len(inference.NODES)) as ports:
                    advertised = []
                    for name, port in zip(inference.NODES, ports, strict=True):
                        link = LinkEmulator("127.0.0.1", port, name=f"link->{name}")
                        links.append(link)
                        advertised.append((name, port, link.start_in_thread()))
                for name, port, address in advertised:
                    nodes.append(swarm.start_node(name, ["--listen", f"127.0.0.1:{port}",
                                                         "--advertise", address]))  # fmt: skip
            swarm.wait_registered(nodes)
            swarm.add_model(checkpoint, inference.MODEL)
            with (
                Client(swarm.address) as ring,
                Client(swarm.address, driver_config=DriverConfig(ring=False)) as pushed,
                Client(swarm.address, driver_config=DriverConfig(push=False)) as hop,
            ):
                clients = {"ring": ring, "pushed": pushed, "hop by hop": hop}
                wait_for_replicas(ring, inference.MODEL, timeout_s=300)
                for delay in args.delays:
                    for link in links:
                        link.set(delay_ms=delay)
                    for client in clients.values():  # warm-up, untimed
                        inference.generate_swarm(client, prompt_ids, 4)
                    rounds: list[dict[str, inference.Run]] = []
                    for r in range(args.rounds):
                        order = list(clients)
                        order = order[r % len(order) :] + order[: r % len(order)]
                        runs = {
                            label: inference.generate_swarm(
                                clients[label], prompt_ids, args.tokens, label
                            )
                            for label in order
                        }
                        same = same and len({tuple(run.token_ids) for run in runs.values()}) == 1
                        rounds.append(runs)
                    for label, client in clients.items():
                        record = client.last_run
                        assert record is not None
                        if record.push_off and label != "hop by hop":
                            say(f"  the {label} client stopped pushing: {record.push_off}")
                        if record.ring_off and label == "ring":
                            say(f"  the ring client's ring stopped: {record.ring_off}")
                    # The round with the median ring/hop by hop ratio (lower middle if even).
                    rounds.sort(key=lambda runs: inference.ratio(runs["ring"], runs["hop by hop"]))
                    runs = rounds[(len(rounds) - 1) // 2]
                    a, b, c = runs["ring"], runs["pushed"], runs["hop by hop"]
                    ring_ratios[delay] = inference.ratio(a, c)
                    push_ratios[delay] = inference.ratio(b, c)
                    rows.append(
                        [f"{delay:g} ms", f"{a.tokens_per_s:.2f}", f"{b.tokens_per_s:.2f}",
                         f"{c.tokens_per_s:.2f}", f"{inference.ratio(a, b):.2f}",
                         f"{push_ratios[delay]:.2f}",
                         f"{a.median_token_ms:.1f} / {b.median_token_ms:.1f} / "
                         f"{c.median_token_ms:.1f}"]
                    )  # fmt: skip
                    say(
                        f"{delay:g} ms a link: ring/hop by hop "
                        + ", ".join(
                            f"{inference.ratio(r['ring'], r['hop by hop']):.2f}" for r in rounds
                        )
                        + f" (median {ring_ratios[delay]:.2f}); ring/pushed in that round "
                        f"{inference.ratio(a, b):.2f}"
                    )
    finally:
        for link in links:
            link.stop_thread()
    say()
    say(inference.table(rows))
    say(f"greedy token ids identical in every run: {'yes' if same else 'NO'}")
    say(f"total time {time.monotonic() - t0:.0f} s")
    largest = max(ring_ratios)
    say(f"pushed/hop by hop tokens/s at {largest:g} ms a link: {push_ratios[largest]:.2f}")
    say(f"ring/hop by hop tokens/s at {largest:g} ms a link: {ring_ratios[largest]:.2f}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
