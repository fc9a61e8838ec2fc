"""Learning-rate schedules: a thin selector over transformers' implementations (none written here).

All are defined in optimizer steps and start with a linear warmup to --lr (from 0; WSD, as
transformers implements it, from min_lr_ratio * lr):
  cosine    cosine decay to min_lr_ratio * lr at max_steps
  linear    linear decay to 0 at max_steps
  constant  flat at lr after warmup
  wsd       warmup-stable-decay: flat, then the last decay_fraction of steps decays (cosine) to
            min_lr_ratio * lr; lets a run be extended or branched from the stable phase
"""

from __future__ import annotations

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR
from transformers import (
    get_constant_schedule_with_warmup,
    get_cosine_with_min_lr_schedule_with_warmup,
    get_linear_schedule_with_warmup,
    get_wsd_schedule,
)

from common.config import TrainConfig


def build_scheduler(optimizer: Optimizer, cfg: TrainConfig) -> LambdaLR:
    warmup, total = cfg.warmup_steps, cfg.max_steps
    if cfg.lr_schedule == "cosine":
        return get_cosine_with_min_lr_schedule_with_warmup(
            optimizer, num_warmup_steps=warmup, num_training_steps=total, min_lr_rate=cfg.min_lr_ratio
        )
    if cfg.lr_schedule == "linear":
        return get_linear_schedule_with_warmup(optimizer, num_warmup_steps=warmup, num_training_steps=total)
    if cfg.lr_schedule == "constant":
        return get_constant_schedule_with_warmup(optimizer, num_warmup_steps=warmup)
    if cfg.lr_schedule == "wsd":
        decay = max(1, round(cfg.decay_fraction * total))
        return get_wsd_schedule(
            optimizer,
            num_warmup_steps=warmup,
            num_decay_steps=decay,
            num_training_steps=total,
            min_lr_ratio=cfg.min_lr_ratio,
        )
    raise ValueError(f"unknown schedule {cfg.lr_schedule!r}")  # unreachable: the parser checks choices
