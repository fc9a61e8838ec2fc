"""Tiny random-init models of the causal-LM families people train in 2025-2026, made locally with
transformers' own config classes (nothing from the Hub): byte-tokenizer vocabulary, 2-4 layers,
hidden size 64. Each entry says what it brings that a Llama-like model does not.

Hybrids get one layer of each kind they have (an attention layer and a recurrent/convolutional one);
MoE families get a sparse layer (DeepSeek-V3 and GLM-4-MoE also a dense first layer)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (AutoModelForCausalLM, DeepseekV3Config, FalconH1Config, Gemma3TextConfig,
                          Glm4MoeConfig, GptOssConfig, GraniteConfig, GraniteMoeHybridConfig,
                          JambaConfig, Lfm2Config, MiniMaxConfig, Olmo3Config, Qwen3Config,
                          Qwen3MoeConfig, Qwen3NextConfig, SmolLM3Config)

VOCAB = 259  # the byte-level tokenizer
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)

# name -> (what it brings, config factory)
FAMILIES = {
    "qwen3": ("q/k norms, grouped-query attention",
              lambda: Qwen3Config(**COMMON, num_hidden_layers=2, intermediate_size=128, head_dim=16,
                                  tie_word_embeddings=True)),
    "smollm3": ("rotary skipped on every 4th layer (NoPE)",
                lambda: SmolLM3Config(**COMMON, num_hidden_layers=4, intermediate_size=128,
                                      tie_word_embeddings=True)),
    "olmo3": ("sliding-window and full attention layers, post-norms",
              lambda: Olmo3Config(**COMMON, num_hidden_layers=2, intermediate_size=128, sliding_window=16,
                                  layer_types=["sliding_attention", "full_attention"],
                                  tie_word_embeddings=False)),
    "gemma3": ("embedding scaled by sqrt(hidden), sliding/full layers with their own rotary, "
               "final-logit soft-capping, tied head",
               lambda: Gemma3TextConfig(**COMMON, num_hidden_layers=2, intermediate_size=128, head_dim=16,
                                        sliding_window=16, layer_types=["sliding_attention", "full_attention"],
                                        final_logit_softcapping=30.0, tie_word_embeddings=True)),
    "granite": ("embedding, residual, attention multipliers and logits scaling",
                lambda: GraniteConfig(**COMMON, num_hidden_layers=2, intermediate_size=128,
                                      embedding_multiplier=12.0, logits_scaling=8.0, residual_multiplier=0.22,
                                      attention_multiplier=0.0625, tie_word_embeddings=True)),
    "qwen3_moe": ("sparse MoE with a load-balancing loss",
                  lambda: Qwen3MoeConfig(**COMMON, num_hidden_layers=2, intermediate_size=128, head_dim=16,
                                         moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                                         tie_word_embeddings=False)),
    "deepseek_v3": ("multi-head latent attention (MLA), aux-loss-free router with a correction bias, "
                    "shared expert, a dense first layer",
                    lambda: DeepseekV3Config(**{**COMMON, "num_key_value_heads": 4}, num_hidden_layers=2,
                                             intermediate_size=128,
                                             moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1,
                                             num_experts_per_tok=2, n_group=1, topk_group=1,
                                             first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24,
                                             qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                                             tie_word_embeddings=False)),
    "glm4_moe": ("sigmoid router with a correction bias, shared expert, a dense first layer",
                 lambda: Glm4MoeConfig(**COMMON, num_hidden_layers=2, intermediate_size=128,
                                       moe_intermediate_size=32, n_routed_experts=4, n_shared_experts=1,
                                       num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
                                       tie_word_embeddings=False)),
    "gpt_oss": ("attention sinks, sliding/full layers, MoE with clamped SwiGLU experts",
                lambda: GptOssConfig(**COMMON, num_hidden_layers=2, intermediate_size=32, head_dim=16,
                                     num_local_experts=4, num_experts_per_tok=2, sliding_window=16,
                                     layer_types=["sliding_attention", "full_attention"],
                                     tie_word_embeddings=False)),
    "qwen3_next": ("gated DeltaNet linear attention with short convolutions, gated full attention, MoE",
                   lambda: Qwen3NextConfig(**COMMON, num_hidden_layers=2, intermediate_size=128, head_dim=16,
                                           layer_types=["linear_attention", "full_attention"],
                                           linear_key_head_dim=16, linear_value_head_dim=16,
                                           linear_num_key_heads=2, linear_num_value_heads=4,
                                           moe_intermediate_size=32, shared_expert_intermediate_size=32,
                                           num_experts=4, num_experts_per_tok=2, tie_word_embeddings=False)),
    "jamba": ("Mamba layers beside attention, MoE every other layer",
              lambda: JambaConfig(**COMMON, num_hidden_layers=2, intermediate_size=128, num_experts=4,
                                  num_experts_per_tok=2, expert_layer_period=2, expert_layer_offset=1,
                                  attn_layer_period=2, attn_layer_offset=1, use_mamba_kernels=False,
                                  mamba_d_state=8, mamba_dt_rank=8, tie_word_embeddings=False)),
    "falcon_h1": ("Mamba2 heads in parallel with attention in every layer, multipliers (muP)",
                  lambda: FalconH1Config(**COMMON, num_hidden_layers=2, intermediate_size=128,
                                         mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1,
                                         mamba_d_state=8, mamba_chunk_size=16, tie_word_embeddings=False)),
    "granitemoehybrid": ("Mamba2 layers and attention layers, MoE, Granite's multipliers",
                         lambda: GraniteMoeHybridConfig(**COMMON, num_hidden_layers=2, intermediate_size=32,
                                                        shared_intermediate_size=64, num_local_experts=4,
                                                        num_experts_per_tok=2, layer_types=["mamba", "attention"],
                                                        mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=1,
                                                        mamba_d_state=8, mamba_chunk_size=16,
                                                        position_embedding_type="rope", tie_word_embeddings=True)),
    "lfm2": ("gated short convolutions beside attention",
             lambda: Lfm2Config(**COMMON, num_hidden_layers=2, intermediate_size=128,
                                layer_types=["conv", "full_attention"], tie_word_embeddings=True)),
    "minimax": ("lightning (linear) attention beside softmax attention, MoE",
                lambda: MiniMaxConfig(**COMMON, num_hidden_layers=2, intermediate_size=32, head_dim=16,
                                      num_local_experts=4, num_experts_per_tok=2, block_size=16,
                                      layer_types=["linear_attention", "full_attention"],
                                      tie_word_embeddings=False)),
}

def make_config(name: str):
    return FAMILIES[name][1]()


def save_family(name: str, folder: str | Path, seed: int = 0) -> Path:
    """A random-init model of `name` saved as a Hugging Face folder (seeded)."""
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(make_config(name)).save_pretrained(folder)
    return Path(folder)
