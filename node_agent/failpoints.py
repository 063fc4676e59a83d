"""Failpoints: make a node misbehave on purpose, for adversary tests, chaos runs and demos.

Set ``TESSERA_FAILPOINTS`` in the node agent's environment to a comma-separated list:

    corrupt=Q        with probability Q per output, add noise of 50% of the output's RMS
                     (training: ForwardTrain hidden states; the last stage's loss)
    corrupt_backward=Q  training only: the same noise on BackwardTrain's grad_input
    skip_step=Q      training only: with probability Q an OptimizerStep answers the new
                     version but leaves the weights as they were (a lazy node)
    noise=S          add Gaussian noise of S x the output's RMS to every output
    zeros            answer zeros (a lazy node that skips the work)
    echo             answer the input when it has the output's shape, else zeros
    delay_ms=N       wait N ms before every answer (a straggler)
    crash_after=N    kill the whole process (SIGKILL) on call N+1
    seed=N           seed of the random choices, for reproducible runs
    inflate_benchmark=F  report F x the measured matmul TFLOPS at registration (a node
                     that lies about its speed; measured traffic must correct it)
    clock_skew_s=S   the node's clock is S seconds ahead (negative: behind), as on a PC
                     whose clock is wrong; it must still serve (capabilities expire by the
                     coordinator's clock)

for example ``TESSERA_FAILPOINTS=corrupt=0.05,seed=3``. Unset or empty: no effect at all
(``from_env`` returns None and the stage server never calls in here). When set, the node
logs a loud warning at start-up and counts every output it tampers with. Tampering happens
before signing: the node signs what it sends, which is what makes a wrong output proof.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from protos import codec
from protos.output_check import as_float32, from_float32
from protos.tessera.v1 import common_pb2

log = logging.getLogger("tessera.failpoints")

ENV_VAR = "TESSERA_FAILPOINTS"
CORRUPTION_SCALE = 0.5  # relative size of a `corrupt` perturbation: far above any tolerance
_FLAGS = frozenset({"zeros", "echo"})
_VALUES = {
    "corrupt": float,
    "corrupt_backward": float,
    "skip_step": float,
    "noise": float,
    "delay_ms": int,
    "crash_after": int,
    "seed": int,
    "inflate_benchmark": float,
    "clock_skew_s": float,
}


class FailpointError(ValueError):
    """TESSERA_FAILPOINTS does not parse; the message shows the accepted form."""


@dataclass(frozen=True)
class FailpointSpec:
    corrupt: float = 0.0
    corrupt_backward: float = 0.0
    skip_step: float = 0.0
    noise: float = 0.0
    zeros: bool = False
    echo: bool = False
    delay_ms: int = 0
    crash_after: int = 0
    seed: int | None = None
    inflate_benchmark: float = 0.0
    clock_skew_s: float = 0.0

    @property
    def touches_outputs(self) -> bool:
        return bool(self.zeros or self.echo or self.noise or self.corrupt)

    def describe(self) -> str:
        parts = [f"{k}={v}" for k, v in self.__dict__.items() if v not in (0, 0.0, False, None)]
        return ", ".join(p.removesuffix("=True") for p in parts)


def parse(text: str) -> FailpointSpec:
    values: dict[str, object] = {}
    for entry in filter(None, (e.strip() for e in text.split(","))):
        name, has_value, raw = entry.partition("=")
        name = name.strip()
        if name in _FLAGS and not has_value:
            values[name] = True
        elif name in _VALUES and has_value:
            try:
                values[name] = _VALUES[name](raw.strip())
            except ValueError:
                raise FailpointError(
                    f"{ENV_VAR}: {name} needs a {_VALUES[name].__name__}, got {raw!r}"
                ) from None
        else:
            raise FailpointError(
                f"{ENV_VAR}: cannot read {entry!r}; use a comma-separated list of "
                "corrupt=Q, corrupt_backward=Q, skip_step=Q, noise=S, zeros, echo, "
                "delay_ms=N, crash_after=N, seed=N, inflate_benchmark=F, clock_skew_s=S"
            )
    spec = FailpointSpec(**values)  # type: ignore[arg-type]
    for name in ("corrupt", "corrupt_backward", "skip_step"):
        value = getattr(spec, name)
        if not 0.0 <= value <= 1.0:
            raise FailpointError(f"{ENV_VAR}: {name} is a probability in [0, 1], got {value}")
    if spec.noise < 0 or spec.delay_ms < 0 or spec.crash_after < 0 or spec.inflate_benchmark < 0:
        raise FailpointError(
            f"{ENV_VAR}: noise, delay_ms, crash_after and inflate_benchmark cannot be negative"
        )
    return spec


class Failpoints:
    """Applies a FailpointSpec to stage outputs, one call at a time."""

    def __init__(self, spec: FailpointSpec) -> None:
        self.spec = spec
        self.calls = 0
        self.tampered = 0
        self._rng = np.random.default_rng(spec.seed)

    async def apply(
        self, output: common_pb2.Tensor, request_input: common_pb2.Tensor
    ) -> common_pb2.Tensor:
        spec = self.spec
        self.calls += 1
        if spec.crash_after and self.calls > spec.crash_after:
            log.error("FAILPOINT crash_after=%d: killing this node now", spec.crash_after)
            os.kill(os.getpid(), signal.SIGKILL)
        if spec.delay_ms:
            await asyncio.sleep(spec.delay_ms / 1000.0)
        if not spec.touches_outputs:
            return output
        values = as_float32(codec.decode(output, finite=False), output.dtype)
        changed = self._tamper(values, request_input)
        if changed is None:
            return output
        self.tampered += 1
        log.warning("FAILPOINT tampered with output %d (%d so far)", self.calls, self.tampered)
        return codec.encode(from_float32(changed, output.dtype), output.dtype)

    def _tamper(self, values: np.ndarray, request_input: common_pb2.Tensor) -> np.ndarray | None:
        spec = self.spec
        if spec.zeros:
            return np.zeros_like(values)
        if spec.echo:
            if list(request_input.shape) == list(values.shape) and request_input.dtype in (
                codec.FLOAT_DTYPES
            ):
                return as_float32(codec.decode(request_input), request_input.dtype)
            return np.zeros_like(values)
        rms = float(np.sqrt(np.mean(np.square(values, dtype=np.float64)))) or 1.0
        scale = spec.noise
        if spec.corrupt and self._rng.random() < spec.corrupt:
            scale += CORRUPTION_SCALE
        if scale == 0.0:
            return None
        return values + self._rng.normal(0.0, scale * rms, values.shape).astype(np.float32)

    def tamper_loss(self, loss: float) -> float:
        """corrupt, at a training pipeline's last stage: report a wrong loss."""
        self.calls += 1
        if not (self.spec.corrupt and self._rng.random() < self.spec.corrupt):
            return loss
        self.tampered += 1
        log.warning("FAILPOINT reports a wrong loss (%d so far)", self.tampered)
        return loss * (1.0 + CORRUPTION_SCALE)

    def tamper_backward(self, grad: common_pb2.Tensor) -> common_pb2.Tensor:
        """corrupt_backward: a training node's wrong input gradient (before signing)."""
        if not (self.spec.corrupt_backward and self._rng.random() < self.spec.corrupt_backward):
            return grad
        values = as_float32(codec.decode(grad, finite=False), grad.dtype)
        rms = float(np.sqrt(np.mean(np.square(values, dtype=np.float64)))) or 1.0
        noise = self._rng.normal(0.0, CORRUPTION_SCALE * rms, values.shape).astype(np.float32)
        self.tampered += 1
        log.warning("FAILPOINT corrupted a backward gradient (%d so far)", self.tampered)
        return codec.encode(from_float32(values + noise, grad.dtype), grad.dtype)

    def skips_step(self) -> bool:
        """skip_step: this OptimizerStep should leave the weights unchanged."""
        if not (self.spec.skip_step and self._rng.random() < self.spec.skip_step):
            return False
        self.tampered += 1
        log.warning("FAILPOINT skips an optimizer step (%d tampered so far)", self.tampered)
        return True


def _env_text(environ: Mapping[str, str] | None) -> str:
    return (environ if environ is not None else os.environ).get(ENV_VAR, "").strip()


def from_env(environ: Mapping[str, str] | None = None) -> Failpoints | None:
    """The node's failpoints, or None when the variable is unset or empty (the default)."""
    text = _env_text(environ)
    if not text:
        return None
    spec = parse(text)
    banner = "!" * 72
    log.warning(
        "%s\nFAILPOINTS ACTIVE (%s=%s): this node will misbehave on purpose: %s\n%s",
        banner, ENV_VAR, text, spec.describe(), banner,
    )  # fmt: skip
    return Failpoints(spec)


def benchmark_factor(environ: Mapping[str, str] | None = None) -> float:
    """What the node multiplies its measured TFLOPS by before it reports them: 1.0 unless
    TESSERA_FAILPOINTS sets inflate_benchmark (then a loud warning says so)."""
    text = _env_text(environ)
    factor = parse(text).inflate_benchmark if text else 0.0
    if not factor:
        return 1.0
    log.warning(
        "FAILPOINT inflate_benchmark=%g: this node REPORTS %g x ITS MEASURED SPEED (a lie, "
        "for tests of the coordinator's measured speeds)", factor, factor,
    )  # fmt: skip
    return factor


def local_clock(environ: Mapping[str, str] | None = None) -> Callable[[], float]:
    """This machine's clock: ``time.time``, unless TESSERA_FAILPOINTS sets clock_skew_s
    (then a loud warning says so)."""
    text = _env_text(environ)
    skew = parse(text).clock_skew_s if text else 0.0
    if not skew:
        return time.time
    log.warning(
        "FAILPOINT clock_skew_s=%g: this node's clock reads %g s off (for tests of nodes "
        "whose clock is wrong)", skew, skew,
    )  # fmt: skip
    return lambda: time.time() + skew
