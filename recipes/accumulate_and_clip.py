"""Gradient accumulation with token-normalised loss and clipping on the full gradient, in every strategy.

    accelerate launch --config_file accelerate_configs/single_gpu.yaml recipes/accumulate_and_clip.py \
        --gradient_accumulation_steps 8 --packing false --data_files my_docs.txt --txt_documents line
    accelerate launch --config_file accelerate_configs/fsdp.yaml recipes/accumulate_and_clip.py \
        --gradient_accumulation_steps 4

Accumulation: an optimizer step takes gradient_accumulation_steps micro-batches. Inside
`accelerator.accumulate` the non-final micro-batches run backward without DDP's gradient
all-reduce (no_sync); the last one synchronises the summed gradients once.

Normalisation: the step's loss is the mean over every target token of the step, across all
micro-batches and all ranks, not a mean of per-micro-batch means (which over-weights the tokens of
short rows whenever rows carry different numbers of targets, e.g. padded fine-tuning data,
--packing false). So the step's micro-batches are gathered first, their target tokens counted and
summed over ranks (one scalar all-reduce), and each micro-batch's summed loss is divided by that
count. accelerator.backward (and DeepSpeed's engine) divide by gradient_accumulation_steps and
gradient averaging divides by the world size; both are multiplied back in. transformers' Trainer does the
same with `num_items_in_batch`.

Clipping: on the full gradient, after the last micro-batch (under fp16 after unscaling), once per
optimizer step; the logged norm is the pre-clip one, and the norm after clipping is logged too.
Under DeepSpeed clipping happens inside its step, from `gradient_clipping` (= --max_grad_norm).

The delta against bf16_baseline.py is marked `# New:`.
"""

import sys
import time
from dataclasses import dataclass
from pathlib import Path

# New: tensors for the step's loss and token count.
import torch
# End new
from accelerate import Accelerator
# New: accumulation that syncs on a micro-batch count (not at epoch ends).
from accelerate.utils import (DataLoaderConfiguration, DistributedType, GradientAccumulationPlugin,
                               parse_flag_from_env, set_seed)
# End new
from tqdm.auto import tqdm

from common import config, data, guard
from common import model as modeling
from common.export import check_replaceable, export_pretrained
from common.files import write_json


# New: the accumulation option (--gradient_accumulation_steps); gradient norms as numbers.
@dataclass
class Options(config.AccumulationOptions, config.RecipeConfig):
    """The core options, and the number of micro-batches per optimizer step."""
    check_order = (*config.RecipeConfig.check_order, config.AccumulationOptions)


def as_float(norm) -> float:
    """FSDP2 returns a gradient norm as a DTensor, DeepSpeed as a float, the rest as a tensor."""
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
# End new


def main(argv=None):
    cfg = config.parse(Options, argv, recipe=Path(__file__).name)
    modeling.check_seq_len(cfg)
    if cfg.save_model:  # a model/ that the export may not replace: refused now, not after training
        check_replaceable(Path(cfg.output_dir) / "model")

    # Mixed precision, device and process count come from the launch config. The LR schedule is ours to
    # step (accelerate steps it world_size times); batches are copied from pinned memory without a wait.
    # New: every strategy; accumulation counted in micro-batches, so an epoch boundary inside an
    # accumulation window does not force an early optimizer step.
    # Under FSDP2, gradients are reduce-scattered every micro-batch: each rank keeps a shard's gradient
    # between micro-batches, not the whole model's unsharded one (no_sync's way, one reduction a step).
    plugin = GradientAccumulationPlugin(num_steps=cfg.gradient_accumulation_steps, sync_with_dataloader=False,
                                        sync_each_batch=parse_flag_from_env("ACCELERATE_USE_FSDP"))
    accelerator = Accelerator(step_scheduler_with_optimizer=False, gradient_accumulation_plugin=plugin,
                              dataloader_config=DataLoaderConfiguration(non_blocking=True))
    guard.check_launch(accelerator, Path(__file__).name, supports=("single", "ddp", "fsdp", "deepspeed"))
    if accelerator.distributed_type == DistributedType.DEEPSPEED:  # DeepSpeed clips inside its own step
        accelerator.state.deepspeed_plugin.deepspeed_config["gradient_clipping"] = cfg.max_grad_norm
    # End new
    if accelerator.mixed_precision == "fp16":
        raise config.ConfigError(f"{Path(__file__).name} does not handle fp16 loss scaling; use fp16_scaler.py")
    set_seed(cfg.seed)

    tokenizer = data.build_tokenizer(cfg)
    with accelerator.main_process_first():  # rank 0 builds the tokenised cache, the others reuse it
        train_set, eval_set = data.build_datasets(cfg, tokenizer)
    train_loader, eval_loader = data.build_loaders(
        cfg, train_set, eval_set, pin_memory=accelerator.device.type == "cuda"
    )
    setup = config.setup_facts(cfg, accelerator)
    if accelerator.is_main_process:
        print(config.describe_setup(setup), flush=True)

    model = modeling.build_model(cfg, len(tokenizer))
    optimizer = modeling.build_optimizer(model, cfg, accelerator.device)
    scheduler = modeling.build_scheduler(optimizer, cfg)
    model, optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, eval_loader, scheduler
    )

    # The run's record, kept in <output_dir>/run_summary.json: the setup, losses, evals, throughput.
    summary = {"recipe": Path(__file__).name, "setup": setup, "losses": [], "eval": [], "throughput": []}
    # New: an optimizer step now spans several micro-batches, gathered before their backward.
    tokens_per_step = cfg.micro_batch_size * cfg.seq_len * accelerator.num_processes
    tokens_per_step *= cfg.gradient_accumulation_steps
    micro_batches = []
    # End new

    def run_eval(step):
        result = modeling.evaluate(model, eval_loader, accelerator, cfg.eval_batches)
        summary["eval"].append({"step": step, **result})
        if accelerator.is_main_process:
            tqdm.write(f"step {step}: eval loss {result['loss']:.4f}  perplexity {result['perplexity']:.2f}")

    if cfg.eval_every > 0:
        run_eval(0)
    model.train()
    step, epoch, last_log_step = 0, 0, 0
    bar = tqdm(total=cfg.max_steps, disable=not accelerator.is_main_process, desc="train")
    interval_start = time.perf_counter()
    while step < cfg.max_steps:
        train_loader.set_epoch(epoch)  # the shuffle order is a function of (seed, epoch)
        for batch in train_loader:
            # New: gather the step's micro-batches; normalise by all of its target tokens on all
            # ranks; backward each inside accumulate (no all-reduce before the last one).
            micro_batches.append(batch)
            if len(micro_batches) < cfg.gradient_accumulation_steps:
                continue
            step_tokens = accelerator.reduce(sum((b["labels"] != -100).sum() for b in micro_batches), "sum")
            scale = cfg.gradient_accumulation_steps * accelerator.num_processes / step_tokens
            loss_sum = torch.zeros((), device=accelerator.device)
            for micro in micro_batches:
                with accelerator.accumulate(model):
                    micro_sum = modeling.causal_lm_loss(model, micro["input_ids"], micro["labels"], reduction="sum")
                    accelerator.backward(micro_sum * scale)
                loss_sum += micro_sum.detach()
            micro_batches = []
            loss = accelerator.reduce(loss_sum, "sum") / step_tokens  # the step's token mean, on every rank
            # Clip the full gradient once (fp16: unscaled first). Pre-clip norm returned; inf = measure only.
            grad_norm = accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm or float("inf"))
            if accelerator.distributed_type != DistributedType.DEEPSPEED:  # DeepSpeed keeps its gradients inside
                clipped_norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None])
            else:
                clipped_norm = float("nan")
            # End new
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1

            # Every step's loss, averaged over ranks. .item() is a CPU-GPU sync each step: fine
            # for the baseline; train.py batches these syncs up to one per log interval.
            loss_value = accelerator.reduce(loss.detach(), "mean").item()
            summary["losses"].append({"step": step, "loss": loss_value, "lr": scheduler.get_last_lr()[0]})
            # New: the pre-clip norm and the norm after clipping.
            summary["losses"][-1].update(grad_norm=as_float(grad_norm), grad_norm_after_clip=as_float(clipped_norm))
            # End new
            if step % cfg.log_every == 0 or step == cfg.max_steps:
                elapsed = time.perf_counter() - interval_start
                tokens_per_s = (step - last_log_step) * tokens_per_step / elapsed
                summary["throughput"].append({"step": step, "tokens_per_s": tokens_per_s})
                bar.set_postfix(loss=f"{loss_value:.4f}", lr=f"{scheduler.get_last_lr()[0]:.2e}",
                                tok_s=f"{tokens_per_s:,.0f}")
                interval_start, last_log_step = time.perf_counter(), step
            bar.update(1)
            if cfg.eval_every > 0 and (step % cfg.eval_every == 0 or step == cfg.max_steps):
                run_eval(step)
            if step == cfg.max_steps:
                break
        epoch += 1
    bar.close()

    if cfg.save_model:
        summary["export"] = str(export_pretrained(accelerator, model, tokenizer, f"{cfg.output_dir}/model"))
    if accelerator.is_main_process:
        write_json(f"{cfg.output_dir}/run_summary.json", summary)
        print(f"done: {step} steps -> {cfg.output_dir}", flush=True)
    accelerator.wait_for_everyone()  # no rank tears down the process group while another still uses it
    accelerator.end_training()


if __name__ == "__main__":
    sys.exit(config.run_cli(main))
