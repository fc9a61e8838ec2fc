"""Launched by tests/test_precision.py under the CPU harness with fp16: the GradScaler's state
(scale and growth tracker) goes through accelerator.save_state / load_state."""

import sys

import torch
from accelerate import Accelerator
from accelerate.utils import GradScalerKwargs

accelerator = Accelerator(kwargs_handlers=[GradScalerKwargs(init_scale=2.0**10, growth_interval=3)])
assert accelerator.scaler is not None and accelerator.mixed_precision == "fp16"
model = torch.nn.Linear(4, 4)
optimizer = torch.optim.AdamW(model.parameters())
model, optimizer = accelerator.prepare(model, optimizer)

accelerator.backward(model(torch.ones(2, 4)).sum())
for param in model.parameters():
    param.grad[0] = float("inf")  # a real overflow: the scaler must skip and halve
optimizer.step()
optimizer.zero_grad()
accelerator.backward(model(torch.ones(2, 4)).sum())  # a clean step: the growth tracker counts 1
optimizer.step()
saved = (accelerator.scaler.get_scale(), accelerator.scaler._get_growth_tracker())
accelerator.save_state(sys.argv[1])

accelerator.scaler.update(new_scale=1.0)  # clobber, then restore
accelerator.load_state(sys.argv[1])
restored = (accelerator.scaler.get_scale(), accelerator.scaler._get_growth_tracker())
print(f"saved {saved} restored {restored}")
assert saved == (2.0**9, 1) and restored == saved, (saved, restored)
