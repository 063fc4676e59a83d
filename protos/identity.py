"""Ed25519 identities and the exact bytes that get signed on the wire.

Both ends of every signature import these helpers, so the signed payloads can never drift
apart between the coordinator, the node agent and the client.
"""

from __future__ import annotations

import functools
import hashlib
import struct

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

from protos.tessera.v1 import client_api_pb2, coordinator_pb2, jobs_pb2, ledger_pb2

PUBLIC_KEY_BYTES = 32
SIGNATURE_BYTES = 64

# Domain separation: a signature made for one purpose can never be replayed as another.
_REGISTER_DOMAIN = b"tessera/v1/register\n"
_CAPABILITY_DOMAIN = b"tessera/v1/capability\n"
_OUTPUT_DOMAIN = b"tessera/v1/stage-output\n"
_USAGE_DOMAIN = b"tessera/v1/usage-receipt\n"
_USAGE_COUNTERSIGN_DOMAIN = b"tessera/v1/usage-countersign\n"
_OPEN_SESSION_DOMAIN = b"tessera/v1/open-session\n"
_OPEN_TRAINING_DOMAIN = b"tessera/v1/open-training-session\n"
_LEDGER_QUERY_DOMAIN = b"tessera/v1/ledger-query\n"


def node_id(public_key: bytes) -> str:
    """The node id is a digest of its public key: same key, same id; no key, no id."""
    if len(public_key) != PUBLIC_KEY_BYTES:
        raise ValueError(
            f"an Ed25519 public key has {PUBLIC_KEY_BYTES} bytes, got {len(public_key)}"
        )
    return "n" + hashlib.sha256(b"tessera-node-id\n" + public_key).hexdigest()[:23]


def client_account(public_key: bytes) -> str:
    """A paying client's account id: a digest of its public key, like a node id."""
    if len(public_key) != PUBLIC_KEY_BYTES:
        raise ValueError(
            f"an Ed25519 public key has {PUBLIC_KEY_BYTES} bytes, got {len(public_key)}"
        )
    return "c" + hashlib.sha256(b"tessera-client-account\n" + public_key).hexdigest()[:23]


def generate_private_key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


def private_key_to_pem(key: Ed25519PrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def private_key_from_pem(data: bytes) -> Ed25519PrivateKey:
    key = serialization.load_pem_private_key(data, password=None)
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError("the key file does not hold an Ed25519 private key")
    return key


def public_key_bytes(key: Ed25519PrivateKey | Ed25519PublicKey) -> bytes:
    public = key.public_key() if isinstance(key, Ed25519PrivateKey) else key
    return public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def verify(public_key: bytes, signature: bytes, payload: bytes) -> bool:
    """True only for a well-formed key and a valid signature; never raises on bad input."""
    if len(public_key) != PUBLIC_KEY_BYTES or len(signature) != SIGNATURE_BYTES:
        return False
    try:
        _public_key(public_key).verify(signature, payload)
    except (InvalidSignature, ValueError):
        return False
    return True


@functools.lru_cache(maxsize=4096)
def _public_key(raw: bytes) -> Ed25519PublicKey:
    # A client checks every reply of the same few nodes, a node every capability of the
    # same coordinator: parsing the key each time was a fifth of a verification.
    return Ed25519PublicKey.from_public_bytes(raw)


def register_payload(request: coordinator_pb2.RegisterRequest) -> bytes:
    """What a node signs to register: the nonce plus everything it claims about itself."""
    unsigned = coordinator_pb2.RegisterRequest()
    unsigned.CopyFrom(request)
    unsigned.ClearField("signature")
    return _REGISTER_DOMAIN + unsigned.SerializeToString(deterministic=True)


def sign_register(key: Ed25519PrivateKey, request: coordinator_pb2.RegisterRequest) -> None:
    request.signature = key.sign(register_payload(request))


def capability_payload(claims: bytes) -> bytes:
    return _CAPABILITY_DOMAIN + claims


def sign_capability(
    key: Ed25519PrivateKey, claims: client_api_pb2.CapabilityClaims
) -> client_api_pb2.SignedCapability:
    raw = claims.SerializeToString(deterministic=True)
    return client_api_pb2.SignedCapability(claims=raw, signature=key.sign(capability_payload(raw)))


def open_capability(
    coordinator_public_key: bytes, signed: client_api_pb2.SignedCapability
) -> client_api_pb2.CapabilityClaims | None:
    """The claims if the coordinator signed them, else None. Expiry is the caller's check."""
    if not verify_repeated(
        coordinator_public_key, signed.signature, capability_payload(signed.claims)
    ):
        return None
    claims = client_api_pb2.CapabilityClaims()
    try:
        claims.ParseFromString(signed.claims)
    except Exception:  # a valid signature over garbage is still garbage
        return None
    return claims


@functools.lru_cache(maxsize=4096)
def verify_repeated(public_key: bytes, signature: bytes, payload: bytes) -> bool:
    """``verify`` for signed bytes that come again and again: a session's capability with
    every stream, report and settlement of the session, a checker's catch-up answer with
    every step it audits. The same bytes verify the same way each time, and an Ed25519
    verify costs ~130 us, a hit ~1 us; keyed by the very bytes, any change is checked
    anew."""
    return verify(public_key, signature, payload)


def output_payload(
    session_id: str,
    step: int,
    layer_start: int,
    layer_end: int,
    output_sha256: bytes,
    *,
    input_digest: bytes = b"",
) -> bytes:
    """What a stage node signs for each reply: (session, step, stage layers, digest of the
    session's input prefix (protos.output_check.input_chain), sha256(output)).

    The inference data plane always passes the 32-byte input digest; without one (training
    micro-batches) the bytes are those of the original (session, step, layers, sha256)."""
    return b"".join(
        [
            _OUTPUT_DOMAIN,
            session_id.encode(),
            b"\n",
            f"{step}:{layer_start}:{layer_end}\n".encode(),
            input_digest,
            output_sha256,
        ]
    )


TRAINING_PASSES = ("forward", "backward", "norm", "step")


def training_norm_bytes(sq_norm: float, finite: bool) -> bytes:
    """What a GradNorm signature hashes: the stage's squared norm and finiteness."""
    return struct.pack("<d?", sq_norm, finite)


def training_step_bytes(clip_coef: float, version: int) -> bytes:
    """What an OptimizerStep signature hashes: the clip coefficient applied, new version."""
    return struct.pack("<dQ", clip_coef, version)


def training_loss_bytes(loss: float, label_tokens: int) -> bytes:
    """What the last training stage's signature hashes in place of an output tensor."""
    return struct.pack("<dQ", loss, label_tokens)


def training_payload(
    pass_name: str,
    job_id: str,
    step: int,
    micro_batch: int,
    layer_start: int,
    layer_end: int,
    output_sha256: bytes,
    input_digest: bytes,
) -> bytes:
    """What a training stage signs for each ForwardTrain / BackwardTrain reply.

    The inference payload with the training session spelled out: the pass and micro-batch
    go into its session field (so one micro-batch's or pass's output cannot be passed off
    as another's), the step is the stage's version, and ``input_digest``
    (protos.output_check.tensor_digest of what the node was sent) commits to the input."""
    if pass_name not in TRAINING_PASSES:
        raise ValueError(f"pass_name must be one of {TRAINING_PASSES}, got {pass_name!r}")
    return output_payload(
        f"{job_id}#{pass_name}#{micro_batch}",
        step,
        layer_start,
        layer_end,
        output_sha256,
        input_digest=input_digest,
    )


def usage_payload(receipt: bytes) -> bytes:
    """What a stage node signs for its cumulative usage receipt (a serialized UsageReceipt)."""
    return _USAGE_DOMAIN + receipt


def usage_countersign_payload(receipt: bytes, billed_tokens: int) -> bytes:
    """What the client's driver signs to agree with a node's usage receipt and to pay for
    `billed_tokens` of its tokens (the rest were verification checks)."""
    return _USAGE_COUNTERSIGN_DOMAIN + billed_tokens.to_bytes(8, "big") + receipt


def open_session_payload(request: client_api_pb2.OpenSessionRequest) -> bytes:
    """What a paying client signs to open a session: the request without its signature."""
    unsigned = client_api_pb2.OpenSessionRequest()
    unsigned.CopyFrom(request)
    unsigned.ClearField("client_signature")
    return _OPEN_SESSION_DOMAIN + unsigned.SerializeToString(deterministic=True)


def open_training_payload(request: jobs_pb2.OpenTrainingSessionRequest) -> bytes:
    """What a paying client signs to open (and escrow) a training job's session."""
    unsigned = jobs_pb2.OpenTrainingSessionRequest()
    unsigned.CopyFrom(request)
    unsigned.ClearField("client_signature")
    return _OPEN_TRAINING_DOMAIN + unsigned.SerializeToString(deterministic=True)


def ledger_query_payload(purpose: str, public_key: bytes, unix_ms: int) -> bytes:
    """What a client ("balance") or node ("earnings") signs to read its own ledger."""
    return _LEDGER_QUERY_DOMAIN + f"{purpose}\n{unix_ms}\n".encode() + public_key


def sign_ledger_query(key: Ed25519PrivateKey, purpose: str, unix_ms: int) -> ledger_pb2.SignedQuery:
    public = public_key_bytes(key)
    return ledger_pb2.SignedQuery(
        public_key=public,
        unix_ms=unix_ms,
        signature=key.sign(ledger_query_payload(purpose, public, unix_ms)),
    )
