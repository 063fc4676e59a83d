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

from node_agent import failpoints
from node_agent.runtime import StageModel, load_stage_model
from protos import codec, output_check

BATCH = 64
TOKENS = 8
STAGES = ((0, 2), (2, 4))
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
            limit = output_check.pair_tolerance(("cpu", da), ("cpu", db))
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
        assert error < output_check.pair_tolerance(("cpu", da), ("cpu", db)) / 5, (da, db, error)
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
                    assert error > output_check.pair_tolerance(("cpu", dtype), ("cpu", dtype))
