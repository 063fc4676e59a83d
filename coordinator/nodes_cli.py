"""`tessera-coordinator nodes list|drain|ban|unban`: look at and steer the registered nodes."""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

from google.protobuf import json_format

from coordinator.admin_client import (
    add_connection_arguments,
    bearer_metadata,
    open_channel,
    resolve_address,
    resolve_admin_token,
)
from protos.tessera.v1 import (
    admin_pb2,
    admin_pb2_grpc,
    client_api_pb2,
    client_api_pb2_grpc,
    node_pb2,
)

RPC_TIMEOUT_S = 15.0


def add_parser(subparsers: Any) -> None:
    nodes = subparsers.add_parser(
        "nodes",
        help="list, drain, ban or unban the nodes of a running coordinator",
        description="Look at and steer the nodes registered with a running coordinator.",
        epilog="examples:\n"
        "  tessera-coordinator nodes list --data-dir /var/lib/tessera --all\n"
        "  tessera-coordinator nodes drain NODE_ID --reason 'disk swap' \\\n"
        "      --data-dir /var/lib/tessera\n"
        "  tessera-coordinator nodes ban NODE_ID --reason 'spams sessions' \\\n"
        "      --data-dir /var/lib/tessera\n"
        "  tessera-coordinator nodes unban NODE_ID --reason 'owner fixed it' \\\n"
        "      --data-dir /var/lib/tessera",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = nodes.add_subparsers(dest="nodes_command", required=True, metavar="ACTION")

    listing = actions.add_parser(
        "list",
        help="show registered nodes",
        description="Show the nodes the coordinator knows (connected ones unless --all).",
        epilog="columns:\n"
        "  MS/GPARAM  time the planner gives the node per billion parameters and token,\n"
        "             measured on real traffic ('(claim)': its own benchmark until then)\n"
        "  CALL_MS    fixed time of each call whatever its layers; told apart once the\n"
        "             node has served spans of different sizes ('-' until then)\n"
        "  LEAVES/H   departures per hour online, from its history\n"
        "  TRUST      trust score, then verified/failed checks\n\n"
        "example: tessera-coordinator nodes list --data-dir /var/lib/tessera --all",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    listing.add_argument("--all", action="store_true", help="include offline and banned nodes")
    listing.add_argument("--json", action="store_true", help="print JSON instead of a table")
    add_connection_arguments(listing)
    listing.set_defaults(func=run_list)

    _add_node_action(
        actions, "drain", run_drain,
        help="ask a node to finish its work and leave (admin)",
        description="Ask an attached node to stop taking new work, finish what runs and "
        "disconnect. Needs the admin token.",
        example="--reason 'disk swap'",
        reason_help="shown to the node's operator (default: none)",
    )  # fmt: skip
    _add_node_action(
        actions, "ban", run_ban,
        help="ban a node: disconnect it and refuse its key (admin)",
        description="Ban a node: its stream is closed, its shards are placed elsewhere, and "
        "its key may not register again until `nodes unban`. A node agent exits when "
        "banned, so its open sessions fail over to alternates. Slashes nothing: stakes are "
        "slashed only on proof of wrong work. Needs the admin token.",
        example="--reason 'spams sessions'",
        reason_help="kept in the node's history (default: none)",
    )  # fmt: skip
    _add_node_action(
        actions, "unban", run_unban,
        help="lift a node's ban (admin)",
        description="Lift a ban: the node may register again, and is checked as a new node "
        "would be (its failures stay on record). Needs the admin token.",
        example="--reason 'owner fixed it'",
        reason_help="kept in the node's history (default: none)",
    )  # fmt: skip


def _add_node_action(
    actions: Any,
    name: str,
    func: Callable[[argparse.Namespace], int],
    *,
    help: str,  # noqa: A002 - argparse's own word
    description: str,
    example: str,
    reason_help: str,
) -> None:
    """`nodes NAME NODE_ID [--reason TEXT]`, an admin action on one node."""
    action = actions.add_parser(
        name,
        help=help,
        description=description,
        epilog=f"example: tessera-coordinator nodes {name} n3f2a... {example} "
        "--data-dir /var/lib/tessera",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    action.add_argument("node_id", metavar="NODE_ID", help="as shown by `nodes list --all`")
    action.add_argument("--reason", default="", help=reason_help)
    add_connection_arguments(action)
    action.set_defaults(func=func)


def _state_name(value: int) -> str:
    return node_pb2.NodeState.Name(value).removeprefix("NODE_STATE_").lower()


def _state_cell(node: node_pb2.NodeInfo) -> str:
    """Its state, and whether this coordinator could dial its data address back (a node
    it cannot reach gets no shards)."""
    unreachable = node.data_address and not node.reachable
    return _state_name(node.state) + (", unreachable" if unreachable else "")


def _age(ms: int) -> str:
    if not ms:
        return "-"
    seconds = max(0.0, time.time() - ms / 1000)
    return f"{seconds:.0f}s ago" if seconds < 120 else f"{seconds / 60:.0f}m ago"


def _speed_cells(speed: node_pb2.NodeSpeed) -> tuple[str, str]:
    """What placement plans with: measured on real traffic, or the node's claim (marked)."""
    per_gparam = f"{speed.ms_per_gparam:.3g}" + ("" if speed.measured else " (claim)")
    return per_gparam, f"{speed.call_ms:.3g}" if speed.call_ms else "-"


def run_list(args: argparse.Namespace) -> int:
    with open_channel(resolve_address(args)) as channel:
        reply = client_api_pb2_grpc.ClientApiStub(channel).ListNodes(
            client_api_pb2.ListNodesRequest(include_offline=args.all), timeout=RPC_TIMEOUT_S
        )
    if args.json:
        rows = [json_format.MessageToDict(n, preserving_proto_field_name=True) for n in reply.nodes]
        print(json.dumps(rows, indent=2))
        return 0
    header = ("NODE_ID", "NAME", "STATE", "DEVICE", "USABLE_GB", "TFLOPS", "GB/S", "LAST_SEEN",
              "LEAVES/H", "TRUST", "MS/GPARAM", "CALL_MS")  # fmt: skip
    rows = [header]
    for n in reply.nodes:
        caps = n.capabilities
        rows.append((
            n.node_id, n.name, _state_cell(n), f"{caps.device_kind} {caps.device_name}"[:32],
            f"{caps.memory_usable_bytes / 1e9:.1f}", f"{caps.matmul_tflops:.2f}",
            f"{caps.memory_bandwidth_gbps:.0f}" if caps.memory_bandwidth_gbps else "-",
            _age(n.last_seen_unix_ms),
            f"{n.reliability.leave_rate_per_h:.2f}" if n.HasField("reliability") else "-",
            f"{n.trust.trust:.2f} {n.trust.verified}/{n.trust.failures}"
            if n.HasField("trust") else "-",
            *(_speed_cells(n.speed) if n.HasField("speed") else ("-", "-")),
        ))  # fmt: skip
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(header))]
    for row in rows:
        print("  ".join(str(v).ljust(w) for v, w in zip(row, widths, strict=True)).rstrip())
    if not reply.nodes:
        print("(no nodes" + ("" if args.all else " connected; --all shows offline ones") + ")")
    for n in reply.nodes:
        if n.state == node_pb2.NODE_STATE_BANNED:
            print(f"{n.node_id} is banned: {n.state_reason or 'no reason on record'}")
    return 0


def _admin_call(args: argparse.Namespace, method: str, request: Any) -> None:
    token = resolve_admin_token(args)
    with open_channel(resolve_address(args)) as channel:
        getattr(admin_pb2_grpc.AdminStub(channel), method)(
            request, metadata=bearer_metadata(token), timeout=RPC_TIMEOUT_S
        )


def run_drain(args: argparse.Namespace) -> int:
    request = admin_pb2.DrainNodeRequest(node_id=args.node_id, reason=args.reason)
    _admin_call(args, "DrainNode", request)
    print(f"node {args.node_id} is draining")
    return 0


def run_ban(args: argparse.Namespace) -> int:
    request = admin_pb2.NodeModerationRequest(node_id=args.node_id, reason=args.reason)
    _admin_call(args, "BanNode", request)
    print(f"node {args.node_id} is banned; `nodes unban {args.node_id}` lifts it")
    return 0


def run_unban(args: argparse.Namespace) -> int:
    request = admin_pb2.NodeModerationRequest(node_id=args.node_id, reason=args.reason)
    _admin_call(args, "UnbanNode", request)
    print(f"node {args.node_id} may register again")
    return 0
