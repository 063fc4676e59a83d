"""The double-entry credit ledger.

Accounts (names are `kind:owner`, system accounts are bare):
    mint                the source of granted credit; the only account below zero
    client:<id>         a client's spendable credit
    escrow              every open hold, together
    pending:<operator>  settled earnings inside their challenge window
    operator:<name>     released earnings
    stake:<name>        an operator's optional stake, slashable
    fee                 the coordinator's cut of settlements
    slashed             pending earnings and stakes taken for proven fraud

Every operation is one SQLite transaction whose entries sum to zero, keyed by an
idempotency id (txid): a retry finds its transaction and answers the same, so nothing is
paid twice, and a crash before COMMIT leaves nothing half-applied.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

import grpc
import sqlite_utils

from coordinator.ledger.amounts import INT64_MAX, LedgerError, check_amount, usage_charge
from coordinator.ledger.failpoints import failpoint
from coordinator.ledger.shortfall import Held, Where, shortfalls

MINT = "mint"
ESCROW = "escrow"
FEE = "fee"
SLASHED = "slashed"
MAX_NAME = 128
# How long after a hold closed (settled by its client, or expired) a receipt its client
# counter-signed is still paid, from the client's balance: a node's own settlement of what
# the client acknowledged may reach the coordinator after the client's close.
LATE_SETTLEMENT_MS = 15 * 60 * 1000


def client_account(client_id: str) -> str:
    return f"client:{client_id}"


def pending_account(operator: str) -> str:
    return f"pending:{operator}"


def operator_account(operator: str) -> str:
    return f"operator:{operator}"


def stake_account(operator: str) -> str:
    return f"stake:{operator}"


@dataclass(frozen=True)
class NodeQuote:
    """What one granted node charges and who is paid for its work."""

    price: int  # credit units per 1,000 token-layers
    operator: str


@dataclass(frozen=True)
class Usage:
    """Work a session's receipts (signed by node and client) prove."""

    receipt_id: str
    node_id: str
    layer_start: int
    layer_end: int
    tokens: int  # what the client agreed to pay for (billed_tokens)
    # What the node counted (the receipt's tokens, which the client signed too); billed in
    # full where the node was the session's primary for these layers. None: as tokens.
    counted: int | None = None
    # The longest prefix the node held there (UsageReceipt.longest; 0: no evidence).
    longest: int = 0


@dataclass(frozen=True)
class _Extra:
    """A shortfall's charge to one (node, layers): what its shortfalls were charged
    before, and what this adds."""

    where: Where
    before: int
    add: int

    def earning_id(self, hold_id: str) -> str:
        node_id, start, end = self.where
        return f"shortfall:{hold_id}:{node_id}:{start}-{end}:{self.before + self.add}"


@dataclass(frozen=True)
class SettlementResult:
    session_id: str
    escrowed: int
    charged: int
    refunded: int
    fee: int
    closed: bool = True  # False after a periodic settlement: the session is still open
    # Charged by this settlement because the receipts billed less than the longest
    # prefixes held (shortfall.py): a client passing work off as checks, or one that
    # rightly refused a primary's receipt.
    shortfall: int = 0


@dataclass(frozen=True)
class EarningsSummary:
    node_id: str
    pending: int
    released: int
    slashed: int
    rejected: int
    next_release_ms: int


@dataclass(frozen=True)
class BalanceSummary:
    account: str
    available: int
    escrowed: int


def _now_ms() -> int:
    return int(time.time() * 1000)


def _canonical(params: Mapping[str, object]) -> str:
    return json.dumps(params, sort_keys=True, separators=(",", ":"))


def _check_name(name: str, what: str) -> str:
    if not isinstance(name, str) or not name or len(name) > MAX_NAME:
        raise LedgerError(
            grpc.StatusCode.INVALID_ARGUMENT, f"{what} must be 1 to {MAX_NAME} characters"
        )
    if not name.isprintable() or any(c.isspace() for c in name):
        raise LedgerError(
            grpc.StatusCode.INVALID_ARGUMENT, f"{what} must be printable, without spaces"
        )
    return name


class Ledger:
    def __init__(
        self,
        db: sqlite_utils.Database,
        *,
        challenge_window_ms: int = 3_600_000,
        fee_bps: int = 0,
        clock_ms: Callable[[], int] = _now_ms,
    ) -> None:
        if not 0 <= fee_bps <= 10_000:
            raise ValueError(f"fee_bps must be within [0, 10000], got {fee_bps}")
        self.db = db
        self.challenge_window_ms = challenge_window_ms
        self.fee_bps = fee_bps
        self._clock = clock_ms

    # ---- the core: one balanced, idempotent transaction ------------------------------------

    def _existing(self, txid: str, params: Mapping[str, object]) -> bool:
        """True if `txid` was already applied with these params; refuses other params."""
        row = self.db.execute(
            "SELECT params FROM ledger_transactions WHERE txid = ?", [txid]
        ).fetchone()
        if row is None:
            return False
        if row[0] != _canonical(params):
            raise LedgerError(
                grpc.StatusCode.ALREADY_EXISTS,
                f"request id {txid!r} was already used for a different request; use a new id",
            )
        return True

    def _post(
        self, txid: str, kind: str, params: Mapping[str, object], entries: Iterable[tuple[str, int]]
    ) -> None:
        """Write one balanced transaction. The caller holds the surrounding db.atomic()."""
        merged: dict[str, int] = {}
        for account, amount in entries:
            merged[account] = merged.get(account, 0) + amount
        if sum(merged.values()) != 0:
            raise AssertionError(f"unbalanced transaction {txid}: {merged}")  # a ledger bug
        now = self._clock()
        self.db.execute(
            "INSERT INTO ledger_transactions (txid, kind, params, created_ms) VALUES (?, ?, ?, ?)",
            [txid, kind, _canonical(params), now],
        )
        for account, amount in merged.items():
            if amount == 0:
                continue
            balance = self._balance(account)
            new = balance + amount
            if new > INT64_MAX:
                raise LedgerError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"account {account} would exceed the largest balance the ledger holds",
                )
            if new < 0 and account != MINT:
                raise LedgerError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"account {account} has {balance} credit units; {-amount} are needed",
                )
            self.db.execute(
                "INSERT INTO ledger_accounts (account, balance, created_ms) VALUES (?, ?, ?) "
                "ON CONFLICT(account) DO UPDATE SET balance = excluded.balance",
                [account, new, now],
            )
            self.db.execute(
                "INSERT INTO ledger_entries (txid, account, amount) VALUES (?, ?, ?)",
                [txid, account, amount],
            )

    def _balance(self, account: str) -> int:
        row = self.db.execute(
            "SELECT balance FROM ledger_accounts WHERE account = ?", [account]
        ).fetchone()
        return int(row[0]) if row else 0

    # ---- reads --------------------------------------------------------------------------

    def balance(self, account: str) -> int:
        return self._balance(account)

    def client_balance(self, client_id: str) -> BalanceSummary:
        account = client_account(client_id)
        row = self.db.execute(
            "SELECT COALESCE(SUM(amount - charged), 0) FROM ledger_holds "
            "WHERE account = ? AND state = 'open'",
            [account],
        ).fetchone()
        return BalanceSummary(client_id, self._balance(account), int(row[0]))

    def earnings(self, node_id: str) -> EarningsSummary:
        totals = dict.fromkeys(("pending", "released", "slashed", "rejected"), 0)
        for state, amount in self.db.execute(
            "SELECT state, SUM(amount) FROM ledger_earnings WHERE node_id = ? GROUP BY state",
            [node_id],
        ).fetchall():
            totals[state] = int(amount)
        row = self.db.execute(
            "SELECT MIN(release_after_ms) FROM ledger_earnings "
            "WHERE node_id = ? AND state = 'pending'",
            [node_id],
        ).fetchone()
        return EarningsSummary(node_id, next_release_ms=int(row[0] or 0), **totals)

    def hold(self, hold_id: str) -> dict[str, object] | None:
        row = self.db.execute(
            "SELECT hold_id, account, amount, state, client_key, prices, expires_ms, charged, "
            "refunded, fee, closed_ms FROM ledger_holds WHERE hold_id = ?",
            [hold_id],
        ).fetchone()
        if row is None:
            return None
        keys = ("hold_id", "account", "amount", "state", "client_key", "prices", "expires_ms",
                "charged", "refunded", "fee", "closed_ms")  # fmt: skip
        hold = dict(zip(keys, row, strict=True))
        hold["prices"] = {
            node: NodeQuote(price, operator)
            for node, (price, operator) in json.loads(str(hold["prices"])).items()
        }
        return hold

    # ---- grants and stakes ----------------------------------------------------------------

    def usage_settled(self, hold_id: str) -> list[Usage]:
        """The cumulative usage settled so far per (node, layers) of a hold (where only a
        count and a prefix were kept, nothing was settled)."""
        rows = self.db.execute(
            "SELECT node_id, layer_start, layer_end, tokens FROM ledger_usage_paid "
            "WHERE hold_id = ? AND tokens > 0 ORDER BY node_id, layer_start",
            [hold_id],
        ).fetchall()
        return [Usage("", n, start, end, tokens) for n, start, end, tokens in rows]

    def grant(self, client_id: str, amount: int, request_id: str) -> int:
        """Mint `amount` into a client account (admin); returns its balance."""
        _check_name(client_id, "account")
        _check_name(request_id, "request id")
        check_amount(amount)
        txid = f"grant:{request_id}"
        params = {"account": client_id, "amount": amount}
        with self.db.atomic():
            if not self._existing(txid, params):
                self._post(
                    txid, "grant", params, [(MINT, -amount), (client_account(client_id), amount)]
                )
        return self._balance(client_account(client_id))

    def first_use(self, nonce: bytes, keep_ms: int) -> bool:
        """Record a signed request's nonce: False when it was seen in the last ``keep_ms``
        (a replay). Older nonces are dropped: their requests' stamps are stale anyway."""
        now = self._clock()
        with self.db.atomic():
            self.db.execute("DELETE FROM ledger_request_nonces WHERE seen_ms < ?", [now - keep_ms])
            inserted = self.db.execute(
                "INSERT OR IGNORE INTO ledger_request_nonces (nonce, seen_ms) VALUES (?, ?)",
                [nonce, now],
            )
        return inserted.rowcount == 1

    def deposit_stake(self, operator: str, amount: int, request_id: str) -> None:
        """Move released earnings of `operator` into its slashable stake."""
        _check_name(operator, "operator")
        _check_name(request_id, "request id")
        check_amount(amount)
        txid = f"stake:{request_id}"
        params = {"operator": operator, "amount": amount}
        with self.db.atomic():
            if not self._existing(txid, params):
                self._post(
                    txid,
                    "stake",
                    params,
                    [(operator_account(operator), -amount), (stake_account(operator), amount)],
                )

    # ---- holds ---------------------------------------------------------------------------

    def open_hold(
        self,
        hold_id: str,
        client_id: str,
        amount: int,
        prices: Mapping[str, NodeQuote],
        expires_ms: int,
        client_key: bytes,
        primaries: Sequence[tuple[str, int, int]] = (),
    ) -> None:
        """Escrow `amount` of the client's credit for a session; refused past its balance.
        ``primaries`` are its stages' primaries at open, (node id, layer start, end): their
        receipts there are billed in full (``_billable``).

        Not tied to inference: `hold_id` names any paid piece of work (a training job holds
        under "job:<job id>", so it cannot collide with a session id), `client_key` is the
        key that counter-signs its usage, and settlement charges Usage.tokens x layers x
        price / 1000. A job priced per sample-layer passes NodeQuote(price x 1000) and the
        samples as tokens; settle_usage pays it periodically, settle closes it.
        """
        _check_name(hold_id, "session id")
        _check_name(client_id, "account")
        check_amount(amount, "quote")
        for node_id, quote in prices.items():
            _check_name(node_id, "node id")
            check_amount(quote.price, f"price of {node_id}", allow_zero=True)
        txid = f"hold:{hold_id}"
        table = {n: [q.price, q.operator] for n, q in sorted(prices.items())}
        params = {"account": client_id, "amount": amount, "prices": table}
        with self.db.atomic():
            if self._existing(txid, params):
                return
            available = self._balance(client_account(client_id))
            if available < amount:
                raise LedgerError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"account {client_id} has {available} credit units available; this session "
                    f"needs {amount} in escrow. Ask the operator for credits "
                    "(tessera-coordinator credits grant), or lower max_length",
                )
            self._post(
                txid, "hold", params, [(client_account(client_id), -amount), (ESCROW, amount)]
            )
            self.db.execute(
                "INSERT INTO ledger_holds (hold_id, account, amount, state, client_key, prices, "
                "created_ms, expires_ms) VALUES (?, ?, ?, 'open', ?, ?, ?, ?)",
                [hold_id, client_account(client_id), amount, client_key,
                 _canonical(table), self._clock(), expires_ms],
            )  # fmt: skip
            for node_id, start, end in primaries:
                self.db.execute(
                    "INSERT OR IGNORE INTO ledger_hold_primaries "
                    "(hold_id, node_id, layer_start, layer_end) VALUES (?, ?, ?, ?)",
                    [hold_id, node_id, start, end],
                )
            failpoint("hold:before-commit")

    def add_prices(
        self, hold_id: str, prices: Mapping[str, NodeQuote], expires_ms: int | None = None
    ) -> None:
        """After a reroute: the new nodes may bill at their price (the escrow still caps),
        and the hold lives as long as the fresh capability."""
        with self.db.atomic():
            hold = self.hold(hold_id)
            if hold is None or hold["state"] != "open":
                return
            table = dict(hold["prices"])  # type: ignore[call-overload]
            for node_id, quote in prices.items():
                table.setdefault(node_id, quote)
            self.db.execute(
                "UPDATE ledger_holds SET prices = ?, expires_ms = MAX(expires_ms, ?) "
                "WHERE hold_id = ?",
                [
                    _canonical({n: [q.price, q.operator] for n, q in sorted(table.items())}),
                    expires_ms or 0,
                    hold_id,
                ],
            )

    def settle(self, hold_id: str, usages: list[Usage]) -> SettlementResult:
        """Close a session: pay operators (pending) for proven usage not paid yet, refund
        the rest of the escrow.

        Usage beyond the escrow (replays after fail-overs) is scaled down so the total is
        exactly the escrow: the client never pays past its quote. Work that verification
        already rejected, or of a node convicted of fraud, is refunded instead of paid.
        Idempotent per session: a retry answers the first settlement, whatever receipts
        it carries.
        """
        hold = self._open_hold(hold_id)
        if hold["state"] != "open":
            return self._settled(hold)
        return self._pay(hold, usages, close=True)

    def settle_usage(self, hold_id: str, usages: list[Usage]) -> SettlementResult:
        """Periodic settlement of an open session: pay what these cumulative receipts add
        over what was paid before; the hold shrinks by the charge. A repeated or older
        receipt adds nothing, so any replay pays nothing twice.

        After the hold closed (its client's close, or its expiry), for LATE_SETTLEMENT_MS:
        a late settlement, paid from the client's balance instead of the escrow, still
        within the quote (what was refunded) and the balance. The receipts are the ones
        the client counter-signed, so it agreed to pay them; its nodes settle them on
        their own, a few seconds apart, and a close must not outrun them."""
        hold = self.hold(hold_id)
        if hold is None:
            raise LedgerError(grpc.StatusCode.NOT_FOUND, f"no escrow hold for session {hold_id!r}")
        if hold["state"] == "open":
            return self._pay(hold, usages, close=False)
        closed_ms = int(hold["closed_ms"] or 0)  # type: ignore[call-overload]
        if self._clock() > closed_ms + LATE_SETTLEMENT_MS:
            raise LedgerError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"session {hold_id} is {hold['state']} since more than "
                f"{LATE_SETTLEMENT_MS // 60_000} minutes: its usage can no longer be settled",
            )
        return self._pay(hold, usages, close=False, late=True)

    def _open_hold(self, hold_id: str) -> dict[str, object]:
        hold = self.hold(hold_id)
        if hold is None:
            raise LedgerError(grpc.StatusCode.NOT_FOUND, f"no escrow hold for session {hold_id!r}")
        if hold["state"] == "expired":
            raise LedgerError(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"session {hold_id} expired before it was closed; its escrow went back "
                "to the client and no usage can be settled any more",
            )
        return hold

    def _increments(
        self, hold: Mapping[str, object], usages: list[Usage], unpaid: set[str]
    ) -> list[tuple[Usage, int, int]]:
        """(usage, its cumulative charge, what it adds now) for each receipt (billable:
        ``_billable_usages``) that adds tokens over the last one paid for its (node,
        layers), scaled to the escrow left. Work of `unpaid` nodes adds nothing (and takes
        no share of the escrow)."""
        hold_id = str(hold["hold_id"])
        prices: dict[str, NodeQuote] = hold["prices"]  # type: ignore[assignment]
        paid = {
            (row[0], row[1], row[2]): (int(row[3]), int(row[4]))
            for row in self.db.execute(
                "SELECT node_id, layer_start, layer_end, tokens, charged FROM ledger_usage_paid "
                "WHERE hold_id = ?",
                [hold_id],
            )
        }
        seen: set[str] = set()
        found: list[tuple[Usage, int, int]] = []
        for usage in usages:
            if usage.receipt_id in seen:
                raise LedgerError(
                    grpc.StatusCode.INVALID_ARGUMENT, "the same receipt was sent twice"
                )
            seen.add(usage.receipt_id)
            quote = prices.get(usage.node_id)
            if quote is None and usage.tokens == 0:
                continue  # a verification-only replica's checks: nothing to pay
            if quote is None:
                raise LedgerError(
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"node {usage.node_id} was never granted to session {hold_id}",
                )
            check_amount(usage.tokens, "tokens", allow_zero=True)
            charge = usage_charge(usage.tokens, usage.layer_end - usage.layer_start, quote.price)
            tokens_before, charged_before = paid.get(
                (usage.node_id, usage.layer_start, usage.layer_end), (0, 0)
            )
            if usage.tokens > tokens_before:  # receipts are cumulative: older ones add nothing
                add = 0 if usage.node_id in unpaid else max(0, charge - charged_before)
                found.append((usage, charge, add))
        left = int(hold["amount"]) - int(hold["charged"])  # type: ignore[call-overload]
        return _capped(found, left)

    def primaries(self, hold_id: str) -> dict[str, dict[int, int]]:
        """node id -> {layer start: layer end} of the stages it was primary for at open."""
        spans: dict[str, dict[int, int]] = {}
        for node_id, start, end in self.db.execute(
            "SELECT node_id, layer_start, layer_end FROM ledger_hold_primaries WHERE hold_id = ?",
            [hold_id],
        ):
            spans.setdefault(node_id, {})[int(start)] = int(end)
        return spans

    def _billable_usages(self, hold_id: str, usages: list[Usage]) -> list[Usage]:
        primaries = self.primaries(hold_id)
        return [_billable(u, primaries.get(u.node_id, {})) for u in usages]

    def _shortfall(
        self,
        hold: Mapping[str, object],
        usages: list[Usage],
        unpaid: set[str],
        room: int,
    ) -> list[_Extra]:
        """What the session's receipts, stored and these (billable), bill short of the
        longest prefix any node held on each layer (shortfall.py), past what such
        shortfalls were charged before: one charge per (node, layers), within ``room``.
        Work of `unpaid` nodes, or of nodes the hold has no price for, adds nothing."""
        hold_id = str(hold["hold_id"])
        prices: dict[str, NodeQuote] = hold["prices"]  # type: ignore[assignment]
        rows: dict[Where, list[int]] = {
            (r[0], int(r[1]), int(r[2])): [int(r[3]), int(r[4]), int(r[5]), int(r[6])]
            for r in self.db.execute(
                "SELECT node_id, layer_start, layer_end, tokens, counted, longest, "
                "extra_charged FROM ledger_usage_paid WHERE hold_id = ?",
                [hold_id],
            )
        }
        for u in usages:  # what this settlement adds (receipts are cumulative)
            row = rows.setdefault((u.node_id, u.layer_start, u.layer_end), [0, 0, 0, 0])
            row[0] = max(row[0], u.tokens)
            row[1] = max(row[1], u.tokens if u.counted is None else u.counted)
            row[2] = max(row[2], u.longest)
        held = [  # a row paid before counts were kept (counted 0) counted what it billed
            Held(node, start, end, billed=r[0], counted=max(r[0], r[1]), longest=r[2])
            for (node, start, end), r in rows.items()
        ]
        found: list[_Extra] = []
        for where, token_layers in sorted(shortfalls(held).items()):
            quote = prices.get(where[0])
            if quote is None or where[0] in unpaid:
                continue
            before = rows[where][3]
            charge = usage_charge(token_layers, 1, quote.price)
            if charge > before:
                found.append(_Extra(where, before, charge - before))
        total = sum(e.add for e in found)
        if total > max(room, 0):
            found = [replace(e, add=e.add * max(room, 0) // total) for e in found]
        return [e for e in found if e.add > 0]

    def _record_held(self, hold_id: str, usages: list[Usage], extras: list[_Extra]) -> None:
        """Keep each receipt's count and longest prefix (a receipt paying nothing more
        still adds its evidence), and what shortfalls were charged."""
        self.db.conn.executemany(
            "INSERT INTO ledger_usage_paid (hold_id, node_id, layer_start, layer_end, tokens, "
            "charged, counted, longest) VALUES (?, ?, ?, ?, 0, 0, ?, ?) ON CONFLICT DO UPDATE "
            "SET counted = MAX(counted, excluded.counted), longest = MAX(longest, "
            "excluded.longest)",
            [
                (hold_id, u.node_id, u.layer_start, u.layer_end,
                 u.tokens if u.counted is None else u.counted, u.longest)
                for u in usages
            ],
        )  # fmt: skip
        self.db.conn.executemany(
            "UPDATE ledger_usage_paid SET extra_charged = ? WHERE hold_id = ? AND node_id = ? "
            "AND layer_start = ? AND layer_end = ?",
            [(e.before + e.add, hold_id, *e.where) for e in extras],
        )

    def _unpaid_nodes(self, hold_id: str) -> set[str]:
        """Nodes whose work in this session is not paid: rejected there, or convicted."""
        return {
            row[0]
            for row in self.db.execute(
                "SELECT node_id FROM ledger_disputes WHERE session_id = ? "
                "UNION SELECT node_id FROM ledger_convictions",
                [hold_id],
            )
        }

    def _pay(
        self, hold: Mapping[str, object], usages: list[Usage], *, close: bool, late: bool = False
    ) -> SettlementResult:
        """Pay the receipts' increments from the escrow (``late``: from the client's
        balance, the hold being closed); ``close`` also refunds the rest and closes it.
        A close or a late settlement also charges what the session's receipts bill short
        of the longest prefixes held (``_shortfall``)."""
        hold_id = str(hold["hold_id"])
        prices: dict[str, NodeQuote] = hold["prices"]  # type: ignore[assignment]
        amount = int(hold["amount"])  # type: ignore[call-overload]
        charged_before = int(hold["charged"])  # type: ignore[call-overload]
        fee_before = int(hold["fee"])  # type: ignore[call-overload]
        client = str(hold["account"])
        unpaid = self._unpaid_nodes(hold_id)
        usages = self._billable_usages(hold_id, usages)
        increments = self._increments(hold, usages, unpaid)
        room = amount - charged_before  # a client never pays past its quote
        if late:  # what was refunded may have been spent since: never below 0
            room = min(room, self._balance(client))
            increments = _capped(increments, room)
        extras: list[_Extra] = []
        if close or late:
            extras = self._shortfall(
                hold, usages, unpaid, room - sum(add for _, _, add in increments)
            )
        source = client if late else ESCROW
        now = self._clock()
        charges = [(u.receipt_id, u.node_id, add) for u, _, add in increments] + [
            (e.earning_id(hold_id), e.where[0], e.add) for e in extras
        ]
        entries, earnings, fee_total = self._split(charges, prices, source)
        charged = charged_before + sum(-a for acct, a in entries if acct == source)
        refunded = amount - charged if close else 0
        if refunded:
            entries += [(ESCROW, -refunded), (client, refunded)]
        if late:  # the client pays back part of what it was refunded
            refunded = int(hold["refunded"]) - (charged - charged_before)  # type: ignore[call-overload]
        # The usage paid for so far: disputed work counts as settled (not paid), so a
        # later receipt of it is not paid either.
        paid_rows = [
            (hold_id, u.node_id, u.layer_start, u.layer_end, u.tokens, c) for u, c, _ in increments
        ]
        if close:
            txid = f"settle:{hold_id}"
            params: dict[str, object] = {
                "receipts": sorted(u.receipt_id for u, _, _ in increments),
                "charged": charged,
                "refunded": refunded,
            }
        else:
            if not entries:
                # Nothing to pay (older receipts, rejected work, or shares the escrow cap
                # rounded to 0): still remember the usage as settled, so that a later
                # settlement does not pay it after all, and what the receipts held.
                with self.db.atomic():
                    self._record_paid(paid_rows)
                    self._record_held(hold_id, usages, [])
                return SettlementResult(hold_id, amount, charged_before, refunded, fee_before, late)
            txid = f"usage:{hold_id}:{self._count_usage_settlements(hold_id) + 1}"
            params = {"receipts": sorted(u.receipt_id for u, _, _ in increments)}
        if extras:
            params["shortfall"] = sorted(e.earning_id(hold_id) for e in extras)
        state = "settled" if close else "open"
        try:
            with self.db.atomic():
                if self._existing(txid, params):
                    return self._settled(self.hold(hold_id) or hold)
                self._post(txid, "settle" if close else "usage", params, entries)
                if late:
                    self.db.execute(
                        "UPDATE ledger_holds SET charged = ?, refunded = ?, fee = ? "
                        "WHERE hold_id = ? AND state != 'open'",
                        [charged, refunded, fee_before + fee_total, hold_id],
                    )
                else:
                    self.db.execute(
                        "UPDATE ledger_holds SET state = ?, closed_ms = ?, charged = ?, "
                        "refunded = ?, fee = ? WHERE hold_id = ? AND state = 'open'",
                        [state, now if close else None, charged, refunded,
                         fee_before + fee_total, hold_id],
                    )  # fmt: skip
                failpoint("settle:mid")
                self._record_paid(paid_rows)
                self._record_held(hold_id, usages, extras)
                self._record_earnings(hold_id, earnings, now)
                failpoint("settle:before-commit")
        except sqlite3.IntegrityError as exc:
            raise LedgerError(
                grpc.StatusCode.ALREADY_EXISTS,
                f"a receipt of session {hold_id} was already paid ({exc})",
            ) from None
        failpoint("settle:after-commit")
        fee = fee_before + fee_total
        return SettlementResult(
            hold_id, amount, charged, refunded, fee, close or late, sum(e.add for e in extras)
        )

    def _split(
        self, charges: list[tuple[str, str, int]], prices: Mapping[str, NodeQuote], source: str
    ) -> tuple[list[tuple[str, int]], list[tuple[str, str, str, int]], int]:
        """Entries moving each (earning id, node id, charge) from ``source`` to its
        operator's pending account less the fee; the earnings (id, node, operator,
        amount) they make; the fee in all."""
        entries: list[tuple[str, int]] = []
        earnings: list[tuple[str, str, str, int]] = []
        fee_total = 0
        for earning_id, node_id, charge in charges:
            if charge == 0:
                continue
            fee = charge * self.fee_bps // 10_000
            operator = prices[node_id].operator
            entries += [(source, -charge), (pending_account(operator), charge - fee)]
            if fee:
                entries.append((FEE, fee))
            fee_total += fee
            if charge - fee:
                earnings.append((earning_id, node_id, operator, charge - fee))
        return entries, earnings, fee_total

    def _record_earnings(
        self, hold_id: str, earnings: list[tuple[str, str, str, int]], now: int
    ) -> None:
        self.db.conn.executemany(
            "INSERT INTO ledger_earnings (receipt_id, hold_id, node_id, operator, "
            "amount, state, settled_ms, release_after_ms) "
            "VALUES (?, ?, ?, ?, ?, 'pending', ?, ?)",
            [
                (earning_id, hold_id, node_id, op, a, now, now + self.challenge_window_ms)
                for earning_id, node_id, op, a in earnings
            ],
        )

    def _record_paid(self, rows: list[tuple[str, str, int, int, int, int]]) -> None:
        self.db.conn.executemany(
            "INSERT INTO ledger_usage_paid (hold_id, node_id, layer_start, layer_end, tokens, "
            "charged) VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT DO UPDATE SET "
            "tokens = excluded.tokens, charged = excluded.charged",
            rows,
        )

    def _count_usage_settlements(self, hold_id: str) -> int:
        row = self.db.execute(
            "SELECT COUNT(*) FROM ledger_transactions WHERE kind = 'usage' AND txid LIKE ?",
            [f"usage:{hold_id}:%"],
        ).fetchone()
        return int(row[0])

    def _settled(self, hold: Mapping[str, object]) -> SettlementResult:
        return SettlementResult(
            str(hold["hold_id"]), int(hold["amount"]), int(hold["charged"]),  # type: ignore[call-overload]
            int(hold["refunded"]), int(hold["fee"]), hold["state"] != "open",  # type: ignore[call-overload]
        )  # fmt: skip

    def expire_holds(self, now_ms: int | None = None) -> list[str]:
        """Refund the escrow of sessions never closed before their hold expired."""
        now = self._clock() if now_ms is None else now_ms
        expired = [
            (row[0], row[1], int(row[2]))
            for row in self.db.execute(
                "SELECT hold_id, account, amount - charged FROM ledger_holds "
                "WHERE state = 'open' AND expires_ms <= ?",
                [now],
            )
        ]
        for hold_id, account, left in expired:
            with self.db.atomic():
                hold = self.hold(hold_id)
                if hold is None:  # selected just above, in this process: cannot happen
                    continue
                # A client that never closes still pays what its receipts, as its nodes
                # settled them, bill short of the prefixes they held.
                extras = self._shortfall(hold, [], self._unpaid_nodes(hold_id), left)
                entries, earnings, fee = self._split(
                    [(e.earning_id(hold_id), e.where[0], e.add) for e in extras],
                    hold["prices"],  # type: ignore[arg-type]
                    ESCROW,
                )
                charged = sum(e.add for e in extras)
                refunded = left - charged
                txid = f"expire:{hold_id}"
                params: dict[str, object] = {"amount": left}
                if extras:
                    params["shortfall"] = sorted(e.earning_id(hold_id) for e in extras)
                if self._existing(txid, params):
                    continue
                if refunded:
                    entries += [(ESCROW, -refunded), (account, refunded)]
                self._post(txid, "expire", params, entries)
                self.db.execute(
                    "UPDATE ledger_holds SET state = 'expired', closed_ms = ?, refunded = ?, "
                    "charged = charged + ?, fee = fee + ? WHERE hold_id = ?",
                    [now, refunded, charged, fee, hold_id],
                )
                self._record_held(hold_id, [], extras)
                self._record_earnings(hold_id, earnings, now)
        return [h for h, _, _ in expired]

    # ---- the challenge window ------------------------------------------------------------

    def release(self, earning_id: int, now_ms: int | None = None) -> None:
        """Release one pending earning to its operator; refused inside the window."""
        now = self._clock() if now_ms is None else now_ms
        with self.db.atomic():
            row = self.db.execute(
                "SELECT operator, amount, state, release_after_ms FROM ledger_earnings "
                "WHERE id = ?",
                [earning_id],
            ).fetchone()
            if row is None:
                raise LedgerError(grpc.StatusCode.NOT_FOUND, f"no earning {earning_id}")
            operator, amount, state, release_after = row
            if state != "pending":
                if state == "released":
                    return
                raise LedgerError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"earning {earning_id} was {state}; it can no longer be released",
                )
            if now < release_after:
                raise LedgerError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"earning {earning_id} is inside its challenge window for another "
                    f"{(release_after - now) / 1000:.0f} s",
                )
            self._post(
                f"release:{earning_id}",
                "release",
                {"amount": amount},
                [(pending_account(operator), -amount), (operator_account(operator), amount)],
            )
            self.db.execute(
                "UPDATE ledger_earnings SET state = 'released', closed_ms = ? WHERE id = ?",
                [now, earning_id],
            )
            failpoint("release:before-commit")

    def release_due(self, now_ms: int | None = None) -> int:
        """Release every earning whose challenge window has passed; returns how many."""
        now = self._clock() if now_ms is None else now_ms
        due = [
            row[0]
            for row in self.db.execute(
                "SELECT id FROM ledger_earnings WHERE state = 'pending' AND release_after_ms <= ?",
                [now],
            )
        ]
        for earning_id in due:
            self.release(earning_id, now)
        return len(due)

    # ---- verification outcomes -----------------------------------------------------------

    def work_rejected(self, node_id: str, session_id: str, reason: str) -> int:
        """Verification rejected this node's work in this session: its pending earnings
        there go back to the client, and a later settlement will not pay it. Returns the
        credit units refunded now."""
        _check_name(node_id, "node id")
        _check_name(session_id, "session id")
        now = self._clock()
        refunded = 0
        with self.db.atomic():
            self.db.execute(
                "INSERT OR IGNORE INTO ledger_disputes (node_id, session_id, reason, created_ms) "
                "VALUES (?, ?, ?, ?)",
                [node_id, session_id, reason[:500], now],
            )
            rows = self.db.execute(
                "SELECT e.id, e.operator, e.amount, h.account FROM ledger_earnings e "
                "JOIN ledger_holds h ON h.hold_id = e.hold_id "
                "WHERE e.node_id = ? AND e.hold_id = ? AND e.state = 'pending'",
                [node_id, session_id],
            ).fetchall()
            for earning_id, operator, amount, client in rows:
                self._post(
                    f"reject:{earning_id}",
                    "reject",
                    {"amount": amount, "reason": reason[:500]},
                    [(pending_account(operator), -amount), (client, amount)],
                )
                self.db.execute(
                    "UPDATE ledger_earnings SET state = 'rejected', closed_ms = ? WHERE id = ?",
                    [now, earning_id],
                )
                refunded += int(amount)
        return refunded

    def fraud_proven(self, node_id: str, operator: str, evidence_id: str) -> int:
        """Proven fraud: every pending earning of the node and the operator's stake go to
        the slashing account. Idempotent per evidence id; returns the units slashed."""
        _check_name(node_id, "node id")
        _check_name(operator, "operator")
        _check_name(evidence_id, "evidence id")
        txid = f"slash:{evidence_id}"
        now = self._clock()
        with self.db.atomic():
            row = self.db.execute(
                "SELECT COALESCE(SUM(-amount), 0) FROM ledger_entries WHERE txid = ? "
                "AND account != ?",
                [txid, SLASHED],
            ).fetchone()
            if self.db.execute(
                "SELECT 1 FROM ledger_transactions WHERE txid = ?", [txid]
            ).fetchone():
                return int(row[0])
            rows = self.db.execute(
                "SELECT id, operator, amount FROM ledger_earnings "
                "WHERE node_id = ? AND state = 'pending'",
                [node_id],
            ).fetchall()
            entries: list[tuple[str, int]] = []
            for _, op, amount in rows:
                entries += [(pending_account(op), -amount), (SLASHED, amount)]
            stake = self._balance(stake_account(operator))
            if stake:
                entries += [(stake_account(operator), -stake), (SLASHED, stake)]
            self._post(txid, "slash", {"node_id": node_id, "operator": operator}, entries)
            # Its work in sessions not settled yet is never paid either (see _unpaid_nodes).
            self.db.execute(
                "INSERT OR IGNORE INTO ledger_convictions (node_id, evidence_id, created_ms) "
                "VALUES (?, ?, ?)",
                [node_id, evidence_id, now],
            )
            self.db.conn.executemany(
                "UPDATE ledger_earnings SET state = 'slashed', closed_ms = ? WHERE id = ?",
                [(now, r[0]) for r in rows],
            )
        return sum(int(r[2]) for r in rows) + stake


def _capped(found: list[tuple[Usage, int, int]], left: int) -> list[tuple[Usage, int, int]]:
    """Scale what each receipt adds so that together they take no more than ``left``."""
    total = sum(add for _, _, add in found)
    if total > left:
        return [(u, c, add * left // total) for u, c, add in found]
    return found


def _billable(usage: Usage, primary_spans: Mapping[int, int]) -> Usage:
    """The usage with what the client pays for: the node's whole count where its layers are
    stages it was primary for at open (one, or consecutive ones served as one hop). A
    stage's checks run on other nodes, so all it computed there was the client's own
    work, and billed_tokens below that count is the client's word against its own
    signature of the count. Elsewhere (checkers, alternates and rerouted nodes, whose
    counts may hold checks) what the client agreed to pay for."""
    if usage.counted is None or usage.counted <= usage.tokens:
        return usage
    at = usage.layer_start
    while at in primary_spans and at < usage.layer_end:
        at = primary_spans[at]
    if at != usage.layer_end:
        return usage
    return replace(usage, tokens=usage.counted)
