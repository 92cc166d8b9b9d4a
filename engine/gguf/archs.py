"""Per-architecture knowledge: GGUF metadata -> mlx-lm ``config.json``, tensor names, fix-ups.

What llama.cpp's converter did that has to be undone, or hard-codes rather than stores:

- gemma3: it added 1.0 to every ``*norm.weight``; mlx-lm's Gemma RMSNorm scales by ``1 + w``,
  so it is subtracted again. q/k are not permuted; the head is tied to the embedding.
  Sliding-window pattern 6 (five local layers to one global), local RoPE base 10,000 and the
  query scale 1/sqrt(head_dim) are not in the file.
- llama: q and k (weights and biases) were permuted for llama.cpp's interleaved RoPE;
  permuted back here. Llama 3.1+'s RoPE scaling is stored as ``rope_freqs.weight`` factors and
  solved back into mlx-lm's parameters (``llama3_rope``). llama.cpp writes Mistral models
  (``MistralForCausalLM`` and Mistral's own consolidated format) as ``llama`` too; ``mistral``
  is kept for files written by other tools.
- qwen2, qwen3: stored as Hugging Face has them (NeoX RoPE), biases on q/k/v for qwen2,
  ``attn_q_norm``/``attn_k_norm`` for qwen3.

Floats in the metadata are float32: they are read back as the shortest decimal that rounds to
the same float32 (``1e-05``, not ``9.999999747378752e-06``), which is what the source config said.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine.gguf.llama3_rope import llama3_rope_scaling
from engine.gguf.reader import GGUFError, GGUFFile

_BLOCK = re.compile(r"^blk\.(\d+)\.(.+)$")

_COMMON_LAYER = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GEMMA3_LAYER = {
    **_COMMON_LAYER,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


@dataclass(frozen=True)
class Architecture:
    """How one GGUF ``general.architecture`` becomes an mlx-lm model directory."""

    name: str
    config: Callable[[GGUFFile], dict[str, Any]]
    layer_names: dict[str, str]
    fix: Callable[[GGUFFile, str, np.ndarray], np.ndarray] = lambda g, name, a: a
    chat_template: str | None = None  # used when the file carries none
    extra_eos: tuple[str, ...] = ()  # tokens that end a turn besides the file's EOS
    skip: frozenset[str] = field(default_factory=frozenset)  # GGUF tensors with no mlx-lm weight

    def hf_name(self, gguf_name: str) -> str:
        stem, _, kind = gguf_name.rpartition(".")  # kind: weight or bias
        m = _BLOCK.match(stem)
        if m:
            layer, part = m.groups()
            if part not in self.layer_names:
                raise GGUFError(f"{self.name}: no mlx-lm name for tensor {gguf_name!r}")
            return f"model.layers.{layer}.{self.layer_names[part]}.{kind}"
        if stem not in _GLOBAL:
            raise GGUFError(f"{self.name}: no mlx-lm name for tensor {gguf_name!r}")
        return f"{_GLOBAL[stem]}.{kind}"


def _base_config(g: GGUFFile, model_type: str) -> dict[str, Any]:
    heads = int(g.require("attention.head_count"))
    hidden = int(g.require("embedding_length"))
    kv_heads = g.get("attention.head_count_kv", heads)
    if not isinstance(kv_heads, int):
        raise GGUFError(f"{g.path}: per-layer KV head counts are not supported")
    config: dict[str, Any] = {
        "model_type": model_type,
        "hidden_size": hidden,
        "num_hidden_layers": int(g.require("block_count")),
        "intermediate_size": int(g.require("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": int(g.get("attention.key_length", hidden // heads)),
        "rms_norm_eps": _f32(g.get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": _f32(g.get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(g.get("context_length", 4096)),
        "vocab_size": _vocab_size(g),
        "tie_word_embeddings": "output.weight" not in g.tensors,
    }
    scaling = g.get("rope.scaling.type")
    factor = g.get("rope.scaling.factor")
    if scaling == "linear" and factor:
        config["rope_scaling"] = {"type": "linear", "rope_type": "linear", "factor": _f32(factor)}
    elif scaling not in (None, "none"):
        raise GGUFError(f"{g.path}: RoPE scaling {scaling!r} is not supported by the converter")
    return config


def _f32(value: Any) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it."""
    return float(str(np.float32(value)))


def _vocab_size(g: GGUFFile) -> int:
    embed = g.tensors.get("token_embd.weight")
    if embed is None:
        raise GGUFError(f"{g.path}: no token_embd.weight tensor")
    return int(embed.shape[0])


def _gemma3_config(g: GGUFFile) -> dict[str, Any]:
    config = _base_config(g, "gemma3_text")
    config |= {
        "architectures": ["Gemma3ForCausalLM"],
        "sliding_window": int(g.get("attention.sliding_window", 512)),
        "sliding_window_pattern": 6,
        "rope_local_base_freq": 10000.0,
        "query_pre_attn_scalar": config["head_dim"],
        "rope_scaling": config.get("rope_scaling"),
        "final_logit_softcapping": None,
        "tie_word_embeddings": True,
    }
    return config


def _gemma3_fix(g: GGUFFile, name: str, a: np.ndarray) -> np.ndarray:
    return a - 1.0 if name.endswith("norm.weight") else a


def _biases(g: GGUFFile) -> dict[str, bool]:
    """mlx-lm's Llama reads its q/k/v/o and MLP biases' presence from the config."""
    return {"attention_bias": "blk.0.attn_q.bias" in g.tensors,
            "mlp_bias": "blk.0.ffn_up.bias" in g.tensors}


def _llama_family_config(g: GGUFFile, model_type: str, architecture: str) -> dict[str, Any]:
    config = _base_config(g, model_type) | _biases(g) | {"architectures": [architecture]}
    if "rope_freqs.weight" in g.tensors:  # Llama 3.1+: llama3 RoPE scaling, stored as factors
        dims = int(g.get("rope.dimension_count", config["head_dim"]))
        config["rope_scaling"] = llama3_rope_scaling(g, config["rope_theta"], dims)
    return config


def _llama_config(g: GGUFFile) -> dict[str, Any]:
    return _llama_family_config(g, "llama", "LlamaForCausalLM")


def _mistral_config(g: GGUFFile) -> dict[str, Any]:
    return _llama_family_config(g, "mistral", "MistralForCausalLM")


def _qwen2_config(g: GGUFFile) -> dict[str, Any]:
    return _base_config(g, "qwen2") | {"architectures": ["Qwen2ForCausalLM"]}


def _qwen3_config(g: GGUFFile) -> dict[str, Any]:
    return _base_config(g, "qwen3") | {"architectures": ["Qwen3ForCausalLM"]}


def _unpermute(a: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's ``permute`` of q/k rows (interleaved RoPE -> Hugging Face's halves)."""
    rows = a.shape[0]
    return (a.reshape(heads, rows // heads // 2, 2, *a.shape[1:])
            .swapaxes(1, 2).reshape(a.shape))


def _llama_fix(g: GGUFFile, name: str, a: np.ndarray) -> np.ndarray:
    """q and k rows back in Hugging Face's order; llama.cpp permutes their biases too."""
    if name.endswith(("attn_q.weight", "attn_q.bias")):
        return _unpermute(a, int(g.require("attention.head_count")))
    if name.endswith(("attn_k.weight", "attn_k.bias")):
        heads = g.require("attention.head_count")
        return _unpermute(a, int(g.get("attention.head_count_kv", heads)))
    return a


GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- if messages[0]['content'] is string -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}"
    "{%- endif -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{%- if message['content'] is string -%}"
    "{{ message['content'] | trim }}"
    "{%- elif message['content'] -%}"
    "{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)

ARCHITECTURES: dict[str, Architecture] = {
    "gemma3": Architecture("gemma3", _gemma3_config, _GEMMA3_LAYER, _gemma3_fix,
                           chat_template=GEMMA_CHAT_TEMPLATE, extra_eos=("<end_of_turn>",),
                           skip=frozenset({"output.weight"})),
    "llama": Architecture("llama", _llama_config, _COMMON_LAYER, _llama_fix,
                          skip=frozenset({"rope_freqs.weight"})),
    "mistral": Architecture("mistral", _mistral_config, _COMMON_LAYER, _llama_fix,
                            skip=frozenset({"rope_freqs.weight"})),
    "qwen2": Architecture("qwen2", _qwen2_config, _COMMON_LAYER),
    "qwen3": Architecture("qwen3", _qwen3_config, _COMMON_LAYER),
}


def architecture_of(g: GGUFFile) -> Architecture:
    arch = ARCHITECTURES.get(g.architecture)
    if arch is None:
        raise GGUFError(f"{g.path}: GGUF architecture {g.architecture!r} cannot be converted "
                        f"(supported: {', '.join(sorted(ARCHITECTURES))})")
    return arch
