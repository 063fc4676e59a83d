"""Zero false positives: 10,000+ honest comparisons across fp32, fp16 and bf16 paths.

Real runtime outputs (node_agent.runtime on a tiny checkpoint), computed the two ways a
primary and a checker really compute them: the primary one token at a time against its KV
cache, the checker catching up with one batched prefill, each in its own compute dtype.
Every honest pair must agree within protos.output_check's tolerance, and every output the
failpoints tamper with (corrupt, zeros, echo) must not.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import torch
from support.checkpoints import TINY_SHAPE, make_checkpoint
from verification.test_report_bad_input import INPUT, PREFIX, Node

from client.channels import ChannelPool
from client.verification import StageVerifier
from coordinator.verifier import evidence
from node_agent import failpoints
from node_agent.runtime import StageModel, load_stage_model
from protos import codec, identity, output_check
from protos.tessera.v1 import client_api_pb2, common_pb2, verification_pb2

BATCH = 64
TOKENS = 8
STAGES = ((0, 2), (2, 4))
LAYERS = 2  # per stage
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def load(checkpoint: Path, start: int, end: int, dtype: str) -> StageModel:
    stage = load_stage_model(checkpoint, start, end)
    if dtype != "float32":
        # The runtime refuses half precision on CPU nodes; cast after loading to run the
        # very same fp16/bf16 code path a GPU node runs.
        stage.to(DTYPES[dtype])
        stage.dtype = DTYPES[dtype]
    return stage


@torch.inference_mode()
def outputs(stage: StageModel, x: torch.Tensor, incremental: bool) -> np.ndarray:
    if x.is_floating_point():
        x = x.to(stage.dtype)
    if not incremental:
        return stage(x, stage.new_cache(TOKENS, BATCH), 0).float().numpy()
    cache = stage.new_cache(TOKENS, BATCH)
    steps = [stage(x[:, i : i + 1], cache, i) for i in range(TOKENS)]
    return torch.cat(steps, dim=1).float().numpy()


@pytest.fixture(scope="module")
def runs(checkpoint: Path) -> dict[tuple[int, str, bool], np.ndarray]:
    torch.manual_seed(0)
    tokens = torch.randint(0, 64, (BATCH, TOKENS))
    first = load(checkpoint, *STAGES[0], "float32")
    with torch.inference_mode():
        hidden = first(tokens, None, 0)
    inputs = {0: tokens, 2: hidden}
    found = {}
    for (start, end), dtype, incremental in itertools.product(STAGES, DTYPES, (False, True)):
        stage = load(checkpoint, start, end, dtype)
        found[(start, dtype, incremental)] = outputs(stage, inputs[start], incremental)
    return found


def test_honest_nodes_are_never_flagged(runs) -> None:
    paths = [(d, inc) for d in DTYPES for inc in (False, True)]
    comparisons = 0
    worst: dict[tuple[str, str], float] = {}
    for start, _ in STAGES:
        for (da, ia), (db, ib) in itertools.combinations(paths, 2):
            if "float32" not in (da, db) and da != db:
                continue  # fp16 vs bf16 nodes never share a stage's tolerance class
            a, b = runs[(start, da, ia)], runs[(start, db, ib)]
            limit = output_check.pair_tolerance(("cpu", da), ("cpu", db), layers=LAYERS)
            for row, position in itertools.product(range(BATCH), range(TOKENS)):
                error = output_check.relative_error(
                    a[row, position], "float32", b[row, position], "float32"
                )
                comparisons += 1
                key = tuple(sorted((da, db)))
                worst[key] = max(worst.get(key, 0.0), error)
                assert error <= limit, (
                    f"false positive: layers from {start}, {da}{'/inc' if ia else ''} vs "
                    f"{db}{'/inc' if ib else ''}, row {row} pos {position}: {error:.3g} > {limit}"
                )
    assert comparisons >= 10_000
    # The margins the docs quote: the worst honest error stays far below each tolerance.
    for (da, db), error in worst.items():
        limit = output_check.pair_tolerance(("cpu", da), ("cpu", db), layers=LAYERS)
        assert error < limit / 5, (da, db, error)
    print({f"{a}/{b}": f"{e:.2e}" for (a, b), e in worst.items()}, comparisons)


@pytest.mark.parametrize("mode", ["corrupt=1.0,seed=2", "zeros", "echo"])
async def test_tampered_outputs_are_always_flagged(runs, mode: str) -> None:
    points = failpoints.Failpoints(failpoints.parse(mode))
    for start, _ in STAGES:
        for dtype in DTYPES:
            honest = runs[(start, dtype, True)]
            for position in range(TOKENS):
                out = codec.encode(np.ascontiguousarray(honest[:, position : position + 1]))
                # What the stage received: token ids for the first (echo cannot mimic
                # logits with them), hidden states for the middle one.
                if start == 0:
                    inp = codec.encode(np.zeros((BATCH, 1), dtype=np.int64))
                else:
                    sent = runs[(0, "float32", False)][:, position : position + 1]
                    inp = codec.encode(np.ascontiguousarray(sent))
                bad = codec.decode(await points.apply(out, inp), finite=False)
                for row in range(BATCH):
                    error = output_check.relative_error(
                        bad[row, 0], "float32", honest[row, position], "float32"
                    )
                    assert error > output_check.pair_tolerance(
                        ("cpu", dtype), ("cpu", dtype), layers=LAYERS
                    )
                    # Whatever the depth: no tolerance, capped, could let them through.
                    assert error > output_check.MAX_TOLERANCE


def test_a_tolerance_grows_with_the_square_root_of_the_layers_past_the_calibrated_depth():
    base = output_check.tolerance("cuda", "float16", layers=1)
    for layers in range(1, output_check.CALIBRATED_LAYERS + 1):
        assert output_check.tolerance("cuda", "float16", layers=layers) == base
    deep = output_check.CALIBRATED_LAYERS * 4
    assert output_check.tolerance("cuda", "float16", layers=deep) == pytest.approx(2 * base)
    assert output_check.tolerance("cpu", "float32", layers=deep) == pytest.approx(2e-3)
    # Capped: bf16 would pass it at 44 layers.
    assert output_check.tolerance("cuda", "bfloat16", layers=deep) == output_check.MAX_TOLERANCE
    assert output_check.tolerance("cuda", "bfloat16", layers=10_000) == output_check.MAX_TOLERANCE
    # The pair's looser member decides, at the depth compared.
    pair = output_check.pair_tolerance(("cpu", "float32"), ("cuda", "float16"), layers=deep)
    assert pair == output_check.tolerance("cuda", "float16", layers=deep)


DEPTHS = (2, 8, 32)


@torch.inference_mode()
def test_honest_half_precision_errors_grow_no_faster_than_the_tolerance_with_depth(tmp_path):
    """The law the depth factor rests on, measured: fp16 and bf16 stages of 2 to 32 layers
    against fp32 (the checker's batched pass against the primary's incremental one). The
    honest error grows more slowly than the square root of the depth (3.3x in bf16 and 3.5x
    in fp16 from 2 to 32 layers here, where the root is 4x), so every depth keeps a
    fifth-of-tolerance margin."""
    deep = make_checkpoint(tmp_path / "deep", "llama", num_layers=1 + max(DEPTHS),
                           **TINY_SHAPE, seed=3)  # fmt: skip
    torch.manual_seed(1)
    tokens = torch.randint(0, TINY_SHAPE["vocab_size"], (BATCH, TOKENS))
    hidden = load(deep, 0, 1, "float32")(tokens, None, 0)
    worst: dict[tuple[str, int], float] = {}
    for depth in DEPTHS:
        reference = outputs(load(deep, 1, 1 + depth, "float32"), hidden, incremental=False)
        for dtype in ("float16", "bfloat16"):
            half = outputs(load(deep, 1, 1 + depth, dtype), hidden, incremental=True)
            limit = output_check.pair_tolerance(("cpu", dtype), ("cpu", "float32"), layers=depth)
            for row, position in itertools.product(range(BATCH), range(TOKENS)):
                error = output_check.relative_error(
                    half[row, position], "float32", reference[row, position], "float32"
                )
                worst[(dtype, depth)] = max(worst.get((dtype, depth), 0.0), error)
            assert worst[(dtype, depth)] < limit / 5, (dtype, depth, worst[(dtype, depth)])
    for dtype in ("float16", "bfloat16"):
        shallow = worst[(dtype, DEPTHS[0])]
        for depth in DEPTHS[1:]:
            assert worst[(dtype, depth)] <= shallow * (depth / DEPTHS[0]) ** 0.5, (dtype, worst)
    print({f"{d}@{n}": f"{e:.2e}" for (d, n), e in worst.items()})


@pytest.mark.parametrize("layers, judged", [(4, "mismatch"), (40, "agreement")])
def test_the_coordinator_judges_a_comparison_at_the_depth_it_covers(layers, judged):
    """Two bf16 nodes 0.1 apart (relative L2): over the flat 8e-2 tolerance, inside the
    0.15 that a 40-layer stage gets. The coordinator takes it as evidence of a mismatch on
    a 4-layer stage, and refuses it as one on a 40-layer stage (the client, judging at the
    same depth, would have reported an agreement)."""
    a, b = Node("a", "op-a"), Node("b", "op-b")
    span = (0, layers)
    base = np.ones((1, 1, 8), dtype=np.float32)
    apart = base.copy()
    apart[0, 0, 0] += 0.1 * np.sqrt(8.0)  # ||a - b|| / ||a|| is 0.1 (the larger norm)
    comparison = verification_pb2.Comparison(
        primary=a.sign("s", 1, apart, layers=span),
        checker=b.sign("s", 1, base, layers=span),
        agreed=False,
        prefix=[codec.encode(PREFIX, "int64")],
        input=codec.encode(INPUT, "int64"),
    )

    def hop(node: Node) -> client_api_pb2.Hop:
        return client_api_pb2.Hop(
            node_id=node.node_id, account=node.account, device_kind="cuda",
            compute_dtype="bfloat16", layers=common_pb2.LayerRange(start=0, end=layers),
        )  # fmt: skip

    error = output_check.relative_error(apart, "float32", base, "float32")
    assert 0.08 < error < 0.15
    if judged == "mismatch":
        found = evidence.check_mismatch(comparison, hop(a), hop(b))
        assert found.error == pytest.approx(error) and found.tolerance == pytest.approx(0.08)
    else:
        with pytest.raises(evidence.ReportError, match="agree within the tolerance"):
            evidence.check_mismatch(comparison, hop(a), hop(b))


@pytest.mark.parametrize("layers", [4, 40])
def test_the_driver_judges_at_the_same_depth_as_the_coordinator(layers):
    """An honest pair's comparison must never be an agreement to one side and a mismatch
    to the other: the driver's limit is the coordinator's, at the depth compared."""
    a, b = Node("a", "op-a"), Node("b", "op-b")
    claims = client_api_pb2.CapabilityClaims(
        session_id="s",
        grants=[
            client_api_pb2.Hop(
                node_id=n.node_id,
                public_key=n.public_key,
                account=n.account,
                device_kind=kind,
                compute_dtype=dtype,
            )
            for n, (kind, dtype) in ((a, ("cuda", "bfloat16")), (b, ("cpu", "float32")))
        ],  # fmt: skip
    )
    verifier = StageVerifier("s", ChannelPool())
    signed = identity.sign_capability(identity.generate_private_key(), claims)
    verifier._load_grants(signed)  # the driver's view of who computes in what
    expected = output_check.pair_tolerance(("cuda", "bfloat16"), ("cpu", "float32"), layers=layers)
    assert verifier._tolerance(a.node_id, b.node_id, layers) == expected
    assert expected == (0.08 if layers <= output_check.CALIBRATED_LAYERS else 0.15)
