"""What a model's KV cache holds, read from mlx-lm's own cache objects rather than config keys.

`probe_cache_layout(model)` calls `make_prompt_cache(model)` and runs a forward of two tokens
without evaluating it: MLX knows every array's shape and dtype lazily, so nothing is
allocated even when the model's parameters are themselves unevaluated (a model built from
its config alone). Each cache entry then says what it is:

    full      KVCache: every token, in 256-token steps
    window    RotatingKVCache: at most `window` tokens (plus a prefill chunk while it runs)
    chunked   ChunkedKVCache (llama4): at most one attention chunk
    state     ArraysCache (mamba, gated delta-net): a fixed state per sequence
    quantized QuantizedKVCache: packed keys and values, every token
    custom    a model's own cache class (deepseek_v41's LayerCache): every token, at the
              bytes per token it held after the probe

An entry the probe's forward left empty (nemotron-nas's layers without attention) holds
nothing: a full entry of no bytes.

A `CacheList` entry contributes one `LayerCache` per child. Bytes per token come from the
keys' and values' shapes except the sequence axis, so MLA's latent keys (1 head × 512) and
rotary values (1 × 64) are counted as they are stored, not as the config's heads suggest.

A second lazy forward asks whether the model takes a batch of rows whose caches hold one
offset and one mask per row, as mlx-lm's batch caches and the paged store's views do
(gpt_bigcode makes its positions from the offset as a Python int, so it cannot):
`CacheLayout.batched`.

`CacheLayout.plain_kv` is the paged store's case (every entry a plain `KVCache` with the same
heads and dims for keys and values, rows batched), and `CacheLayout.paged_windows` its case
of full and sliding-window layers (held in layer groups, `memory.paged`); other models are
served by `engine.dense`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from engine.kv.attention import attends_through_shared_sdpa, layer_modules
from memory import ModelGeometry, geometry_from_model
from memory.estimate import KVGroup, KVLayout, cache_slots

KV_STEP = 256  # mlx-lm's caches grow by this many tokens
MEMO_ENTRIES = 4096  # sequence lengths whose bytes a layout remembers (then it starts over)
PROBE_TOKENS = 2

FULL, WINDOW, CHUNKED, STATE, QUANTIZED, CUSTOM = (
    "full", "window", "chunked", "state", "quantized", "custom"
)


class CacheLayoutError(RuntimeError):
    """The model's caches could not be read (its forward does not run lazily)."""


@dataclass(frozen=True)
class LayerCache:
    """One cache entry (or one child of a `CacheList` entry)."""

    kind: str
    cache_type: str  # mlx-lm's class name
    bytes_per_token: int = 0  # keys + values of one token (every kind but state)
    fixed_bytes: int = 0  # state held per sequence whatever its length (state)
    window: int | None = None  # max_size (window) or chunk_size (chunked)
    keep: int = 0  # RotatingKVCache's leading tokens never rotated out
    kv_heads: int = 0
    key_dim: int = 0
    value_dim: int = 0
    mergeable: bool = True  # the class has `merge`: rows batch through mlx-lm's batch caches

    @property
    def held_as(self) -> str:
        """How the memory module sizes it: quantized and custom entries hold every token."""
        return FULL if self.kind in (QUANTIZED, CUSTOM) else self.kind

    def slots(self, tokens: int, chunk: int = 0, *, merged: bool = True) -> int:
        """Token slots this entry holds for a sequence of `tokens`, `chunk` at a time, its
        row `merged` into a decode batch or not (`memory.estimate.cache_slots`: the one
        rule admission and the store share)."""
        return cache_slots(self.held_as, tokens, self.window, chunk, merged=merged)

    def bytes_for(self, tokens: int, chunk: int = 0, *, merged: bool = True) -> int:
        return self.slots(tokens, chunk, merged=merged) * self.bytes_per_token + self.fixed_bytes

    def bytes_used(self, tokens: int) -> int:
        """The bytes of the tokens themselves (no step rounding): what is written."""
        kept = tokens if self.kind in (FULL, QUANTIZED, CUSTOM) else min(tokens, self.window or tokens)
        return (0 if self.kind == STATE else kept) * self.bytes_per_token + self.fixed_bytes


@dataclass(frozen=True)
class CacheLayout:
    layers: tuple[LayerCache, ...]
    entries: int  # len(make_prompt_cache(model)): CacheList children count once here
    vocab_size: int
    dtype: mx.Dtype
    model_layers: int = 0  # len(model.layers): more than `entries` when layers reuse others' KV
    batched: bool = True  # the forward takes rows with per-row cache offsets
    # Fewer entries than layers, and every attention call of the forward names a cache
    # entry (`_attention_through_entries`): Gemma 3n's KV-shared layers attend through an
    # earlier layer's cache object. Not afm7's KV-reuse layers, which attend K/V they are
    # handed; nor iquestloopcoder, whose layers run twice, the second time naming one entry
    # while attending another's K/V.
    attends_through_entries: bool = False

    @cached_property
    def _one_per_layer(self) -> bool:
        """One cache entry per layer, or layers that share an earlier layer's entry and attend
        through it (Gemma 3n), none attending K/V handed to it outside a cache (afm7's
        KV-reuse layers), none running twice (iquestloopcoder's), rows batched: what every
        paged case needs."""
        if not self.layers or len(self.layers) != self.entries or not self.batched:
            return False
        return not self.model_layers or self.model_layers == self.entries or self.attends_through_entries

    @cached_property
    def plain_kv(self) -> bool:
        """Every entry a plain full `KVCache`, keys and values of one shape, one per layer
        (no layer reading another's cache, as afm7's KV-reuse layers do), rows batched: the
        paged store."""
        if not self._one_per_layer:
            return False
        first = self.layers[0]
        return all(
            c.cache_type == "KVCache" and c.kind == FULL and c.key_dim == c.value_dim
            and (c.kv_heads, c.key_dim) == (first.kv_heads, first.key_dim)
            for c in self.layers
        )

    @cached_property
    def paged_gather(self) -> bool:
        """Every entry a plain `KVCache` of one shape, one per layer, rows batched, whatever
        its keys' and values' widths: the paged store can hold it and hand each decode row's
        K/V back to the model's own attention (MLA: a latent key and a rotary value of other
        widths than the config's heads, `KVGeometry.gather`)."""
        if not self._one_per_layer:
            return False
        first = self.layers[0]
        return first.key_dim > 0 and first.value_dim > 0 and all(
            c.cache_type == "KVCache" and c.kind == FULL
            and (c.kv_heads, c.key_dim, c.value_dim) == (first.kv_heads, first.key_dim, first.value_dim)
            for c in self.layers
        )

    @cached_property
    def paged_windows(self) -> tuple[int | None, ...] | None:
        """Each entry's window (None: full) where the paged store holds the model in layer
        groups (`memory.paged`): every entry a plain `KVCache` or a `RotatingKVCache` that
        keeps no leading tokens, keys and values of one shape, one per layer, rows
        batched. None otherwise (and for a model of full layers only: `plain_kv`)."""
        if not self._one_per_layer:
            return None
        first = self.layers[0]
        if not all(
            ((c.cache_type == "KVCache" and c.kind == FULL)
             or (c.cache_type == "RotatingKVCache" and c.kind == WINDOW and c.keep == 0 and c.window))
            and c.key_dim == c.value_dim and (c.kv_heads, c.key_dim) == (first.kv_heads, first.key_dim)
            for c in self.layers
        ):
            return None
        windows = tuple(c.window if c.kind == WINDOW else None for c in self.layers)
        return windows if any(w is not None for w in windows) else None

    @cached_property
    def paged_states(self) -> tuple[bool, ...] | None:
        """Which entries hold recurrent state (True) where the paged store holds the rest: a
        hybrid whose entries are each a plain `KVCache` (all of one shape; MLA's latent keys
        and rotary values too, through the gather path) or an `ArraysCache` (conv window,
        SSM or delta-net state: `engine.kv.state`), at least one of each, one per layer,
        rows batched. None otherwise."""
        if not self._one_per_layer:
            return None
        kv = [c for c in self.layers if c.kind != STATE]
        if not kv or len(kv) == len(self.layers):
            return None
        first = kv[0]
        if not all(c.cache_type == "ArraysCache" for c in self.layers if c.kind == STATE) or not all(
            c.cache_type == "KVCache" and c.kind == FULL and c.key_dim > 0 and c.value_dim > 0
            and (c.kv_heads, c.key_dim, c.value_dim) == (first.kv_heads, first.key_dim, first.value_dim)
            for c in kv
        ):
            return None
        return tuple(c.kind == STATE for c in self.layers)

    @cached_property
    def mergeable(self) -> bool:
        """Every entry batches through mlx-lm's `merge` / `extend` / `filter`."""
        return all(c.mergeable for c in self.layers)

    @cached_property
    def bytes_per_token(self) -> int:
        """Keys and values of one token across every entry that stores tokens (windows
        counted as if they held every token: the per-token rate, not a sequence's total)."""
        return sum(c.bytes_per_token for c in self.layers)

    @cached_property
    def fixed_bytes(self) -> int:
        return sum(c.fixed_bytes for c in self.layers)

    def bytes_for(self, tokens: int, chunk: int = 0) -> int:
        """KV bytes one sequence of `tokens` holds at most, prefilled `chunk` tokens at a
        time: full entries every token in 256-token steps (counted from the exact length
        at which a row merges into the decode batch, where rows merge), window entries at
        most their window (plus a chunk during prefill), state entries their fixed size.

        Remembered per (tokens, chunk): admission asks it for every admitted row of every
        request it weighs, and summing every layer each time made a burst of 64 short
        prompts on a six-layer windowed model spend 40 % of its time here."""
        memo = self._bytes_for_memo
        key = (tokens, chunk)
        found = memo.get(key)
        if found is None:
            if len(memo) >= MEMO_ENTRIES:
                memo.clear()
            merged = self.merges
            found = memo[key] = sum(c.bytes_for(tokens, chunk, merged=merged) for c in self.layers)
        return found

    @cached_property
    def _bytes_for_memo(self) -> dict[tuple[int, int], int]:
        return {}

    def bytes_used(self, tokens: int) -> int:
        """The bytes a sequence's `tokens` have written (`LayerCache.bytes_used`, summed):
        the engine reports it for every row at every step, so the layers are summed once
        into one rate per window (for 32 rows of a 48-layer windowed model, the step's store
        figures took 1.26 ms of host time, now 0.18)."""
        fixed, rates = self._used_rates
        return fixed + sum((tokens if cap is None else min(tokens, cap)) * rate for cap, rate in rates)

    @cached_property
    def _used_rates(self) -> tuple[int, tuple[tuple[int | None, int], ...]]:
        """Fixed bytes, and bytes per token written by the entries keeping at most `cap`
        tokens (None: every token)."""
        fixed, rates = 0, {}
        for c in self.layers:
            fixed += c.fixed_bytes
            if c.kind != STATE:
                cap = None if c.kind in (FULL, QUANTIZED, CUSTOM) else (c.window or None)
                rates[cap] = rates.get(cap, 0) + c.bytes_per_token
        return fixed, tuple(rates.items())

    @cached_property
    def merges(self) -> bool:
        """Rows join a merged decode batch (else each keeps its own caches)."""
        return self.mergeable and self.batched

    @cached_property
    def uniform(self) -> bool:
        """Every entry holds every token and no fixed state: sized by bytes per token alone."""
        return all(c.held_as == FULL and not c.fixed_bytes for c in self.layers)

    def kv_layout(self, dtype_bytes: int | None = None) -> KVLayout:
        """The memory module's terms: entries grouped by kind and window, their bytes
        summed (scaled to `dtype_bytes` per element where the weights will be another
        dtype than the probe's)."""
        def scaled(n: int) -> int:
            if dtype_bytes is None or dtype_bytes == self.dtype.size:
                return n
            return -(-n * dtype_bytes // self.dtype.size)

        groups: dict[tuple[str, int | None], list[LayerCache]] = {}
        for c in self.layers:
            groups.setdefault((c.held_as, c.window if c.held_as != FULL else None), []).append(c)
        return KVLayout(tuple(
            KVGroup(kind, len(members), bytes_per_token=scaled(sum(c.bytes_per_token for c in members)),
                    fixed_bytes=scaled(sum(c.fixed_bytes for c in members)), window=window,
                    merged=self.merges)
            for (kind, window), members in groups.items()
        ))

    def kinds(self) -> dict[str, int]:
        """Entries by kind, e.g. {"full": 2, "window": 10}."""
        out: dict[str, int] = {}
        for c in self.layers:
            out[c.kind] = out.get(c.kind, 0) + 1
        return out

    def describe(self) -> str:
        parts = []
        for kind, n in self.kinds().items():
            windows = sorted({c.window for c in self.layers if c.kind == kind and c.window})
            extra = f" ({', '.join(str(w) for w in windows)} tokens)" if windows else ""
            parts.append(f"{n} {kind}{extra}")
        return ", ".join(parts)


def probe_cache_layout(model: Any, *, weights_loaded: bool = False) -> CacheLayout:
    """Read the layout of `model`'s caches from a lazy two-token forward (nothing evaluated).

    If the lazy forward raises and `weights_loaded`, one evaluated two-token forward is run
    instead (a few kilobytes on a loaded model); without loaded weights that would
    materialise every parameter, so the error is raised instead, as it is up front for a
    model whose forward reads values on the host (`.tolist()`, `.item()`, `mx.eval`).
    """
    from mlx_lm.models.cache import make_prompt_cache

    if not weights_loaded and (reader := _host_reader(model)) is not None:
        raise CacheLayoutError(
            f"{reader}: its forward reads values on the host, which would evaluate "
            "unloaded weights; load the weights to read its caches"
        )
    tokens = mx.zeros((1, PROBE_TOKENS), dtype=mx.int32)
    caches = make_prompt_cache(model)
    try:
        logits, named, calls = _attention_through_entries(model, tokens, caches)
    except Exception as exc:
        if not weights_loaded:
            raise CacheLayoutError(
                f"{type(model).__module__}: its forward did not run on unevaluated arrays "
                f"({type(exc).__name__}: {exc}); load the weights to read its caches"
            ) from exc
        caches = make_prompt_cache(model)
        logits, named, calls = _attention_through_entries(model, tokens, caches)
        mx.eval(logits, [c.state for c in caches])
    growing = _growing_states(model, caches)
    layers: list[LayerCache] = []
    for cache in caches:
        layers.extend(_read(cache, growing))
    model_layers = getattr(model, "layers", None)
    count = len(model_layers) if isinstance(model_layers, list) else len(caches)
    return CacheLayout(
        tuple(layers), len(caches), int(logits.shape[-1]), _dtype_of(caches, logits),
        model_layers=count, batched=_takes_rows(model, caches),
        attends_through_entries=len(caches) < count and named == calls,
    )


def _attention_through_entries(model: Any, tokens: mx.array, caches: list[Any]) -> tuple[mx.array, int, int]:
    """The model's logits on `tokens`, how many of its attention calls (mlx-lm's shared
    `scaled_dot_product_attention`, as each model module names it) named one of `caches`,
    and how many it made: a layer that attends through a cache object is served from that
    entry's K/V in the paged store; one that attends K/V it was handed is not."""
    entries = {id(c) for c in caches}
    named = calls = 0
    originals: dict[Any, Any] = {}

    def counting(fn: Any) -> Any:
        def attend(*args: Any, **kwargs: Any) -> Any:
            nonlocal named, calls
            cache = kwargs["cache"] if "cache" in kwargs else (args[3] if len(args) > 3 else None)
            named += cache is not None and id(cache) in entries
            calls += 1
            return fn(*args, **kwargs)
        return attend

    for module in layer_modules(model):
        fn = getattr(module, "scaled_dot_product_attention", None)
        if callable(fn):
            originals[module] = fn
            module.scaled_dot_product_attention = counting(fn)
    try:
        return model(tokens, cache=caches), named, calls
    finally:
        for module, fn in originals.items():
            module.scaled_dot_product_attention = fn


def _takes_rows(model: Any, caches: list[Any]) -> bool:
    """Whether a decode step runs on three rows whose caches are merged, each with its own
    offset and a per-row mask (nothing evaluated): gpt_bigcode makes its positions from the
    offset as an int, phi3small's block-sparse attention cannot broadcast a per-row mask.
    Caches without `merge` are never batched: True."""
    if not all(hasattr(type(c), "merge") for c in caches):
        return True
    try:
        rows = [type(c).merge([c, c, c]) for c in caches]
        model(mx.zeros((3, 1), dtype=mx.int32), cache=rows)
    except Exception:
        return False
    return True


def _growing_states(model: Any, caches: list[Any]) -> set[int]:
    """Ids of `ArraysCache`s whose arrays change shape when one more token runs (an n-gram
    context, not a fixed state): mlx-lm's `extend` cannot join rows of unequal shapes."""
    from mlx_lm.models.cache import ArraysCache

    def shapes() -> dict[int, list[tuple[int, ...]]]:
        return {id(c): [tuple(a.shape) for a in c.cache if a is not None]
                for c in _leaf_caches(caches) if isinstance(c, ArraysCache)}

    before = shapes()
    if not before:
        return set()
    try:
        model(mx.zeros((1, 1), dtype=mx.int32), cache=caches)
    except Exception:
        return set()
    return {k for k, v in shapes().items() if v != before[k]}


def _leaf_caches(caches: list[Any]) -> list[Any]:
    from mlx_lm.models.cache import CacheList

    out: list[Any] = []
    for c in caches:
        out.extend(_leaf_caches(list(c.caches)) if isinstance(c, CacheList) else [c])
    return out


_HOST_READS = (".tolist()", ".item()", "mx.eval(")
_MODELS = "mlx_lm.models."


def _host_reader(model: Any) -> str | None:
    """The first function of the model's forward pass whose source reads arrays on the host
    (dbrx's router calls tolist()): a lazy forward would evaluate its weights. Only code the
    forward runs counts: a host read in `sanitize` or a sharding helper (prism_hadamard_qwen35
    checks its sign vectors with .item() at load) never runs in the probe."""
    for fn in _forward_functions(model):
        source = _source(fn)
        if source is not None and any(s in source for s in _HOST_READS):
            return f"{fn.__module__}.{fn.__qualname__}"
    return None


def _forward_functions(model: Any) -> list[Any]:
    """mlx-lm's functions reachable from the `__call__` of every layer class in the model
    (and their bases): the methods and module-level functions they name, followed
    transitively. Names are resolved loosely (any layer class's method of that name), so
    the set may hold more than the forward runs, never less of mlx-lm's own code."""
    import inspect

    classes = [k for m in model.modules() for k in type(m).__mro__ if k.__module__.startswith(_MODELS)]
    methods: dict[str, list[Any]] = {}
    for klass in dict.fromkeys(classes):
        for name, member in vars(klass).items():
            fn = member.fget if isinstance(member, property) else member
            if inspect.isfunction(fn):
                methods.setdefault(name, []).append(fn)
    todo = list(methods.get("__call__", []))
    seen: dict[int, Any] = {}
    while todo:
        fn = todo.pop()
        if id(fn) in seen:
            continue
        seen[id(fn)] = fn
        for name in _names(fn.__code__):
            todo.extend(methods.get(name, []))
            todo.extend(_global_functions(fn, name))
    return list(seen.values())


def _names(code: Any) -> set[str]:
    """Global and attribute names a code object uses, nested functions and lambdas included."""
    names = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names |= _names(const)
    return names


def _global_functions(fn: Any, name: str) -> list[Any]:
    """mlx-lm functions `name` denotes in `fn`'s module: a global of that name, or an
    attribute of that name on an mlx-lm module it imported (`qwen3_5.helper`)."""
    import inspect
    import types

    found = [fn.__globals__.get(name)]
    found += [getattr(m, name, None) for m in fn.__globals__.values()
              if isinstance(m, types.ModuleType) and m.__name__.startswith(_MODELS)]
    return [f for f in found if inspect.isfunction(f) and f.__module__.startswith(_MODELS)]


def _source(fn: Any) -> str | None:
    import inspect

    try:
        return inspect.getsource(fn)
    except (OSError, TypeError):
        return None


def _read(cache: Any, growing: set[int]) -> list[LayerCache]:
    from mlx_lm.models.cache import (
        ArraysCache,
        CacheList,
        ChunkedKVCache,
        KVCache,
        QuantizedKVCache,
        RotatingKVCache,
    )

    name = type(cache).__name__
    mergeable = hasattr(type(cache), "merge")
    if isinstance(cache, CacheList):
        return [c for child in cache.caches for c in _read(child, growing)]
    if isinstance(cache, ArraysCache):
        fixed = sum(a.nbytes for a in cache.cache if a is not None)
        return [LayerCache(STATE, name, fixed_bytes=fixed, mergeable=id(cache) not in growing)]
    if isinstance(cache, QuantizedKVCache):
        per_token = sum(_per_token(a) for a in _arrays(cache.keys) + _arrays(cache.values))
        return [LayerCache(QUANTIZED, name, bytes_per_token=per_token, mergeable=mergeable)]
    keys, values = getattr(cache, "keys", None), getattr(cache, "values", None)
    if keys is None and values is None and getattr(cache, "offset", None) == 0:
        return [LayerCache(FULL, name, mergeable=mergeable)]  # a layer that stores nothing
    if not isinstance(keys, mx.array) or not isinstance(values, mx.array):
        offset, nbytes = getattr(cache, "offset", 0), getattr(cache, "nbytes", None)
        if isinstance(offset, int) and offset > 0 and isinstance(nbytes, int):
            return [LayerCache(CUSTOM, name, bytes_per_token=-(-nbytes // offset), mergeable=mergeable)]
        raise CacheLayoutError(f"{name}: the probe's forward left no keys and values in it")
    shape = dict(
        bytes_per_token=_per_token(keys) + _per_token(values), kv_heads=int(keys.shape[1]),
        key_dim=int(keys.shape[-1]), value_dim=int(values.shape[-1]), mergeable=mergeable,
    )
    if isinstance(cache, RotatingKVCache):
        return [LayerCache(WINDOW, name, window=cache.max_size, keep=cache.keep, **shape)]  # type: ignore[arg-type]
    if isinstance(cache, ChunkedKVCache):
        return [LayerCache(CHUNKED, name, window=cache.chunk_size, **shape)]  # type: ignore[arg-type]
    if isinstance(cache, KVCache) or hasattr(cache, "offset"):
        return [LayerCache(FULL, name, **shape)]  # type: ignore[arg-type]
    raise CacheLayoutError(f"{name}: an unknown cache kind")


def _arrays(tree: Any) -> list[mx.array]:
    if isinstance(tree, mx.array):
        return [tree]
    return [a for _, a in tree_flatten(tree) if isinstance(a, mx.array)]


def _per_token(a: mx.array) -> int:
    """Bytes of one token of a [batch, heads, tokens, dim] cache array."""
    return math.prod(a.shape[1:2] + a.shape[3:]) * a.itemsize


def _dtype_of(caches: list[Any], logits: mx.array) -> mx.Dtype:
    """The dtype the caches store (the logits' when no entry holds a floating array)."""
    for _, a in tree_flatten([c.state for c in caches]):
        if isinstance(a, mx.array) and mx.issubdtype(a.dtype, mx.floating):
            return a.dtype
    return logits.dtype


_HEADS = ("num_attention_heads", "n_head", "n_heads", "num_heads")
_HIDDEN = ("hidden_size", "n_embd", "d_model", "dim")
_INTERMEDIATE = ("intermediate_size", "n_inner", "ffn_dim", "d_inner")


def geometry_for(model: Any, layout: CacheLayout, dtype_bytes: int | None = None) -> ModelGeometry:
    """The memory module's geometry: from the model's config where it has the usual keys,
    else from the probe (KV heads and dims of its first attention entry, vocabulary from the
    logits) and whichever config names the architecture uses. Either way its KV bytes per
    token are the probe's, as the caches store them, and a layout of several kinds (window,
    chunked, state entries) comes with it, so that every estimate sizes a sequence as its
    caches hold it."""
    try:
        geometry = geometry_from_model(model, dtype_bytes=dtype_bytes)
    except ValueError:
        geometry = _geometry_from_probe(model, layout, dtype_bytes)
    measured = layout.bytes_per_token
    if dtype_bytes is not None and layout.dtype.size != dtype_bytes:
        measured = measured * dtype_bytes // layout.dtype.size
    from dataclasses import replace

    if not layout.uniform and geometry.kv_bits is None:
        geometry = replace(geometry, kv_layout=layout.kv_layout(dtype_bytes))
    if layout.paged_windows is not None:
        geometry = replace(geometry, kv_windows=layout.paged_windows)
    if layout.paged_states is not None and attends_through_shared_sdpa(model):
        geometry = replace(geometry, kv_states=layout.paged_states)
    if geometry.kv_bits is not None or measured == geometry.kv_bytes_per_token:
        return geometry
    return replace(geometry, measured_kv_bytes_per_token=measured)


def _geometry_from_probe(model: Any, layout: CacheLayout, dtype_bytes: int | None) -> ModelGeometry:
    args = getattr(model, "args", None)
    args = vars(args) if hasattr(args, "__dict__") else dict(args) if isinstance(args, dict) else {}
    text = args.get("text_config")
    if text is not None and not isinstance(text, dict):
        text = vars(text)
    config = {**(text or {}), **{k: v for k, v in args.items() if v is not None}}

    def first(keys: tuple[str, ...]) -> int | None:
        for key in keys:
            if isinstance(config.get(key), int):
                return int(config[key])
        return None

    attn = next((c for c in layout.layers if c.kv_heads), None)
    kv_heads = attn.kv_heads if attn else 1
    head_dim = max(attn.key_dim, attn.value_dim) if attn else 1
    hidden = first(_HIDDEN) or _embedding_dim(model) or kv_heads * head_dim
    heads = first(_HEADS) or kv_heads
    return ModelGeometry(
        num_layers=max(layout.entries, 1),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        hidden_size=hidden,
        intermediate_size=first(_INTERMEDIATE) or 4 * hidden,
        vocab_size=layout.vocab_size,
        dtype_bytes=dtype_bytes or layout.dtype.size,
    )


def _embedding_dim(model: Any) -> int | None:
    import mlx.nn as nn

    for _, module in model.named_modules():
        if isinstance(module, nn.Embedding):
            return int(module.weight.shape[-1])
    return None
