"""Where a small step's time goes: train.py's per-step work against the bare step, timed in one
process, interleaved (10 steps of each variant in turn, 30 rounds, medians), so the shared machine's
drifts (which move whole runs by +-20% here, see overhead-small) hit every variant alike.

    P=mini MB=12 python benchmarks/step_parts.py      # the `mini` preset, micro-batch 12 x 64 tokens
    P=tiny MB=4 python benchmarks/step_parts.py

Variants on one model and loader: bare (forward, backward, fused AdamW, zero_grad); + clipping at
1.0 and the schedule; "recipe-like": the operations of recipes/train.py's loop for one micro-batch
(accelerate's loader, accumulate and backward, the token-normalised loss, the NaN/preemption stack
and its host sync, accelerate's clip_grad_norm_, optimizer and scheduler wrappers), written out here
to time them; keep it in step with the recipe by hand. Prints the medians; writes nothing.
"""

import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
torch.set_num_threads(2)
from accelerate import Accelerator  # noqa: E402
from accelerate.utils import GradientAccumulationPlugin  # noqa: E402

from common import data  # noqa: E402
from common import model as modeling  # noqa: E402
from train_extras.options import TrainConfig  # noqa: E402

ROUNDS = 30


def main():
    cfg = TrainConfig(preset=os.environ.get("P", "mini"), micro_batch_size=int(os.environ.get("MB", "12")),
                      seq_len=64, max_steps=100000, warmup_steps=3)
    tokenizer = data.build_tokenizer(cfg)
    loader, _ = data.build_loaders(cfg, *data.build_datasets(cfg, tokenizer), pin_memory=False)
    accelerator = Accelerator(cpu=True, step_scheduler_with_optimizer=False, gradient_accumulation_plugin=
                              GradientAccumulationPlugin(num_steps=1, sync_with_dataloader=False))
    torch.manual_seed(0)
    model = modeling.build_model(cfg, len(tokenizer))
    optimizer = modeling.build_optimizer(model, cfg, accelerator.device)
    scheduler = modeling.build_scheduler(optimizer, cfg)
    p_model, p_optimizer, p_loader, p_scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    raw, prepared = forever(loader), forever(p_loader)
    vote, pending = torch.zeros(()), []

    def bare():
        batch = next(raw)
        modeling.causal_lm_loss(model, batch["input_ids"], batch["labels"]).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def bare_clip_schedule():
        batch = next(raw)
        modeling.causal_lm_loss(model, batch["input_ids"], batch["labels"]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)

    def recipe_like():  # recipes/train.py's loop body, one micro-batch, one process
        micro_batches = [next(prepared)]
        step_tokens = accelerator.reduce(sum((b["labels"] != -100).sum() for b in micro_batches), "sum")
        scale = accelerator.num_processes / step_tokens
        loss_sum = torch.zeros(())
        for batch in micro_batches:
            with accelerator.accumulate(p_model):
                micro_sum = modeling.causal_lm_loss(p_model, batch["input_ids"], batch["labels"], reduction="sum")
                accelerator.backward(micro_sum * scale)
            loss_sum += micro_sum.detach()
        loss_and_votes = accelerator.reduce(torch.stack([loss_sum, vote.fill_(0.0)]), "sum")
        step_loss = loss_and_votes[0] / step_tokens
        torch.stack([torch.isfinite(step_loss).float(), loss_and_votes[1]]).tolist()
        grad_norm = accelerator.clip_grad_norm_(p_model.parameters(), 1.0)
        p_optimizer.step()
        if not accelerator.optimizer_step_was_skipped:
            p_scheduler.step()
        p_optimizer.zero_grad(set_to_none=True)
        pending.append((p_optimizer.param_groups[0]["lr"], step_loss, grad_norm.detach().float()))

    variants = {"bare": bare, "bare + clip + schedule": bare_clip_schedule, "train.py's step": recipe_like}
    times = {name: [] for name in variants}
    for step in variants.values():  # warm-up
        for _ in range(10):
            step()
    for _ in range(ROUNDS):
        for name, step in variants.items():
            t0 = time.perf_counter()
            for _ in range(10):
                step()
            times[name].append((time.perf_counter() - t0) / 10 * 1e3)
        pending.clear()
    base = statistics.median(times["bare"])
    print(f"{cfg.preset}, micro-batch {cfg.micro_batch_size} x {cfg.seq_len}, {torch.get_num_threads()} threads, "
          f"{ROUNDS} rounds of 10 steps each:")
    for name, values in times.items():
        print(f"  {name:24s} median {statistics.median(values):6.2f} ms  ({statistics.median(values) / base:.3f}x)")


def forever(loader):
    while True:
        yield from loader


if __name__ == "__main__":
    main()
