"""Activation checkpointing (--gradient_checkpointing): same loss, same gradients, fewer saved bytes
(in-process, debug preset, fp32 on the CPU)."""

import torch

from train_extras.options import TrainConfig
from common.model import build_model, causal_lm_loss
from families import FAMILIES, save_family

import pytest

pytestmark = pytest.mark.quick  # launches nothing: docs/testing.md#running-the-tests

VOCAB = 259
MICRO, SEQ = 4, 128


def run(checkpointing: bool):
    """One forward/backward of causal_lm_loss; returns the loss, the gradients, the bytes autograd
    saved during forward (once per storage, parameters excluded) and how often the blocks' MLPs ran."""
    torch.manual_seed(0)  # the same initial weights in both runs
    model = build_model(TrainConfig(preset="debug", gradient_checkpointing=checkpointing), VOCAB).train()
    ids = torch.randint(0, VOCAB, (MICRO, SEQ + 1), generator=torch.Generator().manual_seed(1))
    param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in param_storages:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    # A checkpointed block's forward runs again during backward: its MLP is entered twice (a pre-hook:
    # the recompute stops early, right after the last tensor backward needs, before the MLP returns).
    calls = []
    for layer in model.model.layers:
        layer.mlp.register_forward_pre_hook(lambda *_: calls.append(1))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = causal_lm_loss(model, ids[:, :-1], ids[:, 1:])
    saved_bytes = sum(saved.values())
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return model, loss.detach(), grads, saved_bytes, len(calls)


def test_checkpointing_same_loss_and_gradients_less_memory():
    plain_model, plain_loss, plain_grads, plain_saved, plain_calls = run(False)
    ckpt_model, ckpt_loss, ckpt_grads, ckpt_saved, ckpt_calls = run(True)
    layers = len(plain_model.model.layers)

    # The switch reached every block, and the blocks really were recomputed in backward.
    assert all(layer.gradient_checkpointing for layer in ckpt_model.model.layers)
    assert not any(layer.gradient_checkpointing for layer in plain_model.model.layers)
    assert plain_calls == layers and ckpt_calls == 2 * layers

    # Same computation: the forward is the very same ops, so the loss is bitwise equal; the
    # backward of a recomputed block may sum in another order, hence a tight tolerance.
    assert torch.equal(plain_loss, ckpt_loss)
    assert plain_grads.keys() == ckpt_grads.keys()
    max_diff = max((plain_grads[n] - ckpt_grads[n]).abs().max().item() for n in plain_grads)
    print(f"\nloss {plain_loss.item():.6f}; max |grad difference| {max_diff:.3g}; "
          f"saved bytes {plain_saved} -> {ckpt_saved} ({ckpt_saved / plain_saved:.3f}x)")
    for name in plain_grads:
        torch.testing.assert_close(ckpt_grads[name], plain_grads[name], atol=1e-6, rtol=1e-5, msg=name)

    # Far fewer activation bytes kept: measured 0.19x on this shape (each block keeps only its
    # input; the embedding/head/cross-entropy part is unchanged). If checkpointing silently did
    # nothing the ratio would be 1.
    assert ckpt_saved < 0.35 * plain_saved


def test_selective_checkpointing_same_loss_and_gradients_memory_between():
    """--gradient_checkpointing selective: the same loss and gradients (the recomputed element-wise
    ops give the same values); what stays alive once forward ends lies between none and every block
    (measured on this shape: 1.00x / 0.64x / 0.20x of no checkpointing)."""
    from tools.plan import live_tracker

    kept, results = {}, {}
    for mode in ("false", "selective", "true"):
        torch.manual_seed(0)
        model = build_model(TrainConfig(preset="debug", gradient_checkpointing=mode), VOCAB).train()
        ids = torch.randint(0, VOCAB, (MICRO, SEQ + 1), generator=torch.Generator().manual_seed(1))
        tracker = live_tracker(list(model.parameters()))
        with tracker:
            loss = causal_lm_loss(model, ids[:, :-1], ids[:, 1:])
            kept[mode] = tracker.live()
        loss.backward()
        results[mode] = loss.detach(), {n: p.grad for n, p in model.named_parameters()}
    ratios = {mode: round(kept[mode] / kept["false"], 2) for mode in kept}
    print(f"\nkept after forward, of no checkpointing's: {ratios}")
    assert torch.equal(results["selective"][0], results["false"][0])
    for name, grad in results["false"][1].items():
        torch.testing.assert_close(results["selective"][1][name], grad, atol=1e-6, rtol=1e-5, msg=name)
    assert kept["true"] < kept["selective"] < 0.8 * kept["false"]


def test_selective_checkpointing_recomputes_an_output_changed_in_place():
    """A kept matmul output that forward then changes in place (mul_) is recomputed, not handed back
    changed: the gradients equal those without checkpointing. Handed back as kept, the recompute
    would double it a second time and the relu's mask, hence the input's gradient, would differ."""
    from torch.utils.checkpoint import checkpoint

    from common.model import checkpoint_kwargs

    weight = torch.randn(8, 8, generator=torch.Generator().manual_seed(0))

    def block(x):
        return (torch.mm(x, weight).mul_(2) - 1.0).relu().sum()

    grads = []
    for kwargs in (None, checkpoint_kwargs("selective")):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
        loss = block(x) if kwargs is None else checkpoint(block, x, **kwargs)
        loss.backward()
        grads.append(x.grad)
    torch.testing.assert_close(grads[1], grads[0], atol=0, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_selective_checkpointing_on_every_family_changes_no_value(tmp_path, family):
    """The 15 families of tests/families.py (dense, MoE, Mamba and linear-attention hybrids, sliding
    windows), each built by build_model from a saved folder: --gradient_checkpointing selective
    reaches the blocks, and the loss and every gradient equal those without checkpointing, exactly."""
    folder = str(save_family(family, tmp_path))
    results = []
    for mode in ("false", "selective"):
        torch.manual_seed(0)
        model = build_model(TrainConfig(model_name_or_path=folder, gradient_checkpointing=mode), VOCAB).train()
        ids = torch.randint(0, VOCAB, (2, 33), generator=torch.Generator().manual_seed(1))
        loss = causal_lm_loss(model, ids[:, :-1], ids[:, 1:])
        loss.backward()
        results.append((model, loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (plain, plain_loss, plain_grads), (ckpt, ckpt_loss, ckpt_grads) = results
    assert any(getattr(m, "gradient_checkpointing", False) for m in ckpt.modules())
    assert not any(getattr(m, "gradient_checkpointing", False) for m in plain.modules())
    assert torch.equal(ckpt_loss, plain_loss)
    assert ckpt_grads.keys() == plain_grads.keys()
    for name, grad in plain_grads.items():
        assert torch.equal(ckpt_grads[name], grad), name


@pytest.mark.parametrize("pair", ["lora", "bf16 autocast"])
def test_selective_checkpointing_with_lora_and_autocast_changes_no_value(pair):
    """--gradient_checkpointing selective x --lora_r (the frozen base, peft's adapters trained, applied
    by train_extras/lora.apply as train.py does) and x bf16 autocast (accelerate's mixed precision on
    one process and DDP: the kept matmul outputs are bf16): the loss and every trained gradient equal
    those without checkpointing, bitwise; and it did checkpoint: fewer bytes alive once forward ends
    (measured: LoRA 0.76x of none, autocast 0.59x; LoRA was 1.17x while the adapters' up-projections
    were kept, common/model._keeps)."""
    from tools.plan import live_tracker
    from train_extras import lora

    results, kept = {}, {}
    for mode in ("false", "selective"):
        torch.manual_seed(0)
        cfg = TrainConfig(preset="debug", gradient_checkpointing=mode, lora_r=4 if pair == "lora" else 0)
        model = build_model(cfg, VOCAB).train()
        if pair == "lora":
            assert lora.apply(model, cfg)
        ids = torch.randint(0, VOCAB, (MICRO, SEQ + 1), generator=torch.Generator().manual_seed(1))
        tracker = live_tracker(list(model.parameters()))
        with tracker, torch.autocast("cpu", dtype=torch.bfloat16, enabled=pair == "bf16 autocast"):
            loss = causal_lm_loss(model, ids[:, :-1], ids[:, 1:])
            kept[mode] = tracker.live()
        loss.backward()
        results[mode] = loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    (plain, plain_grads), (selective, selective_grads) = results["false"], results["selective"]
    trained = {n for n, g in plain_grads.items() if g is not None and g.abs().sum() > 0}
    assert trained and (pair != "lora" or all(".lora_" in n for n in plain_grads)), sorted(plain_grads)[:4]
    print(f"\nkept after forward: selective {kept['selective'] / kept['false']:.2f}x of none")
    assert kept["selective"] < 0.9 * kept["false"]
    assert torch.equal(selective, plain)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(selective_grads[name], grad, atol=0, rtol=0, msg=name)
