"""Pipeline parallel (PP): consecutive decoder layers on each GPU, micro-batches flowing through them.

    accelerate launch --config_file accelerate_configs/ddp.yaml --num_processes 4 \
        recipes/pipeline_parallel.py --preset 1b --micro_batch_size 2 --gradient_accumulation_steps 8
    ACCELERATE_USE_CPU=true accelerate launch --config_file accelerate_configs/ddp.yaml --num_processes 2 \
        recipes/pipeline_parallel.py --preset debug --micro_batch_size 2 \
        --gradient_accumulation_steps 4                                                    # CPU, gloo

Naive model parallel places layers on different GPUs and passes one batch through them: only one
GPU works at a time. A pipeline cuts each optimizer step's batch into micro-batches
(--gradient_accumulation_steps of them, by default one per stage; --micro_batch_size sequences
each) so that stage s works on micro-batch m while stage s+1 works on m-1. torch's 1F1B schedule
(torch.distributed.pipelining) runs one backward as soon as one forward has reached the last
stage, so a stage keeps the activations of at most `stages` micro-batches, not all of them. The
idle time ("bubble") is (stages - 1) / (micro-batches + stages - 1) of a step: 1/5 with 2 stages
and 4 micro-batches, 1/3 with 2 stages and the default 2.
Gradients add up over the micro-batches (each micro-batch's loss is its token sum over the step's
token count), so one optimizer step equals one step on the whole batch.

Communication: each stage sends its output activations to the next one and receives their
gradients back, point to point (micro-batch x seq x hidden each way), nothing else; that is why PP
crosses slow links (between machines) better than FSDP or TP. It pays for very deep models
spread over many machines, combined with data and tensor parallelism (this recipe is PP alone).

accelerate 1.15's ParallelismConfig has no pipeline dimension, so the launch config only provides
the processes (ddp.yaml: one per GPU; nothing is wrapped in DDP) and this recipe makes every rank
one stage. Every rank builds the full model with the same seed, keeps its layers (the first stage
also the embedding, the last the final norm and the LM head) and reads the whole batch (the first
stage needs the inputs, the last the labels). Each stage runs the family's own forward over its
layers (embedding and logit scaling, soft-capping, sliding windows, rotary per layer type), and a
start-up probe checks that the stages one after the other give the whole model's logits. A tied
head is a copy on the last stage of the first stage's embedding: their gradients are summed before
each step, so both stay equal. Gradient clipping uses the norm of the whole model (squared norms
summed over stages). Export: rank 0 gathers every stage's weights into the full model and writes
one Hugging Face folder; the probe logits come through the pipeline. Mixtures of experts are
refused (their router loss is not carried across stages). The delta against bf16_baseline.py is
marked `# New:`.
"""

import sys
import time
from dataclasses import dataclass
from pathlib import Path

from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, set_seed
from tqdm.auto import tqdm

from common import config, data, guard
# New: the pipeline stages and their schedule; the export is the pipeline's, not common/export's
import dataclasses

from accelerate.utils import gather_object

from common import model as modeling
from common.export import check_replaceable
from common.files import write_json
from train_extras.parallel.pipeline import MicroBatchOptions, Pipeline, check_micro_batches, check_pipeline_layout
# End new


# New: --gradient_accumulation_steps is the number of micro-batches in flight per pipeline step.
@dataclass
class Options(MicroBatchOptions, config.RecipeConfig):
    """The core options, and the micro-batches per step (--gradient_accumulation_steps)."""
    check_order = (*config.RecipeConfig.check_order, MicroBatchOptions)
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
    # New: every rank a stage: at least 2 processes, no more than the model's layers
    guard.check_launch(accelerator, Path(__file__).name, supports=("ddp",))
    model_cfg = modeling.model_config(cfg)
    if not 2 <= accelerator.num_processes <= model_cfg.num_hidden_layers:
        raise config.ConfigError(f"{Path(__file__).name} needs 2 to {model_cfg.num_hidden_layers} processes (one "
                                 f"stage each, at least one layer per stage); got {accelerator.num_processes}")
    check_pipeline_layout(model_cfg, Path(__file__).name)
    micro_batches = cfg.gradient_accumulation_steps or accelerator.num_processes  # default: one per stage
    check_micro_batches(micro_batches, accelerator.num_processes, Path(__file__).name)
    cfg = dataclasses.replace(cfg, gradient_accumulation_steps=micro_batches)  # as the setup block and summary say
    # End new
    if accelerator.mixed_precision == "fp16":
        raise config.ConfigError(f"{Path(__file__).name} does not handle fp16 loss scaling; use fp16_scaler.py")
    set_seed(cfg.seed)

    tokenizer = data.build_tokenizer(cfg)
    with accelerator.main_process_first():  # rank 0 builds the tokenised cache, the others reuse it
        train_set, eval_set = data.build_datasets(cfg, tokenizer)
    # New: every rank reads the whole step's batch (not prepared: accelerate would split it over ranks)
    train_loader, eval_loader = data.build_loaders(
        dataclasses.replace(cfg, micro_batch_size=cfg.micro_batch_size * micro_batches), train_set, eval_set,
        pin_memory=accelerator.device.type == "cuda", data_ranks=1)
    # End new
    # New: one batch of micro_batch_size x micro-batches for all the stages
    setup = config.setup_facts(cfg, accelerator, data_ranks=1)
    # End new
    if accelerator.is_main_process:
        print(config.describe_setup(setup), flush=True)

    # New: the same full model on every rank (same seed), then this rank's stage of it
    pipeline = Pipeline(modeling.build_model(cfg, len(tokenizer)), accelerator, micro_batches, Path(__file__).name)
    model = pipeline.module  # this stage's layers: what this rank trains
    optimizer = modeling.build_optimizer(model, cfg, accelerator.device)
    scheduler = modeling.build_scheduler(optimizer, cfg)
    # End new

    # The run's record, kept in <output_dir>/run_summary.json: the setup, losses, evals, throughput.
    summary = {"recipe": Path(__file__).name, "setup": setup, "losses": [], "eval": [], "throughput": []}
    # New: one batch for the whole pipeline; which layers each stage holds
    tokens_per_step = cfg.micro_batch_size * micro_batches * cfg.seq_len
    summary["pipeline"] = {"stages": accelerator.num_processes, "micro_batches": micro_batches,
                           "layers_per_stage": gather_object([list(pipeline.layer_range)])}
    # End new

    def run_eval(step):
        # New: forward only, through the stages
        result = pipeline.evaluate(eval_loader, cfg.eval_batches)
        # End new
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
        # New: a plain DataLoader: the epoch goes to its sampler (accelerate's wrapper would forward it)
        train_loader.sampler.set_epoch(epoch)  # the shuffle order is a function of (seed, epoch)
        # End new
        for batch in train_loader:
            # New: forward and backward of every micro-batch through every stage; clip on the whole model
            loss = pipeline.train_step(batch["input_ids"], batch["labels"])
            if cfg.max_grad_norm > 0:
                pipeline.clip_grad_norm_(cfg.max_grad_norm)
            # End new
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1

            # Every step's loss, averaged over ranks. .item() is a CPU-GPU sync each step: fine
            # for the baseline; train.py batches these syncs up to one per log interval.
            # New: train_step already sent the last stage's loss to every rank: no second all-reduce
            loss_value = loss.item()
            # End new
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
        # New: gathered from every stage on rank 0
        summary["export"] = str(pipeline.export(tokenizer, f"{cfg.output_dir}/model"))
        # End new
    if accelerator.is_main_process:
        write_json(f"{cfg.output_dir}/run_summary.json", summary)
        print(f"done: {step} steps -> {cfg.output_dir}", flush=True)
    accelerator.wait_for_everyone()  # no rank tears down the process group while another still uses it
    accelerator.end_training()


if __name__ == "__main__":
    sys.exit(config.run_cli(main))
