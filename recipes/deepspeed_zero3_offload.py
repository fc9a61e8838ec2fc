"""DeepSpeed ZeRO-3 with CPU offload: the baseline on a DeepSpeed engine that partitions everything
and keeps the partitions of parameters and optimizer state in CPU RAM.

    accelerate launch --config_file accelerate_configs/deepspeed_zero3_offload.yaml \
        recipes/deepspeed_zero3_offload.py --preset 8b
    ACCELERATE_RECIPES_CPU_HARNESS=1 PYTHONPATH=scripts/cpu_harness accelerate launch \
        --config_file accelerate_configs/deepspeed_zero3_offload.yaml --num_processes 2 \
        recipes/deepspeed_zero3_offload.py --preset debug     # CPU, gloo

What ZeRO-3 does: with zero3_init_flag the model is built inside deepspeed.zero.Init, so each
rank materialises only its 1/N partition of every parameter. Forward and backward gather each
layer's parameters when needed and release them after; gradients are reduce-scattered to the
rank owning each partition. With offload, parameter partitions wait in CPU RAM between uses and
the optimizer step runs on the CPU (DeepSpeedCPUAdam, to which accelerate maps the recipe's
torch AdamW with its parameter groups).

Memory per rank (read from DeepSpeed's code, docs/toolchain.md#zero-3-fp32-master-copy): GPU:
almost nothing at rest, the gathered layers and activations at peak. CPU RAM: the parameter
partition, a separate fp32 master copy, fp32 gradients and two AdamW moments: about
(4 + 4 + 4 + 8)/N = 20/N bytes per parameter in fp32 training, not the 16/N of the ZeRO paper's
accounting.

Communication per optimizer step: all-gather of parameters in forward and in backward and a
reduce-scatter of gradients (like FSDP, about 1.5x DDP), plus PCIe traffic: parameters to the GPU
twice, gradients back once. Gradient clipping is done by DeepSpeed inside its step, from
`gradient_clipping` in the JSON, set from --max_grad_norm (below); the export writes
the 16-bit consolidated weights (stage3_gather_16bit_weights_on_model_save).

The delta against bf16_baseline.py is marked `# New:`.
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


# New: DeepSpeed clips at its config's gradient_clipping (train.py's rule is the same, in
# train_extras/parallel/deepspeed_settings.py; tests/test_strategy_settings.py holds them equal).
def set_clipping(ds_config: dict, max_grad_norm: float) -> None:
    clip = ds_config.get("gradient_clipping", "auto")
    if clip == "auto":
        ds_config["gradient_clipping"] = max_grad_norm
    elif float(clip) != max_grad_norm:
        raise config.ConfigError(f"the DeepSpeed config clips gradients at {clip} but --max_grad_norm is "
                                 f'{max_grad_norm}; set gradient_clipping to "auto" in the JSON or pass the same value')


# End new
def main(argv=None):
    cfg = config.parse(Options, argv, recipe=Path(__file__).name)
    modeling.check_seq_len(cfg)
    if cfg.save_model:  # a model/ that the export may not replace: refused now, not after training
        check_replaceable(Path(cfg.output_dir) / "model")

    # Mixed precision, device and process count come from the launch config. The LR schedule is ours to
    # step (accelerate steps it world_size times); batches are copied from pinned memory without a wait.
    accelerator = Accelerator(step_scheduler_with_optimizer=False,
                              dataloader_config=DataLoaderConfiguration(non_blocking=True))
    # New: DeepSpeed ZeRO-3 only. DeepSpeed clips inside its own step, at `gradient_clipping` of its
    # config, which accelerate fills with 1.0 when the JSON says "auto": set it to --max_grad_norm
    # (0 = off) before prepare builds the engine; a JSON with another number is refused.
    guard.check_launch(accelerator, Path(__file__).name, supports=("deepspeed",))
    ds_config = accelerator.state.deepspeed_plugin.deepspeed_config
    if ds_config["zero_optimization"]["stage"] != 3:
        raise config.ConfigError(f"{Path(__file__).name} is ZeRO-3; the DeepSpeed config has stage "
                                 f"{ds_config['zero_optimization']['stage']}")
    set_clipping(ds_config, cfg.max_grad_norm)
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
            # New: accelerator.backward ran the engine's backward *and* step, clipping included;
            # the optimizer.step() and zero_grad() below are no-ops kept for the shared loop shape.
            # End new
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
