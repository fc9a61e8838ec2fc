"""Presets, FLOPs per token, the optimizer's parameter groups, pretrained loading (in-process)."""

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from common.config import ConfigError
from train_extras.options import TrainConfig
from common.model import PRESETS, build_model, build_optimizer, check_seq_len, model_config
from train_extras.observe.flops import flops_per_token, matmul_params


pytestmark = pytest.mark.quick  # launches nothing: docs/testing.md#running-the-tests

VOCAB = 259  # the byte-level tokenizer


@pytest.mark.parametrize("preset, low, high", [
    ("debug", 50_000, 1_000_000), ("mini", 800_000, 900_000), ("tiny", 2_000_000, 6_000_000), ("small", 100e6, 150e6),
    ("1b", 0.9e9, 1.3e9), ("8b", 6.5e9, 8.5e9),
])
def test_preset_sizes(preset, low, high):
    config = model_config(TrainConfig(preset=preset), VOCAB)
    with torch.device("meta"):  # shapes only, no memory
        model = AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())
    assert low <= total <= high
    # matmul_params = all parameters - input embedding (the output projection is untied here)
    assert matmul_params(config) == total - VOCAB * config.hidden_size


def test_flops_per_token_by_hand():
    config = LlamaConfig(vocab_size=100, hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, intermediate_size=16)
    # per layer: q 8*8 + k 8*4 + v 8*4 + o 8*8 = 192; mlp 3*8*16 = 384; two norms 16 -> 592
    # total: 2*592 + final norm 8 + lm_head 100*8 = 1992
    assert matmul_params(config) == 1992
    # 6N + 12 * L * H * Q * T with L=2, H=2, Q=4, T=32
    assert flops_per_token(config, 32) == 6 * 1992 + 12 * 2 * 2 * 4 * 32


def test_weight_decay_only_on_matrices():
    model = build_model(TrainConfig(preset="debug"), VOCAB)
    optimizer = build_optimizer(model, TrainConfig(weight_decay=0.1), torch.device("cpu"))
    decay, no_decay = optimizer.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    names = {id(p): n for n, p in model.named_parameters()}
    decayed = {names[id(p)] for p in decay["params"]}
    assert "model.embed_tokens.weight" not in decayed
    assert "lm_head.weight" in decayed and "model.layers.0.mlp.up_proj.weight" in decayed
    assert all(p.ndim == 1 for p in no_decay["params"] if names[id(p)] != "model.embed_tokens.weight")
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_model_settings():
    model = build_model(TrainConfig(preset="debug", gradient_checkpointing=True), VOCAB)
    assert model.config._attn_implementation == "sdpa"
    assert any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    assert next(model.parameters()).dtype == torch.float32
    # auto (the default) is transformers' pick, SDPA for Llama; a name given wins
    assert build_model(TrainConfig(preset="debug", attn_implementation="eager"), VOCAB).config._attn_implementation \
        == "eager"


def test_seq_len_above_positions_refused():
    check_seq_len(TrainConfig(preset="debug", seq_len=PRESETS["debug"]["max_position_embeddings"]))
    with pytest.raises(ConfigError, match="exceeds the 256 positions of preset 'debug'"):
        check_seq_len(TrainConfig(preset="debug", seq_len=257))


def test_pretrained_loads_saved_folder(tmp_path):
    """--model_name_or_path: the exact weights of a save_pretrained folder, and its positions limit."""
    original = build_model(TrainConfig(preset="debug"), VOCAB)
    original.save_pretrained(tmp_path)
    cfg = TrainConfig(model_name_or_path=str(tmp_path), seq_len=64)
    loaded = build_model(cfg, VOCAB)
    for (name, a), (_, b) in zip(original.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    with pytest.raises(ConfigError, match="exceeds the 256 positions"):
        check_seq_len(TrainConfig(model_name_or_path=str(tmp_path), seq_len=300))
