"""Does a model fit, and how much work fits beside it: computed before its weights are read.

One computation serves load admission (``serve`` refuses a model that does not fit) and
``mlx-headroom doctor`` (what fits on this machine), so the two can never disagree.

The request-level arithmetic is :mod:`memory.walk`, the engine's admission in bytes.

Usage before the model loads (``baseline_bytes``) is the process's own usage as the probe
counts it: the interpreter and libraries on Linux and macOS, nothing with the allocator
probe. The tracker can only raise predictions above the static estimate (it learns from
measured chunks); the estimate is an upper bound of those on the CPU, so in practice it
does not.

**Load admission** walks a prompt of ``reserve_tokens`` through that admission just after
loading: the model loads when that prompt would be admitted, and the refusal gives its
numbers (baseline + weights + the prompt's KV reservation + its worst prefill chunk).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ._units import MiB
from ._units import format_bytes as fb
from .ceiling import Ceiling
from .estimate import KV_STEP, ModelGeometry
from .walk import EngineParams, largest_chunk_bytes, store_bytes, walk_single_request
from .weights import Quantization, WeightInventory

CONCURRENCY_PROMPTS = (1024, 8192, 32768)
QUANTIZATION_OPTIONS = (Quantization(8), Quantization(4))


@dataclass(frozen=True)
class ModelSpec:
    """What the fit needs to know about a model: shape, weight bytes, context length."""

    name: str
    geometry: ModelGeometry
    weights: WeightInventory
    context_length: int
    weights_source: str  # how the weights were counted, for the report

    @property
    def weight_bytes(self) -> int:
        return self.weights.total_bytes


def _largest(fits: Callable[[int], bool], low: int, high: int) -> int:
    """The largest n in [low, high] with fits(n), given fits(low) (binary search)."""
    while low < high:
        mid = (low + high + 1) // 2
        if fits(mid):
            low = mid
        else:
            high = mid - 1
    return low


@dataclass(frozen=True)
class LoadRequirement:
    """What loading a model asks of the ceiling, by cause: room for one prompt of
    ``reserve_tokens`` right after the weights."""

    baseline_bytes: int  # in use before the weights (interpreter, libraries)
    weight_bytes: int
    reserve_tokens: int  # after capping at the model's context
    reserve_kv_bytes: int
    margin_bytes: int  # that prompt's largest prefill chunk
    # One projection group held twice while the loader fuses it (engine.fusion), before
    # any KV exists: it counts only where it exceeds the reserve's KV and chunk.
    fusion_bytes: int = 0

    @property
    def after_weights_bytes(self) -> int:
        return max(self.reserve_kv_bytes + self.margin_bytes, self.fusion_bytes)

    @property
    def total_bytes(self) -> int:
        return self.baseline_bytes + self.weight_bytes + self.after_weights_bytes

    def describe(self) -> str:
        if self.fusion_bytes > self.reserve_kv_bytes + self.margin_bytes:
            beside = f"fusing one projection group at load {fb(self.fusion_bytes)}"
        else:
            beside = (f"KV for {self.reserve_tokens} reserved tokens {fb(self.reserve_kv_bytes)} + "
                      f"one prefill chunk {fb(self.margin_bytes)}")
        return (
            f"weights {fb(self.weight_bytes)} + {beside} + "
            f"{fb(self.baseline_bytes)} already in use = {fb(self.total_bytes)}"
        )


def load_requirement(
    spec: ModelSpec,
    *,
    reserve_tokens: int,
    baseline_bytes: int,
    ceiling_bytes: int,
    params: EngineParams,
) -> LoadRequirement:
    """Walk a prompt of ``reserve_tokens`` (capped at the context) through admission just
    after loading: its total is at most the ceiling exactly when that prompt is admitted
    (the chunk is the one it would run at its worst step, or the one refused)."""
    reserve = max(min(reserve_tokens, spec.context_length), 1)
    walk = walk_single_request(
        spec.geometry, prompt_tokens=reserve, max_tokens=0,
        usage_bytes=baseline_bytes + spec.weight_bytes, ceiling_bytes=ceiling_bytes, params=params,
    )
    margin = walk.peak_bytes - baseline_bytes - spec.weight_bytes - walk.kv_bytes
    return LoadRequirement(
        baseline_bytes=baseline_bytes,
        weight_bytes=spec.weight_bytes,
        reserve_tokens=reserve,
        reserve_kv_bytes=walk.kv_bytes,
        margin_bytes=margin,
        fusion_bytes=spec.weights.largest_fused_group_bytes if params.fuse_projections else 0,
    )


@dataclass(frozen=True)
class ConcurrencyFit:
    prompt_tokens: int
    max_tokens: int
    requests: int  # how many such requests can run at once (0: none, or beyond the context)
    beyond_context: bool


@dataclass(frozen=True)
class QuantizedOption:
    quantization: Quantization
    weight_bytes: int
    fits: bool


@dataclass(frozen=True)
class FitReport:
    """The answer to "does it fit, and what fits beside it" for one model and ceiling."""

    model: str
    ceiling: Ceiling
    load: LoadRequirement
    max_tokens: int  # output tokens assumed per request
    max_prompt_tokens: int  # longest prompt at concurrency 1 (0: none fits)
    concurrency: tuple[ConcurrencyFit, ...]
    max_reserve_tokens: int  # longest reserve that would let the model load (0: none)
    quantized: tuple[QuantizedOption, ...]  # smaller quantizations and whether they fit
    wired_limit_mb: int | None  # on macOS, when the wired limit binds: the value to set

    @property
    def fits(self) -> bool:
        return self.load.total_bytes <= self.ceiling.hard_bytes

    @property
    def fits_at_all(self) -> bool:
        """Whether weights and the smallest useful request (one token) fit."""
        return self.max_prompt_tokens > 0

    @property
    def shortfall_bytes(self) -> int:
        return max(self.load.total_bytes - self.ceiling.hard_bytes, 0)

    def message(self) -> str:
        """A paragraph with the numbers, the binding ceiling, and what would fit."""
        c = self.ceiling
        verdict = "fits" if self.fits else f"does not fit ({fb(self.shortfall_bytes)} over)"
        lines = [
            f"{self.model} {verdict}: {self.load.describe()}; the {c.describe()}."
        ]
        if not self.fits:
            lines.append(self.advice())
        return " ".join(lines)

    def advice(self) -> str:
        """What would fit instead, most direct first."""
        options: list[str] = []
        if 0 < self.max_reserve_tokens < self.load.reserve_tokens:
            options.append(
                f"a shorter reserve: --reserve-context-tokens {self.max_reserve_tokens} (or less)"
            )
        for q in self.quantized:
            if q.fits:
                options.append(f"a smaller quantization: {q.quantization} weights ({fb(q.weight_bytes)})")
                break
        if self.wired_limit_mb is not None:
            options.append(
                f"raise the GPU wired limit: sudo sysctl iogpu.wired_limit_mb={self.wired_limit_mb}"
            )
        if not options:
            options.append("a machine with more memory, or a smaller model")
        return "What would fit: " + "; ".join(options) + ". --force-load loads it anyway."


def wired_limit_advice(ceiling: Ceiling, needed_bytes: int, *, macos: bool) -> int | None:
    """On a Mac whose GPU wired limit binds: the ``iogpu.wired_limit_mb`` value to set.

    The value is the machine's own safe limit, the static ceiling (RAM less the tier's
    reserve; the custom ceiling under tier custom), in MiB: a setting that persists should
    not follow what other apps use this minute. None when the wired limit does not bind,
    or when raising it would still not hold ``needed_bytes`` under the other limits now.
    """
    if not macos or ceiling.binding != "device":
        return None
    others = {name: v for name, v in ceiling.components.items() if name != "device"}
    if not others:
        return None
    target = others.get("static") or others.get("custom") or min(others.values())
    if target <= ceiling.hard_bytes or min(others.values()) < needed_bytes:
        return None
    return target // MiB


def compute_fit(
    spec: ModelSpec,
    ceiling: Ceiling,
    *,
    baseline_bytes: int,
    reserve_tokens: int,
    max_tokens: int,
    params: EngineParams,
    macos: bool = False,
    concurrency_prompts: Sequence[int] = CONCURRENCY_PROMPTS,
) -> FitReport:
    """Everything load admission and ``doctor`` report (pure: same inputs, same report)."""
    g, hard = spec.geometry, ceiling.hard_bytes
    load = load_requirement(
        spec, reserve_tokens=reserve_tokens, baseline_bytes=baseline_bytes, ceiling_bytes=hard,
        params=params,
    )
    usage = baseline_bytes + spec.weight_bytes
    max_tokens = max(min(max_tokens, spec.context_length - 1), 1)

    def admits(prompt: int, out: int = max_tokens) -> bool:
        return walk_single_request(
            g, prompt_tokens=prompt, max_tokens=out, usage_bytes=usage,
            ceiling_bytes=hard, params=params,
        ).admitted

    longest_prompt = spec.context_length - max_tokens
    max_prompt = _largest(admits, 1, longest_prompt) if longest_prompt >= 1 and admits(1) else 0

    def reserve_admits(reserve: int) -> bool:
        return admits(reserve, 0)

    max_reserve = _largest(reserve_admits, 1, load.reserve_tokens) if reserve_admits(1) else 0
    rounded = max_reserve - max_reserve % KV_STEP
    if rounded and reserve_admits(rounded):
        max_reserve = rounded

    concurrency = tuple(
        _concurrency(spec, prompt, max_tokens, usage, hard, params) for prompt in concurrency_prompts
    )
    def loads_with_weights(weight_bytes: int) -> bool:
        return walk_single_request(
            g, prompt_tokens=load.reserve_tokens, max_tokens=0,
            usage_bytes=baseline_bytes + weight_bytes, ceiling_bytes=hard, params=params,
        ).admitted

    quantized = tuple(
        QuantizedOption(q, b, loads_with_weights(b))
        for q in QUANTIZATION_OPTIONS
        if (b := spec.weights.bytes_at(q)) < spec.weight_bytes
    )
    # What loading needs once the device limit is out of the way (chunks may then be larger).
    others = [v for name, v in ceiling.components.items() if name != "device"]
    needed_if_raised = load.total_bytes
    if ceiling.binding == "device" and others:
        needed_if_raised = load_requirement(
            spec, reserve_tokens=reserve_tokens, baseline_bytes=baseline_bytes,
            ceiling_bytes=min(others), params=params,
        ).total_bytes
    return FitReport(
        model=spec.name,
        ceiling=ceiling,
        load=load,
        max_tokens=max_tokens,
        max_prompt_tokens=max_prompt,
        concurrency=concurrency,
        max_reserve_tokens=max_reserve,
        quantized=quantized,
        wired_limit_mb=wired_limit_advice(ceiling, needed_if_raised, macos=macos),
    )


def _concurrency(
    spec: ModelSpec, prompt: int, max_tokens: int, usage: int, hard: int, params: EngineParams
) -> ConcurrencyFit:
    """How many requests of ``prompt`` + ``max_tokens`` tokens can be in flight together:
    the segments holding their reservations, plus room for one full-size chunk of the last
    one's prefill (an estimate: the store packs requests into segments as they come)."""
    g = spec.geometry
    final = prompt + max_tokens
    if final > spec.context_length:
        return ConcurrencyFit(prompt, max_tokens, 0, True)
    chunk = largest_chunk_bytes(g, prompt, params)

    def fits(n: int) -> bool:
        return usage + store_bytes(g, final, n, params) + chunk <= hard

    if not fits(1):
        return ConcurrencyFit(prompt, max_tokens, 0, False)
    high = 1
    while fits(high * 2):
        high *= 2
    return ConcurrencyFit(prompt, max_tokens, _largest(fits, high, high * 2 - 1), False)
