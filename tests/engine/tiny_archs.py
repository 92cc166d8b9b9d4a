"""A tiny random mlx-lm model of every architecture the installed mlx-lm ships.

One config per model type: the type is the name of its module in `mlx_lm/models/`, the
config what that module's `ModelArgs.from_dict` reads. Most come from mlx-lm's own
tests/test_models.py, shrunk further (hidden 64 or less, at most 4 layers, a 256-token
vocabulary, a few experts, windows of 16 tokens or less, so that the tests' 40-token
prompts pass them); the rest are written from each `ModelArgs`.
`build(name)` returns the model in float32 with its parameters evaluated, the same
weights on every call (fixed seed).
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

import mlx.core as mx
from mlx.utils import tree_map

VOCAB = 256

# multi-head latent attention
_MLA = dict(kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)
# ministral3 / mistral4 read Llama 4's attention scaling from their rope parameters
_MISTRAL_ROPE = dict(rope_theta=1000.0, rope_type="default", llama_4_scaling_beta=0.1,
                     original_max_position_embeddings=1000)

_CONFIGS: dict[str, dict[str, Any]] = {
    "afm7": dict(
        vocab_size=VOCAB, hidden_dim=64, num_layers=4, num_kv_reuse_layers=2, num_heads=4,
        num_kv_heads=2,
    ),
    "afmoe": dict(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, intermediate_size=64, head_dim=16, rope_theta=100.0,
        layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, sliding_window=16,
    ),
    "apertus": dict(
        hidden_size=64, num_hidden_layers=4, intermediate_size=64, mlp_bias=True, num_attention_heads=8,
        attention_bias=False, rms_norm_eps=1e-05, vocab_size=VOCAB, num_key_value_heads=4,
        max_position_embeddings=1000, rope_theta=1000, post_norm=True, qk_norm=True,
        tie_word_embeddings=False,
    ),
    "baichuan_m1": dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, rope_theta=1000, sliding_window=16, sliding_window_layers=[0, 2],
        conv_window=2, rms_norm_eps=1e-05,
    ),
    "bailing_hybrid": dict(
        hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, num_experts=4, num_experts_per_tok=2,
        num_shared_experts=1, n_group=1, topk_group=1, first_k_dense_replace=1,
        layer_group_size=2, group_norm_size=1, vocab_size=VOCAB, rms_norm_eps=1e-5,
        rope_theta=1000.0, max_position_embeddings=1000, routed_scaling_factor=1.0,
        head_dim=16, **_MLA,
    ),
    "bailing_moe": dict(
        hidden_size=64, intermediate_size=64, max_position_embeddings=1000, moe_intermediate_size=64,
        num_experts=4, num_shared_experts=1, norm_topk_prob=True, num_attention_heads=4,
        num_experts_per_tok=2, num_hidden_layers=4, num_key_value_heads=2, rms_norm_eps=1e-05,
        rope_theta=1000, vocab_size=VOCAB, first_k_dense_replace=2,
    ),
    "bailing_moe_linear": dict(
        hidden_size=64, num_hidden_layers=4, intermediate_size=64, moe_intermediate_size=64,
        num_experts_per_tok=2, num_experts=4, norm_topk_prob=True, num_shared_experts=2,
        num_attention_heads=4, num_key_value_heads=4, rms_norm_eps=1e-05, vocab_size=VOCAB,
        rope_theta=1000, first_k_dense_replace=0, layer_group_size=2, group_norm_size=1,
        max_position_embeddings=1000,
    ),
    "bailing_moe_v3": dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
        num_experts=4, num_experts_per_tok=2, num_shared_experts=1, first_k_dense_replace=1,
        n_group=1, topk_group=1, layer_group_size=2, head_dim=16, short_conv_kernel_size=3,
        max_position_embeddings=1000, **_MLA,
    ),
    "bitnet": dict(
        hidden_size=64, num_hidden_layers=4, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=4, rms_norm_eps=1e-05, vocab_size=VOCAB,
    ),
    "cohere": dict(
        hidden_size=64, num_hidden_layers=2, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, use_qk_norm=True,
    ),
    "cohere2": dict(
        hidden_size=64, head_dim=16, num_hidden_layers=4, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=VOCAB, sliding_window=16, sliding_window_pattern=2,
    ),
    "dbrx": dict(
        d_model=64, ffn_config=dict(ffn_hidden_size=64, moe_num_experts=4, moe_top_k=2),
        attn_config=dict(kv_n_heads=2, clip_qkv=True, rope_theta=10000), n_layers=4, n_heads=4,
        vocab_size=VOCAB,
    ),
    "deepseek": dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, moe_intermediate_size=64,
        num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
    ),
    "deepseek_v2": dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, moe_intermediate_size=64,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, kv_lora_rank=4, q_lora_rank=4,
        qk_rope_head_dim=32, v_head_dim=16, qk_nope_head_dim=32,
        rope_scaling=dict(
            beta_fast=32, beta_slow=1, factor=40, mscale=1.0, mscale_all_dim=1.0,
            original_max_position_embeddings=4096, type="yarn",
        ),
    ),
    # MLA: one latent KV head, keys 4 wide and values 16 (kv_lora_rank, qk_rope_head_dim)
    "deepseek_v3": dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64,
        moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, n_routed_experts=4, n_group=2, topk_group=1,
        num_experts_per_tok=2, n_shared_experts=1, kv_lora_rank=8, q_lora_rank=8,
        qk_rope_head_dim=16, v_head_dim=16, qk_nope_head_dim=16, first_k_dense_replace=1,
    ),
    "deepseek_v32": dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, moe_intermediate_size=64,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, n_routed_experts=4, n_group=2,
        topk_group=1, num_experts_per_tok=2, n_shared_experts=1, kv_lora_rank=4, q_lora_rank=4,
        qk_rope_head_dim=32, v_head_dim=16, qk_nope_head_dim=32,
        rope_scaling=dict(
            beta_fast=32, beta_slow=1, factor=40, mscale=1.0, mscale_all_dim=1.0,
            original_max_position_embeddings=4096, type="yarn",
        ),
    ),
    "deepseek_v41": dict(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        head_dim=32, q_lora_rank=16, qk_rope_head_dim=8, o_groups=2, o_lora_rank=16,
        moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, sliding_window=16,
        compress_ratios=[0, 4, 4, 0], kv_source_layer_ids=[1], index_source_layer_ids=[2],
        index_n_heads=2, index_head_dim=16, index_topk=4, candidate_topk_blocks=0,
        hc_mult=2, hc_sinkhorn_iters=3, max_position_embeddings=1000,
    ),
    "dots1": dict(
        hidden_size=64, num_hidden_layers=4, intermediate_size=64, num_attention_heads=4,
        rms_norm_eps=1e-05, vocab_size=VOCAB, max_position_embeddings=None, num_key_value_heads=2,
        first_k_dense_replace=1, moe_intermediate_size=64, n_routed_experts=4, n_shared_experts=1,
        norm_topk_prob=True, num_experts_per_tok=1, rope_theta=1000, routed_scaling_factor=1.0,
    ),
    "ernie4_5": dict(
        hidden_size=64, intermediate_size=64, max_position_embeddings=1000, num_attention_heads=4,
        num_key_value_heads=2, head_dim=None, num_hidden_layers=4, rms_norm_eps=1e-05, vocab_size=VOCAB,
        rope_theta=10000, use_bias=False, tie_word_embeddings=True,
    ),
    "ernie4_5_moe": dict(
        hidden_size=64, intermediate_size=64, max_position_embeddings=1000, num_attention_heads=4,
        num_key_value_heads=2, num_hidden_layers=4, rms_norm_eps=1e-05, vocab_size=VOCAB, rope_theta=1000,
        use_bias=False, tie_word_embeddings=False, moe_num_experts=4,
    ),
    "exaone": dict(
        hidden_size=64, num_layers=4, intermediate_size=64, num_attention_heads=8, num_key_value_heads=2,
        vocab_size=VOCAB, layer_norm_epsilon=0.0001, rope_theta=10000,
    ),
    "exaone4": dict(
        hidden_size=64, intermediate_size=64, num_attention_heads=4, vocab_size=VOCAB, rms_norm_eps=1e-05,
        num_hidden_layers=4, max_position_embeddings=1000, rope_theta=10000, layer_norm_epsilon=1e-05,
        num_key_value_heads=2, head_dim=16, tie_word_embeddings=False, rope_scaling=None,
        sliding_window=8, sliding_window_pattern="LLGL",
    ),
    "exaone_moe": dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, moe_intermediate_size=64,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=4,
        num_experts_per_tok=2, num_shared_experts=1, n_group=1, topk_group=1, routed_scaling_factor=2.5,
        norm_topk_prob=True, sliding_window=16, max_position_embeddings=1000, rms_norm_eps=1e-05,
        rope_theta=1000.0,
        layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
        is_moe_layer=[False, True, True, True], tie_word_embeddings=False,
    ),
    # CacheList(ArraysCache, KVCache) per layer: mamba beside attention
    "falcon_h1": dict(
        num_hidden_layers=2, vocab_size=VOCAB, hidden_size=64,
        intermediate_size=64, head_dim=16, num_attention_heads=4, num_key_value_heads=2,
        mamba_d_conv=3, mamba_d_head=16, mamba_d_ssm=64, mamba_d_state=16, mamba_n_heads=4,
        mamba_chunk_size=16,
    ),
    "gear": dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
        layer_types=["conv_mixer", "sliding_attention", "conv_mixer", "full_attention"],
        sliding_window=16,
    ),
    "gemma": dict(
        hidden_size=64, num_hidden_layers=4, intermediate_size=64, num_attention_heads=4, head_dim=16,
        rms_norm_eps=1e-05, vocab_size=VOCAB, num_key_value_heads=4,
    ),
    "gemma2": dict(
        hidden_size=64, num_hidden_layers=4, intermediate_size=64, num_attention_heads=2, head_dim=16,
        rms_norm_eps=0.0001, vocab_size=VOCAB, num_key_value_heads=2,
    ),
    # sliding window (RotatingKVCache) beside full attention, 1 full : 1 sliding
    "gemma3": dict(
        vocab_size=VOCAB,
        text_config=dict(
            model_type="gemma3_text", hidden_size=64, num_hidden_layers=4, intermediate_size=64,
            num_attention_heads=4, head_dim=16, num_key_value_heads=1, rms_norm_eps=1e-4,
            sliding_window=16, sliding_window_pattern=2,
        ),
    ),
    "gemma3_text": dict(
        hidden_size=64, num_hidden_layers=4, intermediate_size=128,
        num_attention_heads=4, head_dim=16, num_key_value_heads=1, rms_norm_eps=1e-4,
        sliding_window=16, sliding_window_pattern=2, vocab_size=VOCAB,
    ),
    "gemma3n": dict(
        num_hidden_layers=4, vocab_size=VOCAB,
        text_config=dict(
            model_type="gemma3n", hidden_size=64, num_hidden_layers=4, intermediate_size=64,
            num_attention_heads=4, head_dim=16, rms_norm_eps=1e-05, vocab_size=VOCAB,
            num_key_value_heads=2, num_kv_shared_layers=2, vocab_size_per_layer_input=VOCAB,
            sliding_window=8, max_position_embeddings=1000, rope_local_base_freq=1.0, rope_theta=1000.0,
            final_logit_softcapping=1.0,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            activation_sparsity_pattern=[0.5, 0.5, 0.5, 0.5], hidden_size_per_layer_input=16,
            altup_num_inputs=4, altup_coef_clip=1.0, altup_correct_scale=True, altup_active_idx=0,
            laurel_rank=8,
        ),
    ),
    "gemma4": dict(
        vocab_size=VOCAB,
        text_config=dict(
            model_type="gemma4_text", hidden_size=64, num_hidden_layers=4, intermediate_size=64,
            num_attention_heads=4, head_dim=16, global_head_dim=32, rms_norm_eps=1e-06,
            vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB, num_key_value_heads=1,
            num_kv_shared_layers=2, hidden_size_per_layer_input=16, sliding_window=16,
            sliding_window_pattern=2, final_logit_softcapping=30.0,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            rope_parameters=dict(
                full_attention=dict(partial_rotary_factor=0.25, rope_theta=1000000.0),
                sliding_attention=dict(rope_theta=10000.0),
            ),
        ),
    ),
    "gemma4_text": dict(
        hidden_size=64, num_hidden_layers=4, intermediate_size=64, num_attention_heads=4, head_dim=16,
        global_head_dim=32, rms_norm_eps=1e-06, vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB,
        num_key_value_heads=1, num_kv_shared_layers=2, hidden_size_per_layer_input=16,
        sliding_window=16, sliding_window_pattern=2, final_logit_softcapping=30.0,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        rope_parameters=dict(
            full_attention=dict(partial_rotary_factor=0.25, rope_theta=1000000.0),
            sliding_attention=dict(rope_theta=10000.0),
        ),
    ),
    "glm": dict(
        hidden_size=64, num_hidden_layers=4, intermediate_size=64, num_attention_heads=4,
        rms_norm_eps=1e-05, vocab_size=VOCAB, head_dim=16, num_key_value_heads=2,
    ),
    "glm4": dict(
        hidden_size=64, num_hidden_layers=4, intermediate_size=64, num_attention_heads=4,
        attention_bias=False, head_dim=16, rms_norm_eps=1e-05, vocab_size=VOCAB, num_key_value_heads=2,
        partial_rotary_factor=0.5, rope_theta=1000,
    ),
    "glm4_moe": dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, max_position_embeddings=1000,
        moe_intermediate_size=64, norm_topk_prob=True, num_attention_heads=4, n_group=2, head_dim=16,
        topk_group=1, n_shared_experts=1, n_routed_experts=4, routed_scaling_factor=1.0,
        num_experts_per_tok=2, first_k_dense_replace=1, num_hidden_layers=4, num_key_value_heads=2,
        rms_norm_eps=1e-05, rope_theta=1000, rope_scaling=None, use_qk_norm=True,
        tie_word_embeddings=False, attention_bias=False, partial_rotary_factor=0.5,
    ),
    "glm4_moe_lite": dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=4, routed_scaling_factor=1.0, kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=8, topk_method="noaux_tc", scoring_func="sigmoid",
        norm_topk_prob=True, n_group=1, topk_group=1, num_experts_per_tok=2, moe_layer_freq=1,
        first_k_dense_replace=1, max_position_embeddings=256, rms_norm_eps=1e-05, rope_theta=1000,
        rope_scaling=None, attention_bias=False, partial_rotary_factor=1.0, tie_word_embeddings=False,
        num_nextn_predict_layers=1,
    ),
    # no 'num_attention_heads' in its config: sized from the probe
    "glm_moe_dsa": dict(
        vocab_size=VOCAB, hidden_size=64, index_head_dim=16, index_n_heads=2, index_topk=8,
        intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4,
        routed_scaling_factor=1.0, topk_method="noaux_tc", scoring_func="sigmoid",
        norm_topk_prob=True, n_group=1, topk_group=1, num_experts_per_tok=2, moe_layer_freq=1,
        first_k_dense_replace=1, max_position_embeddings=1000, rms_norm_eps=1e-5,
        rope_parameters=dict(rope_theta=1000.0, rope_type="default"), attention_bias=False,
        **_MLA,
    ),
    "gpt2": dict(
        n_ctx=256, n_embd=64, n_head=4, n_layer=2, n_positions=256,
        layer_norm_epsilon=1e-5, vocab_size=VOCAB,
    ),
    "gpt_bigcode": dict(
        n_embd=64, n_layer=4, n_inner=64, n_head=4, n_positions=1000, layer_norm_epsilon=1e-05,
        vocab_size=VOCAB,
    ),
    "gpt_neox": dict(
        max_position_embeddings=2048, hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
        layer_norm_eps=1e-05, vocab_size=VOCAB, rotary_emb_base=10000, rotary_pct=0.25,
    ),
    # sinks + sliding window, mixture of experts
    "gpt_oss": dict(
        hidden_size=64, num_hidden_layers=2, intermediate_size=64,
        head_dim=16, num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=16, rope_theta=10000, vocab_size=VOCAB,
        layer_types=["sliding_attention", "full_attention"],
    ),
    "gptj": dict(n_embd=64, vocab_size=VOCAB, n_positions=256, n_head=4, rotary_dim=8, n_layer=2),
    "granite": dict(
        hidden_size=64, num_hidden_layers=4, intermediate_size=64, num_attention_heads=4,
        rms_norm_eps=1e-05, vocab_size=VOCAB, logits_scaling=1.0, attention_multiplier=1.0,
        embedding_multiplier=1.0, residual_multiplier=1.0, max_position_embeddings=1000,
        num_key_value_heads=2, attention_bias=False, mlp_bias=False, rope_theta=1000,
    ),
    "granitemoe": dict(
        hidden_size=64, num_hidden_layers=4, intermediate_size=64, num_attention_heads=4,
        rms_norm_eps=1e-05, vocab_size=VOCAB, logits_scaling=1.0, attention_multiplier=1.0,
        embedding_multiplier=1.0, residual_multiplier=1.0, max_position_embeddings=1000,
        num_key_value_heads=2, attention_bias=False, rope_theta=1000, num_local_experts=4,
        num_experts_per_tok=2,
    ),
    "granitemoehybrid": dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=4,
        max_position_embeddings=1000, num_attention_heads=8, num_key_value_heads=4, attention_bias=False,
        embedding_multiplier=1.0, attention_multiplier=1.0, logits_scaling=1.0, residual_multiplier=1.0,
        num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=64, mamba_n_heads=8,
        mamba_d_head=16, mamba_proj_bias=False, mamba_d_state=16, mamba_d_conv=4, mamba_n_groups=1,
        mamba_conv_bias=False, layer_types=["mamba", "attention", "mamba", "attention"],
        rms_norm_eps=1e-05, rope_theta=1000.0,
    ),
    "helium": dict(
        hidden_size=64, num_hidden_layers=4, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-05, vocab_size=VOCAB, attention_bias=False, head_dim=16,
        max_position_embeddings=1000, mlp_bias=False, rope_theta=1000, tie_word_embeddings=False,
    ),
    "hunyuan": dict(
        hidden_size=64, attention_bias=False, intermediate_size=64, num_attention_heads=4,
        num_hidden_layers=4, num_key_value_heads=2, rms_norm_eps=0.0001, rope_theta=1000, vocab_size=VOCAB,
        moe_topk=2, num_experts=2, num_shared_expert=1, use_mixed_mlp_moe=True, use_qk_norm=True,
        rope_scaling=dict(alpha=1000.0, factor=1.0, type="dynamic"), use_cla=True, cla_share_factor=2,
    ),
    "hunyuan_v1_dense": dict(
        hidden_size=64, attention_bias=False, intermediate_size=64, num_attention_heads=4,
        num_hidden_layers=4, num_key_value_heads=2, rms_norm_eps=0.0001, rope_theta=1000, vocab_size=VOCAB,
        use_qk_norm=True,
        rope_scaling=dict(
            alpha=1000.0, factor=1.0, type="dynamic", beta_fast=32, beta_slow=1, mscale=1.0,
            mscale_all_dim=0.0, original_max_position_embeddings=8192,
        ),
        max_position_embeddings=32768,
    ),
    "internlm2": dict(
        hidden_size=64, num_hidden_layers=4, intermediate_size=64, num_attention_heads=4,
        rms_norm_eps=1e-05, vocab_size=VOCAB,
    ),
    "internlm3": dict(
        hidden_size=64, num_hidden_layers=4, intermediate_size=64, num_attention_heads=4,
        rms_norm_eps=1e-05, vocab_size=VOCAB,
    ),
    "iquestloopcoder": dict(
        hidden_size=64, num_hidden_layers=2, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-05, head_dim=16, vocab_size=VOCAB, rope_theta=500000.0,
        tie_word_embeddings=False, loop_num=2, loop_window_size=16,
    ),
    "jamba": dict(
        hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, attn_layer_offset=1, attn_layer_period=2, expert_layer_offset=1,
        expert_layer_period=2, mamba_d_conv=4, mamba_d_state=16, mamba_expand=2, num_experts=4,
        num_experts_per_tok=2, rms_norm_eps=1e-05, max_position_embeddings=1000, vocab_size=VOCAB,
    ),
    "kimi_k25": dict(
        text_config=dict(
            model_type="deepseek_v3", vocab_size=VOCAB, hidden_size=64, intermediate_size=64,
            moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=4, n_routed_experts=4, n_group=2, topk_group=1,
            num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, **_MLA,
        ),
    ),
    "kimi_k3": dict(
        text_config=dict(
            model_type="kimi_linear", vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=4, intermediate_size=64,
            linear_attn_config=dict(num_heads=4, head_dim=16, short_conv_kernel_size=3,
                                    kda_layers=[1, 3]),
            num_experts=4, num_experts_per_token=2, num_shared_experts=1,
            moe_intermediate_size=32, first_k_dense_replace=1, **_MLA,
        ),
    ),
    "kimi_linear": dict(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, intermediate_size=64, head_dim=16, rope_theta=100.0, rms_norm_eps=1e-06,
        linear_attn_config=dict(num_heads=8, head_dim=16, kda_layers=[1]), model_max_length=1000,
        num_experts=2, moe_intermediate_size=64, kv_lora_rank=8, qk_nope_head_dim=16,
        qk_rope_head_dim=16, v_head_dim=16,
    ),
    "kimi_vl": dict(
        text_config=dict(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=64, moe_intermediate_size=64,
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, n_shared_experts=1,
            n_routed_experts=4, kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16,
            qk_nope_head_dim=16,
        ),
        num_hidden_layers=4, vocab_size=VOCAB,
    ),
    "Klear": dict(
        hidden_size=64, num_hidden_layers=4, intermediate_size=64, num_attention_heads=4,
        attention_bias=False, mlp_only_layers=[0], num_experts=4, num_experts_per_tok=2,
        decoder_sparse_step=2, n_shared_experts=1, moe_intermediate_size=64, rms_norm_eps=1e-05,
        vocab_size=VOCAB, num_key_value_heads=4, rope_theta=1000.0, max_position_embeddings=1000,
        norm_topk_prob=True,
    ),
    "laguna": dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-06, sliding_window=4,
        partial_rotary_factor=0.5, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
        shared_expert_intermediate_size=64, moe_routed_scaling_factor=2.5,
        moe_router_score_func="sqrtsoftplus",
        layer_types=["full_attention", "sliding_attention", "sliding_attention", "sliding_attention"],
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        num_attention_heads_per_layer=[4, 4, 4, 4],
        rope_parameters=dict(
            full_attention=dict(
                rope_type="yarn", rope_theta=500000.0, factor=8.0, original_max_position_embeddings=4096,
                beta_slow=1.0, beta_fast=32.0, partial_rotary_factor=0.5,
            ),
            sliding_attention=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=1.0),
        ),
    ),
    "lfm2": dict(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        norm_eps=1e-05, vocab_size=VOCAB, full_attn_idxs=[0, 2], rope_theta=10000, block_dim=64,
        block_ffn_dim_multiplier=1.5, block_auto_adjust_ff_dim=True, block_ff_dim=64,
        block_multiple_of=16, max_position_embeddings=1000, conv_bias=True, conv_L_cache=3,
    ),
    "lfm2-vl": dict(
        vocab_size=VOCAB, num_hidden_layers=4,
        text_config=dict(
            model_type="lfm2", vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1000, norm_eps=1e-05,
            conv_bias=False, conv_L_cache=3, block_dim=64, block_ff_dim=64, block_multiple_of=4,
            block_ffn_dim_multiplier=2, block_auto_adjust_ff_dim=True,
            layer_types=["full_attention", "", "full_attention", ""], rope_theta=1000,
        ),
    ),
    "lfm2_moe": dict(
        hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, norm_eps=1e-05, vocab_size=VOCAB, full_attn_idxs=[0, 1, 2],
        rope_theta=10000, max_position_embeddings=1000, conv_bias=True, conv_L_cache=3,
        moe_intermediate_size=64, num_dense_layers=2, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True, use_expert_bias=True,
    ),
    "lille-130m": dict(
        block_size=128, num_hidden_layers=4, n_layer=4, n_head=4, n_kv_heads=4, n_embd=64,
        vocab_size=VOCAB, rope_theta=1000, layer_norm_eps=1e-05,
    ),
    "llama": dict(
        hidden_size=64, num_hidden_layers=4, intermediate_size=64, num_attention_heads=8,
        num_key_value_heads=4, rms_norm_eps=1e-05, vocab_size=VOCAB, sliding_window=4,
        layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
        tie_word_embeddings=False, rope_theta=10000.0,
    ),
    # chunked local attention (ChunkedKVCache, no `merge`) beside full attention
    "llama4": dict(
        num_hidden_layers=4, vocab_size=VOCAB,
        text_config=dict(
            attention_bias=False, attention_chunk_size=8, head_dim=16, hidden_size=64,
            interleave_moe_layer_step=2, intermediate_size=64, intermediate_size_mlp=64,
            max_position_embeddings=1000, model_type="llama4", num_attention_heads=4,
            num_experts_per_tok=1, num_hidden_layers=4, num_key_value_heads=2,
            num_local_experts=2, rms_norm_eps=1e-4, rope_scaling=None, rope_theta=1000,
            use_qk_norm=True, vocab_size=VOCAB,
        ),
    ),
    "llama4_text": dict(
        hidden_size=64, num_hidden_layers=4, intermediate_size=64, num_attention_heads=4,
        rms_norm_eps=1e-05, vocab_size=VOCAB, head_dim=8, num_key_value_heads=2, intermediate_size_mlp=64,
        rope_theta=1000.0, tie_word_embeddings=False, no_rope_layers=[0, 0, 1, 1], use_qk_norm=True,
    ),
    "longcat_flash": dict(
        attention_method="MLA", zero_expert_type="identity", hidden_size=64, ffn_hidden_size=64,
        moe_topk=2, expert_ffn_hidden_size=64, n_routed_experts=2, zero_expert_num=2, num_layers=4,
        num_hidden_layers=4, vocab_size=VOCAB, max_position_embeddings=1000, num_attention_heads=4,
        kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
        routed_scaling_factor=1.0, rms_norm_eps=1e-05, rope_theta=1000, mla_scale_q_lora=True,
        mla_scale_kv_lora=True, attention_bias=False,
    ),
    "longcat_flash_ngram": dict(
        attention_method="MLA", zero_expert_type="identity", hidden_size=64, ffn_hidden_size=64,
        moe_topk=2, expert_ffn_hidden_size=64, n_routed_experts=2, zero_expert_num=2, num_layers=4,
        num_hidden_layers=4, vocab_size=VOCAB, max_position_embeddings=1000, num_attention_heads=4,
        kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
        routed_scaling_factor=1.0, rms_norm_eps=1e-05, rope_theta=1000, mla_scale_q_lora=True,
        mla_scale_kv_lora=True, attention_bias=False,
    ),
    "mamba": dict(
        vocab_size=VOCAB, use_bias=False, use_conv_bias=True, conv_kernel=4, hidden_size=64,
        num_hidden_layers=4, state_size=16, intermediate_size=64, time_step_rank=48,
    ),
    # pure state-space model: no attention at all
    "mamba2": dict(
        num_heads=4, head_dim=16, vocab_size=VOCAB, hidden_size=32,
        intermediate_size=64, state_size=16, num_hidden_layers=2, layer_norm_epsilon=1e-4,
        conv_kernel=3, n_groups=2, use_bias=False, use_conv_bias=False,
        tie_word_embeddings=True, time_step_limit=(0.01, 10), time_step_rank="auto",
    ),
    "mellum": dict(
        hidden_size=64, num_hidden_layers=4, intermediate_size=64, num_attention_heads=4,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, rms_norm_eps=1e-5,
        vocab_size=VOCAB, num_key_value_heads=2, head_dim=16, tie_word_embeddings=False,
        max_position_embeddings=1000, norm_topk_prob=True, sliding_window=16,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        rope_parameters=dict(
            sliding_attention=dict(rope_theta=1000.0, rope_type="default"),
            full_attention=dict(rope_theta=10000.0, rope_type="default"),
        ),
    ),
    "mimo": dict(
        hidden_size=64, num_hidden_layers=4, intermediate_size=64, num_attention_heads=4,
        rms_norm_eps=1e-05, vocab_size=VOCAB, num_key_value_heads=2,
    ),
    "mimo_v2_flash": dict(
        num_experts_per_tok=2, hybrid_layer_pattern=[0, 1, 0, 1], moe_layer_freq=[0, 1, 0, 1],
        add_swa_attention_sink_bias=True, add_full_attention_sink_bias=False, sliding_window_size=16,
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, moe_intermediate_size=64,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, n_shared_experts=1,
        n_routed_experts=4, routed_scaling_factor=None, topk_method="noaux_tc", scoring_func="sigmoid",
        norm_topk_prob=True, n_group=2, topk_group=1, max_position_embeddings=1000,
        layernorm_epsilon=1e-05, rope_theta=1000.0, swa_rope_theta=1000.0, swa_num_attention_heads=4,
        swa_num_key_value_heads=2, head_dim=16, v_head_dim=16, swa_head_dim=16, swa_v_head_dim=16,
        partial_rotary_factor=0.5,
    ),
    "minicpm": dict(
        hidden_size=64, dim_model_base=32, num_hidden_layers=4, intermediate_size=64,
        num_attention_heads=4, rms_norm_eps=0.0001, vocab_size=VOCAB, num_key_value_heads=2,
        scale_depth=1.0, scale_emb=1.0,
    ),
    "minicpm3": dict(
        hidden_size=64, dim_model_base=32, num_hidden_layers=2, intermediate_size=64,
        num_attention_heads=4, rms_norm_eps=1e-5, vocab_size=VOCAB, num_key_value_heads=4,
        q_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, kv_lora_rank=8, scale_depth=1.4,
        scale_emb=1.0, max_position_embeddings=1000,
        rope_scaling=dict(original_max_position_embeddings=1000),
    ),
    "minimax": dict(
        hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=1000, num_experts_per_tok=2, num_local_experts=4,
        shared_intermediate_size=64, num_hidden_layers=4, rms_norm_eps=0.0001, rope_theta=1000,
        rotary_dim=16, vocab_size=VOCAB,
    ),
    "minimax_m3_vl": dict(
        text_config=dict(
            hidden_size=64, intermediate_size=32, dense_intermediate_size=64,
            shared_intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
            num_hidden_layers=4, num_local_experts=4, num_experts_per_tok=2, head_dim=16,
            vocab_size=VOCAB, moe_layer_freq=[0, 1, 1, 1], sparse_attention_freq=[0, 1, 0, 1],
            index_n_heads=2, index_head_dim=16, index_block_size=4, index_topk_blocks=2,
        ),
    ),
    "ministral3": dict(
        hidden_size=64, num_hidden_layers=4, intermediate_size=64, num_attention_heads=4,
        rms_norm_eps=1e-5, vocab_size=VOCAB, head_dim=16, num_key_value_heads=2,
        max_position_embeddings=1000, sliding_window=16,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        rope_parameters=_MISTRAL_ROPE,
    ),
    "mistral3": dict(
        text_config=dict(
            model_type="ministral3", hidden_size=64, num_hidden_layers=2, intermediate_size=64,
            num_attention_heads=4, rms_norm_eps=1e-5, vocab_size=VOCAB, head_dim=16,
            num_key_value_heads=2, max_position_embeddings=1000,
            rope_parameters=_MISTRAL_ROPE,
        ),
    ),
    "mistral4": dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=4, routed_scaling_factor=1.0, norm_topk_prob=True,
        max_position_embeddings=1000, rms_norm_eps=1e-5, topk_group=1, num_experts_per_tok=2,
        first_k_dense_replace=1, n_group=1, rope_parameters=_MISTRAL_ROPE, **_MLA,
    ),
    "mixtral": dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_experts_per_tok=2, num_key_value_heads=2, num_local_experts=4,
    ),
    "muse_glimmer": dict(
        hidden_size=64, num_hidden_layers=4, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, sliding_window=16,
    ),
    "muse_spark": dict(
        text_config=dict(
            hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            num_hidden_layers=4, vocab_size=VOCAB, rms_norm_eps=1e-5, post_norm_eps=1e-8,
            rope_parameters=dict(rope_theta=1000.0), layer_rope_theta=[1000.0, 0, 1000.0, 0],
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            sliding_window=16, final_logit_softcapping=20.0, output_multiplier=0.5,
            num_local_experts=4, num_experts_per_tok=2, moe_hidden_size=64,
            moe_intermediate_size=32,
        ),
    ),
    "nanbeige": dict(
        hidden_size=64, num_hidden_layers=2, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=VOCAB, num_loops=2,
    ),
    "nanochat": dict(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, intermediate_size=64,
    ),
    "nemotron": dict(
        hidden_size=64, hidden_act="gelu", num_hidden_layers=4, intermediate_size=64,
        num_attention_heads=4, norm_eps=1e-05, vocab_size=VOCAB, num_key_value_heads=2,
    ),
    "nemotron-nas": dict(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, rms_norm_eps=1e-5,
        vocab_size=VOCAB,
        block_configs=[
            dict(attention=dict(n_heads_in_group=2), ffn=dict(ffn_mult=1.0)),
            dict(attention=dict(no_op=True), ffn=dict(ffn_mult=1.0)),
            dict(attention=dict(replace_with_linear=True), ffn=dict(no_op=True)),
            dict(attention=dict(n_heads_in_group=4), ffn=dict(replace_with_linear=True)),
        ],
    ),
    "nemotron_h": dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=4,
        max_position_embeddings=1000, num_attention_heads=8, num_key_value_heads=4, attention_bias=False,
        mamba_num_heads=8, mamba_head_dim=64, mamba_proj_bias=False, ssm_state_size=16, conv_kernel=3,
        n_groups=4, time_step_limit=[1.0, 2.0], mlp_bias=False, layer_norm_epsilon=0.0001,
        rms_norm_eps=1e-05, use_bias=True, use_conv_bias=True, residual_in_fp32=True,
        hybrid_override_pattern=["*", "M", "*", "M"],
    ),
    "olmo": dict(
        d_model=64, n_layers=2, mlp_hidden_size=128, n_heads=4, vocab_size=VOCAB, embedding_size=VOCAB,
    ),
    "olmo2": dict(
        hidden_size=64, attention_bias=False, intermediate_size=64, num_attention_heads=4,
        num_hidden_layers=4, num_key_value_heads=2, rms_norm_eps=0.0001, rope_theta=1000, vocab_size=VOCAB,
    ),
    "olmo3": dict(
        num_heads=8, head_dim=16, vocab_size=VOCAB, hidden_size=64, intermediate_size=64,
        num_attention_heads=8, rope_theta=1000, num_hidden_layers=4, rms_norm_eps=0.0001,
        sliding_window=16, tie_word_embeddings=True, max_position_embeddings=1000,
    ),
    "olmo_hybrid": dict(
        hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=VOCAB, max_position_embeddings=1000,
        linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=3, linear_allow_neg_eigval=True,
        tie_word_embeddings=False, attention_bias=False,
    ),
    "olmoe": dict(
        hidden_size=64, num_hidden_layers=4, intermediate_size=64, num_attention_heads=2,
        rms_norm_eps=1e-05, vocab_size=VOCAB, num_experts=4, num_experts_per_tok=2,
    ),
    "openelm": dict(
        head_dim=16, num_transformer_layers=2, model_dim=64, vocab_size=VOCAB, ffn_dim_divisor=16,
        num_query_heads=[4, 4], num_kv_heads=[1, 2], ffn_multipliers=[0.5, 1.0],
    ),
    "phi": dict(
        max_position_embeddings=256, vocab_size=VOCAB, hidden_size=64, num_attention_heads=4,
        num_hidden_layers=2, num_key_value_heads=4, intermediate_size=64,
    ),
    "phi3": dict(
        hidden_size=64, num_hidden_layers=4, intermediate_size=64, num_attention_heads=32,
        rms_norm_eps=1e-05, vocab_size=VOCAB,
    ),
    "phi3small": dict(
        hidden_size=64, dense_attention_every_n_layers=2, ff_intermediate_size=64, gegelu_limit=1.0,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, layer_norm_epsilon=0.0001,
        vocab_size=VOCAB,
    ),
    "phimoe": dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        rope_scaling=dict(
            long_factor=[1.0] * 8, short_factor=[1.0] * 8, long_mscale=1.0, short_mscale=1.0,
            original_max_position_embeddings=4096, type="longrope",
        ),
    ),
    "phixtral": dict(num_vocab=VOCAB, model_dim=64, num_heads=4, num_layers=2, rotary_dim=8,
                     num_experts_per_tok=2, num_local_experts=4),
    "pixtral": dict(
        text_config=dict(
            model_type="llama", hidden_size=64, num_hidden_layers=4, intermediate_size=64,
            num_attention_heads=4, rms_norm_eps=1e-05, vocab_size=VOCAB,
        ),
        num_hidden_layers=4, vocab_size=VOCAB,
    ),
    "plamo": dict(
        hidden_size=64, num_hidden_layers=4, intermediate_size=64, num_attention_heads=8,
        rms_norm_eps=1e-05, vocab_size=VOCAB,
    ),
    "plamo2": dict(
        hidden_size=64, num_hidden_layers=4, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, hidden_size_per_head=16, rms_norm_eps=1e-05, vocab_size=VOCAB,
        attention_window_size=16, mamba_d_state=16, mamba_num_heads=4, mamba_chunk_size=16,
    ),
    "plamo3": dict(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, max_position_embeddings=1000, sliding_window=16, sliding_window_pattern=2,
        intermediate_size=64, vocab_size=VOCAB,
    ),
    "prism_hadamard_qwen35": dict(
        schema_version=1, tensor_namespace="mlx-lm-text",
        quantization=dict(bits=2, group_size=128, mode="affine"),
        modules=[dict(path="model.layers.1.mlp.down_proj", embedding=False, dtype="float16", block=0)],
        text_config=dict(
            model_type="qwen3_5", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
            num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
            linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=16,
            linear_value_head_dim=16, linear_conv_kernel_dim=3, rms_norm_eps=1e-5, head_dim=16,
            rope_theta=1000.0, partial_rotary_factor=0.5, max_position_embeddings=1000,
            full_attention_interval=2,
        ),
    ),
    "qwen": dict(
        hidden_size=64, num_attention_heads=4, num_hidden_layers=2, kv_channels=16,
        intermediate_size=128, vocab_size=VOCAB,
    ),
    "qwen2": dict(
        hidden_size=64, num_hidden_layers=4, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=4, rms_norm_eps=1e-05, vocab_size=VOCAB,
    ),
    "qwen2_moe": dict(
        hidden_size=64, num_hidden_layers=4, intermediate_size=64, num_attention_heads=4,
        rms_norm_eps=1e-05, vocab_size=VOCAB, num_experts_per_tok=2, num_experts=4,
        moe_intermediate_size=64, shared_expert_intermediate_size=64,
    ),
    "qwen2_vl": dict(
        text_config=dict(
            model_type="qwen2", hidden_size=64, num_hidden_layers=2, intermediate_size=64,
            num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=VOCAB,
        ),
    ),
    "qwen3": dict(
        hidden_size=64, num_hidden_layers=4, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=4, rms_norm_eps=1e-05, vocab_size=VOCAB, head_dim=16,
        max_position_embeddings=4096, tie_word_embeddings=False, rope_theta=1000,
    ),
    "qwen3_5": dict(
        hidden_size=64, num_hidden_layers=4, intermediate_size=64, num_attention_heads=8,
        num_key_value_heads=4, vocab_size=VOCAB, linear_num_value_heads=4, linear_num_key_heads=4,
        linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=3, rms_norm_eps=1e-05,
        head_dim=16, rope_theta=1000.0, partial_rotary_factor=0.5, max_position_embeddings=1000,
    ),
    "qwen3_5_moe": dict(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
        vocab_size=VOCAB, linear_num_value_heads=4, linear_num_key_heads=4, linear_key_head_dim=32,
        linear_value_head_dim=32, linear_conv_kernel_dim=3, num_experts=4, num_experts_per_tok=2,
        shared_expert_intermediate_size=64, moe_intermediate_size=64, rms_norm_eps=1e-05, head_dim=16,
        rope_theta=1000.0, partial_rotary_factor=0.5, max_position_embeddings=1000,
    ),
    "qwen3_moe": dict(
        hidden_size=64, num_hidden_layers=4, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=4, rms_norm_eps=1e-05, head_dim=16, vocab_size=VOCAB, decoder_sparse_step=1,
        mlp_only_layers=[], num_experts_per_tok=2, num_experts=4, moe_intermediate_size=64,
        rope_theta=1000, max_position_embeddings=4096, tie_word_embeddings=False, norm_topk_prob=True,
    ),
    # gated delta-net state (ArraysCache) every layer but the last, attention in the last
    "qwen3_next": dict(
        hidden_size=64, num_hidden_layers=4, intermediate_size=64,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
        linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=3, num_experts=4,
        num_experts_per_tok=2, decoder_sparse_step=1, shared_expert_intermediate_size=64,
        mlp_only_layers=[0], moe_intermediate_size=64, rms_norm_eps=1e-5, head_dim=16,
        rope_theta=1000.0, partial_rotary_factor=0.5, max_position_embeddings=1000,
        full_attention_interval=4,
    ),
    "qwen3_vl": dict(
        text_config=dict(
            model_type="qwen3", hidden_size=64, num_hidden_layers=4, intermediate_size=64,
            num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-05, vocab_size=VOCAB,
            head_dim=16, max_position_embeddings=1000, tie_word_embeddings=False, rope_theta=1000,
        ),
        num_hidden_layers=4, vocab_size=VOCAB,
    ),
    "qwen3_vl_moe": dict(
        text_config=dict(
            model_type="qwen3_moe", hidden_size=64, num_hidden_layers=4, intermediate_size=64,
            num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-05, head_dim=16,
            vocab_size=VOCAB, decoder_sparse_step=1, mlp_only_layers=[], num_experts_per_tok=2,
            num_experts=4, moe_intermediate_size=64, rope_theta=1000, max_position_embeddings=1000,
            tie_word_embeddings=False, norm_topk_prob=True,
        ),
        num_hidden_layers=4, vocab_size=VOCAB,
    ),
    "recurrent_gemma": dict(
        hidden_size=64, attention_bias=False, conv1d_width=3, intermediate_size=64, logits_soft_cap=1.0,
        num_attention_heads=4, num_hidden_layers=4, num_key_value_heads=2, rms_norm_eps=0.0001,
        rope_theta=1000, attention_window_size=16, vocab_size=VOCAB,
        block_types=["recurrent", "recurrent", "attention"],
    ),
    "rwkv7": dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, norm_eps=1e-05, head_dim=16,
        num_hidden_layers=4, a_low_rank_dim=16, v_low_rank_dim=16, gate_low_rank_dim=16,
        decay_low_rank_dim=16,
    ),
    "seed_oss": dict(
        hidden_size=64, num_hidden_layers=4, intermediate_size=64, num_attention_heads=2,
        rms_norm_eps=1e-05, vocab_size=VOCAB, num_key_value_heads=2, head_dim=16,
    ),
    "smollm3": dict(
        hidden_size=64, num_hidden_layers=4, intermediate_size=64, num_attention_heads=4,
        rms_norm_eps=1e-05, vocab_size=VOCAB,
    ),
    "solar_open": dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        n_shared_experts=1, n_routed_experts=4, routed_scaling_factor=1.0, num_experts_per_tok=2,
        first_k_dense_replace=1, norm_topk_prob=True, max_position_embeddings=1000,
        rms_norm_eps=1e-5, rope_theta=1000.0, tie_word_embeddings=False, partial_rotary_factor=0.5,
    ),
    "spark2_5": dict(
        hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=VOCAB, sliding_window=16,
        rope_parameters=dict(
            sliding_attention=dict(rope_theta=1000.0, rope_type="default"),
            full_attention=dict(rope_theta=10000.0, rope_type="default"),
        ),
    ),
    "stablelm": dict(
        vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_hidden_layers=4,
        num_key_value_heads=2, partial_rotary_factor=1.0, intermediate_size=64, layer_norm_eps=0.01,
        rope_theta=10000, use_qkv_bias=False,
    ),
    "starcoder2": dict(
        hidden_size=64, num_hidden_layers=4, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=4,
    ),
    "step3p5": dict(
        hidden_size=64, num_hidden_layers=4, vocab_size=VOCAB, num_attention_heads=4,
        num_attention_groups=2, head_dim=16, intermediate_size=64, rms_norm_eps=1e-05,
        rope_theta=[10000.0, 10000.0, 10000.0, 10000.0], sliding_window=16,
        layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
        partial_rotary_factors=[0.5, 1.0, 1.0, 0.5],
        attention_other_setting=dict(num_attention_heads=8, num_attention_groups=2),
        use_head_wise_attn_gate=True, moe_num_experts=4, moe_top_k=2, moe_intermediate_size=64,
        share_expert_dim=64, moe_layers_enum="1,2,3",
    ),
    "talkie": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, head_dim=16,
                   intermediate_size=64, vocab_size=VOCAB),
    "telechat3": dict(
        hidden_size=64, num_hidden_layers=4, intermediate_size=64, num_attention_heads=8,
        num_key_value_heads=4, rms_norm_eps=1e-05, vocab_size=VOCAB, rope_theta=10000.0,
        max_position_embeddings=1000,
    ),
    "youtu_llm": dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
    ),
}

CONFIGS: dict[str, dict[str, Any]] = {
    name: {"model_type": name, **config} for name, config in _CONFIGS.items()
}


def build(name: str, *, evaluate: bool = True, seed: int = 0) -> Any:
    """The tiny model `name`, float32; its parameters evaluated unless `evaluate` is False."""
    if name == "olmo":  # its module only checks that ai2-olmo is installed; nothing uses it
        sys.modules.setdefault("hf_olmo", types.ModuleType("hf_olmo"))
    arch = importlib.import_module(f"mlx_lm.models.{name}")
    mx.random.seed(seed)
    model = arch.Model(arch.ModelArgs.from_dict(CONFIGS[name]))
    if name == "phi3small":  # it masks tokenizer ids past 100255: the last few of ours instead
        model._dummy_tokenizer_ids = mx.arange(VOCAB - 4, VOCAB)
    if evaluate:
        model.update(tree_map(_float32, model.parameters()))
        mx.eval(model.parameters())
    return model


def _float32(p: mx.array) -> mx.array:
    return p.astype(mx.float32) * 1.0 if mx.issubdtype(p.dtype, mx.floating) else p


def loaded(name: str) -> Any:
    """The tiny model `name` as the engine's LoadedModel (no tokenizer, CPU, its caches probed)."""
    from engine import LoadedModel
    from engine.cache_layout import geometry_for, probe_cache_layout

    model = build(name)
    layout = probe_cache_layout(model, weights_loaded=True)
    return LoadedModel(model=model, tokenizer=None, model_id=name, path="",
                       geometry=geometry_for(model, layout), backend="cpu",
                       context_length=4096, weight_bytes=0, layout=layout)
