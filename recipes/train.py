"""The complete recipe: trains a causal LM with whatever strategy the launch config names.

    accelerate launch recipes/train.py                       # CPU or 1 GPU, embedded data, no download
    accelerate launch --config_file accelerate_configs/cpu.yaml recipes/train.py --preset debug
    accelerate launch --config_file accelerate_configs/single_gpu.yaml recipes/train.py --preset small

Options: `python recipes/train.py --help` (or a YAML file with --config). Data flow, in order:
config -> Accelerator -> tokenizer -> data -> model -> prepare -> loop (forward, loss, backward,
clip, step, schedule, log, eval) -> Hugging Face export -> run_summary.json.

Features: mixed precision from the launch config (no / bf16), gradient accumulation, gradient
clipping, four LR schedules, periodic held-out eval (loss, perplexity), gradient checkpointing,
pretrained start (--model_name_or_path), fused AdamW, tqdm bar with loss, lr and tokens/s.
Not yet: resumable checkpoints, trackers, the multi-process strategies' start-up guard
(see the README's status table).
"""

import math
import sys
import time

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import GradientAccumulationPlugin, set_seed
from tqdm.auto import tqdm

from common import checkpoint, config, data, metrics, strategy
from common import model as modeling
from common.schedule import build_scheduler


def batches_forever(loader):
    """Micro-batches across epochs; each epoch's order is a function of (seed, epoch)."""
    epoch = 0
    while True:
        loader.set_epoch(epoch)
        yield from loader
        epoch += 1


def main(argv=None):
    # ---- config: every check that needs no model runs here, before anything heavy ----
    cfg = config.parse_config(argv)
    modeling.check_seq_len(cfg)

    # Sync on a count of micro-batches, not at the end of the dataloader: an epoch boundary in
    # the middle of an accumulation window must not trigger an early optimizer step.
    plugin = GradientAccumulationPlugin(num_steps=cfg.grad_accum_steps, sync_with_dataloader=False)
    # We step the LR schedule ourselves, once per optimizer step (accelerate would step it once
    # per process per optimizer step, i.e. world_size times too fast for a schedule in steps).
    accelerator = Accelerator(
        gradient_accumulation_plugin=plugin,
        step_scheduler_with_optimizer=False,
        fsdp_plugin=strategy.fsdp_plugin(),  # None unless the config asks for FSDP
    )
    strategy.check_launch(accelerator, "train.py", supports=("single", "ddp", "fsdp", "deepspeed"))
    strategy.configure_deepspeed(accelerator, cfg)  # DeepSpeed clips in its step: pass --max_grad_norm on
    set_seed(cfg.seed)  # the same seed on every rank: identical initial weights everywhere

    tokenizer = data.build_tokenizer(cfg)
    model_cfg = modeling.model_config(cfg, len(tokenizer))
    flops_per_token = modeling.flops_per_token(model_cfg, cfg.seq_len)

    # ---- data: rank 0 tokenises and caches first; the other ranks then read its cache ----
    with accelerator.main_process_first():
        train_set, eval_set = data.build_datasets(cfg, tokenizer)
    train_loader, eval_loader = data.build_loaders(
        cfg, train_set, eval_set, pin_memory=accelerator.device.type == "cuda"
    )
    # Printed once the data is known to be good, so bad input stays a one-line error.
    setup = config.setup_facts(cfg, accelerator)
    if accelerator.is_main_process:
        print(config.describe_setup(cfg, accelerator, {
            "model": cfg.model_name_or_path or f"preset {cfg.preset} (random init)",
            "FLOPs/token": f"{flops_per_token:.3e} (6N + 12LHQT)",
            "data": f"{len(train_set)} train / {len(eval_set)} held-out blocks of {cfg.seq_len + 1} tokens",
        }), flush=True)

    # ---- model, optimizer, schedule ----
    model = modeling.build_model(cfg, len(tokenizer))
    num_params = metrics.count_parameters(model)
    optimizer = modeling.build_optimizer(model, cfg, accelerator.device)
    scheduler = build_scheduler(optimizer, cfg)
    model, optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, eval_loader, scheduler
    )

    summary = {
        "recipe": "train.py",
        "setup": setup,
        "model": {"parameters": num_params, "flops_per_token": flops_per_token},
        "data": {
            "train_blocks": len(train_set),
            "eval_blocks": len(eval_set),
            "eval_bigram_entropy": data.bigram_entropy(eval_set.blocks.reshape(-1)),
        },
        "parameters_per_rank": metrics.parameter_facts(model, accelerator),  # at rest, after prepare
        "optimizer_groups": metrics.optimizer_facts(optimizer),
        "losses": [],
        "eval": [],
        "throughput": [],
    }
    tokens_per_step = cfg.micro_batch_size * cfg.seq_len * cfg.grad_accum_steps * accelerator.num_processes

    def run_eval(step):
        result = metrics.evaluate(model, eval_loader, accelerator, cfg.eval_batches)
        summary["eval"].append({"step": step, **result})
        if accelerator.is_main_process:
            tqdm.write(f"step {step}: eval loss {result['loss']:.4f}  perplexity {result['perplexity']:.2f}")

    # ---- training loop ----
    if cfg.eval_every > 0:
        run_eval(0)
    model.train()
    batches = batches_forever(train_loader)
    pending = []  # per-step losses kept on device; fetched at log points (one sync per interval)
    interval_start, interval_steps = time.perf_counter(), 0
    bar = tqdm(total=cfg.max_steps, disable=not accelerator.is_main_process, desc="train")
    for step in range(1, cfg.max_steps + 1):
        micro_losses = []
        for _ in range(cfg.grad_accum_steps):
            batch = next(batches)
            with accelerator.accumulate(model):  # no gradient all-reduce before the last micro-batch
                loss = modeling.causal_lm_loss(model, batch["input_ids"], batch["labels"])
                accelerator.backward(loss)  # divides by grad_accum_steps
            micro_losses.append(loss.detach())
        # The last micro-batch synchronised the gradients: clip, step and schedule once.
        if cfg.max_grad_norm > 0:
            accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        pending.append((step, scheduler.get_last_lr()[0], torch.stack(micro_losses).mean()))
        interval_steps += 1

        if step % cfg.log_every == 0 or step == cfg.max_steps:
            # Mean over ranks; .tolist() is the CPU-GPU sync that makes the timing honest.
            step_losses = accelerator.reduce(torch.stack([l for _, _, l in pending]), "mean").tolist()
            elapsed = time.perf_counter() - interval_start
            tokens_per_s = interval_steps * tokens_per_step / elapsed
            for (s, lr, _), value in zip(pending, step_losses):
                summary["losses"].append({"step": s, "loss": value, "lr": lr})
            summary["throughput"].append({"step": step, "tokens_per_s": tokens_per_s})
            bar.set_postfix(loss=f"{step_losses[-1]:.4f}", lr=f"{pending[-1][1]:.2e}", tok_s=f"{tokens_per_s:,.0f}")
            bar.update(interval_steps)
            pending, interval_start, interval_steps = [], time.perf_counter(), 0
        if cfg.eval_every > 0 and (step % cfg.eval_every == 0 or step == cfg.max_steps):
            run_eval(step)
    bar.close()

    # ---- export and record ----
    summary["tokens_seen"] = cfg.max_steps * tokens_per_step
    if cfg.save_model:
        out = checkpoint.export_pretrained(accelerator, model, tokenizer, f"{cfg.output_dir}/model")
        probe = eval_set[0]["input_ids"][:8]
        summary["export"] = {
            "path": str(out),
            "probe_input_ids": probe.tolist(),
            "probe_logits": checkpoint.probe_logits(accelerator, model, probe),
        }
    summary["peak_memory_per_rank"] = metrics.peak_memory(accelerator)
    if accelerator.is_main_process:
        rates = [t["tokens_per_s"] for t in summary["throughput"]]
        summary["tokens_per_s_median"] = float(np.median(rates))
        metrics.write_summary(f"{cfg.output_dir}/run_summary.json", summary)
        final = summary["eval"][-1]["loss"] if summary["eval"] else math.nan
        print(f"done: {cfg.max_steps} steps, final eval loss {final:.4f} "
              f"(bigram entropy of held-out data {summary['data']['eval_bigram_entropy']:.4f}), "
              f"median {summary['tokens_per_s_median']:,.0f} tokens/s -> {cfg.output_dir}", flush=True)
    accelerator.wait_for_everyone()  # no rank tears down the process group while another still uses it
    accelerator.end_training()


if __name__ == "__main__":
    sys.exit(config.run_cli(main))
