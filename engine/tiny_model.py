"""The embedded default model: a tiny, deterministic mlx-lm model built on first use.

Model hubs may be unreachable, and tests must run real MLX on a real model, so the
project builds its own: a Llama-architecture model with seeded random float32 weights,
a byte-level BPE tokenizer (every byte is a token, so any text round-trips), and a
ChatML chat template whose end-of-turn token is the model's EOS. The output is
gibberish, but it is a real mlx-lm model directory that `mlx_lm.load` reads like any
other, and the same seed always gives the same weights.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# ChatML with Hermes-style tools (the layout Qwen 2.5 uses): the tool list goes into the
# system turn, calls are `<tool_call>{"name": ..., "arguments": ...}</tool_call>` blocks
# (mlx-lm's `json_tools` parser, which it infers from `tool_call.name` below), results come
# back as `<tool_response>` blocks in a user turn.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\n\n' }}{%- endif %}"
    "{{- '# Tools\n\nYou may call one or more functions. Function signatures:\n<tools>' }}"
    "{%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\n</tools>\n\nFor each call, return a JSON object within <tool_call></tool_call> tags:\n'"
    " + '<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>'"
    " + '<|im_end|>\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and loop.first %}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '<|im_start|>user\n<tool_response>\n' + message['content'] + '\n</tool_response><|im_end|>\n' }}"
    "{%- elif message['role'] == 'assistant' and message.get('tool_calls') %}"
    "{{- '<|im_start|>assistant\n' + (message['content'] or '') }}"
    "{%- for tool_call in message['tool_calls'] %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '<tool_call>\n{\"name\": \"' + tool_call.name + '\", \"arguments\": '"
    " + (tool_call.arguments | tojson) + '}\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\n' + (message['content'] or '') + '<|im_end|>\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"
)
BUILD_VERSION = 3
_BIAS_CHANNEL = 5.0


@dataclass(frozen=True)
class TinyModelShape:
    """Geometry of the tiny model; the defaults are small enough for a 2-core CPU."""

    hidden_size: int = 128
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 256
    max_position_embeddings: int = 8192
    seed: int = 0


def default_cache_dir() -> Path:
    base = os.environ.get("MLX_HEADROOM_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "mlx-headroom"
    )
    return Path(base)


def default_model_path(shape: TinyModelShape = TinyModelShape()) -> Path:
    return default_cache_dir() / f"tiny-chat-v{BUILD_VERSION}-s{shape.seed}-h{shape.hidden_size}"


def byte_chars() -> list[str]:
    """GPT-2's byte-to-unicode table, by byte: ByteLevel pre-tokenisation maps each byte to
    one of these printable characters, so a BPE with no merges is exactly a byte tokenizer."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def _byte_vocab() -> dict[str, int]:
    return {c: b for b, c in enumerate(byte_chars())}


def tokenizer_json() -> dict[str, object]:
    vocab = _byte_vocab()
    added = [
        {
            "id": 256 + i,
            "content": tok,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for i, tok in enumerate(SPECIAL_TOKENS)
    ]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {
            "type": "ByteLevel",
            "add_prefix_space": False,
            "trim_offsets": True,
            "use_regex": True,
        },
        "post_processor": None,
        "decoder": {
            "type": "ByteLevel",
            "add_prefix_space": False,
            "trim_offsets": True,
            "use_regex": True,
        },
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [],
        },
    }


def write_tokenizer_files(directory: Path, *, model_max_length: int) -> None:
    """The embedded tokenizer as a Hugging Face tokenizer directory's files."""
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer_json()))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "model_max_length": model_max_length,
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "unk_token": None,
                "add_bos_token": False,
                "add_eos_token": False,
                "clean_up_tokenization_spaces": False,
                "chat_template": CHAT_TEMPLATE,
            }
        )
    )
    (directory / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"})
    )


def architecture_config(shape: TinyModelShape, vocab_size: int) -> dict[str, Any]:
    """The Llama config.json fields that define the model's shape."""
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": shape.hidden_size,
        "num_hidden_layers": shape.num_hidden_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "head_dim": shape.hidden_size // shape.num_attention_heads,
        "intermediate_size": shape.intermediate_size,
        "vocab_size": vocab_size,
        "max_position_embeddings": shape.max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }


def _config(shape: TinyModelShape, vocab_size: int) -> dict[str, Any]:
    return {
        **architecture_config(shape, vocab_size),
        "bos_token_id": None,
        "eos_token_id": 256 + SPECIAL_TOKENS.index("<|im_end|>"),
        "mlx_headroom": {"builder": "tiny_model", "version": BUILD_VERSION, **asdict(shape)},
    }


def _weights(shape: TinyModelShape, vocab_size: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(shape.seed)
    h, inter = shape.hidden_size, shape.intermediate_size
    head_dim = h // shape.num_attention_heads
    kv = shape.num_key_value_heads * head_dim

    def dense(out_dim: int, in_dim: int) -> np.ndarray:
        return (rng.standard_normal((out_dim, in_dim)) / np.sqrt(in_dim)).astype(np.float32)

    embed = rng.standard_normal((vocab_size, h)).astype(np.float32)
    embed[:, 0] = _BIAS_CHANNEL  # a near-constant channel: lets the head give tokens a bias
    weights: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": embed,
        "model.norm.weight": np.ones(h, np.float32),
    }
    for i in range(shape.num_hidden_layers):
        p = f"model.layers.{i}."
        weights |= {
            p + "self_attn.q_proj.weight": dense(h, h),
            p + "self_attn.k_proj.weight": dense(kv, h),
            p + "self_attn.v_proj.weight": dense(kv, h),
            p + "self_attn.o_proj.weight": dense(h, h),
            p + "mlp.gate_proj.weight": dense(inter, h),
            p + "mlp.up_proj.weight": dense(inter, h),
            p + "mlp.down_proj.weight": dense(h, inter),
            p + "input_layernorm.weight": np.ones(h, np.float32),
            p + "post_attention_layernorm.weight": np.ones(h, np.float32),
        }
    # Favour printable ASCII so that what the model says is readable, and never produce
    # the special tokens by chance: their rows read only the constant channel, with a large
    # negative weight. Generation then ends on max_tokens or a stop string, which keeps
    # lengths deterministic at any temperature.
    head = dense(vocab_size, h) * 4.0
    head[:, 0] = 0.0
    token_ids = np.arange(vocab_size)
    readable = (token_ids >= 32) & (token_ids < 127)
    head[~readable] *= 0.05
    head[256:] = 0.0
    head[256:, 0] = -40.0
    weights["lm_head.weight"] = head
    return weights


def build_tiny_model(path: Path, shape: TinyModelShape = TinyModelShape()) -> Path:
    """Write a complete mlx-lm model directory at `path` (atomically) and return it."""
    from safetensors.numpy import save_file

    path = Path(path)
    if (path / "config.json").exists():
        return path
    vocab_size = 256 + len(SPECIAL_TOKENS)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file(_weights(shape, vocab_size), str(tmp / "model.safetensors"))
    write_tokenizer_files(tmp, model_max_length=shape.max_position_embeddings)
    (tmp / "config.json").write_text(json.dumps(_config(shape, vocab_size), indent=2))
    try:
        tmp.rename(path)
    except OSError:  # another process finished first
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return path


def ensure_default_model() -> Path:
    return build_tiny_model(default_model_path())


if __name__ == "__main__":
    print(ensure_default_model())
