"""Tensor parallel (TP): every weight matrix of a transformer block split across the GPUs of one machine.

    accelerate launch --config_file accelerate_configs/tp.yaml recipes/tensor_parallel.py --preset 1b
    ACCELERATE_RECIPES_CPU_HARNESS=1 PYTHONPATH=scripts/cpu_harness accelerate launch \
        --config_file accelerate_configs/tp.yaml --num_processes 2 --parallelism_config_tp_size 2 \
        recipes/tensor_parallel.py --preset debug                  # CPU, gloo

What TP does (Megatron-LM's layout, which transformers declares per model as `base_model_tp_plan`):
- Column-wise (q, k, v, gate, up projections): the weight's output rows are split, Shard(0). Each
  rank holds whole attention heads (heads / N of them) and a slice of the MLP width, and computes
  its slice of the output from the full input, which every rank has. Forward: no communication.
  Backward: the input's gradient is a sum of every rank's part, so it is all-reduced.
- Row-wise (o, down projections): the weight's input columns are split, Shard(1). Each rank
  multiplies its slice of the input (exactly what its column-wise partner produced: no exchange in
  between) and gets a partial sum of the full output; an all-reduce in forward adds them up.
  Backward: no communication.
So attention and MLP each cost one all-reduce of the activations (batch x seq x hidden) forward
and one backward, inside every layer: on the critical path, and proportional to tokens, not to
parameters. (A column-parallel layer alone would leave each rank with part of the output; all-
reducing those parts, as some tutorials do, adds numbers that belong side by side: wrong output.)

When TP pays: when a layer is too big or too slow for one GPU (large hidden sizes, or a batch that
must stay small), and the GPUs share NVLink-class bandwidth: keep tp_size within one machine.
It divides weights, gradients, optimizer state AND activations inside the blocks by N; every rank
sees the same batch, so it does not add data parallelism. For more GPUs combine it with FSDP2
(accelerate_configs/fsdp_tp.yaml, recipes/train.py). For models that fit with FSDP/ZeRO, those
are simpler and communicate less often.

How this recipe gets there: accelerate builds the device mesh from the config's parallelism_config
(tp_size) and gives every rank the same batch; transformers' `from_pretrained` with
`DistributedConfig(tp_plan="auto")` (the 5.24 spelling of `tp_plan="auto"`) shards the weights
while loading, each rank reading only its slice. It needs a saved folder, so a random-init preset
is first written by rank 0 to <output_dir>/initial_model. transformers 5.24 builds its own mesh
(ignoring a mesh passed in); with TP over every rank it is accelerate's "tp" mesh, which the recipe
checks. transformers also splits the embedding table and the LM head over the vocabulary; the
norms stay whole on every rank. Gradient clipping: accelerate sums the squared norms per mesh.
Export: the DTensor shards are gathered into full tensors (common/export.py). Resumable
checkpoints, accumulation and 2D: recipes/train.py. The delta against bf16_baseline.py is marked `# New:`.
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
# New: the model-family check and transformers' TP loading (train_extras/parallel/tensor_parallel.py).
from train_extras.parallel import tensor_parallel
# End new


@dataclass
class Options(config.RecipeConfig):
    """The core options: run, model, data, optimizer, eval and export."""


def main(argv=None):
    cfg = config.parse(Options, argv, recipe=Path(__file__).name)
    modeling.check_seq_len(cfg)
    if cfg.save_model:  # a model/ that the export may not replace: refused now, not after training
        check_replaceable(Path(cfg.output_dir) / "model")
    # New: the process count against the config's tp_size, before accelerate builds the mesh.
    tensor_parallel.check_launch_sizes(Path(__file__).name)
    # End new

    # Mixed precision, device and process count come from the launch config. The LR schedule is ours to
    # step (accelerate steps it world_size times); batches are copied from pinned memory without a wait.
    accelerator = Accelerator(step_scheduler_with_optimizer=False,
                              dataloader_config=DataLoaderConfiguration(non_blocking=True))
    # New: the mesh comes from the config's parallelism_config; TP alone (2D is train.py's). fp16 is refused.
    guard.check_launch(accelerator, Path(__file__).name, supports=("tp",))
    tp_size = config.tensor_parallel_size(accelerator)  # = the world size (accelerate checks the mesh's total)
    tensor_parallel.check(accelerator, cfg, modeling.model_config(cfg), Path(__file__).name)
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

    # New: load with the model's TP plan. transformers shards while loading, from a saved folder.
    folder = cfg.model_name_or_path
    if folder is None:  # a random-init preset: rank 0 writes it once (same seed as every other recipe)
        folder = f"{cfg.output_dir}/initial_model"
        if accelerator.is_main_process:
            modeling.build_model(cfg, len(tokenizer)).save_pretrained(folder)
        accelerator.wait_for_everyone()
    model = tensor_parallel.load_with_tp_plan(folder, cfg, tp_size, accelerator)
    # End new
    optimizer = modeling.build_optimizer(model, cfg, accelerator.device)
    scheduler = modeling.build_scheduler(optimizer, cfg)
    model, optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, eval_loader, scheduler
    )

    # The run's record, kept in <output_dir>/run_summary.json: the setup, losses, evals, throughput.
    summary = {"recipe": Path(__file__).name, "setup": setup, "losses": [], "eval": [], "throughput": []}
    # New: the global batch is one rank's (the TP ranks share it)
    tokens_per_step = cfg.micro_batch_size * cfg.seq_len
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
