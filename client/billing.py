"""Paying for sessions: the client key, signed session opens, and usage receipts.

The client's Ed25519 key (default ~/.tessera/client.key, or $TESSERA_CLIENT_KEY) is its
account: the account id is a digest of the public key, so there is nothing to register.
The key signs OpenSession (escrow can only be taken by its owner) and counter-signs the
nodes' usage receipts the driver agrees with: the coordinator pays a node only for
receipts both signed.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from google.protobuf.message import DecodeError

from protos import identity
from protos.tessera.v1 import client_api_pb2, jobs_pb2, ledger_pb2

log = logging.getLogger(__name__)

KEY_ENV = "TESSERA_CLIENT_KEY"
NONCE_BYTES = 16  # OpenSessionRequest.nonce


def default_key_path() -> Path:
    return Path(os.environ.get(KEY_ENV) or Path.home() / ".tessera" / "client.key")


def load_key(path: Path, *, create: bool = False) -> Ed25519PrivateKey:
    """The client key at `path`; created (mode 0600) when missing and `create` is set.

    ValueError says what is wrong with the file and what to do (the CLI prints it)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        if not create:
            raise ValueError(
                f"no client key at {path}; pass the --key your account uses, or run "
                "`tessera balance` once to create one"
            ) from None
    except OSError as err:  # a directory, no permission, ...
        raise ValueError(f"cannot read the client key {path}: {err.strerror}") from None
    else:
        try:
            return identity.private_key_from_pem(data)
        except (ValueError, TypeError):  # TypeError: a key with a passphrase
            raise ValueError(
                f"{path} is not a Tessera client key (an Ed25519 private key in PEM, without "
                "a passphrase). Pass the right --key: the account is the key, so a new key "
                "starts a new, empty account"
            ) from None
    key = identity.generate_private_key()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(identity.private_key_to_pem(key))
    log.info("created a client key at %s (account %s)", path, account_of(key))
    return key


def account_of(key: Ed25519PrivateKey) -> str:
    return identity.client_account(identity.public_key_bytes(key))


def sign_open(
    request: client_api_pb2.OpenSessionRequest, key: Ed25519PrivateKey, now_ms: int
) -> None:
    """Make `request` a paying one: the key, its account, a fresh stamp (``now_ms``, by
    the coordinator's clock as far as the client knows it), the signature."""
    request.client_public_key = identity.public_key_bytes(key)
    request.account = account_of(key)
    request.request_unix_ms = now_ms
    request.nonce = os.urandom(NONCE_BYTES)  # the coordinator accepts each signed open once
    request.client_signature = key.sign(identity.open_session_payload(request))


def sign_open_training(
    request: jobs_pb2.OpenTrainingSessionRequest, key: Ed25519PrivateKey, now_ms: int
) -> None:
    """Sign a training job's open: the coordinator escrows the job's quote from this key's
    account (docs/ledger.md, "Jobs")."""
    request.client_public_key = identity.public_key_bytes(key)
    request.request_unix_ms = now_ms
    request.nonce = os.urandom(NONCE_BYTES)
    request.client_signature = key.sign(identity.open_training_payload(request))


def balance_query(key: Ed25519PrivateKey, now_ms: int) -> ledger_pb2.SignedQuery:
    return identity.sign_ledger_query(key, "balance", now_ms)


_Key = tuple[str, int, int]  # node id, layer start, layer end


@dataclass
class UsageBook:
    """What the driver sent to each (node, layers), what the verifier sent there to check
    another node, and the newest receipt each node returned.

    A node cannot tell a check from a client call (that is what makes checks honest), so
    its cumulative receipt counts both. The client counter-signs a receipt that claims no
    more than it sent in all, and pays only for its own calls (`billed_tokens`): checks
    are verification work, not billed to the client (docs/ledger.md).
    """

    _sent: dict[_Key, int] = field(default_factory=dict)
    _checked: dict[_Key, int] = field(default_factory=dict)
    _receipts: dict[_Key, ledger_pb2.SignedUsage] = field(default_factory=dict)
    _counted: dict[_Key, int] = field(default_factory=dict)  # the tokens of each receipt kept
    # The tokens of the newest receipt each node took an acknowledgment of (Stage.Acknowledge).
    _acknowledged: dict[_Key, int] = field(default_factory=dict)
    # Where earlier runners of a job worked (``inherited``): a node's count there may hold
    # work that a runner which died computed after its last settlement.
    _inherited: set[_Key] = field(default_factory=set)

    def sent(self, node_id: str, start: int, end: int, tokens: int) -> None:
        key = (node_id, start, end)
        self._sent[key] = self._sent.get(key, 0) + tokens

    def inherited(self, node_id: str, start: int, end: int, tokens: int) -> None:
        """Earlier runners of this job settled ``tokens`` there: they count as sent. The
        node's count may also hold what a runner that died unannounced had it compute
        after its last settlement, which nobody can check now. Its receipts are signed
        even so, and pay only what is vouched for (settled and sent since): else the node
        would go unpaid for the rest of the job."""
        self.sent(node_id, start, end, tokens)
        self._inherited.add((node_id, start, end))

    def checked(self, node_id: str, start: int, end: int, tokens: int) -> None:
        """The verifier sent `tokens` to this node to check another one's output."""
        key = (node_id, start, end)
        self._checked[key] = self._checked.get(key, 0) + tokens

    def received(self, node_id: str, start: int, end: int, usage: ledger_pb2.SignedUsage) -> None:
        """Keep the receipt that counts most: they are cumulative, so it covers the others
        (a checker's and a primary's answers of one node may arrive out of order). Its
        signatures are checked at countersign."""
        if not usage.receipt:
            return
        receipt = ledger_pb2.UsageReceipt()
        try:
            receipt.ParseFromString(usage.receipt)
        except DecodeError:
            tokens = 0  # never signed; kept so that ``uncovered`` and the logs name it
        else:
            tokens = receipt.tokens
        key = (node_id, start, end)
        if key not in self._receipts or tokens >= self._counted[key]:
            self._receipts[key], self._counted[key] = usage, tokens

    def owed(self, node_id: str, start: int, end: int) -> int:
        """What the newest receipt there counts past the newest one the node took an
        acknowledgment of."""
        key = (node_id, start, end)
        return self._counted.get(key, 0) - self._acknowledged.get(key, 0)

    def acknowledged(self, node_id: str, start: int, end: int, tokens: int) -> None:
        key = (node_id, start, end)
        self._acknowledged[key] = max(self._acknowledged.get(key, 0), tokens)

    def countersign_one(
        self, session_id: str, node_id: str, start: int, end: int, key: Ed25519PrivateKey
    ) -> tuple[ledger_pb2.SignedUsage, int] | None:
        """The newest receipt of (node, layers) counter-signed, with its tokens; None when
        there is none or the client does not agree with it."""
        where = (node_id, start, end)
        usage = self._receipts.get(where)
        if usage is None:
            return None
        signed = self._countersigned(session_id, where, usage, key)
        return None if signed is None else (signed, self._counted[where])

    def uncovered(self) -> list[_Key]:
        """Where the newest receipt claims more than the driver and the verifier sent: what
        ``countersign`` would leave unsigned as it stands."""
        over = []
        for key, usage in self._receipts.items():
            receipt = ledger_pb2.UsageReceipt()
            try:
                receipt.ParseFromString(usage.receipt)
            except Exception:  # malformed: never signed anyway, nothing to wait for
                continue
            if receipt.tokens > self._sent.get(key, 0) + self._checked.get(key, 0):
                over.append(key)
        return over

    def countersign(self, session_id: str, key: Ed25519PrivateKey) -> list[ledger_pb2.SignedUsage]:
        """Counter-sign every receipt that claims no more than the driver and the verifier
        sent; others are left out (and logged), so a node that inflates its count is not
        paid for them. Each pays for at most what the driver itself sent."""
        signed = []
        for where, usage in sorted(self._receipts.items()):
            countersigned = self._countersigned(session_id, where, usage, key)
            # A checker's alone pays nothing, and the ledger knows checkers of a stage
            # only as nodes it may not bill.
            if countersigned is not None and countersigned.billed_tokens > 0:
                signed.append(countersigned)
        return signed

    def _countersigned(
        self,
        session_id: str,
        where: _Key,
        usage: ledger_pb2.SignedUsage,
        key: Ed25519PrivateKey,
    ) -> ledger_pb2.SignedUsage | None:
        node_id, start, end = where
        receipt = ledger_pb2.UsageReceipt()
        try:
            receipt.ParseFromString(usage.receipt)
            owner = identity.node_id(receipt.node_public_key)
        except Exception:  # a malformed receipt from a node: never sign it
            log.warning("node %s sent a malformed usage receipt; not signing it", node_id)
            return None
        sent = self._sent.get(where, 0)
        checks = self._checked.get(where, 0)
        agreed = (
            receipt.session_id == session_id
            and receipt.node_id == node_id == owner
            and (receipt.layer_start, receipt.layer_end) == (start, end)
            and (receipt.tokens <= sent + checks or where in self._inherited)
            # The ledger bills the longest prefix any node held (docs/ledger.md,
            # "Shortfall"): held, so computed, and counted.
            and receipt.longest <= receipt.tokens
            and identity.verify(
                receipt.node_public_key,
                usage.node_signature,
                identity.usage_payload(usage.receipt),
            )
        )
        if not agreed:
            log.warning(
                "node %s claims %d tokens (a prefix of %d held) on layers [%d, %d), the "
                "driver sent %d (and %d to check others): not signing its receipt", node_id,
                receipt.tokens, receipt.longest, start, end, sent, checks,
            )  # fmt: skip
            return None
        billed = min(receipt.tokens, sent)
        return ledger_pb2.SignedUsage(
            receipt=usage.receipt,
            node_signature=usage.node_signature,
            client_signature=key.sign(identity.usage_countersign_payload(usage.receipt, billed)),
            billed_tokens=billed,
        )
