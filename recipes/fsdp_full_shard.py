"""FSDP2 full shard: the baseline with parameters, gradients and optimizer state split across ranks.

    accelerate launch --config_file accelerate_configs/fsdp.yaml recipes/fsdp_full_shard.py --preset 1b
    ACCELERATE_RECIPES_CPU_HARNESS=1 PYTHONPATH=scripts/cpu_harness accelerate launch \
        --config_file accelerate_configs/fsdp.yaml --num_processes 2 \
        recipes/fsdp_full_shard.py --preset debug                                  # CPU, gloo

What FSDP2 does: accelerate applies torch's `fully_shard` to every transformer block (the model's
own class: LlamaDecoderLayer, GPT2Block, Qwen2DecoderLayer...) and to the root model. Each
parameter becomes a DTensor sharded on dim 0 (rank r keeps rows r/N..(r+1)/N).
Before a layer runs, its parameters are all-gathered; with reshard_after_forward (full shard)
they are freed right after its forward and gathered again for its backward; its gradients are
reduce-scattered so each rank keeps only the gradient of its own shard, and AdamW updates only
that shard.

Memory per rank at rest: (4 parameters + 4 gradients + 8 AdamW moments) / N = 16/N bytes per
parameter in fp32 (the master shards stay fp32 under bf16 mixed precision), plus, at peak, the
gathered (bf16 under mixed precision) parameters of about two layers (the one computing and the
one prefetched) and the activations.

Communication per optimizer step: all-gather of parameters in forward and again in backward, and a
reduce-scatter of gradients: about 1.5x DDP's volume, overlapped with compute by prefetching the
next layer. Gradients are reduced in fp32 (set below; the YAML has no key for it).

Export: the sharded model is gathered into full tensors on rank 0 (common/export.py) and
written as one Hugging Face folder. The delta against bf16_baseline.py is marked `# New:`.
"""

import sys
import time
from dataclasses import dataclass
from pathlib import Path

# New: FSDP2's plugin and the policies it is given here.
import os

import torch
from accelerate import FullyShardedDataParallelPlugin
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
# End new
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


# New: the two FSDP2 policies the YAML cannot express (train.py takes the same ones from
# train_extras/parallel/fsdp_settings.py; tests/test_strategy_settings.py holds them equal).
def fsdp_policies() -> dict:
    policies = {}
    compute = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(os.environ.get("ACCELERATE_MIXED_PRECISION"))
    if compute is not None:
        policies["mixed_precision_policy"] = MixedPrecisionPolicy(
            param_dtype=compute, reduce_dtype=torch.float32, output_dtype=compute)
    if guard.flag("FSDP_OFFLOAD_PARAMS"):
        policies["cpu_offload"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    return policies


# End new
def main(argv=None):
    cfg = config.parse(Options, argv, recipe=Path(__file__).name)
    modeling.check_seq_len(cfg)
    if cfg.save_model:  # a model/ that the export may not replace: refused now, not after training
        check_replaceable(Path(cfg.output_dir) / "model")

    # Mixed precision, device and process count come from the launch config. The LR schedule is ours to
    # step (accelerate steps it world_size times); batches are copied from pinned memory without a wait.
    # New: FSDP2 from the launch config (fsdp.yaml), plus the two policies its YAML cannot express.
    # Mixed precision: compute in bf16/fp16 copies of the weights, but reduce-scatter gradients in
    # fp32 (accelerate would reduce in the compute dtype, summing N ranks' contributions with an
    # 8-bit mantissa); twice the reduce-scatter bytes, the sum exact to fp32 (torchtitan's default).
    # Offload (fsdp_offload_params): pinned host memory only where there is a GPU (accelerate
    # always pins, and pinning fails without one). Shard units: accelerate wraps every block of
    # the model's own class (its _no_split_modules: LlamaDecoderLayer, GPT2Block...) and the root.
    accelerator = Accelerator(step_scheduler_with_optimizer=False,
                              dataloader_config=DataLoaderConfiguration(non_blocking=True),
                              fsdp_plugin=FullyShardedDataParallelPlugin(**fsdp_policies()))
    guard.check_launch(accelerator, Path(__file__).name, supports=("fsdp",))
    if not accelerator.state.fsdp_plugin.reshard_after_forward:
        raise config.ConfigError(f"{Path(__file__).name} needs fsdp_reshard_after_forward: true (full shard)")
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
