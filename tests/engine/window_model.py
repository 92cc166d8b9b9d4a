"""A tiny sliding-window model on disk, servable like any other: mlx-lm's gemma3_text with
random float32 weights and the tiny model's byte-level tokenizer.

Six layers, every third one global (full attention), the others a 64-token sliding window:
a few hundred tokens of prompt are several windows long.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map

WINDOW = 64
LAYERS = 6
PATTERN = 3  # every third layer global
CONFIG: dict[str, Any] = dict(
    model_type="gemma3_text", hidden_size=64, num_hidden_layers=LAYERS, intermediate_size=128,
    num_attention_heads=4, head_dim=16, num_key_value_heads=1, rms_norm_eps=1e-4,
    sliding_window=WINDOW, sliding_window_pattern=PATTERN, vocab_size=259,
    max_position_embeddings=8192, torch_dtype="float32", eos_token_id=258,
)
FULL_LAYERS = LAYERS // PATTERN
WINDOW_LAYERS = LAYERS - FULL_LAYERS
# keys and values of one token in one layer, float32
BYTES_PER_TOKEN_LAYER = 2 * CONFIG["num_key_value_heads"] * CONFIG["head_dim"] * 4


def save_window_model(path: Path, tokenizer_from: Path) -> Path:
    """Write the model's config, weights and the tokenizer files of `tokenizer_from`."""
    from mlx_lm.models import gemma3_text

    path.mkdir(parents=True, exist_ok=True)
    mx.random.seed(0)
    model = gemma3_text.Model(gemma3_text.ModelArgs.from_dict(CONFIG))
    model.update(tree_map(lambda p: p.astype(mx.float32), model.parameters()))
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (path / "config.json").write_text(json.dumps(CONFIG))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (path / name).write_bytes((tokenizer_from / name).read_bytes())
    return path


def reserved_kv_bytes(tokens: int, chunk: int) -> int:
    """What a sequence of `tokens` holds at most, from the config alone: full layers every
    token and up to one more 256-token step (the decode batch merges a row at its exact
    length and grows from there), window layers the window plus a prefill chunk."""
    full = tokens + 255
    window = max(min(-(-tokens // 256) * 256, WINDOW), min(tokens, WINDOW + chunk - 1))
    return (FULL_LAYERS * full + WINDOW_LAYERS * window) * BYTES_PER_TOKEN_LAYER


def paged_reserved_kv_bytes(tokens: int, chunk: int, block: int = 16) -> int:
    """What the paged store reserves for it (memory.paged): the 2 full layers a block per
    `block` tokens, and each of the 2 groups of 2 window layers a ring of blocks for the
    window plus a chunk (or fewer, for a shorter request)."""
    blocks = -(-tokens // block)
    ring = min(blocks, -(-(WINDOW - 1 + chunk) // block))
    groups = WINDOW_LAYERS // FULL_LAYERS
    return (blocks + groups * ring) * block * FULL_LAYERS * BYTES_PER_TOKEN_LAYER


def snapshot_spare_bytes(block: int = 16) -> int:
    """The room a new segment keeps beside its request for two copies of its rings
    (memory.paged.SNAPSHOTS_PER_SEGMENT): per window group, the window's 63 positions from up
    to a block earlier, 6 blocks."""
    groups = WINDOW_LAYERS // FULL_LAYERS
    per_copy = groups * (-(-(WINDOW - 1 + block - 1) // block) + 1)
    return 2 * per_copy * block * FULL_LAYERS * BYTES_PER_TOKEN_LAYER


def cpu_segment_bytes() -> int:
    """A default segment on the CPU: 2,048 tokens of every layer, in 2-layer blocks."""
    return 2048 * LAYERS * BYTES_PER_TOKEN_LAYER


def all_full_kv_bytes(tokens: int) -> int:
    """The same sequence if every layer held every token."""
    return LAYERS * -(-tokens // 256) * 256 * BYTES_PER_TOKEN_LAYER
