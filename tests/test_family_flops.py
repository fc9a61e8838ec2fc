"""FLOPs per token of the 2025-2026 families (tests/families.py) against hand counts from their config
numbers: MLA with its own q/k and v head sizes, sliding and chunked windows, gated DeltaNet, Mamba,
Mamba2 and lightning attention by their own formulas, short convolutions by their weights alone, and an
experts module that runs every expert (Llama 4) with the active figure beside it. In-process,
meta-device models only.

Per token, training: 6 per weight a token goes through (N), plus each layer's mixer
(flops.sequence_flops: its matmuls, 2 FLOPs a multiply-add, x3 for forward and backward) over a
sequence of T tokens, divided by T."""

from types import SimpleNamespace

import pytest
import torch
from transformers import Llama4TextConfig, MistralConfig

from families import make_config
from tools import plan
from train_extras.observe import flops
from train_extras.observe.flops import active_matmul_params, flops_per_token, matmul_params
from train_extras.observe.run_record import RunRecord
from train_extras.options import TrainConfig

T = 64
V, HID = 259, 64  # tests/families.py: byte vocabulary, hidden size


def llama4():
    """Llama 4's text model, a chunked layer (chunks of 16) and a full one, MoE in both (top-1 of 4)."""
    return Llama4TextConfig(vocab_size=V, hidden_size=HID, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, intermediate_size=32, intermediate_size_mlp=128,
                            num_local_experts=4, num_experts_per_tok=1, attention_chunk_size=16,
                            layer_types=["chunked_attention", "full_attention"], tie_word_embeddings=False)


def pairs(t, window=None, chunk=None):
    """(query, key) pairs over t positions as PaLM's 12LHQT counts them (the causal mask ignored): each
    of the t queries against all t keys, or the window's or the chunk's where that is shorter."""
    return t * min(window or chunk or t, t)


def attention(heads, qk, v, t, **span):
    """Training FLOPs of one softmax attention layer over a sequence: QK^T and AV, 2 * heads * (qk + v)
    FLOPs a pair, x3."""
    return 3 * 2 * heads * (qk + v) * pairs(t, **span)


@pytest.mark.quick
def test_deepseek_v3_mla_by_hand():
    """MLA: scores with q/k heads of qk_nope + qk_rope = 16 + 8 and values of v_head_dim 16 (not
    hidden / heads = 16, nor the config's head_dim = qk_rope 8); projections by their real weights."""
    c = make_config("deepseek_v3")
    heads, q_rank, kv_rank, nope, rope, v = 4, 24, 16, 16, 8, 16
    assert (c.num_attention_heads, c.q_lora_rank, c.kv_lora_rank) == (heads, q_rank, kv_rank)
    assert (c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim) == (nope, rope, v)
    mla = (HID * q_rank + q_rank  # q_a_proj, q_a_layernorm
           + q_rank * heads * (nope + rope)  # q_b_proj
           + HID * (kv_rank + rope) + kv_rank  # kv_a_proj_with_mqa (latent + the shared rope key), its norm
           + kv_rank * heads * (nope + v)  # kv_b_proj: per head a nope key and a value
           + heads * v * HID)  # o_proj
    norms = 2 * HID
    dense = mla + norms + 3 * HID * 128  # first_k_dense_replace=1: a SwiGLU MLP of 128
    sparse = mla + norms + 4 * HID + 3 * HID * 32 + 2 * 3 * HID * 32  # router, shared expert, top-2 of 4
    n = dense + sparse + HID + V * HID  # final norm, untied lm_head
    assert active_matmul_params(c) == n == 83_280
    expected = 6 * n + 2 * attention(heads, nope + rope, v, T) / T  # 499_680 + 2 x 3 x 2 x 4 x 40 x 64
    assert flops_per_token(c, T) == expected == 622_560


@pytest.mark.quick
def test_qwen3_next_gated_deltanet_hybrid_by_hand(tmp_path):
    """Gated DeltaNet (layer 0) as the chunked delta rule transformers and fla run: per chunk of 64 and
    value head, k_beta K^T and Q K^T (C x C x dk each), two unit-triangular solves (C(C-1) FLOPs a
    column of v_beta and of the decayed k_beta), the intra-chunk product with the new values (C x C x
    dv) and the state's two reads and one write (C x dk x dv each); gated attention (layer 1) as softmax attention."""
    c = make_config("qwen3_next")
    assert c.layer_types == ["linear_attention", "full_attention"]
    k_heads, v_heads, dk, dv, kernel, chunk = 2, 4, 16, 16, 4, 64
    assert (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim,
            c.linear_conv_kernel_dim) == (k_heads, v_heads, dk, dv, kernel)
    key_dim, value_dim = k_heads * dk, v_heads * dv
    deltanet = (HID * (2 * key_dim + 2 * value_dim) + HID * 2 * v_heads  # in_proj_qkvz, in_proj_ba
                + (2 * key_dim + value_dim) * kernel  # the depthwise short convolution: a weight per tap
                + v_heads + v_heads + dv  # dt_bias, A_log, the gated norm
                + value_dim * HID)  # out_proj
    gated_attention = HID * 4 * 16 * 2 + 2 * HID * 2 * 16 + 4 * 16 * HID + 2 * 16  # q (+ its gate), k, v, o, norms
    moe = 4 * HID + 2 * 3 * HID * 32 + 3 * HID * 32 + HID  # router, top-2 of 4, shared expert and its gate
    n = deltanet + gated_attention + 2 * (moe + 2 * HID) + HID + V * HID
    assert active_matmul_params(c) == n == 88_248
    chunks = 1  # T = 64: one chunk of 64
    delta_rule = 3 * chunks * v_heads * (2 * chunk * chunk * dk + 2 * chunk * chunk * dk
                                         + chunk * (chunk - 1) * (dv + dk) + 2 * chunk * chunk * dv
                                         + 3 * 2 * chunk * dk * dv)
    expected = 6 * n + (delta_rule + attention(4, 16, 16, T)) / T  # 529_488 + 116_352 + 49_152
    assert flops_per_token(c, T) == expected == 694_992
    assert flops.flops(c, T)["counted"] == "6N + 1 gated DeltaNet, 1 softmax attention"
    c.save_pretrained(tmp_path)  # the planner counts as train.py does
    assert plan.model_shape(None, str(tmp_path)).flops_per_token(T) == expected


@pytest.mark.quick
def test_mamba_and_mamba2_layers_by_their_own_formulas():
    """Jamba's Mamba layer: the selective scan, 7 FLOPs per channel and state a token (dt*A, dt*B, *x,
    the state's multiply and add, C's multiply-add). Falcon-H1 (Mamba2 beside attention in every layer)
    and GraniteMoeHybrid: SSD in chunks, per chunk C*B^T per group, its product with x, the chunk's
    states and their read-out per head, and the state passed on."""
    def check(c, sequence):  # 6N and the mixers' FLOPs over a sequence, per token
        assert flops_per_token(c, T) == 6 * active_matmul_params(c) + sequence / T

    jamba = make_config("jamba")
    inner, state = 2 * HID, 8  # mamba_expand * hidden, mamba_d_state
    assert (jamba.mamba_expand, jamba.mamba_d_state) == (2, state)
    check(jamba, 3 * 7 * inner * state * T + attention(4, 16, 16, T))

    def ssd(heads, p, n, groups, chunk):
        per_chunk = (2 * chunk * chunk * n * groups  # C B^T
                     + heads * (2 * chunk * chunk * p  # (C B^T, masked) x
                                + 2 * chunk * n * p  # the chunk's states B^T x
                                + 2 * chunk * n * p  # their read-out C s
                                + 2 * n * p))  # the state passed to the next chunk
        return 3 * (T // chunk) * per_chunk

    falcon = make_config("falcon_h1")
    assert (falcon.mamba_n_heads, falcon.mamba_d_head, falcon.mamba_d_state, falcon.mamba_n_groups,
            falcon.mamba_chunk_size) == (4, 16, 8, 1, 16)
    check(falcon, 2 * (ssd(4, 16, 8, 1, 16) + attention(4, 16, 16, T)))
    granite = make_config("granitemoehybrid")
    assert granite.layer_types == ["linear_attention", "full_attention"] and granite.mamba_n_heads == 8
    check(granite, ssd(8, 16, 8, 1, 16) + attention(4, 16, 16, T))


@pytest.mark.quick
def test_lightning_attention_and_short_convolutions():
    """MiniMax's lightning layer per block of 16: Q K^T and its product with V in the block, Q times the
    (d x d) state and the state's update K^T V. LFM2's short convolution: its weights alone (in N)."""
    minimax = make_config("minimax")
    heads, d, block = 4, 16, 16
    lightning = 3 * heads * (T // block) * (2 * block * block * d * 2 + 2 * block * d * d * 2)
    assert flops_per_token(minimax, T) == 6 * active_matmul_params(minimax) + (lightning + attention(4, 16, 16, T)) / T
    lfm2 = make_config("lfm2")
    assert flops_per_token(lfm2, T) == 6 * matmul_params(lfm2) + attention(4, 16, 16, T) / T
    assert flops.flops(lfm2, T)["counted"] == "6N + 1 short conv, 1 softmax attention"


@pytest.mark.quick
@pytest.mark.parametrize("t", [64, 16])
def test_sliding_and_chunked_windows_per_layer_type(t, tmp_path):
    """Each query against min(16, t) keys in a sliding window of 16 or chunks of 16, all t in a full
    layer; each layer by its layer type (Gemma3, OLMo3, GPT-OSS: sliding then full), every layer of a
    family with a window and no layer types (Mistral). t = 16: the window covers the sequence and costs
    exactly a full layer."""
    assert (pairs(t, window=16), pairs(t, chunk=16), pairs(t)) == {64: (1024, 1024, 4096), 16: (256, 256, 256)}[t]
    for name in ("gemma3", "olmo3", "gpt_oss"):
        c = make_config(name)
        assert c.layer_types == ["sliding_attention", "full_attention"] and c.sliding_window == 16
        expected = 6 * active_matmul_params(c) + (attention(4, 16, 16, t, window=16) + attention(4, 16, 16, t)) / t
        assert flops_per_token(c, t) == expected, name
    c.save_pretrained(tmp_path)  # the planner, at any seq_len
    assert plan.model_shape(None, str(tmp_path)).flops_per_token(t) == expected
    assert flops.flops(llama4(), t)["active"] == 6 * active_matmul_params(llama4()) + (
        attention(4, 16, 16, t, chunk=16) + attention(4, 16, 16, t)) / t
    mistral, full = (MistralConfig(vocab_size=V, hidden_size=HID, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=128, sliding_window=window)
                     for window in (16, None))
    assert flops_per_token(mistral, t) == 6 * matmul_params(mistral) + 2 * attention(4, 16, 16, t, window=16) / t
    assert (flops_per_token(mistral, t) == flops_per_token(full, t)) == (t == 16)


@pytest.mark.quick
def test_every_expert_counted_where_the_experts_run_them_all(tmp_path):
    """Llama 4's experts (transformers 5.25) multiply every token through all 4 experts and weight the
    unchosen by 0: the FLOPs it spends count every expert, and MFU is measured against them; the figure
    from the active weights (top-1 of 4) stands beside it in run_summary.json and the planner says so.
    The other families route sparsely (test_moe_flops.py)."""
    c = llama4()
    scores = (attention(4, 16, 16, T, chunk=16) + attention(4, 16, 16, T)) / T
    inactive = 2 * 3 * 3 * HID * 32  # 2 MoE layers, 3 of the 4 experts' gate, up and down not chosen
    assert matmul_params(c) - active_matmul_params(c) == inactive
    counted = flops.flops(c, T)
    assert counted["dense_experts"] == "Llama4TextExperts"
    assert counted["per_token"] == flops_per_token(c, T) == 6 * matmul_params(c) + scores
    assert counted["active"] == 6 * active_matmul_params(c) + scores
    assert counted["counted"] == ("6N + 1 softmax attention (chunks of 16), 1 softmax attention; N counts every "
                                  f"expert: Llama4TextExperts runs each on every token ({counted['active']:.3e} by "
                                  "the active experts)")
    for name in ("qwen3_moe", "deepseek_v3", "gpt_oss", "qwen3_next", "minimax"):  # sparse in 5.25
        assert flops.flops(make_config(name), T)["dense_experts"] is None, name
    # run_summary.json: MFU's figure (what runs) and the active one beside it
    accelerator = SimpleNamespace(is_main_process=True, num_processes=1, process_index=0,
                                  device=torch.device("cpu"), log=lambda *args, **kwargs: None)
    record = RunRecord(accelerator, TrainConfig(output_dir=str(tmp_path)), {}, peak={"tflops": None, "source": ""},
                       data={}, tokens_per_step=T, flops_per_token=counted["per_token"], flops=counted)
    record.model(1, 1, {})
    assert record.summary["model"] | {"compiled_regions": None} == {
        "parameters": 1, "active_parameters": 1, "flops_per_token": counted["per_token"],
        "flops_per_token_active": counted["active"], "flops_counted": counted["counted"], "compiled_regions": None}
    # the planner: the same figure, and which weights it counts
    c.save_pretrained(tmp_path / "llama4")
    shape = plan.model_shape(None, str(tmp_path / "llama4"))
    assert shape.flops_per_token(T) == counted["per_token"]
    line = plan.cli._compute_line(shape, plan.Request(gpus=1, seq_len=T, micro_batch_size=1))
    assert "matmul weights: Llama4TextExperts runs every expert on every token)" in line


@pytest.mark.quick
def test_the_counts_match_the_matmuls_transformers_runs():
    """torch's FlopCounterMode on one real forward of each recurrent mixer (T = 64, CPU: the torch
    paths) counts its matmuls (2 per multiply-add), not elementwise work nor triangular solves: it
    sees the linear weights (2 x T each; the convolutions over T + kernel - 1 padded positions) plus, beyond
    them, what sequence_flops counts for a forward, less what it counts that is not a matmul, plus
    what transformers' torch fallback for Mamba2 spends beyond mamba_ssm's kernel."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    for name, mixer, beyond in [
            ("minimax", "self_attn", lambda m: 0),  # lightning: all matmuls
            ("qwen3_next", "linear_attn", lambda m: -m.heads * m.chunk * (m.chunk - 1) * (m.qk + m.v)),  # solves
            # SSD's torch fallback: C B^T per head, not per group; states passed between every pair of chunks
            ("falcon_h1", "mamba", lambda m: (T // m.chunk) * 2 * m.chunk ** 2 * m.state * (m.heads - m.groups)
             + 2 * m.heads * m.v * m.state * ((T // m.chunk + 1) ** 2 - T // m.chunk)),
            ("jamba", "mamba", lambda m: -5 * m.inner * m.state * T)]:  # the scan: only C's read-out is a bmm
        c = make_config(name)
        module = getattr(AutoModelForCausalLM.from_config(c).model.layers[0], mixer)
        found = flops.mixers(c)[0]
        extra = {"minimax": {"position_embeddings": None, "attention_mask": None}}.get(name, {})
        with FlopCounterMode(display=False) as counter:
            module(torch.randn(1, T, HID), **extra)
        counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
        weights = sum(m.weight.numel() for m in module.modules() if isinstance(m, torch.nn.Linear))
        convs = [m for m in module.modules() if isinstance(m, torch.nn.Conv1d)]
        assert counts.pop("aten.mm") == 2 * weights * T, name
        assert counts.pop("aten.convolution", 0) == sum(2 * m.weight.numel() * (T + m.kernel_size[0] - 1)
                                                        for m in convs), name
        assert counts == {"aten.bmm": flops.sequence_flops(found, T) // 3 + beyond(found)}, name
