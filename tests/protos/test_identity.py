from protos import identity
from protos.tessera.v1 import client_api_pb2, coordinator_pb2, node_pb2


def test_node_id_is_stable_and_bound_to_the_key() -> None:
    a, b = identity.generate_private_key(), identity.generate_private_key()
    pa = identity.public_key_bytes(a)
    assert identity.node_id(pa) == identity.node_id(pa)
    assert identity.node_id(pa) != identity.node_id(identity.public_key_bytes(b))


def test_pem_round_trip_keeps_the_identity() -> None:
    key = identity.generate_private_key()
    again = identity.private_key_from_pem(identity.private_key_to_pem(key))
    assert identity.public_key_bytes(again) == identity.public_key_bytes(key)


def test_register_signature_covers_every_claim() -> None:
    key = identity.generate_private_key()
    req = coordinator_pb2.RegisterRequest(
        public_key=identity.public_key_bytes(key),
        nonce=b"n" * 32,
        name="box",
        account="alice",
        capabilities=node_pb2.Capabilities(memory_total_bytes=8 << 30),
    )
    identity.sign_register(key, req)
    assert identity.verify(req.public_key, req.signature, identity.register_payload(req))
    req.capabilities.memory_total_bytes = 80 << 30  # a tampered claim
    assert not identity.verify(req.public_key, req.signature, identity.register_payload(req))


def test_capability_opens_only_with_the_signers_key() -> None:
    coord, other = identity.generate_private_key(), identity.generate_private_key()
    claims = client_api_pb2.CapabilityClaims(session_id="s1", model="m", max_tokens=64)
    signed = identity.sign_capability(coord, claims)
    assert identity.open_capability(identity.public_key_bytes(coord), signed) == claims
    assert identity.open_capability(identity.public_key_bytes(other), signed) is None
    forged = client_api_pb2.SignedCapability(claims=signed.claims, signature=b"\0" * 64)
    assert identity.open_capability(identity.public_key_bytes(coord), forged) is None


def test_an_opened_capability_changed_by_one_byte_is_checked_anew() -> None:
    # Opening a capability is remembered (it comes with every stream and report of its
    # session): nothing but the very same bytes may profit from that.
    coord = identity.generate_private_key()
    key = identity.public_key_bytes(coord)
    claims = client_api_pb2.CapabilityClaims(session_id="s1", model="m", max_tokens=64)
    signed = identity.sign_capability(coord, claims)
    for _ in range(2):
        assert identity.open_capability(key, signed) == claims
    more = bytearray(signed.claims)
    more[-1] ^= 1  # max_tokens 64 -> 65
    assert client_api_pb2.CapabilityClaims.FromString(bytes(more)).max_tokens == 65
    raised = client_api_pb2.SignedCapability(claims=bytes(more), signature=signed.signature)
    assert identity.open_capability(key, raised) is None
    flipped = bytearray(signed.signature)
    flipped[0] ^= 1
    bad = client_api_pb2.SignedCapability(claims=signed.claims, signature=bytes(flipped))
    assert identity.open_capability(key, bad) is None
    assert identity.open_capability(key, signed) == claims


def test_verify_rejects_malformed_keys_and_signatures_without_raising() -> None:
    assert not identity.verify(b"short", b"x" * 64, b"payload")
    assert not identity.verify(b"k" * 32, b"short", b"payload")


def test_output_payload_binds_session_step_and_layers() -> None:
    base = identity.output_payload("s", 3, 0, 4, b"h" * 32)
    assert base != identity.output_payload("s", 4, 0, 4, b"h" * 32)
    assert base != identity.output_payload("s", 3, 0, 5, b"h" * 32)
    assert base != identity.output_payload("t", 3, 0, 4, b"h" * 32)
    chained = identity.output_payload("s", 3, 0, 4, b"h" * 32, input_digest=b"i" * 32)
    assert chained != base
    assert chained != identity.output_payload("s", 3, 0, 4, b"h" * 32, input_digest=b"j" * 32)
