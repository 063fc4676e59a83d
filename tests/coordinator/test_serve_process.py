"""`tessera-coordinator serve` as a real process: kill -9 and restart, SIGTERM, the admin CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import sqlite_utils
from support.coordinator_cli import run_main
from support.coordinator_harness import CHANNEL_OPTIONS, FakeNode, wait_until
from support.procs import (
    REPO_ROOT,
    SERVING_RE,
    ManagedProcess,
    python_module,
    start_coordinator,
    start_node,
)

from protos.tessera.v1 import client_api_pb2, client_api_pb2_grpc, node_pb2


def cli(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "coordinator.cli", *args],
        capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT,
    )  # fmt: skip


async def list_nodes(address: str, include_offline: bool = True) -> list[node_pb2.NodeInfo]:
    async with grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS) as channel:
        reply = await client_api_pb2_grpc.ClientApiStub(channel).ListNodes(
            client_api_pb2.ListNodesRequest(include_offline=include_offline)
        )
    return list(reply.nodes)


async def test_nodes_survive_kill_9_and_keep_their_ids(tmp_path) -> None:
    first = start_coordinator(tmp_path)
    with first:
        assert (first.data_dir / "coordinator.addr").read_text().strip() == first.address
        async with grpc.aio.insecure_channel(first.address, options=CHANNEL_OPTIONS) as channel:
            nodes = [FakeNode(channel, f"node-{i}") for i in range(3)]
            replies = [await n.register() for n in nodes]
            await nodes[0].attach()
            await nodes[0].heartbeat(1)

            def attach_recorded() -> bool:
                db = sqlite_utils.Database(first.db_path)
                try:
                    row = db.execute(
                        "SELECT state FROM nodes WHERE node_id = ?", [nodes[0].node_id]
                    ).fetchone()
                finally:
                    db.close()
                return row == ("online",)

            # State changes are durable within moments of happening (not per heartbeat).
            await wait_until(attach_recorded, timeout=2, what="the attach to reach SQLite")
            token = first.admin_token
            coordinator_key = replies[0].coordinator_public_key
            assert first.kill() == -9  # no chance to flush or say goodbye

            second = start_coordinator(tmp_path, data_dir=first.data_dir)
            with second:
                listed = await list_nodes(second.address)
                assert sorted(n.name for n in listed) == ["node-0", "node-1", "node-2"]
                assert {n.state for n in listed} == {node_pb2.NODE_STATE_OFFLINE}
                assert await list_nodes(second.address, include_offline=False) == []

                # Same key, same id, no duplicate row; same coordinator key and admin token.
                async with grpc.aio.insecure_channel(
                    second.address, options=CHANNEL_OPTIONS
                ) as channel2:
                    nodes[0].stub = FakeNode(channel2).stub
                    again = await nodes[0].register()
                    assert again.node_id == replies[0].node_id
                    assert again.coordinator_public_key == coordinator_key
                    await nodes[0].attach()
                    online = await list_nodes(second.address, include_offline=False)
                    assert [n.node_id for n in online] == [nodes[0].node_id]
                assert second.admin_token == token

                db = sqlite_utils.Database(second.db_path)
                assert db["nodes"].count == 3
                reasons = [
                    r[0]
                    for r in db.execute(
                        "SELECT reason FROM node_events WHERE node_id = ? ORDER BY id",
                        [nodes[0].node_id],
                    )
                ]
                assert "coordinator restarted" in reasons
                db.close()


async def test_sigterm_ends_streams_and_exits_cleanly(tmp_path) -> None:
    coordinator = start_coordinator(tmp_path)
    with coordinator:
        async with grpc.aio.insecure_channel(
            coordinator.address, options=CHANNEL_OPTIONS
        ) as channel:
            node = FakeNode(channel, "n1")
            await node.register()
            await node.attach()
            assert coordinator.terminate(timeout=15) == 0
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await node.call.read()
            assert info.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
        log = coordinator.process.log_text()
        assert "stopped" in log
        assert log.count("serving on") == 1
        # The clean shutdown recorded the node going offline.
        db = sqlite_utils.Database(coordinator.db_path)
        state = db.execute("SELECT state FROM nodes WHERE node_id = ?", [node.node_id]).fetchone()
        assert state == ("offline",)


async def test_admin_cli_lists_and_drains(tmp_path) -> None:
    coordinator = start_coordinator(tmp_path)
    with coordinator:
        async with grpc.aio.insecure_channel(
            coordinator.address, options=CHANNEL_OPTIONS
        ) as channel:
            node = FakeNode(channel, "cli-node")
            await node.register()
            await node.attach()
            data_dir = str(coordinator.data_dir)

            listed = cli("nodes", "list", "--data-dir", data_dir)
            assert listed.returncode == 0, listed.stderr
            assert node.node_id in listed.stdout and "online" in listed.stdout
            header, row = listed.stdout.splitlines()[:2]
            at = header.index("LEAVES/H")  # columns are padded to line up
            assert row[at:].split()[0] == "0.69"  # no history yet: the planner's prior
            # No traffic timed yet: the planner uses the node's own benchmark, and says so.
            speed = row[header.index("MS/GPARAM") :].split()
            assert float(speed[0]) > 0 and speed[1:] == ["(claim)", "-"]

            as_json = cli("nodes", "list", "--all", "--json", "--coordinator", coordinator.address)
            assert json.loads(as_json.stdout)[0]["name"] == "cli-node"

            wrong = cli("nodes", "drain", node.node_id, "--data-dir", data_dir,
                        "--admin-token", "guess")  # fmt: skip
            assert wrong.returncode == 1
            assert "UNAUTHENTICATED" in wrong.stderr

            drained = cli("nodes", "drain", node.node_id, "--reason", "reboot",
                          "--data-dir", data_dir)  # fmt: skip
            assert drained.returncode == 0, drained.stderr
            message = await node.call.read()
            assert message.command.drain.reason == "reboot"

            async def draining() -> bool:
                nodes = await list_nodes(coordinator.address)
                return nodes[0].state == node_pb2.NODE_STATE_DRAINING

            await wait_until(draining, what="the node to be draining")

            unknown = cli("nodes", "drain", "n-nobody", "--data-dir", data_dir)
            assert unknown.returncode == 1 and "NOT_FOUND" in unknown.stderr


def test_admin_cli_explains_missing_settings(tmp_path) -> None:
    result = cli("nodes", "drain", "n1")
    assert result.returncode == 2
    assert "--data-dir" in result.stderr and "Traceback" not in result.stderr

    result = cli("nodes", "list", "--data-dir", str(tmp_path))
    assert result.returncode == 2
    assert "coordinator.addr" in result.stderr

    result = cli("nodes", "list", "--coordinator", "127.0.0.1:1")
    assert result.returncode == 1
    assert "cannot reach the coordinator at 127.0.0.1:1" in result.stderr
    assert "is `tessera-coordinator serve` running there?" in result.stderr

    # gRPC would read "localhost" as port 443 and fail with a resolver message.
    for address in ("localhost", "http://127.0.0.1:7000", "127.0.0.1:70000"):
        result = cli("nodes", "list", "--coordinator", address)
        assert result.returncode == 2, result.stderr
        assert f"argument --coordinator: '{address}' is not HOST:PORT" in result.stderr


def test_admin_cli_names_an_address_that_is_no_coordinator(capsys) -> None:
    # A node's data-plane port (or any other gRPC server) answers UNIMPLEMENTED.
    server = grpc.server(ThreadPoolExecutor(max_workers=1))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        for args in (["nodes", "list"], ["models", "list"]):
            code, _, err = run_main([*args, "--coordinator", f"127.0.0.1:{port}"], capsys)
            assert code in (1, 2), err
            assert f"the server at 127.0.0.1:{port} does not answer as a Tessera coordinator" in err
            assert "check --coordinator" in err and "Traceback" not in err
    finally:
        server.stop(None)


def test_ledger_audit_of_a_file_that_is_no_database_exits_2(tmp_path, capsys) -> None:
    not_a_db = tmp_path / "notes.txt"
    not_a_db.write_text("these are not the tables you are looking for\n" * 100)
    code, _, err = run_main(["ledger", "audit", "--db", str(not_a_db)], capsys)
    assert code == 2
    assert f"cannot read {not_a_db}" in err and "give --db the coordinator's database" in err


def test_admin_cli_explains_a_data_dir_that_is_a_file(tmp_path) -> None:
    not_a_dir = tmp_path / "coordinator-data"
    not_a_dir.write_text("")
    for args in (("credits", "grant", "acc", "5"), ("nodes", "list")):
        result = cli(*args, "--data-dir", str(not_a_dir))
        assert result.returncode == 2, result.stderr
        assert "Not a directory" in result.stderr and "Traceback" not in result.stderr
        assert "--data-dir must be the coordinator's data directory" in result.stderr


def test_serve_explains_where_it_cannot_keep_its_state(tmp_path, capsys) -> None:
    not_a_dir = tmp_path / "state"
    not_a_dir.write_text("")
    code, _, err = run_main(["serve", "--db", str(not_a_dir / "c.db")], capsys)
    assert code == 2
    assert f"{not_a_dir} is a file, not a directory" in err and "--db" in err
    a_dir = tmp_path / "c.db"
    a_dir.mkdir()
    code, _, err = run_main(["serve", "--db", str(a_dir)], capsys)
    assert code == 2
    assert f"database {a_dir}" in err and "unable to open database file" in err


def test_serve_names_the_flag_whose_directory_it_cannot_use(tmp_path, capsys) -> None:
    a_file = tmp_path / "state"
    a_file.write_text("")
    code, _, err = run_main(
        ["serve", "--db", str(tmp_path / "ok" / "c.db"), "--data-dir", str(a_file)], capsys
    )
    assert code == 2
    assert f"{a_file} is a file, not a directory; give --data-dir a directory" in err


def test_serve_needs_a_place_for_its_state(capsys) -> None:
    code, _, err = run_main(["serve"], capsys)
    assert code == 2
    assert "serve needs --data-dir DIR" in err and "or --db PATH" in err


def test_serve_with_only_a_data_dir_and_one_coordinator_per_state(tmp_path) -> None:
    data_dir = tmp_path / "state"
    args = python_module("coordinator.cli", "serve", "--data-dir", data_dir,
                         "--listen", "127.0.0.1:0")  # fmt: skip
    with ManagedProcess(args, tmp_path / "first.log", name="coordinator").start() as first:
        first.wait_for_line(SERVING_RE)
        assert (data_dir / "coordinator.db").is_file()
        # A second one on the same state would mark the first one's nodes offline and
        # take over coordinator.addr: it is refused before it touches anything.
        second = cli("serve", "--data-dir", str(data_dir), "--listen", "127.0.0.1:0")
        assert second.returncode == 2, second.stderr
        assert f"pid {first.pid}" in second.stderr
        assert f"already using the data dir {data_dir}" in second.stderr
        other_dir = cli(
            "serve", "--db", str(data_dir / "coordinator.db"),
            "--data-dir", str(tmp_path / "other"), "--listen", "127.0.0.1:0",
        )  # fmt: skip
        assert other_dir.returncode == 2, other_dir.stderr
        assert f"already using the database {data_dir / 'coordinator.db'}" in other_dir.stderr
        assert "serving on" not in second.stderr + other_dir.stderr
        assert first.terminate(timeout=15) == 0
    # The lock went with the process: the same state serves again.
    with start_coordinator(tmp_path, data_dir=data_dir) as again:
        assert again.terminate(timeout=15) == 0


def test_serve_refuses_a_busy_port(tmp_path) -> None:
    coordinator = start_coordinator(tmp_path / "a")
    with coordinator:
        result = cli("serve", "--listen", coordinator.address, "--db", str(tmp_path / "b" / "c.db"))
    assert result.returncode == 2
    assert "cannot listen" in result.stderr
    assert "Pick another --listen" in result.stderr


def test_serve_refuses_a_host_that_is_not_this_machine(tmp_path, capsys) -> None:
    # 192.0.2.0/24 is reserved for documentation: never an address of this machine.
    args = ["serve", "--listen", "192.0.2.1:7000", "--data-dir", str(tmp_path)]
    code, _, err = run_main(args, capsys)
    assert code == 2
    assert "cannot listen on 192.0.2.1:7000" in err
    assert "not an address of this machine" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "args",
    [
        ["--help"],
        ["serve", "--help"],
        ["nodes", "--help"],
        ["nodes", "drain", "--help"],
        ["nodes", "list", "--help"],
    ],
)
def test_help_teaches(args: list[str], capsys) -> None:
    code, out, _ = run_main(args, capsys)
    assert code == 0
    assert "usage: tessera-coordinator" in out
    if args[0] == "serve":
        for flag in ("--listen", "--db", "--data-dir", "--mqtt", "--heartbeat-interval",
                     "--offline-after", "--log-level", "--relay-ports", "--relay-bind",
                     "example"):  # fmt: skip
            assert flag in out


def test_serve_listens_where_the_client_looks_by_default() -> None:
    # `tessera-coordinator serve --data-dir d` then `tessera nodes`, with no address given,
    # must meet; they missed each other on 50051 and 7000.
    from client.api import DEFAULT_COORDINATOR
    from coordinator.cli import build_parser

    args = build_parser().parse_args(["serve", "--data-dir", "d"])
    assert args.listen == DEFAULT_COORDINATOR == "127.0.0.1:7000"


def test_help_works_as_a_program() -> None:
    result = cli("--help")
    assert result.returncode == 0 and "serve" in result.stdout


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["serve", "--db", "x.db", "--listen", "nohost"], "HOST:PORT"),
        (["serve", "--db", "x.db", "--heartbeat-interval", "-1"], "positive"),
        (["serve", "--db", "x.db", "--mqtt", "http://x"], "mqtt://"),
        (["serve", "--db", "x.db", "--heartbeat-ack-every", "7"], "invalid choice"),
        (["serve", "--db", "x.db", "--heartbeat-interval", "5", "--offline-after", "5"],
         "must be longer"),
        (["serve", "--db", "x.db", "--max-token-latency", "-5"], "expected a number >= 0"),
        (["serve", "--db", "x.db", "--max-token-latency", "nan"], "expected a number >= 0"),
        (["serve", "--db", "x.db", "--max-token-latency", "inf"], "expected a number >= 0"),
        (["serve", "--db", "x.db", "--max-token-price", "-1"], "expected a number >= 0"),
        (["serve", "--db", "x.db", "--max-token-price", "nan"], "expected a number >= 0"),
        (["serve", "--db", "x.db", "--heartbeat-interval", "soon"], "not a number of seconds"),
        (["serve", "--db", "x.db", "--heartbeat-interval", "inf"], "positive"),
        (["serve", "--db", "x.db", "--replicas", "0"], "at least 1"),
        (["serve", "--db", "x.db", "--kv-tokens", "many"], "not a whole number"),
        (["serve", "--db", "x.db", "--default-price", "-1"], "between 0 and 2^63-1"),
        (["serve", "--db", "x.db", "--default-price", str(1 << 63)], "between 0 and 2^63-1"),
        (["serve", "--db", "x.db", "--fee-bps", "1.5"], "not a whole number"),
        (["serve", "--db", "x.db", "--fee-bps", "10001"], "at most 10000"),
        (["serve", "--db", "x.db", "--verify-min-probability", "1.5"], "probability in [0, 1]"),
        (["serve", "--db", "x.db", "--verify-min-probability", "nan"], "probability in [0, 1]"),
        (["serve", "--db", "x.db", "--verify-min-probability", "often"], "probability in [0, 1]"),
        (["serve", "--db", "x.db", "--canary-interval", "-5"], "expected a number >= 0"),
        (["serve", "--db", "x.db", "--relay-host", "h", "--relay-ports", "41000"], "LOW-HIGH"),
        (["serve", "--db", "x.db", "--relay-host", "h", "--relay-ports", "a-b"], "LOW-HIGH"),
        (["serve", "--db", "x.db", "--relay-host", "h", "--relay-ports", "5-3"], "LOW <= HIGH"),
        (["serve", "--db", "x.db", "--relay-host", "h", "--relay-ports", "0-9"], "1 <= LOW"),
        (["serve", "--db", "x.db", "--relay-host", "h", "--relay-ports", "1-70000"], "65535"),
        (["serve", "--db", "x.db", "--relay-ports", "41000-41999"], "only with --relay-host"),
        (["serve", "--db", "x.db", "--relay-bind", "0.0.0.0"], "only with --relay-host"),
    ],
)  # fmt: skip
def test_serve_rejects_bad_flags(args: list[str], fragment: str, capsys) -> None:
    code, _, err = run_main(args, capsys)
    assert code == 2
    assert fragment in err


async def test_admin_cli_bans_a_node_agent_and_lifts_the_ban(tmp_path) -> None:
    """Real processes: `nodes ban` ends a running node agent, which exits REFUSED (its
    systemd unit does not restart that) and cannot join again; `nodes unban` lets it."""
    with start_coordinator(tmp_path) as coordinator:
        data_dir = str(coordinator.data_dir)
        node = start_node(coordinator.address, tmp_path / "node", "noisy")
        with node:
            banned = cli("nodes", "ban", str(node.node_id), "--reason", "spams sessions",
                         "--data-dir", data_dir)  # fmt: skip
            assert banned.returncode == 0, banned.stderr
            assert "is banned" in banned.stdout
            assert node.process.wait(timeout=60) == 3  # ExitCode.REFUSED
        assert "banned" in node.process.log_text()
        nodes = await list_nodes(coordinator.address)
        assert [n.state for n in nodes] == [node_pb2.NODE_STATE_BANNED]
        again = start_node(coordinator.address, tmp_path / "node", "noisy",
                           wait_registered=False)  # fmt: skip
        with again:
            assert again.process.wait(timeout=60) == 3
        unknown = cli("nodes", "unban", "n-nobody", "--data-dir", data_dir)
        assert unknown.returncode == 1 and "NOT_FOUND" in unknown.stderr

    # The ban and its reason outlast a kill -9 of the coordinator (leaving the block above).
    with start_coordinator(tmp_path, data_dir=coordinator.data_dir) as coordinator:
        listed = cli("nodes", "list", "--all", "--data-dir", data_dir)
        assert listed.returncode == 0, listed.stderr
        assert f"{node.node_id} is banned: by an operator: 'spams sessions'" in listed.stdout

        lifted = cli("nodes", "unban", str(node.node_id), "--reason", "owner fixed it",
                     "--data-dir", data_dir)  # fmt: skip
        assert lifted.returncode == 0, lifted.stderr
        back = start_node(coordinator.address, tmp_path / "node", "noisy")
        with back:
            assert back.node_id == node.node_id
            nodes = await list_nodes(coordinator.address, include_offline=False)
            assert [n.node_id for n in nodes] == [node.node_id]
        db = sqlite_utils.Database(coordinator.db_path)
        reasons = [
            r[0]
            for r in db.execute(
                "SELECT reason FROM node_events WHERE node_id = ? ORDER BY id", [node.node_id]
            )
        ]
        db.close()
        assert "by an operator: 'spams sessions'" in reasons
        assert "ban lifted by an operator: 'owner fixed it'" in reasons
