"""Static byte estimates for a prefill chunk and a request's KV reservation.

These are deliberately *upper bounds* that follow how mlx-lm actually computes:

- **KV growth.** ``KVCache`` grows by concatenation in 256-token steps. Growing from T to
  T+C tokens allocates at most ``ceil(C/256)·256`` new slots in every layer (permanent), and
  while one layer is being grown its old buffer and its new buffer coexist (transient: one
  layer at a time, since layers run in sequence).
- **Attention.** A fused kernel (Metal for head dims 64/72/80/96/128/192/256; CUDA's cuDNN
  path for fp16/bf16 with head dims that are multiples of 8 up to 128) only needs
  Q/K/V/output-sized buffers. Otherwise, and always on the CPU, the float32 score matrix
  B × heads × C × (T+C) is materialised, plus the softmax output and the causal mask.
- **Activations.** Hidden states (embedding, norm, residuals), the q/k/v/o projections
  (before and after RoPE), and the MLP's gate/up/activation buffers, all for C tokens. The
  loader fuses q/k/v and gate/up into one matmul each (``engine.fusion``, on by default):
  the fused q/k/v output lives until v is consumed, beside the rotated q and k, and the
  fused gate/up output cannot be reused for the activation (it is twice its size), so
  both are counted once more than the separate projections would need.
- **The mask of a batched call** whose rows differ in start or length: an additive mask
  B × C × (T+C) in the activation dtype, built from a boolean one of the same shape, both
  live while the call is planned. It is passed as a broadcast view; a boolean mask would
  be materialised across every query head in every layer on CUDA (``engine.kv.masks``).
- **Logits.** mlx-lm's prefill evaluates only the cache for all chunks but the last, and the
  final step computes logits for one token per sequence: B × vocab × 4 bytes.

Measured against MLX on the CPU (``bench/estimate_vs_measured.py``), the total stays between
1× and about 2.5× the measured peak.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

KV_STEP = 256
KV_QUANT_GROUP = 64  # the default group size of quantized KV (mlx-lm's and the engine's)
BACKENDS = ("cpu", "metal", "cuda")
METAL_FUSED_HEAD_DIMS = frozenset({64, 72, 80, 96, 128, 192, 256})
SCORE_BYTES = 4  # attention scores and softmax run in float32

_DTYPE_BYTES = {
    "float32": 4,
    "float": 4,
    "float16": 2,
    "half": 2,
    "bfloat16": 2,
    "float64": 8,
}


FULL, WINDOW, CHUNKED, STATE = "full", "window", "chunked", "state"


def cache_slots(kind: str, tokens: int, window: int | None = None, chunk: int = 0, *,
                merged: bool = True) -> int:
    """Token slots one of mlx-lm's cache entries holds for a sequence of ``tokens``,
    prefilled ``chunk`` tokens at a time (the rule ``engine.cache_layout`` reads kinds for):

    - full (``KVCache``, quantized, a model's own): every token, in 256-token steps
      counted from wherever the buffer last stood. A cache of its own grows from zero:
      ``tokens`` rounded up to a step. A row ``merged`` into the decode batch is copied at
      its exact length and grows 256 at a time from there, so it holds up to
      ``tokens + 255`` slots (never fewer than its own cache held before it joined);
    - window (``RotatingKVCache``): decoding grows in steps up to the window, and a prefill
      chunk is concatenated to up to window - 1 kept tokens before the next trim;
    - chunked (``ChunkedKVCache``): at most one attention chunk plus the prefill chunk;
    - state (``ArraysCache``): no slots, a fixed size per sequence instead.
    """
    if tokens <= 0 or kind == STATE:
        return 0
    if kind == FULL:
        return tokens + KV_STEP - 1 if merged else _round_up(tokens)
    window = window or tokens
    if kind == WINDOW:
        return max(min(_round_up(tokens), window), min(tokens, window + max(chunk, 1) - 1))
    return min(_round_up(tokens), _round_up(window + max(chunk, 1)))  # chunked


@dataclass(frozen=True)
class KVGroup:
    """Cache entries of one kind and window: what each holds, and how many there are."""

    kind: str  # FULL, WINDOW, CHUNKED or STATE
    entries: int
    bytes_per_token: int = 0  # keys and values of one token, all the group's entries
    fixed_bytes: int = 0  # state per sequence, all the group's entries
    window: int | None = None  # WINDOW: the window; CHUNKED: the attention chunk
    merged: bool = True  # rows join a merged decode batch (``cache_slots``)

    def bytes_for(self, tokens: int, chunk: int = 0) -> int:
        slots = cache_slots(self.kind, tokens, self.window, chunk, merged=self.merged)
        return slots * self.bytes_per_token + self.fixed_bytes

    def span(self, context: int, chunk: int) -> int:
        """Keys one query of a chunk of ``chunk`` after ``context`` tokens attends over."""
        if self.kind == STATE:
            return chunk  # no keys: a recurrent layer's transients are the chunk's own
        if self.kind == FULL or not self.window:
            return context + chunk
        if self.kind == WINDOW:
            return min(context, self.window - 1) + chunk
        return min(context, self.window) + chunk  # chunked


@dataclass(frozen=True)
class KVLayout:
    """A model's caches by kind, read from its own cache objects (``engine.cache_layout``):
    full entries hold every token, window entries at most their window (plus a prefill
    chunk), state entries a fixed size per sequence. A model with such a layout is served
    through mlx-lm's own caches, which allocate as they grow: no blocks, no segments."""

    groups: tuple[KVGroup, ...]

    @property
    def bytes_per_token(self) -> int:
        """Keys and values of one token across every entry (windows counted as if they held
        every token: the per-token rate, not a sequence's total)."""
        return sum(g.bytes_per_token for g in self.groups)

    @property
    def fixed_bytes(self) -> int:
        return sum(g.fixed_bytes for g in self.groups)

    def bytes_for(self, tokens: int, chunk: int = 0) -> int:
        """KV bytes one sequence of ``tokens`` holds at most, prefilled ``chunk`` at a time."""
        return sum(g.bytes_for(tokens, chunk) for g in self.groups)

    def span(self, context: int, chunk: int) -> int:
        """The longest key span any entry's attention runs over for that chunk."""
        return max((g.span(context, chunk) for g in self.groups), default=context + chunk)

    def layer_transient_bytes(self, context: int, chunk: int) -> int:
        """One entry's old and new buffers at once while a chunk grows it (entries run in
        sequence): a full entry's step-rounded old buffer and its grown one; a window entry
        its old buffer, the copy that puts it in temporal order, and the trimmed one with
        the chunk; a state entry its old and new state."""
        worst = 0
        for g in self.groups:
            n = max(g.entries, 1)
            per_token, fixed = g.bytes_per_token // n, g.fixed_bytes // n
            if g.kind == FULL:
                slots = _round_up(context) + context + _round_up(chunk)
            elif g.kind == STATE:
                slots = 0
            else:
                old = cache_slots(g.kind, context, g.window, chunk)
                slots = 2 * old + min(context, g.window or context) + chunk
            worst = max(worst, slots * per_token + 2 * fixed)
        return worst


@dataclass(frozen=True)
class ModelGeometry:
    """The shape numbers that determine memory use; nothing else about the model."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    dtype_bytes: int = 2  # bytes per activation/KV element (float32 → 4, bf16/fp16 → 2)
    kv_bits: int | None = None  # quantized KV; None = dtype
    kv_group_size: int = KV_QUANT_GROUP  # elements per scale and bias of quantized KV
    # Read from the model's own cache objects (the engine's probe) where its caches do not
    # follow the config's heads and dims: MLA's latent, models without attention keys.
    measured_kv_bytes_per_token: int | None = None
    # Where some entries are not full attention (sliding windows, recurrent state): each
    # kind's terms, so that a sequence is sized as its caches hold it. None: every layer
    # holds every token at ``kv_bytes_per_token``.
    kv_layout: KVLayout | None = None
    # Each layer's sliding window (None: full) where the engine's paged store holds the
    # model in layer groups (``memory.paged``); None where it does not (then ``kv_layout``
    # says how mlx-lm's own caches hold it).
    kv_windows: tuple[int | None, ...] | None = None
    # A hybrid whose attention layers the paged store holds, their recurrent state beside
    # them (``engine.kv.state``): per cache entry, True for a state entry. None: it does not.
    kv_states: tuple[bool, ...] | None = None
    # A weight a prefill call materialises beside its activations, one at a time (quantized
    # projections that the engine dequantizes for many rows); 0: none.
    prefill_weight_bytes: int = 0

    @property
    def kv_bytes_per_token(self) -> int:
        """2 (K and V) × layers × KV heads × head dim × bytes per element, unless measured.

        With quantized KV, elements take ``kv_bits/8`` bytes plus a scale and a bias (in the
        activation dtype) per group of ``kv_group_size`` along head_dim: the engine's store
        holds exactly that per token (``engine.kv.quant``).
        """
        if self.measured_kv_bytes_per_token is not None and self.kv_bits is None:
            return self.measured_kv_bytes_per_token
        elements = 2 * self.num_layers * self.num_kv_heads * self.head_dim
        if self.kv_bits is None:
            return elements * self.dtype_bytes
        packed = math.ceil(elements * self.kv_bits / 8)
        groups = 2 * self.num_layers * self.num_kv_heads * math.ceil(self.head_dim / self.kv_group_size)
        return packed + groups * 2 * self.dtype_bytes


def _dtype_bytes_from_name(name: Any) -> int | None:
    if name is None:
        return None
    key = str(name).rsplit(".", 1)[-1].lower()
    return _DTYPE_BYTES.get(key)


def _get(config: Mapping[str, Any], key: str) -> Any:
    """Read ``key`` from the config, falling back to a nested ``text_config`` (VLMs)."""
    if key in config and config[key] is not None:
        return config[key]
    text = config.get("text_config")
    if isinstance(text, Mapping) and text.get(key) is not None:
        return text[key]
    return None


def geometry_from_config(
    config: Mapping[str, Any], dtype_bytes: int | None = None
) -> ModelGeometry:
    """Read an mlx-lm / Hugging Face ``config.json`` dict.

    ``num_key_value_heads`` defaults to the head count and ``head_dim`` to hidden/heads;
    the dtype comes from ``torch_dtype`` (or ``dtype``) unless given, defaulting to 2 bytes.
    A key missing under its usual name is read under dbrx's (``d_model``, ``n_heads``,
    ``n_layers``, ``attn_config.kv_n_heads``, ``ffn_config.ffn_hidden_size``): dbrx's router
    reads values on the host, so its caches are not probed before load and its config is
    all there is to size it by. Step 3.5 names its KV heads ``num_attention_groups``.
    """
    other_names = {  # the usual key: its paths under other architectures' names
        "num_attention_heads": (("n_heads",),),
        "hidden_size": (("d_model",),),
        "num_hidden_layers": (("n_layers",),),
        "num_key_value_heads": (("attn_config", "kv_n_heads"), ("num_attention_groups",)),
        "intermediate_size": (("ffn_config", "ffn_hidden_size"),),
    }

    def read(key: str) -> Any:
        value = _get(config, key)
        for first, *rest in other_names.get(key, ()):
            if value is not None:
                break
            value = _get(config, first)
            for part in rest:
                value = value.get(part) if isinstance(value, Mapping) else None
        return value

    def need(key: str) -> int:
        value = read(key)
        if value is None:
            raise ValueError(f"model config lacks {key!r}")
        return int(value)

    heads = need("num_attention_heads")
    hidden = need("hidden_size")
    kv_heads = read("num_key_value_heads")
    head_dim = _get(config, "head_dim")
    if dtype_bytes is None:
        dtype_bytes = (
            _dtype_bytes_from_name(_get(config, "torch_dtype"))
            or _dtype_bytes_from_name(_get(config, "dtype"))
            or 2
        )
    return ModelGeometry(
        num_layers=need("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=int(kv_heads) if kv_heads is not None else heads,
        head_dim=int(head_dim) if head_dim is not None else hidden // heads,
        hidden_size=hidden,
        intermediate_size=need("intermediate_size"),
        vocab_size=need("vocab_size"),
        dtype_bytes=dtype_bytes,
    )


def _leaves(tree: Any) -> Iterator[Any]:
    if isinstance(tree, Mapping):
        for v in tree.values():
            yield from _leaves(v)
    elif isinstance(tree, (list, tuple)):
        for v in tree:
            yield from _leaves(v)
    else:
        yield tree


def _model_dtype_bytes(model: Any) -> int | None:
    """Bytes of the first floating-point parameter (quantized weights are uint32: skipped)."""
    params = getattr(model, "parameters", None)
    if params is None:
        return None
    for leaf in _leaves(params()):
        dtype = getattr(leaf, "dtype", None)
        if dtype is not None and "float" in str(dtype):
            return _dtype_bytes_from_name(dtype) or int(getattr(dtype, "size", 0)) or None
    return None


def geometry_from_model(model: Any, dtype_bytes: int | None = None) -> ModelGeometry:
    """Read ``model.args`` (an mlx-lm ``ModelArgs`` dataclass) like a config dict; the dtype
    comes from the model's first floating-point parameter unless given."""
    args = getattr(model, "args", None)
    if args is None:
        raise ValueError("model has no .args; use geometry_from_config")
    config = dict(vars(args))
    text = config.get("text_config")
    if text is not None and not isinstance(text, Mapping):
        config["text_config"] = dict(vars(text))
    if dtype_bytes is None:
        dtype_bytes = _model_dtype_bytes(model)
    return geometry_from_config(config, dtype_bytes=dtype_bytes)


def _round_up(tokens: int, step: int = KV_STEP) -> int:
    return -(-tokens // step) * step


def kv_cache_bytes(geometry: ModelGeometry, tokens: int, batch: int = 1) -> int:
    """Bytes allocated by a KV cache holding ``tokens`` tokens (rounded up to 256-token steps;
    window entries at most their window, state entries their fixed size)."""
    if tokens < 0 or batch < 0:
        raise ValueError("tokens and batch must be non-negative")
    if geometry.kv_layout is not None:
        return geometry.kv_layout.bytes_for(tokens) * batch
    return _round_up(tokens) * batch * geometry.kv_bytes_per_token


@dataclass(frozen=True)
class PrefillEstimate:
    """The bytes one prefill chunk needs on top of current usage, by cause."""

    kv_growth_bytes: int
    attention_bytes: int
    activation_bytes: int
    logits_bytes: int

    @property
    def total_bytes(self) -> int:
        return (
            self.kv_growth_bytes + self.attention_bytes + self.activation_bytes + self.logits_bytes
        )


def dense_projection_bytes(geometry: ModelGeometry) -> int:
    """The largest dense projection weight of one layer, in the activations' dtype: q/k/v
    or gate/up, each one matrix as the engine fuses them (o is smaller than q/k/v, down
    than gate/up). What a prefill call holds at most at once where quantized projections
    are dequantized for many rows, sized from the geometry before the model is loaded (an
    upper bound: unfused projections are smaller, and a mixture of experts' routed weights
    stay quantized)."""
    g = geometry
    qkv = g.hidden_size * (g.num_heads + 2 * g.num_kv_heads) * g.head_dim
    gate_up = 2 * g.hidden_size * g.intermediate_size
    return max(qkv, gate_up) * g.dtype_bytes


def fused_attention_available(geometry: ModelGeometry, backend: str) -> bool:
    """Whether prefill attention avoids materialising the score matrix on ``backend``.

    Quantized KV is decoded to the model's dtype before the ordinary SDPA (the engine's
    store, ``engine.kv.quant``), so it takes the same path. Padded batches with array masks
    may still fall off the fused path: measure.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    if backend == "metal":
        return geometry.head_dim in METAL_FUSED_HEAD_DIMS
    if backend == "cuda":
        return geometry.dtype_bytes == 2 and geometry.head_dim % 8 == 0 and geometry.head_dim <= 128
    return False


def estimate_prefill(
    geometry: ModelGeometry,
    *,
    chunk_tokens: int,
    context_tokens: int,
    batch: int = 1,
    backend: str = "cpu",
    masked: bool = False,
) -> PrefillEstimate:
    """Upper-bound the peak bytes of prefilling ``chunk_tokens`` after ``context_tokens``
    already cached (see the module docstring for each term). ``masked``: the call's rows
    differ in start or length, so it carries an array mask of its own."""
    if chunk_tokens <= 0:
        raise ValueError("chunk_tokens must be positive")
    if context_tokens < 0 or batch <= 0:
        raise ValueError("context_tokens must be >= 0 and batch > 0")
    g = geometry
    b, c, t = batch, chunk_tokens, context_tokens
    span = t + c
    dt = g.dtype_bytes

    # KV: every layer gains up to ceil(C/256) steps; one layer's old and new buffers coexist.
    per_token_layer = g.kv_bytes_per_token // g.num_layers
    layout = g.kv_layout
    if layout is None:
        permanent = kv_cache_bytes(g, c, b)
        old_layer = _round_up(t) * b * per_token_layer
        new_layer = (t + _round_up(c)) * b * per_token_layer
        kv_growth = permanent + old_layer + new_layer
    else:  # window entries gain at most the chunk, state entries nothing
        permanent = sum(grp.bytes_per_token for grp in layout.groups if grp.kind == FULL) * _round_up(c)
        permanent += sum(grp.bytes_per_token for grp in layout.groups if grp.kind != FULL) * c
        kv_growth = b * (permanent + layout.layer_transient_bytes(t, c))
        span = layout.span(t, c)  # the longest key span any layer attends over

    # Attention for one layer at a time (layers run in sequence).
    qo = 2 * b * g.num_heads * c * g.head_dim * dt
    if fused_attention_available(g, backend):
        kv_contig = 2 * b * g.num_kv_heads * span * g.head_dim * dt
        attention = qo + kv_contig
    else:
        scores = b * g.num_heads * c * span * SCORE_BYTES
        mask = c * span  # boolean causal mask
        attention = 2 * scores + mask + qo
    if masked:
        attention += b * c * span * (dt + 1)  # the additive mask and its boolean source
    if layout is not None:  # a window's own mask, made once beside the causal one
        attention += sum(c * grp.span(t, c) for grp in layout.groups if grp.kind in (WINDOW, CHUNKED))
    if g.kv_bits is not None:
        attention += b * span * per_token_layer  # the gathered packed rows, before decoding

    # Activations for C tokens.
    hidden = 4 * b * c * g.hidden_size * dt
    projections = 2 * b * c * (g.num_heads + 2 * g.num_kv_heads) * g.head_dim * dt
    projections += b * c * g.hidden_size * dt  # o_proj output
    projections += b * c * (g.num_heads + 2 * g.num_kv_heads) * g.head_dim * dt  # the fused q/k/v output
    # fused gate/up (2) and the activation (1), plus one: the fused model's measured peaks
    # (bench/estimate_vs_measured.py) exceeded the estimate by up to 7 % without it
    mlp = 4 * b * c * g.intermediate_size * dt
    activation = hidden + projections + mlp + g.prefill_weight_bytes

    logits = b * g.vocab_size * 4
    return PrefillEstimate(
        kv_growth_bytes=kv_growth,
        attention_bytes=attention,
        activation_bytes=activation,
        logits_bytes=logits,
    )


def estimate_decode_reservation(
    geometry: ModelGeometry, *, prompt_tokens: int, max_tokens: int, batch: int = 1
) -> int:
    """KV bytes a request will hold at its longest: prompt + max_tokens, step-rounded."""
    if prompt_tokens < 0 or max_tokens < 0:
        raise ValueError("prompt_tokens and max_tokens must be non-negative")
    return kv_cache_bytes(geometry, prompt_tokens + max_tokens, batch)
