"""The schedule selector: values at step 0, end of warmup, and end, for each schedule."""

import pytest
import torch

from train_extras.options import TrainConfig
from common.model import build_scheduler


pytestmark = pytest.mark.quick  # launches nothing: docs/testing.md#running-the-tests


def lr_at(cfg: TrainConfig, step: int) -> float:
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=cfg.lr)
    scheduler = build_scheduler(optimizer, cfg)
    for _ in range(step):
        optimizer.step()
        scheduler.step()
    return scheduler.get_last_lr()[0]


@pytest.mark.parametrize("name, start, end", [
    ("cosine", 0.0, 0.1),  # ends at min_lr_ratio * lr
    ("linear", 0.0, 0.0),
    ("constant", 0.0, 1.0),
    ("wsd", 0.1, 0.1),  # transformers' WSD warms up from min_lr_ratio * lr, not from 0
])
def test_schedule_values(name, start, end):
    cfg = TrainConfig(lr=1.0, lr_schedule=name, warmup_steps=10, max_steps=100, min_lr_ratio=0.1,
                      decay_fraction=0.2)
    assert lr_at(cfg, 0) == pytest.approx(start)
    assert lr_at(cfg, 5) == pytest.approx((start + 1.0) / 2)
    assert lr_at(cfg, 10) == pytest.approx(1.0)
    assert lr_at(cfg, 100) == pytest.approx(end, abs=1e-9)


def test_cosine_midpoint_and_wsd_stable_phase():
    cosine = TrainConfig(lr=1.0, lr_schedule="cosine", warmup_steps=10, max_steps=110, min_lr_ratio=0.0)
    assert lr_at(cosine, 60) == pytest.approx(0.5)  # half-way through the decay
    wsd = TrainConfig(lr=1.0, lr_schedule="wsd", warmup_steps=10, max_steps=100, decay_fraction=0.2)
    assert lr_at(wsd, 80) == pytest.approx(1.0)  # still stable until the last 20 steps
    assert lr_at(wsd, 90) < 1.0
