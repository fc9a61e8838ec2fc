"""LoRA: the baseline, training low-rank adapters on a frozen pretrained model (peft).

    accelerate launch --config_file accelerate_configs/single_gpu.yaml recipes/lora.py \
        --model_name_or_path Qwen/Qwen2.5-0.5B
    accelerate launch --config_file accelerate_configs/cpu.yaml recipes/lora.py \
        --model_name_or_path Qwen/Qwen2.5-0.5B --max_steps 100

Each adapted linear layer W computes W x + alpha/r * B A x, with A (r x in) and B (out x r) the only
trained weights: B starts at zero, so step 0 is the pretrained model exactly. Gradients and AdamW's
moments exist for A and B alone (for r = 16 on an 8B model, about 0.5% of the weights), so the
memory left for activations grows by most of the optimizer's share. The base weights never change.

Which layers: every linear layer but the output head (peft's "all-linear"). The export is the
adapter folder peft loads onto the base (`PeftModel.from_pretrained(base, "<output_dir>/adapter")`)
and the merged model `from_pretrained` loads alone (`<output_dir>/model`).

One process, as the baseline. Under DDP, FSDP2 or ZeRO-3, with document masks, conversations, and
exact resume: train.py --lora_r (train_extras/lora.py). The delta against bf16_baseline.py is marked
`# New:`.
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
# New: peft builds the adapters and merges them back; the adapters' options (rank, scale, dropout).
from dataclasses import field

from peft import LoraConfig, get_peft_model


@dataclass
class LoraOptions:
    lora_r: int = field(default=16, metadata={"help": "The adapters' rank."})
    lora_alpha: float = field(default=32.0, metadata={"help": "The update is alpha/r * B A."})
    lora_dropout: float = field(default=0.05, metadata={"help": "Dropout on the adapters' input."})

    def check(self):
        if self.lora_r < 1 or not self.lora_alpha > 0 or not 0 <= self.lora_dropout < 1:
            raise config.ConfigError("--lora_r must be >= 1, --lora_alpha > 0, --lora_dropout in [0, 1)")


@dataclass
class Options(LoraOptions, config.RecipeConfig):
    """The core options, and the adapters'."""
    check_order = (*config.RecipeConfig.check_order, LoraOptions)
# End new


def main(argv=None):
    cfg = config.parse(Options, argv, recipe=Path(__file__).name)
    modeling.check_seq_len(cfg)
    if cfg.save_model:  # a model/ that the export may not replace: refused now, not after training
        check_replaceable(Path(cfg.output_dir) / "model")
        # New: the adapter folder is an export too.
        check_replaceable(Path(cfg.output_dir) / "adapter")
        # End new
    # New: adapters adapt a pretrained model.
    if cfg.model_name_or_path is None:
        raise config.ConfigError("LoRA adapts a pretrained model: give --model_name_or_path")
    # End new

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
    # New: the base frozen, adapters on every linear layer but the head; the optimizer gets the adapters only.
    model = get_peft_model(model, LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                                             target_modules="all-linear", task_type="CAUSAL_LM"))
    if accelerator.is_main_process:
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in model.parameters())
        print(f"lora: {trainable:,} trainable of {total:,} parameters", flush=True)
    # End new
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
        # New: the adapter folder (peft's save_pretrained), then the merged model as the baseline exports it.
        peft_model = accelerator.unwrap_model(model)
        if accelerator.is_main_process:
            peft_model.save_pretrained(f"{cfg.output_dir}/adapter")
            tokenizer.save_pretrained(f"{cfg.output_dir}/adapter")
        model = peft_model.merge_and_unload()
        # End new
        summary["export"] = str(export_pretrained(accelerator, model, tokenizer, f"{cfg.output_dir}/model"))
    if accelerator.is_main_process:
        write_json(f"{cfg.output_dir}/run_summary.json", summary)
        print(f"done: {step} steps -> {cfg.output_dir}", flush=True)
    accelerator.wait_for_everyone()  # no rank tears down the process group while another still uses it
    accelerator.end_training()


if __name__ == "__main__":
    sys.exit(config.run_cli(main))
