"""Mixture of experts: FLOPs per token from the parameters a token uses (the top-k of the routed
experts, the router and shared experts in full), the run's total/active counts, and the planner
(memory from every parameter, compute from the active ones). In-process, meta-device models only."""

import pytest
from transformers import (DeepseekV2Config, GPT2Config, LlamaConfig, MixtralConfig, OlmoeConfig, Qwen2MoeConfig,
                          Qwen3MoeConfig)

from common.config import ConfigError
from common.model import PRESETS, model_config
from tools import plan
from train_extras.observe.flops import (active_matmul_params, dimensions, flops_per_token, matmul_params,
                                        parameter_counts, routed_experts)
from train_extras.options import TrainConfig

V, H, L, HEADS, KV, HD = 259, 64, 2, 4, 2, 16  # vocab, hidden, layers, heads, kv heads, head_dim
E, K = 4, 2  # routed experts, experts per token
I_DENSE, I_MOE, I_SHARED = 176, 96, 112  # dense MLP, one expert's, the shared expert's widths
T = 64  # seq_len
SHAPE = dict(vocab_size=V, hidden_size=H, num_hidden_layers=L, num_attention_heads=HEADS, num_key_value_heads=KV,
             max_position_embeddings=256, tie_word_embeddings=False)
ATTN = H * HEADS * HD + 2 * H * KV * HD + HEADS * HD * H  # q, k, v, o
ROUTER = E * H
NORMS = 2 * H  # input_layernorm + post_attention_layernorm
TAIL = H + V * H  # final norm + lm_head (untied)
SCORES = 12 * L * HEADS * HD * T  # 12 L H Q T


def mlp(width):  # gate, up, down
    return 3 * H * width


def check(config, layers: list[int], all_layers: list[int]):
    """layers / all_layers: the hand count of each layer with top-k / every expert."""
    active, every = sum(layers) + TAIL, sum(all_layers) + TAIL
    assert active_matmul_params(config) == active
    assert matmul_params(config) == every  # every expert, as before
    assert flops_per_token(config, T) == 6 * active + SCORES
    counts = parameter_counts(config)
    assert counts == {"total": every + V * H, "active": active + V * H}  # + the embedding table


@pytest.mark.quick
def test_mixtral():
    config = MixtralConfig(intermediate_size=I_MOE, num_local_experts=E, num_experts_per_tok=K, **SHAPE)
    layer = ATTN + ROUTER + NORMS
    check(config, [layer + K * mlp(I_MOE)] * L, [layer + E * mlp(I_MOE)] * L)
    assert routed_experts(config) == {"experts": E, "top_k": K, "params": L * E * mlp(I_MOE),
                                      "inactive": L * (E - K) * mlp(I_MOE)}


@pytest.mark.quick
@pytest.mark.parametrize("dense_layers, option", [([1], dict(mlp_only_layers=[1])),
                                                   ([0], dict(decoder_sparse_step=2))])
def test_qwen3_moe_with_a_dense_layer(dense_layers, option):
    """A dense layer (mlp_only_layers, or not a multiple of decoder_sparse_step) counts its MLP in full."""
    config = Qwen3MoeConfig(intermediate_size=I_DENSE, moe_intermediate_size=I_MOE, num_experts=E,
                            num_experts_per_tok=K, head_dim=HD, **option, **SHAPE)
    base = ATTN + 2 * HD + NORMS  # + q_norm, k_norm (head_dim each)
    layers = [base + mlp(I_DENSE) if i in dense_layers else base + ROUTER + K * mlp(I_MOE) for i in range(L)]
    every = [base + mlp(I_DENSE) if i in dense_layers else base + ROUTER + E * mlp(I_MOE) for i in range(L)]
    check(config, layers, every)


@pytest.mark.quick
def test_qwen2_moe_counts_its_shared_expert_in_full():
    config = Qwen2MoeConfig(intermediate_size=I_DENSE, moe_intermediate_size=I_MOE,
                            shared_expert_intermediate_size=I_SHARED, num_experts=E, num_experts_per_tok=K, **SHAPE)
    base = ATTN + HEADS * HD + 2 * KV * HD + NORMS + ROUTER  # + q, k, v biases
    shared = mlp(I_SHARED) + H  # the shared expert and its gate (H -> 1)
    check(config, [base + shared + K * mlp(I_MOE)] * L, [base + shared + E * mlp(I_MOE)] * L)


@pytest.mark.quick
def test_olmoe():
    config = OlmoeConfig(intermediate_size=I_MOE, num_experts=E, num_experts_per_tok=K, **SHAPE)
    base = ATTN + HEADS * HD + KV * HD + NORMS + ROUTER  # + q_norm (over all heads), k_norm (over the kv heads)
    check(config, [base + K * mlp(I_MOE)] * L, [base + E * mlp(I_MOE)] * L)


@pytest.mark.quick
def test_tied_output_projection_still_counts():
    config = MixtralConfig(intermediate_size=I_MOE, num_local_experts=E, num_experts_per_tok=K,
                           **SHAPE | {"tie_word_embeddings": True})
    active = L * (ATTN + ROUTER + NORMS + K * mlp(I_MOE)) + TAIL
    assert active_matmul_params(config) == active  # the shared table is the output matmul
    assert parameter_counts(config)["active"] == active  # the table once


@pytest.mark.quick
def test_a_shape_with_the_issues_figures():
    """4 experts, top-2: 1.63e6 FLOPs/token counting every expert, 1.03e6 from the active weights."""
    config = MixtralConfig(vocab_size=512, hidden_size=80, num_hidden_layers=1, num_attention_heads=4,
                           num_key_value_heads=4, intermediate_size=208, num_local_experts=4, num_experts_per_tok=2,
                           tie_word_embeddings=False)
    h, i, v = 80, 208, 512
    base = 4 * h * h + 4 * h + 2 * h + h + v * h  # attention, router, norms, final norm, lm_head
    assert 6 * matmul_params(config) + 12 * h * 32 == 6 * (base + 4 * 3 * h * i) + 12 * h * 32 == 1_631_520
    assert flops_per_token(config, 32) == 6 * (base + 2 * 3 * h * i) + 12 * h * 32 == 1_032_480


@pytest.mark.quick
def test_dense_figures_are_unchanged():
    """The figures tests/test_model.py and tests/test_model_families.py hold, and every preset."""
    llama = LlamaConfig(vocab_size=100, hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
                        num_key_value_heads=1, intermediate_size=16)
    assert routed_experts(llama) is None
    assert active_matmul_params(llama) == matmul_params(llama) == 1992
    assert flops_per_token(llama, 32) == 6 * 1992 + 12 * 2 * 2 * 4 * 32
    assert parameter_counts(llama) == {"total": 1992 + 100 * 8, "active": 1992 + 100 * 8}
    gpt2 = GPT2Config(vocab_size=V, n_layer=2, n_head=4, n_embd=64, n_positions=256, tie_word_embeddings=True)
    assert active_matmul_params(gpt2) == 2 * (12 * H * H + 13 * H) + 2 * H + V * H
    assert flops_per_token(gpt2, 64) == 6 * (2 * (12 * H * H + 13 * H) + 2 * H + V * H) + 12 * 2 * 4 * 16 * 64
    for preset in PRESETS:
        config = model_config(TrainConfig(preset=preset), V)
        dims = dimensions(config)
        assert flops_per_token(config, 256) == (6 * matmul_params(config)
                                                + 12 * dims["layers"] * dims["heads"] * dims["head_dim"] * 256)
        counts = parameter_counts(config)
        assert counts["active"] == counts["total"] == matmul_params(config) + V * config.hidden_size


@pytest.mark.quick
def test_unreadable_top_k_is_refused_in_one_line():
    """DeepSeek-V2's config class defaults num_experts_per_tok to None: no FLOPs can be counted."""
    config = DeepseekV2Config(vocab_size=V, hidden_size=H, num_hidden_layers=1, num_attention_heads=HEADS,
                              num_key_value_heads=HEADS, intermediate_size=I_DENSE, moe_intermediate_size=I_MOE,
                              n_routed_experts=E, n_shared_experts=1, first_k_dense_replace=0,
                              kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)
    assert config.num_experts_per_tok is None
    with pytest.raises(ConfigError, match="DeepseekV2Config is a mixture of experts but its config gives no") as err:
        flops_per_token(config, T)
    assert "\n" not in str(err.value)
    config.num_experts_per_tok = K  # readable: its shared experts and the router in full
    moe = routed_experts(config)
    assert moe["experts"] == E and moe["top_k"] == K and moe["inactive"] == (E - K) * mlp(I_MOE)
    too_many = MixtralConfig(intermediate_size=I_MOE, num_local_experts=E, num_experts_per_tok=K, **SHAPE)
    too_many.num_experts_per_tok = E + 1
    with pytest.raises(ConfigError, match="no single expert count and top-k"):
        parameter_counts(too_many)


def test_planner_memory_from_total_compute_from_active(tmp_path, capsys):
    folder = tmp_path / "mixtral"
    config = MixtralConfig(intermediate_size=I_MOE, num_local_experts=E, num_experts_per_tok=K, **SHAPE)
    config.save_pretrained(folder)
    counts = parameter_counts(config)
    assert counts["active"] < counts["total"]
    shape = plan.model_shape(None, str(folder))
    assert (shape.n_params, shape.active_params) == (counts["total"], counts["active"])
    assert (shape.experts, shape.top_k) == (E, K)
    assert shape.flops_per_token(T) == flops_per_token(config, T)
    for r in plan.evaluate(shape, plan.Request(gpus=2, seq_len=T, micro_batch_size=2)):
        assert r["states"]["n_params"] == counts["total"]  # every expert is held
    ddp = plan.model_state_bytes("ddp", shape.n_params, 2, "bf16", shape)
    assert ddp["at_rest"]["device"]["total"] == pytest.approx(16 * counts["total"])
    assert plan.main(["--model_name_or_path", str(folder), "--gpus", "2", "--seq_len", str(T),
                      "--micro_batch_size", "2"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("Parameters:"))
    assert (f"Parameters: {counts['total'] / 1e6:.1f}M total (memory: every expert is held), "
            f"{counts['active'] / 1e6:.1f}M active per token (compute: top-{K} of {E} routed experts") in line
    assert f"Compute: {flops_per_token(config, T):.3e} FLOPs/token at seq_len {T}" in line
    assert f"{flops_per_token(config, T) * 2 * T:.3e} training FLOPs per GPU per micro-batch ({2 * T} tokens)" in line

