"""`tessera`: the user's command line (nodes, models, generate, train, jobs, demo)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from google.protobuf import json_format

from client import billing, cli_args
from client.api import COORDINATOR_ENV, Client, default_coordinator
from client.driver import DriverConfig
from client.errors import CoordinatorError, TesseraError
from client.jobs_cli import add_training_commands as _add_training_commands
from client.jobs_cli import jobs_command, train_command
from protos.dialing import CA_ENV
from protos.tessera.v1 import client_api_pb2, node_pb2
from protos.units import human_bytes

log = logging.getLogger("tessera")

EXAMPLES = f"""\
examples:
  tessera nodes --coordinator coord.example.org:7000
  tessera nodes --coordinator grpcs://coord.example.org:7000   # over TLS
  tessera models
  tessera generate --model llama-tiny --prompt "Once upon a time" --max-new-tokens 32
  tessera generate --model llama-tiny --token-ids 1,15,27 --max-new-tokens 8 --json
  tessera balance            # creates your client key on first use, prints your account
  tessera generate --model llama-tiny --prompt "Hi" --max-new-tokens 8 --max-price 5000 \\
      --prefer cheap
  tessera train --model llama-tiny --data tokens.npy --steps 200 --batch-size 8 \\
      --seq-len 64 --lr 3e-4 --checkpoint-every 20 --output-model llama-tiny-ft
  tessera train --resume j0123456789abcdef
  tessera jobs
  tessera demo

The coordinator defaults to ${COORDINATOR_ENV}, else {default_coordinator()}. A grpcs://
address is dialed over TLS and its certificate checked against the system's roots, or the
private CA in ${CA_ENV}.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tessera",
        description="Use a Tessera swarm: see its nodes and models, and generate text "
        "through a pipeline of community GPUs that fails over when a node leaves.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="log what the client does (to stderr)"
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    nodes = commands.add_parser(
        "nodes",
        help="list the swarm's nodes",
        description="List the nodes registered with the coordinator: id, name, state, "
        "device, usable memory, measured matmul TFLOPS, memory bandwidth, when it was last "
        "heard from, how often it leaves (departures per hour online), its trust (the "
        "share of its checked results that were right) and the speed placement plans it "
        "with: ms per billion parameters and token measured on real traffic, plus the "
        "fixed time of each call once spans of different sizes told it apart ('claimed': "
        "the node's own benchmark, until traffic is timed).",
        epilog="examples:\n  tessera nodes --coordinator coord.example.org:7000\n"
        "  tessera nodes --all --json     # offline and banned ones too, for scripts",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_coordinator(nodes)
    nodes.add_argument("--all", action="store_true", help="include offline and banned nodes")
    nodes.add_argument("--json", action="store_true", help="print JSON for scripts")

    models = commands.add_parser(
        "models",
        help="list the models the swarm serves",
        description="List imported models, their size and whether every layer has a "
        "ready replica right now. A model is imported with `tessera-coordinator models add`.",
        epilog="example: tessera models --coordinator coord.example.org:7000",
    )
    _add_coordinator(models)
    models.add_argument("--json", action="store_true", help="print JSON for scripts")

    gen = commands.add_parser(
        "generate",
        help="generate text through the swarm",
        description="Open a session, stream the generated text to the terminal, and close "
        "the session. If a stage node fails mid-generation the client switches to a "
        "replica and replays its inputs, so greedy output is unchanged.",
        epilog='example: tessera generate --model llama-tiny --prompt "Hello" '
        "--max-new-tokens 16 --json",
    )
    _add_coordinator(gen)
    gen.add_argument("--model", required=True, help="model name (see `tessera models`)")
    prompt = gen.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="prompt text (needs a model with a tokenizer)")
    prompt.add_argument(
        "--token-ids",
        type=cli_args.token_ids,
        metavar="IDS",
        help="prompt as comma-separated token ids, e.g. 1,15,27 (for a model without a tokenizer)",
    )
    gen.add_argument(
        "--max-new-tokens",
        type=cli_args.positive_int,
        required=True,
        metavar="N",
        help="how many tokens to generate at most (1 or more; fewer when an end-of-sequence "
        "token comes first); the prompt and these must fit in the model's context",
    )
    gen.add_argument(
        "--temperature",
        type=cli_args.non_negative_float,
        default=0.0,
        metavar="T",
        help="0 = greedy, always the likeliest token (default); higher = more random",
    )
    gen.add_argument(
        "--top-p",
        type=cli_args.top_p,
        default=1.0,
        metavar="P",
        help="nucleus sampling: draw from the likeliest tokens that together hold this "
        "probability, in (0, 1] (default 1 = all of them)",
    )
    gen.add_argument(
        "--seed",
        type=cli_args.seed,
        metavar="N",
        help="seed for sampling, for reproducible runs (default: a random one)",
    )
    gen.add_argument("--account", default="", help="account billed (default: the account of --key)")
    _add_key(gen)
    gen.add_argument(
        "--max-price",
        type=cli_args.credit_units,
        default=0,
        metavar="UNITS",
        help="refuse the session if its quote is above this many credit units (default: no cap)",
    )
    gen.add_argument(
        "--prefer",
        choices=["fast", "cheap"],
        default="fast",
        help="route for the lowest latency (fast, default) or the lowest price (cheap)",
    )
    gen.add_argument(
        "--no-stop-at-eos", action="store_true", help="keep going past end-of-sequence tokens"
    )
    gen.add_argument(
        "--hop-by-hop",
        action="store_true",
        help="send every stage its input yourself instead of having each node hand its "
        "output to the next (slower over real links; for comparing, or nodes that cannot "
        "reach each other)",
    )
    gen.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object (token_ids, text, route, per-stage timings, failovers) "
        "instead of streaming text",
    )
    gen.set_defaults(command_parser=gen)  # so its own usage comes with its errors

    balance = commands.add_parser(
        "balance",
        help="show your credit: available and held in escrow",
        description="Show this client's credit balance. Your account is your client key "
        "(created at the --key path on first use): give its account id to the swarm's "
        "operator to be granted credit.",
        epilog="example: tessera balance --coordinator coord.example.org:7000",
    )
    _add_coordinator(balance)
    _add_key(balance)
    balance.add_argument("--json", action="store_true", help="print JSON for scripts")
    _add_training_commands(commands)

    commands.add_parser(
        "demo",
        help="run a local swarm on this machine and watch a fail-over",
        description="Start a coordinator and several node agents on loopback, generate "
        "through them, kill a node mid-generation and show the recovery.",
        add_help=False,
    )
    return parser


def _add_coordinator(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--coordinator",
        default=None,
        metavar="HOST:PORT",
        type=cli_args.coordinator_address,
        help=f"coordinator address (default: ${COORDINATOR_ENV} or {default_coordinator()})",
    )


def _add_key(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--key",
        type=Path,
        default=None,
        metavar="PATH",
        help=f"client key, your paying identity (default: ${billing.KEY_ENV} or "
        "~/.tessera/client.key; generate uses it when it exists)",
    )


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list and args_list[0] == "demo":
        return _demo(args_list[1:])
    parser = build_parser()
    args = parser.parse_args(args_list)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if args.command is None:
        parser.print_help()
        return 2
    if getattr(args, "coordinator", "") is None:
        # The environment's address bypasses argparse: check it as --coordinator is checked.
        address = default_coordinator()
        try:
            cli_args.coordinator_address(address)
        except argparse.ArgumentTypeError:
            print(
                f"tessera: ${COORDINATOR_ENV} is {address!r}, which is not HOST:PORT; set it to "
                "the address `tessera-coordinator serve` logs as 'serving on HOST:PORT', or "
                "pass --coordinator HOST:PORT",
                file=sys.stderr,
            )
            return 2
    command_parser = getattr(args, "command_parser", parser)
    try:
        if args.command == "nodes":
            return _nodes(args)
        if args.command == "models":
            return _models(args)
        if args.command == "balance":
            return _balance(args)
        if args.command == "train":
            return train_command(args, command_parser)
        if args.command == "jobs":
            return jobs_command(args)
        return _generate(args)
    except CoordinatorError as err:
        print(f"tessera: {_coordinator_problem(err, args)}", file=sys.stderr)
        return 1
    except TesseraError as err:
        print(f"tessera: {err}", file=sys.stderr)
        return 1
    except ValueError as err:
        print(f"tessera: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ntessera: interrupted", file=sys.stderr)
        return 130


def _coordinator_problem(err: CoordinatorError, args: argparse.Namespace) -> str:
    if err.code != grpc.StatusCode.UNIMPLEMENTED:
        return str(err)
    # A node's data-plane port, a web server or another gRPC service: "Method not found!"
    # (or "Received http2 header with status: 404") does not say that the address is wrong.
    address = args.coordinator or default_coordinator()
    return (
        f"the server at {address} does not answer as a Tessera coordinator ({err.details}); "
        "check --coordinator: it must be the address `tessera-coordinator serve` logs as "
        "'serving on HOST:PORT', not a node's"
    )


def _demo(argv: list[str]) -> int:
    # Imported lazily: the demo pulls in process management the other commands never need.
    try:
        from client import demo
    except ModuleNotFoundError as err:
        if err.name != "client.demo":
            raise
        print("tessera: this installation has no demo (client/demo.py is missing)", file=sys.stderr)
        return 1
    return int(demo.main(argv) or 0)


# ---- nodes ------------------------------------------------------------------------------

_STATE_NAMES = {
    node_pb2.NODE_STATE_ONLINE: "online",
    node_pb2.NODE_STATE_SUSPECT: "suspect",
    node_pb2.NODE_STATE_OFFLINE: "offline",
    node_pb2.NODE_STATE_DRAINING: "draining",
    node_pb2.NODE_STATE_BANNED: "banned",
}


def _nodes(args: argparse.Namespace) -> int:
    with Client(args.coordinator) as client:
        nodes = client.nodes(include_offline=args.all)
    if args.json:
        print(json.dumps([_message_json(n) for n in nodes], indent=2))
        return 0
    if not nodes:
        hint = "" if args.all else " (online ones; --all shows every node)"
        print(f"no nodes{hint}")
        return 0
    now_ms = time.time() * 1000
    rows = [
        [
            n.node_id,
            n.name,
            _STATE_NAMES.get(n.state, "?")
            + (", unreachable" if n.data_address and not n.reachable else ""),
            f"{n.capabilities.device_kind}: {n.capabilities.device_name}".strip(": "),
            human_bytes(n.capabilities.memory_usable_bytes),
            f"{n.capabilities.matmul_tflops:.2f}",
            _gbps(n.capabilities.memory_bandwidth_gbps),
            _ago(now_ms - n.last_seen_unix_ms) if n.last_seen_unix_ms else "never",
            _leaves(n),
            _trust(n),
            _speed(n),
        ]
        for n in nodes
    ]
    header = [
        "ID", "NAME", "STATE", "DEVICE", "MEMORY", "TFLOPS", "GB/S", "LAST SEEN", "LEAVES", "TRUST",
        "SPEED",
    ]  # fmt: skip
    print(_table(header, rows))
    for n in nodes:
        if n.state == node_pb2.NODE_STATE_BANNED:
            print(f"{n.node_id} is banned: {n.state_reason or 'no reason on record'}")
    return 0


def _leaves(node: node_pb2.NodeInfo) -> str:
    """How often it leaves, as the planner weighs it: estimated departures per hour online,
    then the departures and hours behind the estimate."""
    if not node.HasField("reliability"):
        return "-"
    r = node.reliability
    return f"{r.leave_rate_per_h:.2f}/h ({r.departures} in {r.hours_online:.1f} h)"


def _speed(node: node_pb2.NodeInfo) -> str:
    """What placement plans the node's calls with: ms per billion parameters and token,
    plus the fixed part of each call once told apart; a speed nobody measured yet is the
    node's own claim, and says so."""
    if not node.HasField("speed"):
        return "-"
    s = node.speed
    text = f"{s.ms_per_gparam:.3g} ms/Gparam"
    if s.call_ms:
        text += f" + {s.call_ms:.3g} ms/call"
    return text if s.measured else f"{text} (claimed)"


def _trust(node: node_pb2.NodeInfo) -> str:
    """Trust, then verified results / failures: what the verifier thinks of the node."""
    if not node.HasField("trust"):
        return "-"
    t = node.trust
    return f"{t.trust:.2f} ({t.verified} ok, {t.failures} failed)"


def _models(args: argparse.Namespace) -> int:
    with Client(args.coordinator) as client:
        models = client.models()
    if args.json:
        print(json.dumps([_message_json(m) for m in models], indent=2))
        return 0
    if not models:
        print("no models (import one with `tessera-coordinator models add DIR`)")
        return 0
    rows = [
        [
            m.name,
            m.architecture,
            str(m.num_layers),
            # Prompt and new tokens together; "-" from a coordinator that does not say.
            f"{m.max_positions:,}" if m.max_positions else "-",
            human_bytes(m.total_bytes),
            "yes" if m.has_tokenizer else "no",
            "ready" if m.available else f"unavailable: {m.unavailable_reason}",
        ]
        for m in models
    ]
    header = ["NAME", "ARCHITECTURE", "LAYERS", "CONTEXT", "SIZE", "TOKENIZER", "STATUS"]
    print(_table(header, rows))
    return 0


# ---- generate ---------------------------------------------------------------------------


def _generate(args: argparse.Namespace) -> int:
    # --token-ids, --max-new-tokens, --max-price, ... were checked while parsing (cli_args).
    key_path = args.key or billing.default_key_path()
    key = load_client_key(key_path) if args.key or key_path.exists() else None
    with Client(
        args.coordinator,
        account=args.account,
        key=key,
        max_price=args.max_price,
        prefer=args.prefer,
        driver_config=DriverConfig(push=not args.hop_by_hop),
    ) as client:
        stream = client.generate(
            args.model,
            prompt=args.prompt,
            token_ids=args.token_ids,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            seed=args.seed,
            stop_at_eos=not args.no_stop_at_eos,
        )
        for token in stream:
            if args.json:
                continue
            for event in token.failovers:
                print(
                    f"\n[fail-over: layers [{event.start}, {event.end}) moved from "
                    f"{event.failed_node_id} to {', '.join(event.replacement_node_ids)}, "
                    f"stalled {event.stalled_ms:.0f} ms]",
                    file=sys.stderr,
                )
            piece = token.text if token.text else ("" if args.prompt else f"{token.id} ")
            if piece:
                sys.stdout.write(piece)
                sys.stdout.flush()
        result = client.last_run
    assert result is not None
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
    else:
        sys.stdout.write("\n")
        print(
            f"[{len(result.token_ids)} tokens, {result.tokens_per_s:.1f} tokens/s, "
            f"{len(result.route)} hops, {len(result.failovers)} fail-overs]",
            file=sys.stderr,
        )
        for rollback in result.rollbacks:
            print(
                f"[a check proved node {rollback.rejected_node_id} wrong at position "
                f"{rollback.position}: the generation went back there without it "
                f"({rollback.discarded_positions} positions redone); no token from it was "
                "shown]",
                file=sys.stderr,
            )
        if result.settlement is not None:
            print(
                f"[charged {result.settlement.charged} of {result.quote} credit units escrowed; "
                f"{result.settlement.refunded} refunded]",
                file=sys.stderr,
            )
    return 0


# ---- balance ----------------------------------------------------------------------------


def _balance(args: argparse.Namespace) -> int:
    path = args.key or billing.default_key_path()
    created = not path.exists()
    key = load_client_key(path, create=True)
    if created:
        print(f"created your client key at {path} (keep it: it is your account)", file=sys.stderr)
    with Client(args.coordinator, key=key) as client:
        balance = client.balance()
    if args.json:
        print(json.dumps(json_format.MessageToDict(
            balance, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
        )))  # fmt: skip
        return 0
    print(f"account   {balance.account}")
    print(f"available {balance.available} credit units")
    print(f"escrowed  {balance.escrowed} credit units (held for open sessions)")
    return 0


def load_client_key(path: Path, create: bool = False) -> Ed25519PrivateKey:
    """billing.load_key, with a key that cannot be created (its folder is not writable, or
    under a file) said as a usage error rather than a traceback."""
    try:
        return billing.load_key(path, create=create)
    except OSError as err:
        raise ValueError(
            f"cannot create the client key at {path} ({err.strerror or err}); pass --key a path "
            f"this user can write, or set ${billing.KEY_ENV}"
        ) from None


# ---- formatting -------------------------------------------------------------------------


def _message_json(message: node_pb2.NodeInfo | client_api_pb2.ModelInfo) -> dict[str, Any]:
    return json_format.MessageToDict(message, preserving_proto_field_name=True)


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True))
        for row in [header, *rows]
    ]
    return "\n".join(line.rstrip() for line in lines)


def _gbps(value: float) -> str:
    return f"{value:.0f}" if value else "-"  # 0: an agent too old to measure it


def _ago(ms: float) -> str:
    seconds = max(0.0, ms / 1000)
    if seconds < 60:
        return f"{seconds:.0f}s ago"
    if seconds < 3600:
        return f"{seconds / 60:.0f}m ago"
    if seconds < 86400:
        return f"{seconds / 3600:.0f}h ago"
    return f"{seconds / 86400:.0f}d ago"


if __name__ == "__main__":
    sys.exit(main())
