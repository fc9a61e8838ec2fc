"""fp16 with a GradScaler: the baseline in fp16 autocast, with the loss scaling fp16 needs.

    accelerate launch --config_file accelerate_configs/fp16.yaml recipes/fp16_scaler.py --preset small
    ACCELERATE_RECIPES_CPU_HARNESS=1 PYTHONPATH=scripts/cpu_harness accelerate launch \
        --config_file accelerate_configs/fp16.yaml --cpu recipes/fp16_scaler.py --preset debug   # CPU

Why fp16 needs a scaler: fp16 has a 5-bit exponent; values below ~6e-8 flush to zero, and many
gradients of a language model are that small. The GradScaler multiplies the loss by a large
factor S before backward, so the fp16 gradients are S times larger and stay representable, and
divides them by S again ("unscales") before they are used. If any gradient overflowed (inf/NaN),
the step is skipped and S halved; after 2000 clean steps S doubles.

Done right here: the gradients are unscaled exactly once per optimizer step, before clipping
(accelerator.clip_grad_norm_ unscales, so the clip threshold applies to the true gradient); a step
the scaler skipped does not advance the LR schedule; the loss scale and the number of skipped steps
are logged every step; the scaler's state is part of accelerator.save_state / load_state.

Prefer bf16 (bf16_baseline.py) wherever the GPU has it (Ampere and newer): it has fp32's 8-bit
exponent, so no scaling, no skipped steps and no scale to checkpoint. fp16 is for older GPUs
(V100, T4) and for fp16-only kernels. fp16 under FSDP2 and DeepSpeed is left to the GPU check.

The delta against bf16_baseline.py is marked `# New:`.
"""

import sys
import time
from dataclasses import dataclass
from pathlib import Path

from accelerate import Accelerator
# New: the GradScaler's settings (its initial scale) go through accelerate's kwargs handler.
from accelerate.utils import DataLoaderConfiguration, GradScalerKwargs, set_seed
# End new
from tqdm.auto import tqdm

from common import config, data, guard
from common import model as modeling
from common.export import check_replaceable, export_pretrained
from common.files import write_json


# New: the GradScaler's option (--fp16_init_scale).
@dataclass
class Options(config.Fp16Options, config.RecipeConfig):
    """The core options, and the GradScaler's initial scale."""
    check_order = (*config.RecipeConfig.check_order, config.Fp16Options)
# End new


def main(argv=None):
    cfg = config.parse(Options, argv, recipe=Path(__file__).name)
    modeling.check_seq_len(cfg)
    if cfg.save_model:  # a model/ that the export may not replace: refused now, not after training
        check_replaceable(Path(cfg.output_dir) / "model")

    # Mixed precision, device and process count come from the launch config. The LR schedule is ours to
    # step (accelerate steps it world_size times); batches are copied from pinned memory without a wait.
    # New: fp16 with a GradScaler, one process or DDP; any other precision belongs to another recipe.
    scaler_kwargs = GradScalerKwargs(init_scale=cfg.fp16_init_scale)
    accelerator = Accelerator(step_scheduler_with_optimizer=False,
                              dataloader_config=DataLoaderConfiguration(non_blocking=True),
                              kwargs_handlers=[scaler_kwargs])
    guard.check_launch(accelerator, Path(__file__).name, supports=("single", "ddp"))
    if accelerator.mixed_precision != "fp16":
        raise config.ConfigError(f"{Path(__file__).name} trains in fp16; launch it with accelerate_configs/fp16.yaml")
    # End new
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
    tokens_per_step = cfg.micro_batch_size * cfg.seq_len * accelerator.num_processes

    def run_eval(step):
        result = modeling.evaluate(model, eval_loader, accelerator, cfg.eval_batches)
        summary["eval"].append({"step": step, **result})
        if accelerator.is_main_process:
            tqdm.write(f"step {step}: eval loss {result['loss']:.4f}  perplexity {result['perplexity']:.2f}")

    if cfg.eval_every > 0:
        run_eval(0)
    model.train()
    step, epoch, last_log_step = 0, 0, 0
    # New: steps the scaler skipped because their gradients overflowed.
    skipped_steps = 0
    # End new
    bar = tqdm(total=cfg.max_steps, disable=not accelerator.is_main_process, desc="train")
    interval_start = time.perf_counter()
    while step < cfg.max_steps:
        train_loader.set_epoch(epoch)  # the shuffle order is a function of (seed, epoch)
        for batch in train_loader:
            loss = modeling.causal_lm_loss(model, batch["input_ids"], batch["labels"])
            accelerator.backward(loss)
            if cfg.max_grad_norm > 0:
                accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
            # New: the scaler skips a step whose gradients overflowed and halves its scale; the
            # schedule must wait. A fused AdamW applies the skip inside its kernel, which accelerate's
            # optimizer_step_was_skipped misses (it says False): a lower scale is the reliable sign.
            scale_before = accelerator.scaler.get_scale()
            optimizer.step()
            if accelerator.scaler.get_scale() < scale_before:
                skipped_steps += 1
            else:
                scheduler.step()
            # End new
            optimizer.zero_grad(set_to_none=True)
            step += 1

            # Every step's loss, averaged over ranks. .item() is a CPU-GPU sync each step: fine
            # for the baseline; train.py batches these syncs up to one per log interval.
            loss_value = accelerator.reduce(loss.detach(), "mean").item()
            summary["losses"].append({"step": step, "loss": loss_value, "lr": scheduler.get_last_lr()[0]})
            # New: the loss scale after this step and the skipped steps so far.
            summary["losses"][-1].update(loss_scale=accelerator.scaler.get_scale(), skipped_steps=skipped_steps)
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
