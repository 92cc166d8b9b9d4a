"""Compare memory.estimate_prefill with MLX's measured peak on this machine.

Builds small mlx-lm llama models with random weights, prefills a context, then measures one
chunk: ``mx.get_peak_memory()`` after ``mx.reset_peak_memory()``, minus the active memory
before the chunk. Prints one row per (shape, C, T) with estimate / measured.

    .venv/bin/python bench/estimate_vs_measured.py [--separate]
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx
from mlx_lm.models import llama
from mlx_lm.models.cache import make_prompt_cache

from engine.fusion import fuse_projections
from memory import estimate_prefill, geometry_from_model


@dataclass(frozen=True)
class Shape:
    name: str
    config: dict[str, Any]
    dtype: Any = mx.float32
    batch: int = 1


def make_model(shape: Shape, *, fuse: bool = True) -> Any:
    """The shape's model, its projections fused as the server's loader fuses them."""
    args = llama.ModelArgs(model_type="llama", rms_norm_eps=1e-5, **shape.config)
    model = llama.Model(args)
    if shape.dtype != mx.float32:
        model.set_dtype(shape.dtype)
    mx.eval(model.parameters())
    if fuse:
        fuse_projections(model)
    return model


def measure_chunk(model: Any, *, chunk: int, context: int, batch: int = 1, step: int = 512) -> int:
    """Peak bytes above the starting active memory while prefilling ``chunk`` tokens after
    ``context`` already-cached tokens (mlx-lm style: evaluate only the cache state)."""
    vocab = model.args.vocab_size
    cache = make_prompt_cache(model)
    tokens = mx.random.randint(0, vocab, (batch, context + chunk))
    mx.eval(tokens)
    for start in range(0, context, step):
        model(tokens[:, start : min(context, start + step)], cache=cache)
        mx.eval([c.state for c in cache])
    mx.clear_cache()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    model(tokens[:, context:], cache=cache)
    mx.eval([c.state for c in cache])
    peak = mx.get_peak_memory() - before
    del cache
    mx.clear_cache()
    return peak


GQA_HD32 = dict(
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    intermediate_size=688,
    vocab_size=1000,
)
SHAPES = [
    Shape("gqa-hd32", GQA_HD32),
    Shape(
        "mha-hd64",
        dict(
            hidden_size=512,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=8,
            intermediate_size=1376,
            vocab_size=2000,
        ),
    ),
    Shape(
        "gqa-hd128",
        dict(
            hidden_size=512,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=128,
            intermediate_size=1024,
            vocab_size=4000,
        ),
    ),
    Shape(
        "wide-mlp",
        dict(
            hidden_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            intermediate_size=2048,
            vocab_size=32000,
        ),
    ),
    Shape("gqa-hd32-b2", GQA_HD32, batch=2),
    Shape("gqa-hd32-bf16", GQA_HD32, dtype=mx.bfloat16),
    Shape("gqa-hd32-fp16", GQA_HD32, dtype=mx.float16),
]
CASES = [(64, 0), (256, 0), (256, 256), (300, 300), (128, 900), (512, 0), (512, 512), (1024, 0)]
QUICK = {
    "gqa-hd32-b2": [(128, 0), (256, 256), (512, 0)],
    "gqa-hd32-bf16": [(64, 0), (256, 0), (256, 256), (64, 200)],
    "gqa-hd32-fp16": [(256, 256)],
}


def main() -> None:
    fuse = "--separate" not in sys.argv[1:]  # --separate: mlx-lm's own projections
    print(
        f"{'shape':<14} {'B':>2} {'C':>5} {'T':>5} {'estimate':>12} {'measured':>12} {'ratio':>6}"
        f"  {'kv':>10} {'attn':>10} {'act':>10}"
    )
    ratios: list[float] = []
    t0 = time.time()
    for shape in SHAPES:
        model = make_model(shape, fuse=fuse)
        geometry = geometry_from_model(model)
        for chunk, context in QUICK.get(shape.name, CASES):
            measured = measure_chunk(model, chunk=chunk, context=context, batch=shape.batch)
            est = estimate_prefill(
                geometry,
                chunk_tokens=chunk,
                context_tokens=context,
                batch=shape.batch,
                backend="cpu",
            )
            ratio = est.total_bytes / measured
            ratios.append(ratio)
            print(
                f"{shape.name:<14} {shape.batch:>2} {chunk:>5} {context:>5} "
                f"{est.total_bytes:>12,} {measured:>12,} {ratio:>6.2f}  "
                f"{est.kv_growth_bytes:>10,} {est.attention_bytes:>10,} "
                f"{est.activation_bytes:>10,}",
                flush=True,
            )
        del model
        mx.clear_cache()
    print(
        f"ratio min {min(ratios):.2f} max {max(ratios):.2f} over {len(ratios)} cases "
        f"({time.time() - t0:.0f} s)"
    )


if __name__ == "__main__":
    main()
