"""The smallest correct training loop: bf16 autocast on one GPU. Every other recipe is this plus
its own delta.

    accelerate launch --config_file accelerate_configs/single_gpu.yaml recipes/bf16_baseline.py --preset small
    accelerate launch --config_file accelerate_configs/cpu.yaml recipes/bf16_baseline.py --preset debug

bf16 autocast runs matmuls in bf16 while weights, AdamW state and the loss softmax stay fp32.
bf16 keeps fp32's 8-bit exponent, so gradients do not underflow and no loss scaling is needed
(compare fp16_scaler.py). The precision comes from the launch config (`mixed_precision`), so the
same file also runs in fp32 (`no`).

Left out on purpose (see train.py): gradient accumulation, fp16 loss scaling, resumable checkpoints,
trackers; their options do not exist here (`--help` lists what this file implements).
"""

import sys
import time
from dataclasses import dataclass
from pathlib import Path

from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, set_seed
from tqdm.auto import tqdm

from common import config, data, guard
from common import model as modeling
from common.export import check_replaceable, export_pretrained
from common.files import write_json


@dataclass
class Options(config.RecipeConfig):
    """The core options: run, model, data, optimizer, eval and export."""


def main(argv=None):
    cfg = config.parse(Options, argv, recipe=Path(__file__).name)
    modeling.check_seq_len(cfg)
    if cfg.save_model:  # a model/ that the export may not replace: refused now, not after training
        check_replaceable(Path(cfg.output_dir) / "model")

    # Mixed precision, device and process count come from the launch config. The LR schedule is ours to
    # step (accelerate steps it world_size times); batches are copied from pinned memory without a wait.
    accelerator = Accelerator(step_scheduler_with_optimizer=False,
                              dataloader_config=DataLoaderConfiguration(non_blocking=True))
    guard.check_launch(accelerator, Path(__file__).name, supports=("single",))
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
    bar = tqdm(total=cfg.max_steps, disable=not accelerator.is_main_process, desc="train")
    interval_start = time.perf_counter()
    while step < cfg.max_steps:
        train_loader.set_epoch(epoch)  # the shuffle order is a function of (seed, epoch)
        for batch in train_loader:
            loss = modeling.causal_lm_loss(model, batch["input_ids"], batch["labels"])
            accelerator.backward(loss)
            if cfg.max_grad_norm > 0:
                accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1

            # Every step's loss, averaged over ranks. .item() is a CPU-GPU sync each step: fine
            # for the baseline; train.py batches these syncs up to one per log interval.
            loss_value = accelerator.reduce(loss.detach(), "mean").item()
            summary["losses"].append({"step": step, "loss": loss_value, "lr": scheduler.get_last_lr()[0]})
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
