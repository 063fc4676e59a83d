"""CUDA check of the node agent's GPU path: half-precision parity, check tolerances, speed.

Needs an NVIDIA GPU and a CUDA build of torch (CI has neither; `--device cpu --quick`
runs the same code in fp32 on the CPU, to try the script itself). In ONE run:

  device      what the node agent's hardware probe reports for the GPU, and its start-up
              matmul benchmark (what the planner is told).
  parity      a Llama-shape checkpoint with random weights (bf16 safetensors, the usual
              format), split in two stages. Each stage runs on the GPU in fp32, fp32 with
              TF32 matmuls, fp16 and bf16, the way a primary runs it (a prefill, then one
              token at a time against its KV cache), and is compared with the same stage
              given the same input computed the way a checker computes it (the whole
              prefix in one batched pass): on the CPU in fp32, and on the GPU in the same
              dtype. The measure and the tolerances are the checks' own
              (protos.output_check): every honest error must sit well under its tolerance,
              or checks would convict honest GPU nodes. transformers' fp32 logits are
              compared with the runtime's fp32 logits too (parity of the model code).
  speed       the whole model as one stage on the GPU, batch 1: prefill tokens/s and greedy
              decode tokens/s of the node agent's runtime, with its decode steps as CUDA
              graphs (the default) and eager (TESSERA_CUDA_GRAPHS=0), against transformers
              on the same GPU, same weights, same dtype, taking turns; decode ratios over
              transformers'.
  swarm       a coordinator and node agents as real processes on loopback: two with
              `--device cuda` (they compute in bf16) and one CPU node (fp32), every stage on
              two nodes; the client generates with verification on. New nodes get every
              call checked on a second node, so GPU bf16 and CPU fp32 nodes check each other:
              no check may fail.

Exit status 1 if any honest error reaches its tolerance, a swarm check fails, or the
swarm's generation fails; the last line says PASS or FAIL.

    python bench/cuda_check.py                        # about 3 minutes on one GPU
    python bench/cuda_check.py --device cpu --quick   # the script itself, fp32 on the CPU
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from greedy import greedy_steps  # noqa: E402  (bench/greedy.py)
from text_table import table  # noqa: E402  (bench/text_table.py)

from client.api import Client  # noqa: E402
from client.demo_checkpoint import DemoShape, write_demo_checkpoint  # noqa: E402
from client.local_swarm import LocalSwarm, wait_for_replicas  # noqa: E402
from client.tokenizer import load_tokenizer  # noqa: E402
from node_agent.hardware_probe import probe  # noqa: E402
from node_agent.matmul_benchmark import measure_bandwidth_gbps, measure_tflops  # noqa: E402
from node_agent.runtime import StageModel, load_stage_model  # noqa: E402
from node_agent.runtime.cuda_graphs import EAGER_STEPS_FIRST  # noqa: E402
from protos import output_check  # noqa: E402

MODEL = "cuda-check"
PROMPT = "A swarm of GPUs checks itself: "


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int


# TinyLlama's shape: 1.1B parameters, GQA with 4 query heads per KV head.
FULL = Shape(layers=22, hidden=2048, heads=32, kv_heads=4, intermediate=5632, vocab=32000)
QUICK = Shape(layers=4, hidden=256, heads=8, kv_heads=2, intermediate=688, vocab=1000)


@dataclass
class Report:
    lines: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    data: dict[str, object] = field(default_factory=dict)

    def say(self, text: str = "") -> None:
        print(text, flush=True)
        self.lines.append(text)

    def fail(self, text: str) -> None:
        self.say(f"FAIL: {text}")
        self.failures.append(text)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="bench/cuda_check.py",
        description=__doc__.split("\n\n")[0],
        epilog=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N, or cpu for a dry run")
    parser.add_argument("--quick", action="store_true", help="a small model, to try the script")
    parser.add_argument(
        "--parts",
        default="device,parity,speed,swarm",
        help="which parts to run, comma-separated (default: %(default)s)",
    )
    parser.add_argument("--workdir", type=Path, help="keep checkpoints and logs here")
    parser.add_argument("--json", type=Path, help="also write every number to this file")
    args = parser.parse_args(argv)
    args.parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    unknown = args.parts - {"device", "parity", "speed", "swarm"}
    if unknown:
        parser.error(f"unknown part(s) {sorted(unknown)}; use device, parity, speed, swarm")
    args.shape = QUICK if args.quick else FULL
    return args


def variants(device: torch.device) -> list[tuple[str, torch.dtype, bool]]:
    """(label, compute dtype, TF32 matmuls) for each way a GPU node could compute."""
    if device.type == "cpu":
        return [("cpu fp32", torch.float32, False)]
    return [
        ("cuda fp32", torch.float32, False),
        ("cuda fp32+tf32", torch.float32, True),
        ("cuda fp16", torch.float16, False),
        ("cuda bf16", torch.bfloat16, False),
    ]


def write_checkpoint(directory: Path, shape: Shape, device: str, seed: int = 0) -> Path:
    """A Hugging Face Llama directory with random weights (transformers' own init)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        vocab_size=shape.vocab,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    with torch.device(device):  # on a GPU, transformers' init of 1B weights takes a second
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(directory)
    return directory


# ---- parity ----------------------------------------------------------------------------


@torch.inference_mode()
def as_primary(stage: StageModel, x: torch.Tensor, prefill: int) -> torch.Tensor:
    """A prefill, then one position at a time against the KV cache (how a primary runs)."""
    cache = stage.new_cache(max_len=x.shape[1], batch=x.shape[0])
    chunks = [stage(x[:, :prefill], cache, 0)]
    chunks += [stage(x[:, p : p + 1], cache, p) for p in range(prefill, x.shape[1])]
    return torch.cat(chunks, dim=1)


@torch.inference_mode()
def as_checker(stage: StageModel, x: torch.Tensor) -> torch.Tensor:
    """The whole prefix in one batched pass (how a checker catches up)."""
    return stage(x, stage.new_cache(max_len=x.shape[1], batch=x.shape[0]), 0)


def errors(a: torch.Tensor, b: torch.Tensor) -> list[float]:
    """The checks' relative L2 error, per sequence of the batch, as the wire carries them."""
    a32 = a.detach().float().cpu().numpy()
    b32 = b.detach().float().cpu().numpy()
    return [
        output_check.relative_error(a32[i], "float32", b32[i], "float32")
        for i in range(a32.shape[0])
    ]


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")  # the wire's names: float32, float16, bfloat16


def parity(args: argparse.Namespace, checkpoint: Path, report: Report) -> None:
    device = torch.device(args.device)
    shape: Shape = args.shape
    split = shape.layers // 2
    spans = ((0, split), (split, shape.layers))
    batch, prefill, steps = (4, 64, 8) if not args.quick else (2, 12, 4)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, shape.vocab, (batch, prefill + steps), generator=generator)
    reference = [load_stage_model(checkpoint, s, e).eval() for s, e in spans]

    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(checkpoint).float().eval()
    with torch.inference_mode():
        hf_logits = hf(input_ids=tokens, use_cache=False).logits.float()
        ours = as_checker(reference[1], as_checker(reference[0], tokens))
    hf_error = max(errors(ours, hf_logits))
    report.say(f"runtime fp32 vs transformers fp32 (CPU, whole model): {hf_error:.1e}")
    report.data["transformers_vs_runtime_fp32"] = hf_error
    if hf_error >= output_check.tolerance("cpu", "float32", layers=shape.layers):
        report.fail(f"the runtime's fp32 logits differ from transformers' by {hf_error:.1e}")
    del hf

    rows = [["primary", "checker", "stage", "positions", "max error", "tolerance", "margin"]]
    found: dict[str, float] = {}
    for label, dtype, tf32 in variants(device):
        try:
            stages = [
                load_stage_model(checkpoint, s, e, device=device, dtype=dtype).eval()
                for s, e in spans
            ]
            # After loading: a CUDA stage turns TF32 off (dtypes.pin_full_fp32); this row
            # measures what it would cost a node that did not.
            torch.backends.cuda.matmul.allow_tf32 = tf32
            x = tokens
            for index, stage in enumerate(stages):
                primary = as_primary(stage, x, prefill)
                checkers = {
                    "cpu fp32": (as_checker(reference[index], x.cpu()), ("cpu", "float32")),
                    f"{label} batched": (as_checker(stage, x), (device.type, dtype_name(dtype))),
                }
                mine = (device.type, dtype_name(dtype))
                for checker, (theirs, kind) in checkers.items():
                    start, end = spans[index]
                    tolerance = output_check.pair_tolerance(mine, kind, layers=end - start)
                    for where, part in (
                        ("prefill", slice(0, prefill)),
                        ("decode", slice(prefill, None)),
                    ):
                        worst = max(errors(primary[:, part], theirs[:, part]))
                        found[f"{label} vs {checker} stage {index} {where}"] = worst
                        rows.append(
                            [
                                label,
                                checker,
                                str(index),
                                where,
                                f"{worst:.1e}",
                                f"{tolerance:.0e}",
                                f"{tolerance / worst:.0f}x" if worst else "exact",
                            ]
                        )
                        if worst >= tolerance and not tf32:
                            report.fail(
                                f"{label} vs {checker}, stage {index} {where}: honest "
                                f"error {worst:.1e} >= tolerance {tolerance:.0e}"
                            )
                x = primary  # the next stage gets what this primary sent
            del stages
        finally:
            torch.backends.cuda.matmul.allow_tf32 = False
        if device.type == "cuda":
            torch.cuda.empty_cache()
    noise = torch.randn(ours.shape, generator=generator) * ours.float().pow(2).mean().sqrt() * 0.5
    corrupt = min(errors(ours + noise, ours))
    report.say(table(rows))
    report.say(f"a corrupted output (noise of 0.5 RMS) for comparison: {corrupt:.2f}")
    report.data["parity"] = found
    report.data["corrupt_error"] = corrupt


# ---- speed -----------------------------------------------------------------------------


@contextmanager
def graphs_off() -> Iterator[None]:
    """Stages built inside decode eagerly (the node's TESSERA_CUDA_GRAPHS=0)."""
    before = os.environ.get("TESSERA_CUDA_GRAPHS")
    os.environ["TESSERA_CUDA_GRAPHS"] = "0"
    try:
        yield
    finally:
        if before is None:
            del os.environ["TESSERA_CUDA_GRAPHS"]
        else:
            os.environ["TESSERA_CUDA_GRAPHS"] = before


@torch.inference_mode()
def graph_memory(stage: StageModel, report: Report) -> int:
    """GPU memory one session's graph holds beyond its KV cache (a graph per session)."""
    cache = stage.new_cache(max_len=1024, batch=1)
    stage(torch.tensor([[1, 2, 3]], device=stage.device), cache, 0)
    torch.cuda.synchronize()
    before = torch.cuda.memory_reserved()
    for position in range(3, 3 + EAGER_STEPS_FIRST + 2):
        stage(torch.tensor([[position]], device=stage.device), cache, position)
    torch.cuda.synchronize()
    held = torch.cuda.memory_reserved() - before
    captured = sum(g is not None for g in cache.decode_graphs.values())
    report.say(f"{stage.dtype}: {captured} graph(s) of a session hold {held / 2**20:.1f} MiB")
    return held


def greedy_transformers(model: torch.nn.Module, prompt: torch.Tensor, tokens: int) -> Iterator[int]:
    x, past = prompt, None
    for _ in range(tokens):
        with torch.inference_mode():
            out = model(input_ids=x, past_key_values=past, use_cache=True, logits_to_keep=1)
        past = out.past_key_values
        token = int(torch.argmax(out.logits[0, -1]))
        yield token
        x = torch.tensor([[token]], device=prompt.device)


@dataclass
class Timing:
    prefill_s: list[float] = field(default_factory=list)
    decode_s: list[float] = field(default_factory=list)  # per generated token after the first
    ids: list[int] = field(default_factory=list)


def timed(run: Callable[[], Iterator[int]], timing: Timing, tokens: int) -> None:
    began = time.perf_counter()
    stream = run()
    first = next(stream)
    prefilled = time.perf_counter()
    ids = [first, *stream]
    done = time.perf_counter()
    timing.prefill_s.append(prefilled - began)
    timing.decode_s.append((done - prefilled) / (tokens - 1))
    timing.ids = ids


def speed(args: argparse.Namespace, checkpoint: Path, report: Report) -> None:
    from transformers import LlamaForCausalLM
    from transformers.utils import logging as transformers_logging

    transformers_logging.set_verbosity_error()  # its argument-rename notices, per call

    device = torch.device(args.device)
    shape: Shape = args.shape
    prompt_len, tokens, rounds = (512, 128, 3) if not args.quick else (32, 16, 2)
    prompt = torch.randint(
        0, shape.vocab, (1, prompt_len), generator=torch.Generator().manual_seed(2)
    )
    prompt = prompt.to(device)
    dtypes = [torch.bfloat16, torch.float16] if device.type == "cuda" else [torch.float32]
    rows = [
        [
            "dtype",
            "run",
            "prefill tok/s",
            "decode tok/s",
            "weights GB/s",
            "decode ratio",
            "same ids as transformers",
        ]
    ]
    for dtype in dtypes:
        graphed = load_stage_model(checkpoint, 0, shape.layers, device=device, dtype=dtype)
        with graphs_off():
            eager = load_stage_model(checkpoint, 0, shape.layers, device=device, dtype=dtype)
        hf = LlamaForCausalLM.from_pretrained(checkpoint).to(device=device, dtype=dtype).eval()
        weight_bytes = sum(p.numel() * p.element_size() for p in graphed.parameters())
        sides = {
            "runtime, CUDA graphs": (lambda m=graphed: greedy_steps(m, prompt, tokens), Timing()),
            "runtime, eager": (lambda m=eager: greedy_steps(m, prompt, tokens), Timing()),
            "transformers": (lambda m=hf: greedy_transformers(m, prompt, tokens), Timing()),
        }
        if device.type != "cuda":  # graphs are for GPUs only: the dry run has one runtime
            sides = {"runtime": sides["runtime, eager"], "transformers": sides["transformers"]}
        for run, _ in sides.values():  # warm-up: kernels, allocator, cuBLAS handles
            timed(run, Timing(), min(tokens, 8))
        for index in range(rounds):  # take turns, who goes first rotating
            order = list(sides.values())
            shift = index % len(order)
            for run, timing in order[shift:] + order[:shift]:
                timed(run, timing, tokens)
        name = dtype_name(dtype)
        baseline = 1 / statistics.median(sides["transformers"][1].decode_s)
        for label, (_, timing) in sides.items():
            prefill = prompt_len / statistics.median(timing.prefill_s)
            decode = 1 / statistics.median(timing.decode_s)
            same = sum(
                a == b for a, b in zip(timing.ids, sides["transformers"][1].ids, strict=True)
            )
            rows.append(
                [
                    name,
                    label,
                    f"{prefill:.0f}",
                    f"{decode:.1f}",
                    f"{weight_bytes * decode / 1e9:.0f}",
                    f"{decode / baseline:.2f}",
                    f"{same}/{tokens}",
                ]
            )
            report.data[f"speed {name} {label}"] = {
                "prefill_tok_s": prefill,
                "decode_tok_s": decode,
                "weight_bytes": weight_bytes,
                "same_ids": same,
            }
        if device.type == "cuda":
            report.data[f"graph_bytes {name}"] = graph_memory(graphed, report)
        del graphed, eager, hf, sides
        if device.type == "cuda":
            torch.cuda.empty_cache()
    report.say(f"batch 1, prompt {prompt_len} tokens, {tokens} generated, median of {rounds}")
    report.say(table(rows))
    report.say("decode ratio: decode tok/s over transformers' in the same dtype. Greedy ids part")
    report.say("early between implementations: random weights give near-tied logits.")


# ---- swarm -----------------------------------------------------------------------------


def swarm(args: argparse.Namespace, workdir: Path, report: Report) -> None:
    device = torch.device(args.device)
    shape = DemoShape(layers=12, hidden=1024, heads=16, kv_heads=4, intermediate=2816)
    if args.quick:
        shape = DemoShape(layers=6, hidden=256, heads=8, kv_heads=4, intermediate=688)
    checkpoint = write_demo_checkpoint(workdir / "demo-checkpoint", shape)
    tokenizer = load_tokenizer((checkpoint / "tokenizer.json").read_bytes())
    assert tokenizer is not None
    prompt_ids = tokenizer.encode(PROMPT)
    tokens = 48 if not args.quick else 16
    gpu = ["--device", str(device)]
    nodes = {"gpu-a": gpu, "gpu-b": gpu, "cpu-c": ["--device", "cpu"]}
    local = load_stage_model(checkpoint, 0, shape.layers).eval()
    expected = list(greedy_steps(local, torch.tensor([prompt_ids]), tokens))
    shutil.rmtree(workdir / "swarm", ignore_errors=True)
    with LocalSwarm(
        workdir / "swarm", coordinator_args=["--min-stages", "3", "--replicas", "2"]
    ) as s:
        s.start_coordinator()
        procs = [s.start_node(name, extra) for name, extra in nodes.items()]
        s.wait_registered(procs)
        names = {p.node_id: p.name for p in procs}
        s.add_model(checkpoint, MODEL)
        with Client(s.address) as client:
            # Two ready replicas of every layer: the first run has checkers too.
            wait_for_replicas(client, MODEL, replicas=2, timeout_s=300)
            runs = []
            for _ in range(4):
                began = time.perf_counter()
                ids = [
                    t.id
                    for t in client.generate(
                        MODEL, token_ids=prompt_ids, max_new_tokens=tokens, stop_at_eos=False
                    )
                ]
                runs.append((ids, time.perf_counter() - began, client.last_run))
        for proc in procs:
            lines = proc.log_text().splitlines()
            placed = [line for line in lines if "loaded" in line.lower()]
            report.say(f"{proc.name}: " + (placed[-1].strip() if placed else "(no shard loaded)"))
            for line in lines:
                if "could not capture a CUDA graph" in line or "Traceback" in line:
                    report.fail(f"{proc.name} logged: {line.strip()}")
    rows = [
        [
            "run",
            "route",
            "calls",
            "checked",
            "primary>checker",
            "mismatches",
            "rollbacks",
            "tok/s",
            "= fp32 CPU",
        ]
    ]
    for index, (ids, wall, result) in enumerate(runs):
        assert result is not None and result.verification is not None
        stats = result.verification
        route = " -> ".join(
            f"{names.get(h.node_id, h.node_id)}[{h.start},{h.end})" for h in result.initial_route
        )
        same = sum(a == b for a, b in zip(ids, expected, strict=False))
        pairs = Counter(f"{names.get(p, p)}>{names.get(c, c)}" for p, c in stats.pairs)
        rows.append(
            [
                str(index + 1),
                route,
                str(sum(stats.calls.values())),
                str(sum(stats.checked.values())),
                " ".join(f"{pair} x{n}" for pair, n in sorted(pairs.items())) or "-",
                str(stats.mismatches),
                str(len(result.rollbacks)),
                f"{len(ids) / wall:.1f}",
                f"{same}/{tokens}",
            ]
        )
        if len(ids) != tokens:
            report.fail(f"swarm run {index + 1} returned {len(ids)} of {tokens} tokens")
        if stats.mismatches or result.rollbacks:
            report.fail(
                f"swarm run {index + 1}: {stats.mismatches} check(s) failed between "
                f"honest nodes ({len(result.rollbacks)} rollback(s))"
            )
    report.say(table(rows))
    report.data["swarm"] = [
        {
            "ids": ids,
            "wall_s": wall,
            "mismatches": r.verification.mismatches if r and r.verification else None,
        }
        for ids, wall, r in runs
    ]


# ---- report ----------------------------------------------------------------------------


def device_part(args: argparse.Namespace, report: Report) -> None:
    hw = probe(args.device)
    report.say(
        f"torch {torch.__version__}; {hw.device_name} ({hw.device_kind}, compute capability "
        f"{hw.compute_capability or '-'}), {hw.memory_total_bytes / 2**30:.0f} GiB, usable "
        f"{hw.memory_usable_bytes / 2**30:.0f} GiB; dtypes {', '.join(hw.dtypes)}"
    )
    tflops = measure_tflops(hw.torch_device, budget_s=1.0)
    bandwidth = measure_bandwidth_gbps(hw.torch_device, budget_s=1.0)
    report.say(
        f"start-up benchmarks (what the planner is told): {tflops:.3g} TFLOP/s matmul, "
        f"{bandwidth:.0f} GB/s memory"
    )
    report.data["device"] = {
        "name": hw.device_name,
        "dtypes": list(hw.dtypes),
        "tflops": tflops,
        "bandwidth_gbps": bandwidth,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(
            "no CUDA GPU here (torch.cuda.is_available() is False); on a machine without "
            "one, try the script with --device cpu --quick",
            file=sys.stderr,
        )
        return 2
    # transformers' deprecation notices (argument names change between its versions).
    warnings.filterwarnings("ignore", category=FutureWarning)
    report = Report()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="tessera-cuda-check-"))
    workdir.mkdir(parents=True, exist_ok=True)
    parts: list[tuple[str, Callable[[], None]]] = [
        ("device", lambda: device_part(args, report)),
        ("parity", lambda: parity(args, checkpoint(), report)),
        ("speed", lambda: speed(args, checkpoint(), report)),
        ("swarm", lambda: swarm(args, workdir, report)),
    ]
    made: list[Path] = []

    def checkpoint() -> Path:
        if not made:
            began = time.perf_counter()
            made.append(write_checkpoint(workdir / "llama", args.shape, args.device))
            report.say(f"checkpoint written in {time.perf_counter() - began:.0f} s: {args.shape}")
        return made[0]

    try:
        for name, run in parts:
            if name not in args.parts:
                continue
            report.say(f"\n== {name}")
            began = time.perf_counter()
            try:
                run()
            except Exception as err:  # one part's failure must not hide the others' numbers
                report.fail(f"{name}: {type(err).__name__}: {err}")
                import traceback

                traceback.print_exc()
            report.say(f"({name}: {time.perf_counter() - began:.0f} s)")
    finally:
        if args.json:
            report.data["failures"] = report.failures
            args.json.write_text(json.dumps(report.data, indent=2, default=str))
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    verdict = "PASS" if not report.failures else f"FAIL ({len(report.failures)})"
    report.say(f"cuda check: {verdict}")
    return 0 if not report.failures else 1


if __name__ == "__main__":
    raise SystemExit(main())
