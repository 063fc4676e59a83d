"""TESSERA_FAILPOINTS: parsing, no effect when unset, and tampering on a real stage server.

The stage server is real (grpc.aio on loopback, the runtime on a tiny checkpoint); the
variable is set the way an operator would, in the environment the servicer starts in.
"""

from __future__ import annotations

import hashlib
import logging
import time

import numpy as np
import pytest
from data_plane.stage_harness import NUM_LAYERS
from data_plane.test_stage_server import Session

from node_agent import failpoints
from protos import codec, identity, output_check


def test_unset_or_empty_means_no_failpoints() -> None:
    assert failpoints.from_env({}) is None
    assert failpoints.from_env({failpoints.ENV_VAR: "  "}) is None


def test_parse_reads_every_failpoint() -> None:
    spec = failpoints.parse(
        "corrupt=0.05, noise=0.01,zeros,echo,delay_ms=20,crash_after=7,seed=3,"
        "corrupt_backward=0.5,skip_step=1"
    )
    assert spec == failpoints.FailpointSpec(
        corrupt=0.05, noise=0.01, zeros=True, echo=True, delay_ms=20, crash_after=7, seed=3,
        corrupt_backward=0.5, skip_step=1.0,
    )  # fmt: skip


@pytest.mark.parametrize(
    "text",
    [
        "corrupt",
        "corrupt=x",
        "corrupt=1.5",
        "delay_ms=-1",
        "explode",
        "zeros=1",
        "corrupt_backward=2",
        "skip_step=-0.1",
        "skip_step",
    ],  # fmt: skip
)
def test_bad_failpoints_are_refused_with_the_accepted_form(text: str) -> None:
    with pytest.raises(failpoints.FailpointError, match="TESSERA_FAILPOINTS"):
        failpoints.parse(text)


def test_a_skewed_clock_reads_that_far_off_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    assert failpoints.local_clock({}) is time.time
    assert failpoints.local_clock({failpoints.ENV_VAR: "corrupt=0.1"}) is time.time
    with caplog.at_level(logging.WARNING, logger="tessera.failpoints"):
        clock = failpoints.local_clock({failpoints.ENV_VAR: "clock_skew_s=-7200"})
    assert abs(clock() - (time.time() - 7200)) < 1.0
    assert "clock_skew_s=-7200" in caplog.text
    with pytest.raises(failpoints.FailpointError, match="clock_skew_s needs a float"):
        failpoints.parse("clock_skew_s=soon")


def test_active_failpoints_log_loudly(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="tessera.failpoints"):
        points = failpoints.from_env({failpoints.ENV_VAR: "corrupt=0.5,seed=1"})
    assert points is not None
    assert "FAILPOINTS ACTIVE" in caplog.text and "corrupt=0.5" in caplog.text


async def test_corrupt_probability_is_honoured() -> None:
    points = failpoints.Failpoints(failpoints.parse("corrupt=0.2,seed=11"))
    clean = codec.encode(np.ones((1, 4, 8), dtype=np.float32))
    tampered = 0
    for _ in range(2000):
        out = await points.apply(clean, clean)
        tampered += out.data != clean.data
    # Binomial(2000, 0.2): mean 400, sd ~18; six sd either side.
    assert 290 < tampered < 510


async def test_a_zeros_node_signs_zeros_over_the_wire(
    start_node, keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(failpoints.ENV_VAR, "zeros")
    node = await start_node([(0, NUM_LAYERS)])
    session = Session.open(node, keys, "s-lazy")
    response = await session.tokens([1, 2, 3], 0)
    logits = codec.decode(response.output)
    assert not logits.any(), "the lazy node must answer zeros"
    # Signed like any honest answer: the signature is what makes it evidence.
    prefix = output_check.prefix_digest([(np.array([[1, 2, 3]], dtype=np.int64), "int64")])
    digest = hashlib.sha256(response.output.data).digest()
    payload = identity.output_payload(
        "s-lazy", response.step, 0, NUM_LAYERS, digest, input_digest=prefix
    )
    assert identity.verify(node.public_key, response.signature, payload)
    await session.close()


async def test_noise_of_a_given_size_moves_the_output_by_that_much(
    start_node, keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    honest = await start_node([(0, NUM_LAYERS)])
    monkeypatch.setenv(failpoints.ENV_VAR, "noise=0.2,seed=5")
    noisy = await start_node([(0, NUM_LAYERS)])
    outs = []
    for node, name in ((honest, "s-honest"), (noisy, "s-noisy")):
        session = Session.open(node, keys, name)
        outs.append((await session.tokens([4, 5, 6, 7], 0)).output)
        await session.close()
    error = output_check.relative_error(
        codec.decode(outs[1]), "float32", codec.decode(outs[0]), "float32"
    )
    assert 0.1 < error < 0.3
