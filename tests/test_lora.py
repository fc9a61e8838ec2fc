"""LoRA in train.py (train_extras/lora.py): adapters on a frozen base, with peft.

In this process, on every family of tests/families.py (dense, MoE, hybrids): which layers get
adapters, that the model is exactly the base at step 0, and that the two exports (the adapter
folder peft loads onto the base, the merged model) give the live model's logits."""

from __future__ import annotations

import re

import pytest
import torch
from peft import PeftModel
from torch import nn
from transformers import AutoModelForCausalLM

from common.config import ConfigError
from common.data import build_tokenizer
from conftest import parse_train
from families import FAMILIES, VOCAB, save_family
from train_extras import lora
from train_extras.options import TrainConfig

IDS = torch.tensor([[1, 40, 77, 5, 200, 13, 99, 2, 64, 31, 8, 150]])


def lora_args(*extra: str) -> list[str]:
    return ["--lora_r", "4", *extra]


@pytest.mark.quick
@pytest.mark.parametrize("family", FAMILIES)
def test_adapters_start_as_the_base_and_both_exports_give_the_trained_logits(family, tmp_path):
    base_dir = save_family(family, tmp_path / "base")
    model = AutoModelForCausalLM.from_pretrained(base_dir)
    with torch.no_grad():
        base_logits = model(IDS).logits
    base = {name: p.detach().clone() for name, p in model.named_parameters()}
    cfg = parse_train(lora_args("--lora_dropout", "0.0"))
    facts = lora.apply(model, cfg)

    # What is adapted: every linear layer named by the targets; never the head or an MoE router.
    adapted = {re.sub(r"(\.base_layer)+", "", name.rsplit(".lora_A", 1)[0]) for name, _ in model.named_parameters()
               if ".lora_A." in name}
    assert facts["adapted_layers"] == len(adapted) > 0
    linear = {name for name, m in model.named_modules()
              if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] in facts["target_modules"]}
    assert linear <= adapted, sorted(linear - adapted)[:5]  # no targeted linear layer left out
    assert not any(name.endswith(("lm_head", ".gate", ".router")) for name in adapted), sorted(adapted)
    assert all(not p.requires_grad for name, p in model.named_parameters() if ".lora_" not in name)
    assert facts["trainable_parameters"] == sum(p.numel() for p in model.parameters() if p.requires_grad) > 0

    with torch.no_grad():  # B starts at zero: the base model, exactly
        assert torch.equal(model(IDS).logits, base_logits)
        for name, p in model.named_parameters():
            if ".lora_B." in name:  # as if trained
                p.copy_(torch.randn_like(p) * 0.05)
        trained = model(IDS).logits
    assert not torch.allclose(trained, base_logits)

    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    weights = lora.base_state(state)
    assert all(torch.equal(weights[name], value) for name, value in base.items())  # the base, as loaded
    lora.writer(tmp_path / "merged", build_tokenizer(TrainConfig()))(tmp_path / "adapter", model, state)

    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), tmp_path / "adapter")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    with torch.no_grad():
        assert (reloaded(IDS).logits - trained).abs().max() < 1e-6
        assert (merged(IDS).logits - trained).abs().max() < 1e-5
    assert merged.config.vocab_size == VOCAB and not any(".lora_" in k for k in merged.state_dict())


@pytest.mark.quick
def test_lora_options_are_checked_in_one_line():
    with pytest.raises(ConfigError, match="add --lora_r"):
        parse_train(["--lora_alpha", "16"])
    with pytest.raises(ConfigError, match="--lora_r must be >= 0"):
        parse_train(["--lora_r", "-1"])
    with pytest.raises(ConfigError, match="Muon"):
        parse_train(lora_args("--optimizer", "muon"))
    assert lora.apply(AutoModelForCausalLM.from_config(FAMILIES["qwen3"][1]()), parse_train([])) is None
