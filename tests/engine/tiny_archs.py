"""Tiny random mlx-lm models of the architectures whose caches are not plain `KVCache`.

Each config is mlx-lm's own test config (its tests/test_models.py) shrunk further: a few
layers, small dims, a 256-token vocabulary, float32 weights. `build(name)` returns the
model with its parameters evaluated, the same weights on every call (fixed seed).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx.utils import tree_map
from mlx_lm.utils import _get_classes

VOCAB = 256

CONFIGS: dict[str, dict[str, Any]] = {
    # sliding window (RotatingKVCache) beside full attention, 1 full : 1 sliding
    "gemma3_text": dict(
        model_type="gemma3_text", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
        num_attention_heads=4, head_dim=16, num_key_value_heads=1, rms_norm_eps=1e-4,
        sliding_window=16, sliding_window_pattern=2, vocab_size=VOCAB,
    ),
    # sinks + sliding window, mixture of experts
    "gpt_oss": dict(
        model_type="gpt_oss", hidden_size=64, num_hidden_layers=2, intermediate_size=64,
        head_dim=16, num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=16, rope_theta=10000, vocab_size=VOCAB,
        layer_types=["sliding_attention", "full_attention"],
    ),
    # gated delta-net state (ArraysCache) every layer but the last, attention in the last
    "qwen3_next": dict(
        model_type="qwen3_next", hidden_size=64, num_hidden_layers=4, intermediate_size=64,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
        linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=3, num_experts=4,
        num_experts_per_tok=2, decoder_sparse_step=1, shared_expert_intermediate_size=64,
        mlp_only_layers=[0], moe_intermediate_size=64, rms_norm_eps=1e-5, head_dim=16,
        rope_theta=1000.0, partial_rotary_factor=0.5, max_position_embeddings=1000,
        full_attention_interval=4,
    ),
    # pure state-space model: no attention at all
    "mamba2": dict(
        model_type="mamba2", num_heads=4, head_dim=16, vocab_size=VOCAB, hidden_size=32,
        intermediate_size=64, state_size=16, num_hidden_layers=2, layer_norm_epsilon=1e-4,
        conv_kernel=3, n_groups=2, use_bias=False, use_conv_bias=False,
        tie_word_embeddings=True, time_step_limit=(0.01, 10), time_step_rank="auto",
    ),
    # MLA: one latent KV head, keys 4 wide and values 16 (kv_lora_rank, qk_rope_head_dim)
    "deepseek_v3": dict(
        model_type="deepseek_v3", vocab_size=VOCAB, hidden_size=64, intermediate_size=64,
        moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, n_routed_experts=4, n_group=2, topk_group=1,
        num_experts_per_tok=2, n_shared_experts=1, kv_lora_rank=8, q_lora_rank=8,
        qk_rope_head_dim=16, v_head_dim=16, qk_nope_head_dim=16, first_k_dense_replace=1,
    ),
    # CacheList(ArraysCache, KVCache) per layer: mamba beside attention
    "falcon_h1": dict(
        model_type="falcon_h1", num_hidden_layers=2, vocab_size=VOCAB, hidden_size=64,
        intermediate_size=64, head_dim=16, num_attention_heads=4, num_key_value_heads=2,
        mamba_d_conv=3, mamba_d_head=16, mamba_d_ssm=64, mamba_d_state=16, mamba_n_heads=4,
        mamba_chunk_size=16,
    ),
    # chunked local attention (ChunkedKVCache, no `merge`) beside full attention
    "llama4": dict(
        model_type="llama4", num_hidden_layers=4, vocab_size=VOCAB,
        text_config=dict(
            attention_bias=False, attention_chunk_size=8, head_dim=16, hidden_size=64,
            interleave_moe_layer_step=2, intermediate_size=64, intermediate_size_mlp=64,
            max_position_embeddings=1000, model_type="llama4", num_attention_heads=4,
            num_experts_per_tok=1, num_hidden_layers=4, num_key_value_heads=2,
            num_local_experts=2, rms_norm_eps=1e-4, rope_scaling=None, rope_theta=1000,
            use_qk_norm=True, vocab_size=VOCAB,
        ),
    ),
    # no 'num_attention_heads' in its config: sized from the probe
    "gpt2": dict(
        model_type="gpt2", n_ctx=256, n_embd=64, n_head=4, n_layer=2, n_positions=256,
        layer_norm_epsilon=1e-5, vocab_size=VOCAB,
    ),
}


def build(name: str, *, evaluate: bool = True, seed: int = 0) -> Any:
    """The tiny model `name`, float32; its parameters evaluated unless `evaluate` is False."""
    config = CONFIGS[name]
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    if evaluate:
        model.update(tree_map(lambda p: p.astype(mx.float32) * 1.0, model.parameters()))
        mx.eval(model.parameters())
    return model
