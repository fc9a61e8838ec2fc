"""fp16 with a GradScaler on CPU (through the CPU harness, which adds torch's CPU GradScaler and
fp16 autocast that accelerate does not build on CPU)."""

import math

import pytest
from conftest import HARNESS, ROOT


def check_overflow_handling(rows, skipped_of):
    scales = [row["loss_scale"] for row in rows]
    skipped = [i for i, row in enumerate(rows) if skipped_of(i)]
    assert len(skipped) >= 3 and skipped[:3] == [0, 1, 2]  # 2^24 overflows at first
    for i in skipped:
        previous = 16777216 if i == 0 else scales[i - 1]
        assert scales[i] == previous / 2  # each skip halves the scale
        assert rows[i]["lr"] == (0.0 if i == 0 else rows[i - 1]["lr"])  # ...and the schedule waits
    applied = [i for i in range(len(rows)) if i not in skipped]
    assert len(applied) >= 10
    assert rows[applied[0]]["lr"] > 0 and scales[-1] >= 2**14  # training goes on at a sane scale


def test_fp16_recipe_skips_overflowed_steps(fp16_recipe_run):
    summary = fp16_recipe_run.summary
    assert summary["setup"]["mixed_precision"] == "fp16" and summary["setup"]["distributed_type"] == "NO"
    rows = summary["losses"]
    counts = [row["skipped_steps"] for row in rows]
    check_overflow_handling(rows, lambda i: counts[i] > (counts[i - 1] if i else 0))
    assert summary["eval"][-1]["loss"] < summary["eval"][0]["loss"] - 1.0  # it still learns


def test_fp16_recipe_clips_and_applies_the_unscaled_gradient(fp16_recipe_run, tmp_path, monkeypatch):
    """What AdamW really applies (the probes read it before each of its steps) is the true gradient,
    clipped at --max_grad_norm. At the first step the scaler lets through, the weights are still the
    initial ones (every earlier step was skipped: AdamW untouched), so that gradient is computed here
    in fp32 from the same weights and micro-batch, and its clipped norm must match within 2% (fp16
    autocast against fp32; the loss, within 0.1%, shows the weights and batch are the same; measured
    2026-12-01: step 7, fp32 norm 2.43 clipped to 1.0, loss 5.57734 both ways). Clipping before the
    scaler unscales would clip the scaled gradient (x 2^14 and more here) to the threshold and then
    divide it by the scale: AdamW would get max_grad_norm / scale (measured: 3.8e-6 = 2^-18)."""
    import datasets
    import torch
    from accelerate.utils import set_seed

    from common.data import build_datasets, build_tokenizer
    from common.model import build_model, causal_lm_loss
    from conftest import FP16_ARGS, parse_train

    run, cfg = fp16_recipe_run, parse_train(FP16_ARGS)
    applied, batches, rows = run.probed("applied_gradient")[0], run.batches[0], run.summary["losses"]
    counts = [row["skipped_steps"] for row in rows]
    assert [a["skipped"] for a in applied] == [counts[i] > (counts[i - 1] if i else 0) for i in range(len(rows))]
    first = next(i for i, a in enumerate(applied) if not a["skipped"])

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path)
    tokenizer = build_tokenizer(cfg)
    train_set, _ = build_datasets(cfg, tokenizer)
    set_seed(cfg.seed)
    model = build_model(cfg, len(tokenizer))
    batch = [train_set[i] for i in batches[first]]
    ids, labels = (torch.stack([row[key] for row in batch]) for key in ("input_ids", "labels"))
    loss = causal_lm_loss(model, ids, labels)
    loss.backward()
    assert loss.item() == pytest.approx(rows[first]["loss"], rel=1e-3)
    norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()
    clipped = norm * min(1.0, cfg.max_grad_norm / (norm + 1e-6))  # torch's clip_grad_norm_
    assert applied[first]["norm"] == pytest.approx(clipped, rel=0.02), (applied[first], norm)
    # and at every applied step the clip bounds the true gradient
    assert all(a["norm"] <= cfg.max_grad_norm * (1 + 1e-4) for a in applied if not a["skipped"]), applied


def test_fp16_with_accumulation_and_clipping_unscales_once(fp16_train_run):
    summary = fp16_train_run.summary
    rows = summary["losses"]
    check_overflow_handling(rows, lambda i: not math.isfinite(rows[i]["grad_norm"]))
    assert summary["skipped_steps"]["fp16_overflow"] == sum(not math.isfinite(r["grad_norm"]) for r in rows)
    # Unscaled exactly once: a second unscale_ raises in torch, and without one the clipped
    # norm would be the scaled one (x 2^17 or more). The logged pre-clip norms are O(1).
    finite = [r["grad_norm"] for r in rows if math.isfinite(r["grad_norm"])]
    assert finite and max(finite) < 50


def test_fp16_scaler_state_survives_save_and_load(tmp_path, hf_home):
    import subprocess

    from conftest import ACCELERATE, launch_env

    cmd = [ACCELERATE, "launch", "--cpu", "--mixed_precision", "fp16", "--num_processes", "1",
           str(ROOT / "tests" / "scripts" / "scaler_roundtrip.py"), str(tmp_path / "state")]
    proc = subprocess.run(cmd, env={**launch_env(hf_home), **HARNESS}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "saved (512.0, 1) restored (512.0, 1)" in proc.stdout
    assert (tmp_path / "state" / "scaler.pt").exists()
