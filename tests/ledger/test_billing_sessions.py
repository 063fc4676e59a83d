"""Quotes, escrow and settlement through the real session manager, placement and router,
on a real SQLite ledger, with real Ed25519 keys for nodes and the client.

The stand-in here is only the command channel to nodes (placement's `send`), as in
tests/planner: shard readiness is reported by the test.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import grpc
import pytest

from client.billing import UsageBook, sign_open
from coordinator.db import open_database
from coordinator.ledger import Ledger, LedgerError, NodeQuote, audit
from coordinator.ledger.billing import Billing
from coordinator.ledger.book import Usage, _billable
from coordinator.placement import Placement, PlacementNode, model_spec
from coordinator.sessions import SessionError, Sessions
from protos import identity
from protos.tessera.v1 import client_api_pb2, common_pb2, ledger_pb2, node_pb2

CONFIG = json.dumps(
    {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 100,
        "rms_norm_eps": 1e-5,
        "hidden_act": "silu",
    }
)
MAX_LENGTH = 32
CREDIT = 96  # serve --usage-credit


class Node:
    def __init__(self, price: int, tflops: float) -> None:
        self.key = identity.generate_private_key()
        self.public = identity.public_key_bytes(self.key)
        self.node_id = identity.node_id(self.public)
        self.price = price
        self.tflops = tflops

    def receipt(
        self, session_id: str, start: int, end: int, tokens: int, longest: int = 0
    ) -> ledger_pb2.SignedUsage:
        body = ledger_pb2.UsageReceipt(
            session_id=session_id, node_id=self.node_id, node_public_key=self.public,
            layer_start=start, layer_end=end, tokens=tokens, first_step=1, last_step=tokens,
            longest=longest,
        ).SerializeToString(deterministic=True)  # fmt: skip
        return ledger_pb2.SignedUsage(
            receipt=body, node_signature=self.key.sign(identity.usage_payload(body))
        )


def countersign(
    usage: ledger_pb2.SignedUsage, key, billed: int | None = None
) -> ledger_pb2.SignedUsage:
    """The client's counter-signature, billing ``billed`` tokens (default: all it counts)."""
    signed = ledger_pb2.SignedUsage()
    signed.CopyFrom(usage)
    counted = ledger_pb2.UsageReceipt.FromString(usage.receipt).tokens
    signed.billed_tokens = counted if billed is None else billed
    signed.client_signature = key.sign(
        identity.usage_countersign_payload(usage.receipt, signed.billed_tokens)
    )
    return signed


class World:
    def __init__(self, tmp_path: Path, nodes: list[Node]) -> None:
        self.commands: list[tuple[str, int, int]] = []
        self.placement = Placement(self._send, replicas=2, min_stages=3, debounce_s=0)
        self.placement.set_models([model_spec("m", CONFIG)])
        self.nodes = {n.node_id: n for n in nodes}
        self.db = open_database(tmp_path / "coordinator.db")
        self.ledger = Ledger(self.db, challenge_window_ms=0)
        self.billing = Billing(self.ledger, lambda n: NodeQuote(self.nodes[n].price, f"op-{n[:6]}"))
        info = client_api_pb2.ModelInfo(name="m", num_layers=6, hidden_size=64, vocab_size=100)
        self.sessions = Sessions(
            identity.generate_private_key(), self.placement, lambda n: info if n == "m" else None,
            lambda: ["m"], billing=self.billing, usage_credit=CREDIT,
        )  # fmt: skip
        self.client = identity.generate_private_key()
        self.account = identity.client_account(identity.public_key_bytes(self.client))

    async def _send(self, node_id: str, command) -> bool:
        kind = command.WhichOneof("kind")
        if kind == "assign":
            body = command.assign
            self.commands.append((node_id, body.layers.start, body.layers.end))
        return True

    async def ready(self) -> None:
        for node in self.nodes.values():
            caps = node_pb2.Capabilities(
                device_kind="cpu", memory_usable_bytes=4 << 30, matmul_tflops=node.tflops
            )
            self.placement.node_up(PlacementNode(node.node_id, "127.0.0.1:1", caps))
        await self.placement.replan()
        for node_id, start, end in self.commands:
            await self.placement.shard_status(
                node_id,
                node_pb2.ShardStatus(
                    model="m", layers=common_pb2.LayerRange(start=start, end=end),
                    state=node_pb2.SHARD_STATE_READY,
                ),
            )  # fmt: skip

    def request(self, *, sign: bool = True, **fields) -> client_api_pb2.OpenSessionRequest:
        request = client_api_pb2.OpenSessionRequest(model="m", max_length=MAX_LENGTH, **fields)
        if sign:
            sign_open(request, self.client, int(time.time() * 1000))
        return request


def expected_quote(grant: client_api_pb2.SessionGrant, nodes: dict[str, Node]) -> int:
    total = 0
    for stage in grant.stages:
        layers = stage.layers.end - stage.layers.start
        price = max(nodes[h.node_id].price for h in (stage.primary, *stage.alternates))
        total += layers * price
    return -(-total * MAX_LENGTH // 1000)


@pytest.fixture
async def world(tmp_path: Path) -> World:
    w = World(tmp_path, [Node(1000 * (i + 1), 1.0 + i) for i in range(6)])
    await w.ready()
    yield w
    assert audit(w.db).ok, audit(w.db).violations
    w.db.close()


async def test_open_quotes_and_escrows_then_close_pays_receipts_and_refunds(world: World):
    world.ledger.grant(world.account, 1_000_000, "g1")
    grant = world.sessions.open_session(world.request())
    quote = grant.quote.amount
    assert quote == expected_quote(grant, world.nodes) > 0
    assert grant.quote.account == world.account
    assert world.ledger.client_balance(world.account).escrowed == quote
    claims = identity.open_capability(world.sessions._public, grant.capability)
    assert claims.account == world.account
    usage = []
    charged = 0
    for stage in grant.stages:
        node = world.nodes[stage.primary.node_id]
        start, end = stage.layers.start, stage.layers.end
        usage.append(countersign(node.receipt(grant.session_id, start, end, 20), world.client))
        charged += 20 * (end - start) * node.price // 1000
    close = client_api_pb2.CloseSessionRequest(
        session_id=grant.session_id, capability=grant.capability, usage=usage
    )
    settlement = world.sessions.close_session(close).settlement
    assert (settlement.charged, settlement.refunded) == (charged, quote - charged)
    assert world.sessions.close_session(close).settlement == settlement, "a retry pays once"
    assert world.ledger.client_balance(world.account).available == 1_000_000 - charged
    assert world.ledger.client_balance(world.account).escrowed == 0
    world.ledger.release_due()
    paid = sum(world.ledger.earnings(n).released for n in world.nodes)
    assert paid == charged


async def test_a_paid_sessions_capability_holds_the_client_to_a_credit_across_reroutes(
    world: World,
):
    world.ledger.grant(world.account, 1_000_000, "g1")
    grant = world.sessions.open_session(world.request())
    claims = identity.open_capability(world.sessions._public, grant.capability)
    assert claims.client_public_key == identity.public_key_bytes(world.client)
    assert claims.usage_credit == CREDIT
    stage = grant.stages[0]
    rerouted = world.sessions.reroute(
        client_api_pb2.RerouteRequest(
            session_id=grant.session_id, capability=grant.capability, span=stage.layers,
            exclude_node_ids=[stage.primary.node_id],
        )
    )  # fmt: skip
    renewed = identity.open_capability(world.sessions._public, rerouted.capability)
    assert (renewed.client_public_key, renewed.usage_credit) == (
        claims.client_public_key,
        CREDIT,
    )
    # Free nodes: no escrow, and so no credit (an unsigned open is a free session's).
    for node in world.nodes.values():
        node.price = 0
    free = world.sessions.open_session(world.request(sign=False))
    free_claims = identity.open_capability(world.sessions._public, free.capability)
    assert not free_claims.client_public_key and free_claims.usage_credit == 0


async def test_a_client_cannot_open_past_its_balance_or_its_max_price(world: World):
    with pytest.raises(LedgerError) as err:
        world.sessions.open_session(world.request())
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "credit units available" in err.value.message
    world.ledger.grant(world.account, 1_000_000, "g1")
    with pytest.raises(LedgerError) as err:
        world.sessions.open_session(world.request(max_price=10))
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "max_price of 10" in err.value.message
    assert world.ledger.client_balance(world.account).escrowed == 0


async def test_prefer_cheap_routes_through_cheaper_nodes_and_fits_a_budget(world: World):
    world.ledger.grant(world.account, 10_000_000, "g1")
    fast = world.sessions.open_session(world.request(prefer="fast"))
    cheap = world.sessions.open_session(world.request(prefer="cheap"))
    assert cheap.quote.amount < fast.quote.amount

    def primary_cost(grant):
        return sum(
            world.nodes[s.primary.node_id].price * (s.layers.end - s.layers.start)
            for s in grant.stages
        )

    assert primary_cost(cheap) <= primary_cost(fast)
    # A budget between the two: the default (fast) preference falls back to a cheaper route.
    budget = cheap.quote.amount
    fitted = world.sessions.open_session(world.request(max_price=budget))
    assert fitted.quote.amount <= budget


@pytest.mark.parametrize(
    ("change", "code", "fragment"),
    [
        (lambda r: setattr(r, "client_signature", b"\x00" * 64),
         grpc.StatusCode.UNAUTHENTICATED, "not signed"),
        (lambda r: setattr(r, "max_length", 31),  # changed after signing
         grpc.StatusCode.UNAUTHENTICATED, "not signed"),
        (lambda r: setattr(r, "client_public_key", b"\x01" * 7),
         grpc.StatusCode.INVALID_ARGUMENT, "32-byte"),
        (lambda r: setattr(r, "account", "c" + "0" * 23),
         grpc.StatusCode.INVALID_ARGUMENT, "not the account"),
        (lambda r: setattr(r, "prefer", "slow"), grpc.StatusCode.INVALID_ARGUMENT, "prefer"),
        (lambda r: setattr(r, "max_price", -5), grpc.StatusCode.INVALID_ARGUMENT, "max_price"),
    ],
)  # fmt: skip
async def test_hostile_open_requests_are_refused(world: World, change, code, fragment):
    world.ledger.grant(world.account, 1_000_000, "g1")
    request = world.request()
    change(request)
    with pytest.raises((LedgerError, SessionError)) as err:
        world.sessions.open_session(request)
    assert err.value.code == code and fragment in err.value.message
    assert world.ledger.client_balance(world.account).escrowed == 0


async def test_stale_and_unsigned_paid_opens_are_refused(world: World):
    world.ledger.grant(world.account, 1_000_000, "g1")
    request = client_api_pb2.OpenSessionRequest(model="m", max_length=MAX_LENGTH)
    with pytest.raises(LedgerError) as err:
        world.sessions.open_session(request)
    assert (
        err.value.code == grpc.StatusCode.FAILED_PRECONDITION and "client key" in err.value.message
    )
    stale = client_api_pb2.OpenSessionRequest(model="m", max_length=MAX_LENGTH)
    sign_open(stale, world.client, int(time.time() * 1000))
    stale.request_unix_ms = int(time.time() * 1000) - 3_600_000
    stale.client_signature = world.client.sign(identity.open_session_payload(stale))
    with pytest.raises(LedgerError) as err:
        world.sessions.open_session(stale)
    assert err.value.code == grpc.StatusCode.UNAUTHENTICATED and "clock" in err.value.message


async def test_hostile_receipts_are_refused_and_the_hold_survives(world: World):
    world.ledger.grant(world.account, 1_000_000, "g1")
    grant = world.sessions.open_session(world.request())
    other = world.sessions.open_session(world.request())
    stage = grant.stages[0]
    node = world.nodes[stage.primary.node_id]
    start, end = stage.layers.start, stage.layers.end
    honest = node.receipt(grant.session_id, start, end, 10)
    impostor = Node(1, 1.0)
    forged = impostor.receipt(grant.session_id, start, end, 10)
    forged_body = ledger_pb2.UsageReceipt.FromString(forged.receipt)
    forged_body.node_id = node.node_id  # claims to be the granted node, signed by another key
    wrong_key_body = forged_body.SerializeToString()
    inflated = node.receipt(grant.session_id, start, end, 10_000)
    inflated.client_signature = countersign(honest, world.client).client_signature
    overflowing = countersign(node.receipt(grant.session_id, start, end, 2**64 - 1), world.client)
    cases = [
        ([countersign(honest, identity.generate_private_key())], "UNAUTHENTICATED", "counter"),
        (
            [
                countersign(
                    ledger_pb2.SignedUsage(
                        receipt=wrong_key_body,
                        node_signature=impostor.key.sign(identity.usage_payload(wrong_key_body)),
                    ),
                    world.client,
                )
            ],
            "UNAUTHENTICATED",
            "not node",
        ),  # noqa: E501
        (
            [
                countersign(
                    ledger_pb2.SignedUsage(receipt=honest.receipt, node_signature=b"\x00" * 64),
                    world.client,
                )
            ],
            "UNAUTHENTICATED",
            "not signed by node",
        ),  # noqa: E501
        ([inflated], "UNAUTHENTICATED", "never agreed"),
        (
            [countersign(node.receipt(other.session_id, start, end, 10), world.client)],
            "PERMISSION_DENIED",
            "is for session",
        ),  # noqa: E501
        (
            [countersign(impostor.receipt(grant.session_id, start, end, 10), world.client)],
            "PERMISSION_DENIED",
            "never granted",
        ),  # noqa: E501
        ([overflowing], "INVALID_ARGUMENT", "do not fit"),
        (  # a longer prefix than it computed: shortfall billing would pay for it
            [countersign(node.receipt(grant.session_id, start, end, 10, longest=11), world.client)],
            "INVALID_ARGUMENT",
            "held a prefix of 11",
        ),
        ([countersign(honest, world.client)] * 2, "INVALID_ARGUMENT", "second receipt"),
        ([ledger_pb2.SignedUsage(receipt=b"\xff\xff garbage")], "INVALID_ARGUMENT", "not a Usage"),
        ([ledger_pb2.SignedUsage(receipt=b"x" * 5000)], "INVALID_ARGUMENT", "at most"),
    ]
    for usage, code, fragment in cases:
        close = client_api_pb2.CloseSessionRequest(
            session_id=grant.session_id, capability=grant.capability, usage=usage
        )
        with pytest.raises(LedgerError) as err:
            world.sessions.close_session(close)
        assert err.value.code.name == code and fragment in err.value.message, (fragment, err.value)
        assert world.ledger.hold(grant.session_id)["state"] == "open"
    close = client_api_pb2.CloseSessionRequest(
        session_id=grant.session_id, capability=grant.capability,
        usage=[countersign(honest, world.client)],
    )  # fmt: skip
    assert (
        world.sessions.close_session(close).settlement.charged
        == 10 * (end - start) * node.price // 1000
    )
    # The same receipt cannot be paid again in another session (it names this one anyway).
    replay = client_api_pb2.CloseSessionRequest(
        session_id=other.session_id, capability=other.capability,
        usage=[countersign(honest, world.client)],
    )  # fmt: skip
    with pytest.raises(LedgerError) as err:
        world.sessions.close_session(replay)
    assert err.value.code == grpc.StatusCode.PERMISSION_DENIED


def test_the_driver_countersigns_only_what_it_sent():
    node = Node(1000, 1.0)
    client = identity.generate_private_key()
    book = UsageBook()
    book.sent(node.node_id, 0, 2, 10)
    book.received(node.node_id, 0, 2, node.receipt("s1", 0, 2, 10))
    other = Node(1000, 1.0)
    book.sent(other.node_id, 2, 4, 10)
    book.received(other.node_id, 2, 4, other.receipt("s1", 2, 4, 11))  # inflated by one
    liar = Node(1000, 1.0)
    book.sent(liar.node_id, 4, 6, 10)
    book.received(liar.node_id, 4, 6, node.receipt("s1", 4, 6, 5))  # another node's receipt
    signed = book.countersign("s1", client)
    assert [ledger_pb2.UsageReceipt.FromString(s.receipt).node_id for s in signed] == [node.node_id]
    assert identity.verify(
        identity.public_key_bytes(client),
        signed[0].client_signature,
        identity.usage_countersign_payload(signed[0].receipt, 10),
    )
    assert book.countersign("another-session", client) == []
    # A prefix longer than the node computed: the ledger bills the longest prefix held
    # (shortfall.py), so the client signs no such claim.
    book.received(node.node_id, 0, 2, node.receipt("s1", 0, 2, 10, longest=11))
    assert book.countersign("s1", client) == []
    book.received(node.node_id, 0, 2, node.receipt("s1", 0, 2, 10, longest=10))
    assert len(book.countersign("s1", client)) == 1
    # What the driver waits for at the close of a session whose ring ended early: the
    # receipts it would leave unsigned as it stands.
    assert sorted(book.uncovered()) == [(other.node_id, 2, 4)]
    book.sent(other.node_id, 2, 4, 1)  # the answer of a ring's step it had not adopted
    assert book.uncovered() == []
    assert len(book.countersign("s1", client)) == 2


def test_the_driver_pays_a_node_that_also_checked_only_for_its_own_calls():
    # After a fail-over, a node that checked a span and then served it as primary returns
    # one cumulative receipt for both: the client signs it, billing only its own calls.
    node = Node(1000, 1.0)
    client = identity.generate_private_key()
    book = UsageBook()
    book.checked(node.node_id, 0, 2, 7)  # the verifier's check of another primary
    book.sent(node.node_id, 0, 2, 14)  # then the replay and the rest, as primary
    book.received(node.node_id, 0, 2, node.receipt("s1", 0, 2, 21))
    [signed] = book.countersign("s1", client)
    assert signed.billed_tokens == 14
    assert identity.verify(
        identity.public_key_bytes(client),
        signed.client_signature,
        identity.usage_countersign_payload(signed.receipt, 14),
    )
    # One token more than it was sent in all: inflated, not signed at all.
    book.received(node.node_id, 0, 2, node.receipt("s1", 0, 2, 22))
    assert book.countersign("s1", client) == []


def test_the_book_keeps_the_receipt_that_counts_most_and_acknowledges_checkers_unbilled():
    # A node that checks one span and serves another... and, here, answers a check and a
    # primary call of the same layers out of order: the later-arriving, older receipt
    # must not replace the newer one.
    node = Node(1000, 1.0)
    client = identity.generate_private_key()
    book = UsageBook()
    book.sent(node.node_id, 0, 2, 10)
    book.received(node.node_id, 0, 2, node.receipt("s1", 0, 2, 10))
    book.received(node.node_id, 0, 2, node.receipt("s1", 0, 2, 6))
    assert book.owed(node.node_id, 0, 2) == 10
    signed, tokens = book.countersign_one("s1", node.node_id, 0, 2, client)
    assert tokens == 10 and ledger_pb2.UsageReceipt.FromString(signed.receipt).tokens == 10
    book.acknowledged(node.node_id, 0, 2, 10)
    book.acknowledged(node.node_id, 0, 2, 4)  # an older acknowledgment landing late
    assert book.owed(node.node_id, 0, 2) == 0
    # A pure checker: its receipt is acknowledged (billed 0), so that it keeps checking,
    # but the settlement leaves it out: it pays nothing and bills no ungranted node.
    checker = Node(1000, 1.0)
    book.checked(checker.node_id, 0, 2, 8)
    book.received(checker.node_id, 0, 2, checker.receipt("s1", 0, 2, 8))
    acknowledged, _ = book.countersign_one("s1", checker.node_id, 0, 2, client)
    assert acknowledged.billed_tokens == 0
    assert [s.billed_tokens for s in book.countersign("s1", client)] == [10]
    assert book.countersign_one("s1", "n-unknown", 0, 2, client) is None


async def test_a_stages_primary_is_billed_its_whole_count_whatever_the_client_claims(
    world: World,
):
    # A client that acknowledges every call as a check (billed 0) to pay nothing: the
    # primaries at open checked nothing of their own stages (checks run on other nodes), so
    # their receipts, whose count the client signed, are billed in full. An alternate's
    # count may hold checks: what the client bills there stands.
    world.ledger.grant(world.account, 1_000_000, "g1")
    grant = world.sessions.open_session(world.request())
    stage = grant.stages[0]
    start, end = stage.layers.start, stage.layers.end
    primary, alternate = (
        world.nodes[stage.primary.node_id],
        world.nodes[stage.alternates[0].node_id],
    )

    def billed(node: Node, counted: int, bills: int) -> ledger_pb2.SignedUsage:
        receipt = node.receipt(grant.session_id, start, end, counted)
        return countersign(receipt, world.client, billed=bills)

    settle = ledger_pb2.SettleUsageRequest(
        session_id=grant.session_id, usage=[billed(primary, 20, 0), billed(alternate, 10, 4)]
    )
    settlement = world.billing.settle_usage(settle.session_id, settle.usage)
    layers = end - start
    assert settlement.charged == (
        20 * layers * primary.price // 1000 + 4 * layers * alternate.price // 1000
    )


def test_only_a_nodes_own_primary_stages_are_billed_in_full():
    spans = {0: 2, 2: 4, 6: 8}  # primary of [0, 2), [2, 4) and [6, 8)

    def tokens(start: int, end: int) -> int:
        usage = Usage("r", "n", start, end, tokens=3, counted=9)
        return _billable(usage, spans).tokens

    assert tokens(0, 2) == tokens(2, 4) == tokens(0, 4) == tokens(6, 8) == 9  # one hop or two
    assert tokens(0, 3) == tokens(4, 6) == tokens(2, 8) == tokens(1, 2) == 3
    assert _billable(Usage("r", "n", 0, 2, tokens=3), spans).tokens == 3  # no count known
