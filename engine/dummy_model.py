"""`--load-format dummy`: an mlx-lm model built from a shape alone, with random weights.

As in vLLM, a dummy model has the real architecture and sizes (so memory, bandwidth and
scheduling behave as with the real checkpoint) but no weight files: the weights are drawn
on the device with `mx.random` from a fixed seed, so an 8B bf16 model builds in seconds
on a GPU. The tokenizer and chat template are the embedded byte-level ones of
`engine.tiny_model`; token ids beyond them exist in the vocabulary but are never produced
by the tokenizer.

The shape comes from a preset name (`PRESETS`) or a `config.json` (a file or the directory
holding it). `save_dummy_model` writes the same weights as an ordinary mlx-lm model
directory, for servers that only load from disk (`mlx_lm.server --model <dir>`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

from engine.tiny_model import (
    SPECIAL_TOKENS,
    TinyModelShape,
    architecture_config,
    default_cache_dir,
    write_tokenizer_files,
)

DTYPES = ("bfloat16", "float16", "float32")
WEIGHT_SCALE = 0.02  # std of the random weights: keeps activations finite in low precision
BYTE_VOCAB = 256 + len(SPECIAL_TOKENS)  # ids the embedded tokenizer can produce
EOS_TOKEN_ID = 256 + SPECIAL_TOKENS.index("<|im_end|>")


def _tiny_preset() -> dict[str, Any]:
    return architecture_config(TinyModelShape(), BYTE_VOCAB)


PRESETS: dict[str, dict[str, Any]] = {
    # Gemma 3 12B's shape: sliding-window attention (1,024 tokens) on five of every six layers.
    "gemma3-12b": {
        "model_type": "gemma3_text",
        "hidden_size": 3840,
        "num_hidden_layers": 48,
        "intermediate_size": 15360,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 256,
        "vocab_size": 262208,
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "query_pre_attn_scalar": 256,
        "sliding_window": 1024,
        "sliding_window_pattern": 6,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-6,
        "torch_dtype": "bfloat16",
    },
    # Qwen3-Next's layout (gated delta-net with full attention every 4th layer, a sparse MoE)
    # with 64 experts instead of 512, so that it fits one 141 GB card in bf16 (~12B).
    "qwen3-next-64e": {
        "model_type": "qwen3_next",
        "hidden_size": 2048,
        "num_hidden_layers": 48,
        "intermediate_size": 5120,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "linear_num_value_heads": 32,
        "linear_num_key_heads": 16,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "num_experts": 64,
        "num_experts_per_tok": 10,
        "decoder_sparse_step": 1,
        "shared_expert_intermediate_size": 512,
        "mlp_only_layers": [],
        "moe_intermediate_size": 512,
        "norm_topk_prob": True,
        "vocab_size": 151936,
        "rope_theta": 10000000.0,
        "partial_rotary_factor": 0.25,
        "max_position_embeddings": 262144,
        "full_attention_interval": 4,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    "llama3-8b": {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 14336,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    "llama3-70b": {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 8192,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 28672,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    "qwen2.5-7b": {
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_size": 3584,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "intermediate_size": 18944,
        "vocab_size": 152064,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    "tiny": _tiny_preset(),
}


@dataclass(frozen=True)
class DummyModel:
    model: nn.Module
    tokenizer: Any  # mlx_lm TokenizerWrapper
    config: dict[str, Any]
    path: Path  # config.json and tokenizer files (no weights)


def dummy_config(model: str, dtype: str | None = None) -> dict[str, Any]:
    """The config of a preset name or a config.json path, with the tokenizer's token ids and
    `torch_dtype` set to `dtype` (default: the config's own, else bfloat16)."""
    if model in PRESETS:
        config = dict(PRESETS[model])
    else:
        path = Path(model)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ValueError(
                f"dummy model {model!r} is neither a preset ({', '.join(PRESETS)}) nor a config.json"
            )
        config = json.loads(path.read_text())
    dtype = dtype or config.get("torch_dtype") or "bfloat16"
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, not {dtype!r}")
    if int(config["vocab_size"]) < BYTE_VOCAB:
        raise ValueError(f"vocab_size must be at least {BYTE_VOCAB} for the byte tokenizer")
    config |= {
        "torch_dtype": dtype,
        "bos_token_id": None,
        "eos_token_id": EOS_TOKEN_ID,
        "pad_token_id": 256,
    }
    config.pop("quantization", None)
    config.pop("quantization_config", None)
    return config


def _is_ones(name: str) -> bool:
    return "norm" in name.rsplit(".", 1)[0].rsplit(".", 1)[-1] and name.endswith(".weight")


def random_weights(model: nn.Module, dtype: str, seed: int) -> dict[str, mx.array]:
    """Weights for every parameter of `model`, drawn lazily on the default device: norms are
    ones, biases zeros, everything else normal × WEIGHT_SCALE. The output rows of the special
    tokens are zero, so that greedy decoding never picks the end-of-turn token (the max of the
    random logits is positive); lengths then end on max_tokens."""
    mx_dtype = getattr(mx, dtype)
    names = sorted(name for name, _ in tree_flatten(model.parameters()))
    shapes = {name: p.shape for name, p in tree_flatten(model.parameters())}
    keys = mx.random.split(mx.random.key(seed), len(names))
    weights: dict[str, mx.array] = {}
    for i, name in enumerate(names):
        shape = shapes[name]
        if _is_ones(name):
            w = mx.ones(shape, dtype=mx_dtype)
        elif name.endswith(".bias"):
            w = mx.zeros(shape, dtype=mx_dtype)
        else:
            w = mx.random.normal(shape, dtype=mx_dtype, scale=WEIGHT_SCALE, key=keys[i])
        weights[name] = w
    head = "lm_head.weight" if "lm_head.weight" in weights else None
    if head is not None:
        weights[head] = weights[head].at[256:BYTE_VOCAB].multiply(0)
    return weights


def build_dummy_model(config: dict[str, Any], *, seed: int = 0) -> nn.Module:
    """An mlx-lm model of `config`'s architecture with evaluated random weights."""
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    dtype = str(config["torch_dtype"])
    weights = random_weights(model, dtype, seed)
    model.update(tree_unflatten(list(weights.items())))
    # Evaluate layer by layer: a single graph over every parameter would hold all the random
    # temporaries at once.
    for _, w in sorted(weights.items()):
        mx.eval(w)
    model.eval()
    return model


def weight_bytes(config: dict[str, Any]) -> int:
    """Bytes of the model's weights in its dtype, computed without allocating them (mlx-lm's
    layers initialise their parameters lazily)."""
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    itemsize = getattr(mx, str(config["torch_dtype"])).size
    return sum(p.size for _, p in tree_flatten(model.parameters())) * itemsize


def write_model_files(out_dir: Path, config: dict[str, Any]) -> Path:
    """config.json and the embedded tokenizer's files: an mlx-lm model directory, less weights."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    write_tokenizer_files(out_dir, model_max_length=int(config.get("max_position_embeddings", 8192)))
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return out_dir


def _files_dir(config: dict[str, Any]) -> Path:
    """A cache directory with config.json and tokenizer files for `config` (no weights)."""
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:12]
    path = default_cache_dir() / f"dummy-{digest}"
    if (path / "config.json").exists():
        return path
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    write_model_files(tmp, config)
    try:
        tmp.rename(path)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def load_dummy_model(model: str, *, dtype: str | None = None, seed: int = 0) -> DummyModel:
    """Build the model named by a preset or config path, with its tokenizer wrapper."""
    from mlx_lm.utils import load_tokenizer

    config = dummy_config(model, dtype)
    path = _files_dir(config)
    tokenizer = load_tokenizer(path, eos_token_ids=config["eos_token_id"])
    return DummyModel(build_dummy_model(config, seed=seed), tokenizer, config, path)


def save_dummy_model(
    out_dir: str | Path, preset: str, dtype: str | None = None, seed: int = 0
) -> Path:
    """Write the dummy model (the same weights `load_dummy_model` builds) as an mlx-lm model
    directory: config.json, model*.safetensors shards with their index, tokenizer files."""
    from mlx_lm.utils import save_model

    config = dummy_config(preset, dtype) | {"mlx_headroom": {"builder": "dummy_model", "seed": seed}}
    out_dir = Path(out_dir)
    if (out_dir / "config.json").exists() and json.loads((out_dir / "config.json").read_text()) == config:
        return out_dir  # already written by an earlier run with the same shape and dtype
    model = build_dummy_model(config, seed=seed)
    # config.json last: its presence marks a complete directory
    write_model_files(out_dir, config).joinpath("config.json").unlink()
    save_model(out_dir, model, donate_model=True)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return out_dir


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="write a dummy model as an mlx-lm directory")
    parser.add_argument("out_dir")
    parser.add_argument("--model", default="tiny", help=f"preset ({', '.join(PRESETS)}) or config.json")
    parser.add_argument("--dtype", choices=DTYPES)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(save_dummy_model(args.out_dir, args.model, args.dtype, args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
