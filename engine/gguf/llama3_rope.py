"""Llama 3.1+ RoPE scaling, recovered from the ``rope_freqs.weight`` llama.cpp stores instead.

llama.cpp writes no ``rope.scaling.*`` keys for Hugging Face's ``rope_type: llama3``: it
stores the per-frequency factors it computed (``LlamaModel.generate_extra_tensors``):

- 1 where the wavelength is under ``original_max_position_embeddings / high_freq_factor``;
- ``factor`` where it is over ``original_max_position_embeddings / low_freq_factor``;
- ``1 / ((1 - s) / factor + s)`` between, with ``s = (orig / wavelength - low) / (high - low)``.

mlx-lm's Llama reads the four parameters, so they are solved back from the factors. Between
the two bounds ``s`` is linear in ``1 / wavelength`` with slope ``orig / (high - low)`` and
intercept ``-low / (high - low)``: only those two are determined, so ``orig`` is taken as
8192 (every Llama 3.x) and ``low``/``high`` follow; any other ``orig`` with the same slope and
intercept gives the same frequencies. The solution is checked by recomputing the factors.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from engine.gguf.reader import GGUFError, GGUFFile

ORIGINAL_CONTEXT = 8192


def llama3_factors(scaling: dict[str, Any], base: float, dims: int) -> np.ndarray:
    """The per-frequency factors llama.cpp's converter stores for a ``llama3`` scaling."""
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    orig = scaling["original_max_position_embeddings"]
    out = []
    for freq in 1.0 / (base ** (np.arange(0, dims, 2, dtype=np.float32) / dims)):
        wavelen = 2 * math.pi / float(freq)
        if wavelen < orig / high:
            out.append(1.0)
        elif wavelen > orig / low:
            out.append(factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, np.float32)


def llama3_rope_scaling(g: GGUFFile, base: float, dims: int) -> dict[str, Any]:
    """mlx-lm's ``rope_scaling`` for the file's ``rope_freqs.weight``, or a GGUFError."""
    factors = g.tensor("rope_freqs.weight").astype(np.float64).reshape(-1)
    if factors.shape != (dims // 2,) or not np.all(factors >= 1.0):
        raise GGUFError(f"{g.path}: rope_freqs.weight {factors.shape} is not llama3 RoPE scaling "
                        f"for head size {dims}")
    factor = float(factors.max())
    freqs = 1.0 / (base ** (np.arange(0, dims, 2, dtype=np.float32).astype(np.float64) / dims))
    inv_wavelen = freqs / (2 * math.pi)
    between = (factors > 1.0 + 1e-6) & (factors < factor * (1 - 1e-6))
    if factor == 1.0 or between.sum() < 2:
        raise GGUFError(f"{g.path}: rope_freqs.weight has too few scaled frequencies to recover "
                        "its llama3 RoPE scaling parameters")
    smooth = (1 / factors[between] - 1 / factor) / (1 - 1 / factor)
    # smooth = slope / wavelength + intercept, slope = orig / (high - low), intercept = -low / (high - low)
    slope, intercept = np.polyfit(inv_wavelen[between], smooth, 1)
    width = ORIGINAL_CONTEXT / slope
    low = round(-intercept * width, 4)
    scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
               "high_freq_factor": round(low + width, 4),
               "original_max_position_embeddings": ORIGINAL_CONTEXT}
    if not np.allclose(llama3_factors(scaling, base, dims), factors, rtol=1e-4, atol=0):
        raise GGUFError(f"{g.path}: rope_freqs.weight is not llama3 RoPE scaling (no factor, "
                        "low and high frequency factors reproduce it)")
    return scaling
