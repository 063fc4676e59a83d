"""A priced three-node market of real processes for the ledger's end-to-end tests: the
coordinator and node agents on loopback, and the CLIs a person would use on them
(`credits grant`, `tessera balance`, `tessera-node earnings`, `ledger audit`)."""

from __future__ import annotations

import contextlib
import json
import sqlite3
import subprocess
import sys
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from support.checkpoints import TINY_SHAPE, make_checkpoint
from support.procs import run_until_killed
from support.waiting import wait_for

from client import billing
from client.api import Client, GenerationResult
from client.local_swarm import LocalSwarm
from node_agent.failpoints import ENV_VAR
from protos import identity
from protos.tessera.v1 import node_pb2

MODEL = "tiny-llama"
PROMPT = [1, 5, 9, 23, 42, 7, 11]
NEW_TOKENS = 8
PRICES = {"alpha": 1000, "bravo": 2500, "charlie": 4000}  # credit units per 1k token-layers
GRANT = 1_000_000
WINDOW_S = 2.0


def run_cli(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [sys.executable, "-m", *argv], capture_output=True, text=True, timeout=120
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"{argv} exited {result.returncode}:\n{result.stdout}\n{result.stderr}"
        )
    return result


def make_market_checkpoint(directory: Path) -> Path:
    return make_checkpoint(
        directory, "llama", num_layers=6, **TINY_SHAPE, seed=7,
    )  # fmt: skip


THREE_STAGES = ("--min-stages", "3", "--replicas", "1")
TURNCOAT = Path(__file__).parents[1] / "ledger" / "turncoat_node.py"


def turncoats(
    work: Path, names: Iterable[str], failpoints: str
) -> tuple[dict[str, Path], dict[str, dict[str, str]], dict[str, Path]]:
    """Every node a turncoat (tests/ledger/turncoat_node.py) with ``failpoints`` and a
    trigger file of its own, so that a test turns whichever node lands where it wants a
    cheater: (scripts, node_env) for running_market, and the triggers by node name."""
    triggers = {name: work / f"{name}-cheats" for name in names}
    env = {
        name: {ENV_VAR: failpoints, "TESSERA_TEST_CHEAT_TRIGGER": str(trigger)}
        for name, trigger in triggers.items()
    }
    return dict.fromkeys(triggers, TURNCOAT), env, triggers


@contextlib.contextmanager
def running_market(
    work: Path,
    checkpoint: Path,
    scripts: dict[str, Path] | None = None,
    *,
    layout: tuple[str, ...] = THREE_STAGES,
    window_s: float = WINDOW_S,
    coordinator_args: tuple[str, ...] = (),
    node_env: dict[str, dict[str, str]] | None = None,
    training_prices: dict[str, int] | None = None,
    prices: dict[str, int] | None = None,
) -> Iterator[LocalSwarm]:
    """A coordinator (short challenge window) and the three PRICES nodes, the model added
    once all three are registered (by default in three stages). `scripts` runs a node
    through another entry point (a cheating agent) with the same arguments; `node_env`
    adds environment variables to one node's process only (e.g. TESSERA_FAILPOINTS);
    `training_prices` gives nodes a price per sample-layer (--training-price); `prices`
    replaces PRICES for a test that needs another order."""
    args = [*layout, "--heartbeat-interval", "1", "--challenge-window", str(window_s),
            *coordinator_args]  # fmt: skip
    with pytest.MonkeyPatch.context() as env, LocalSwarm(work, coordinator_args=args) as swarm:
        # Nodes re-attach quickly after the coordinator restarts.
        env.setenv("TESSERA_BACKOFF_BASE_S", "0.2")
        env.setenv("TESSERA_BACKOFF_CAP_S", "1.0")
        swarm.start_coordinator()
        nodes = []
        for name, price in (prices or PRICES).items():
            extra = ["--price", str(price), "--account", f"op-{name}"]
            if name in (training_prices or {}):
                extra += ["--training-price", str((training_prices or {})[name])]
            script = (scripts or {}).get(name)
            with pytest.MonkeyPatch.context() as own:  # the swarm copies os.environ
                for variable, value in (node_env or {}).get(name, {}).items():
                    own.setenv(variable, value)
                if script is None:
                    nodes.append(swarm.start_node(name, extra))
                else:
                    argv = ["join", "--coordinator", swarm.address, "--name", name,
                            "--data-dir", str(work / "nodes" / name), "--device", "cpu",
                            "--listen", "127.0.0.1:0", *extra]  # fmt: skip
                    nodes.append(swarm._spawn(name, [str(script), *argv]))
        swarm.wait_registered(nodes)
        swarm.add_model(checkpoint, MODEL)
        yield swarm


@contextlib.contextmanager
def settling_market(
    tmp_path_factory: pytest.TempPathFactory, **market: object
) -> Iterator[LocalSwarm]:
    """``running_market`` on the market checkpoint, with nodes that settle what their
    clients acknowledged every 0.3 s (a test waits for that, not for the default 10 s)."""
    checkpoint = make_market_checkpoint(tmp_path_factory.mktemp("ckpt") / "tiny")
    settle_fast = {name: {"TESSERA_SETTLE_EVERY_S": "0.3"} for name in PRICES}
    with running_market(
        tmp_path_factory.mktemp("market"),
        checkpoint,
        node_env=settle_fast,
        **market,  # type: ignore[arg-type]
    ) as swarm:
        yield swarm


def coordinator_rows(market: LocalSwarm, sql: str, params: Sequence[object]) -> list[tuple]:
    """A query on the coordinator's database, as it stands."""
    with sqlite3.connect(market.coordinator_dir / "coordinator.db") as db:
        return db.execute(sql, params).fetchall()


def funded_client(market: LocalSwarm, name: str = "client") -> Ed25519PrivateKey:
    """A client key in the market's work dir (`name`.key), granted GRANT credits with the
    admin CLI (twice with one request id: granted once)."""
    key = billing.load_key(market.workdir / f"{name}.key", create=True)
    account = billing.account_of(key)
    request_id = "g1" if name == "client" else f"g1-{name}"
    for _ in range(2):
        run_cli("coordinator.cli", "credits", "grant", account, str(GRANT), "--request-id",
                request_id, "--data-dir", str(market.coordinator_dir))  # fmt: skip
    return key


def available(client: Client) -> bool:
    info = {m.name: m for m in client.models()}.get(MODEL)
    return bool(info and info.available)


def serves(client: Client, node_id: str) -> bool:
    nodes = {n.node_id: n for n in client.nodes()}
    node = nodes.get(node_id)
    return node is not None and any(
        s.model == MODEL and s.state == node_pb2.SHARD_STATE_READY for s in node.shards
    )


def idle(client: Client) -> bool:
    """No node's last heartbeat reports a session or a queued call. The router adds that
    load to a node's cost, and a heartbeat may still count a session that just ended: a
    test that asserts which node a new session's route starts with waits for this."""
    return all(
        n.telemetry.active_sessions == 0 and n.telemetry.queue_length == 0 for n in client.nodes()
    )


def price_of(market: LocalSwarm, node_id: str) -> int:
    return PRICES[market.node(node_id).name]


def expected_shares(
    market: LocalSwarm, result: GenerationResult, nodes: int | None = None
) -> dict[str, int]:
    """Per node: tokens it was sent x its layers x its price / 1000 (no fail-overs here)."""
    assert not result.failovers
    if nodes is not None:
        assert len({h.node_id for h in result.route}) == nodes, f"route: {result.route}"
    tokens = len(PROMPT) + len(result.token_ids) - 1  # the last token is never fed back
    shares: dict[str, int] = {}
    for hop in result.route:
        charge = tokens * (hop.end - hop.start) * price_of(market, hop.node_id) // 1000
        shares[hop.node_id] = shares.get(hop.node_id, 0) + charge
    return shares


def balance_cli(market: LocalSwarm) -> dict:
    out = run_cli("client.cli", "balance", "--coordinator", market.address,
                  "--key", str(market.workdir / "client.key"), "--json").stdout  # fmt: skip
    return json.loads(out)


def earnings_cli(market: LocalSwarm, node_id: str) -> dict:
    name = market.node(node_id).name
    out = run_cli("node_agent.cli", "earnings", "--coordinator", market.address,
                  "--data-dir", str(market.workdir / "nodes" / name), "--json").stdout  # fmt: skip
    return json.loads(out)


def stake_cli(market: LocalSwarm, node_id: str, amount: int, request_id: str) -> dict:
    """`tessera-node stake deposit` for the node's operator; returns its earnings after."""
    name = market.node(node_id).name
    out = run_cli("node_agent.cli", "stake", "deposit", str(amount), "--request-id", request_id,
                  "--coordinator", market.address, "--data-dir",
                  str(market.workdir / "nodes" / name), "--json").stdout  # fmt: skip
    return json.loads(out)


def audit_cli(market: LocalSwarm, *where: str) -> subprocess.CompletedProcess[str]:
    where = where or ("--data-dir", str(market.coordinator_dir))
    return run_cli("coordinator.cli", "ledger", "audit", *where, check=False)


def generate(market: LocalSwarm, key, settle_every: int = 0, prefer: str = "") -> GenerationResult:
    with Client(market.address, key=key, settle_every=settle_every, prefer=prefer) as client:
        wait_for(lambda: available(client), "the model to be served")
        return client.generate_all(
            MODEL, token_ids=PROMPT, max_new_tokens=NEW_TOKENS, stop_at_eos=False
        )


def bill_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the client library a freeloader that acknowledges every receipt but bills
    nothing on any ("those were all checks"): it counter-signs billed_tokens 0."""
    original = billing.UsageBook._countersigned

    def bills_nothing(self, session_id, where, usage, key):  # noqa: ANN001, ANN202
        signed = original(self, session_id, where, usage, key)
        if signed is not None:
            signed.billed_tokens = 0
            signed.client_signature = key.sign(
                identity.usage_countersign_payload(signed.receipt, 0)
            )
        return signed

    monkeypatch.setattr(billing.UsageBook, "_countersigned", bills_nothing)


def paid_by_node(market: LocalSwarm, session_id: str) -> dict[str, int]:
    return dict(coordinator_rows(
        market,
        "SELECT node_id, SUM(amount) FROM ledger_earnings WHERE hold_id = ? GROUP BY node_id",
        [session_id],
    ))  # fmt: skip


_DYING_CLIENT = """
import os, signal, sys
from pathlib import Path
from client import billing
from client.api import Client

address, key_path, model, prompt, settle_every = sys.argv[1:]
key = billing.load_key(Path(key_path))
with Client(address, key=key, settle_every=int(settle_every)) as client:
    tokens = client.generate(model, token_ids=[int(t) for t in prompt.split(",")],
                             max_new_tokens=8, stop_at_eos=False)
    for seen, _ in enumerate(tokens, 1):
        if seen == 1:
            print(client.last_run.session_id, flush=True)
        if seen == 7:
            os.kill(os.getpid(), signal.SIGKILL)
"""


def kill_paying_client(market: LocalSwarm, settle_every: int) -> str:
    """Run a paying client (the market's client.key) in a process of its own that settles
    every ``settle_every`` tokens (0: never) and kills itself (kill -9) after its 7th
    token, so it never closes its session; returns that session's id."""
    with Client(market.address) as client:
        wait_for(lambda: available(client), "the model to be served")
    printed = run_until_killed(
        _DYING_CLIENT, market.address, market.workdir / "client.key", MODEL,
        ",".join(map(str, PROMPT)), str(settle_every),
    )  # fmt: skip
    return printed.split()[0]
