"""The complete recipe: trains a causal LM with whatever strategy the launch config names.

    accelerate launch recipes/train.py                       # CPU or 1 GPU, tiny Shakespeare, no download
    accelerate launch --config_file accelerate_configs/cpu.yaml recipes/train.py --preset debug
    accelerate launch --config_file accelerate_configs/single_gpu.yaml recipes/train.py --preset small

    accelerate launch --config_file accelerate_configs/fsdp.yaml recipes/train.py --preset 1b
    accelerate launch recipes/train.py --save_every 50 --resume_from_checkpoint auto

Options: `python recipes/train.py --help` (or a YAML file with --config). Data flow, in order:
config -> Accelerator (+ start-up guard) -> tokenizer -> data -> model -> prepare -> resume ->
loop (forward, loss, backward, clip, step, schedule, log, eval, checkpoint) -> Hugging Face export
-> a sample of generated text -> run_summary.json.

Models: a random-init Llama preset, or any causal LM folder or Hub id (--model_name_or_path: Llama,
Qwen, Mistral, GPT-2, GPT-NeoX, Gemma...): FSDP2 shards by the model's own block class, FLOPs are
counted from its real parameters, tied embeddings stay tied, TP uses the model's declared plan.

Features: every config in accelerate_configs/ (single process, DDP, FSDP2, DeepSpeed ZeRO-1/2/3,
tensor parallel and 2D FSDP2 x TP from parallelism_config: common/parallel.py);
mixed precision from the launch config (no / bf16 / fp16 with a GradScaler whose skipped steps
hold the schedule); gradient accumulation with the loss normalised by the step's target tokens
over all micro-batches and ranks; clipping on the full gradient (pre-clip norm logged); NaN/inf
losses skipped, counted, and fatal after --max_nonfinite_steps in a row; four LR schedules;
held-out eval; gradient checkpointing; pretrained start; resumable, atomic, rotated checkpoints
with exact resume; fused AdamW; tqdm bar with loss, lr and tokens/s.
Preemption (SIGTERM/SIGUSR1 on any rank): every rank finishes the step, a checkpoint and
<output_dir>/requeue.json are written, exit code 75 (common/preemption.py). A rank that dies or
hangs makes the others stop within --collective_timeout seconds with a message, not hang.
Per log interval: tokens/s (global, per device), step time, MFU, memory per rank, ETA, into
run_summary.json and the trackers of --report_to (secrets removed first). --compile compiles
each decoder layer.
"""

import dataclasses
import sys
import time
from datetime import timedelta

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import (DistributedType, GradientAccumulationPlugin, GradScalerKwargs, InitProcessGroupKwargs,
                               gather_object, set_seed)
from tqdm.auto import tqdm

from common import checkpoint, config, data, metrics, parallel, preemption, strategy, tracking
from common import model as modeling
from common.schedule import build_scheduler


def batches_forever(accelerator, loader, epoch: int = 0, skip: int = 0):
    """Micro-batches across epochs, starting `skip` micro-batches into `epoch` (a resumed run).

    Each epoch's order is a function of (seed, epoch) alone (data.EpochShuffleSampler), so the
    position is (epoch, batches into it) and skipping is exact even after load_state has
    restored the global RNG."""
    while True:
        loader.set_epoch(epoch)
        yield from (accelerator.skip_first_batches(loader, skip) if skip else loader)
        skip, epoch = 0, epoch + 1


def main(argv=None):
    # ---- config: every check that needs no model runs here, before anything heavy ----
    cfg = config.parse_config(argv)
    modeling.check_seq_len(cfg)
    strategy.use_available_cores()  # accelerate's default for one CPU process is one thread
    # From here on a SIGTERM/SIGUSR1 means "save and stop after this step", not "die now".
    watch = preemption.PreemptionWatch().install() if cfg.save_on_preemption else preemption.PreemptionWatch()

    # Sync on a count of micro-batches, not at the end of the dataloader: an epoch boundary in
    # the middle of an accumulation window must not trigger an early optimizer step.
    plugin = GradientAccumulationPlugin(num_steps=cfg.gradient_accumulation_steps, sync_with_dataloader=False)
    # We step the LR schedule ourselves, once per optimizer step (accelerate would step it once
    # per process per optimizer step, i.e. world_size times too fast for a schedule in steps).
    accelerator = Accelerator(
        gradient_accumulation_plugin=plugin,
        step_scheduler_with_optimizer=False,
        fsdp_plugin=strategy.fsdp_plugin(modeling.model_config(cfg)),  # None unless the config asks for FSDP
        log_with=cfg.report_to or None,  # trackers see only redacted options (common/tracking.py)
        project_dir=cfg.output_dir,
        kwargs_handlers=[
            GradScalerKwargs(init_scale=cfg.fp16_init_scale),  # used by fp16 only
            # A collective that waits longer than this raises on this rank: a dead or hung rank
            # ends the job with a message instead of hanging it (torch's default is 10-30 min).
            InitProcessGroupKwargs(timeout=timedelta(seconds=cfg.collective_timeout)),
        ],
    )
    strategy.check_launch(accelerator, "train.py", supports=("single", "ddp", "fsdp", "deepspeed", "tp", "fsdp+tp"))
    strategy.configure_deepspeed(accelerator, cfg)  # DeepSpeed clips in its step: pass --max_grad_norm on
    if accelerator.is_main_process:
        # A requeued run has started: if it fails before it trains (say its checkpoint is damaged),
        # the job must not be requeued again and again for the old preemption.
        preemption.clear_marker(cfg.output_dir)
    resume_path = checkpoint.resolve_resume(cfg)
    if resume_path is not None:  # before any heavy work: files, model, strategy, world size, batch
        resume_meta = checkpoint.check_compatible(resume_path, cfg, accelerator)
    checkpoint.check_output_dir(cfg, resume_meta["step"] if resume_path is not None else 0)
    set_seed(cfg.seed)  # the same seed on every rank: identical initial weights everywhere

    tokenizer = data.build_tokenizer(cfg)
    model_cfg = modeling.model_config(cfg, len(tokenizer))
    tensor_parallel = parallel.layout(accelerator)  # {"dp_shard": M, "tp": N} from parallelism_config, or None
    if tensor_parallel:
        parallel.check(accelerator, cfg, model_cfg, "train.py")
    flops_per_token = modeling.flops_per_token(model_cfg, cfg.seq_len)

    # ---- data: rank 0 tokenises and caches first; the other ranks then read its cache ----
    with accelerator.main_process_first():
        train_set, eval_set = data.build_datasets(cfg, tokenizer)
    train_loader, eval_loader = data.build_loaders(
        cfg, train_set, eval_set, pin_memory=accelerator.device.type == "cuda"
    )
    # Printed once the data is known to be good, so bad input stays a one-line error.
    setup = config.setup_facts(cfg, accelerator)
    peak = metrics.peak_flops(accelerator)  # per device, for MFU (measured on CPU: ~0.7 s)
    if accelerator.is_main_process:
        print(config.describe_setup(cfg, accelerator, {
            "model": cfg.model_name_or_path or f"preset {cfg.preset} (random init)",
            "FLOPs/token": f"{flops_per_token:.3e} (6N + 12LHQT)",
            "peak for MFU": f"{peak['tflops']:.3g} TFLOP/s per device, {peak['source']}" if peak["tflops"]
                            else f"unknown ({peak['source']}): no MFU",
            "data": f"{len(train_set)} train / {len(eval_set)} held-out "
                    + (f"blocks of {cfg.seq_len + 1} tokens" if cfg.packing else "documents, padded"),
        }), flush=True)

    # ---- model, optimizer, schedule ----
    # Memory in use at a few points of the run, per rank: what model states really cost under each
    # strategy (compared with the formulas of common/plan/ by the tests and benchmarks/memory.py).
    memory_points = {"before_model": metrics.memory_in_use(accelerator.device)}
    model = modeling.build_model(cfg, len(tokenizer))
    compiled_blocks = getattr(model, "compiled_blocks", 0)  # --compile
    num_params = metrics.count_parameters(model)
    if tensor_parallel:  # TP (then FSDP2 for 2D) on accelerate's mesh, by torch's own APIs
        model = parallel.parallelize(model, accelerator)
    optimizer = modeling.build_optimizer(model, cfg, accelerator.device)
    scheduler = build_scheduler(optimizer, cfg)
    if tensor_parallel:  # accelerate takes TP models from transformers' tp_plan only: it gets the data and schedule
        train_loader, eval_loader, scheduler = accelerator.prepare(train_loader, eval_loader, scheduler)
    else:
        model, optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(
            model, optimizer, train_loader, eval_loader, scheduler
        )

    summary = {
        "recipe": "train.py",
        "setup": setup,
        "model": {"class": modeling.class_name(accelerator.unwrap_model(model)), "parameters": num_params,
                  "flops_per_token": flops_per_token, "compiled_blocks": compiled_blocks,
                  # GPT-2-style models share the input embedding with the LM head: still one tensor after prepare?
                  "tied_embeddings": modeling.embeddings_tied(accelerator.unwrap_model(model))},
        "peak_flops_per_device": peak,
        "data": {
            "train_blocks": len(train_set),
            "eval_blocks": len(eval_set),
            "eval_bigram_entropy": data.bigram_entropy(eval_set.token_stream()),
        },
        "parameters_per_rank": metrics.parameter_facts(model, accelerator),  # at rest, after prepare
        "strategy": metrics.strategy_facts(model, optimizer),
        "optimizer_groups": metrics.optimizer_facts(optimizer),
        "losses": [],
        "eval": [],
        "samples": [],
        "throughput": [],
    }
    if tensor_parallel:  # the mesh, and how each parameter is split on it (rank 0's shards)
        summary["strategy"]["mesh"] = tensor_parallel
        summary["tensor_parallel_parameters"] = parallel.parameter_layout(model)
    data_ranks = config.data_parallel_size(accelerator)  # the world size over the tensor-parallel size
    micro_batches_per_step = cfg.gradient_accumulation_steps * data_ranks
    tokens_per_step = cfg.micro_batch_size * cfg.seq_len * micro_batches_per_step

    tracking.start(accelerator, cfg, setup)

    def run_eval(step):
        result = metrics.evaluate(model, eval_loader, accelerator, cfg.eval_batches)
        summary["eval"].append({"step": step, **result})
        accelerator.log({"eval/loss": result["loss"], "eval/perplexity": result["perplexity"]}, step=step)
        if accelerator.is_main_process:
            tqdm.write(f"step {step}: eval loss {result['loss']:.4f}  perplexity {result['perplexity']:.2f}")
        if cfg.sample_at_eval and cfg.sample_length:
            run_sample(step)

    def run_sample(step):
        """What the model writes now: read it to judge the run, not only its loss."""
        text = modeling.sample_text(accelerator, model, tokenizer, cfg.sample_prompt, cfg.sample_length, cfg.seed)
        summary["samples"].append({"step": step, "prompt": cfg.sample_prompt, "text": text})
        if accelerator.is_main_process:
            tqdm.write(f"step {step}: sample ({cfg.sample_length} tokens from {cfg.sample_prompt!r}):\n{text}\n")

    # ---- resume: model, optimizer, schedule, scaler, RNG of every rank, data position ----
    start_step, epoch, skip = 0, 0, 0
    if resume_path is not None:
        checkpoint.load(accelerator, resume_path, optimizer, scheduler, model)
        start_step = resume_meta["step"]
        # (epoch, batches into it) in this run's geometry: FSDP2 and replicated checkpoints may
        # resume on another number of ranks with the same global batch
        epoch, skip = checkpoint.data_position(resume_meta, cfg, data_ranks, len(train_loader))
        summary["resumed_from"] = {"path": str(resume_path), "step": start_step,
                                   "world_size": resume_meta["setup"]["world_size"]}
        if accelerator.is_main_process:
            print(f"resumed from {resume_path} at step {start_step}", flush=True)
    elif cfg.eval_every > 0:
        run_eval(0)
    micro_batches_done = epoch * len(train_loader) + skip

    # ---- training loop ----
    model.train()
    batches = batches_forever(accelerator, train_loader, epoch, skip)
    pending = []  # per-step losses kept on device; fetched at log points (one sync per interval)
    interval_start, interval_steps, step_times = time.perf_counter(), 0, []
    bar = tqdm(total=cfg.max_steps, initial=start_step, disable=not accelerator.is_main_process, desc="train")
    sample_ids = []  # per step, this rank's sample ids (--log_sample_ids)
    nonfinite_in_row, skipped_nonfinite, skipped_overflow = 0, 0, 0
    preempted = None

    def save_checkpoint(step):
        return checkpoint.save(accelerator, cfg.output_dir, step, keep=cfg.save_total_limit, model=model,
                               optimizer=optimizer, metadata={
            "micro_batches_done": micro_batches_done,  # per rank; with batches_per_epoch, the data position
            "batches_per_epoch": len(train_loader),
            "tokens_seen": step * tokens_per_step, "config": dataclasses.asdict(cfg),
            "setup": {k: setup[k] for k in ("distributed_type", "world_size", "data_parallel_size",
                                            "tensor_parallel_size", "mixed_precision")}})

    # The second step of the run: optimizer states exist by then (created lazily at the first step).
    memory_probe_step = min(start_step + 2, cfg.max_steps)
    for step in range(start_step + 1, cfg.max_steps + 1):
        # The whole optimizer step's micro-batches first: their target-token count over all
        # micro-batches and ranks normalises the loss, so every target token weighs the same
        # whatever the length of its row (transformers' num_items_in_batch is the same idea).
        micro_batches = [next(batches) for _ in range(cfg.gradient_accumulation_steps)]
        micro_batches_done += len(micro_batches)
        if cfg.log_sample_ids:
            sample_ids.append([i for b in micro_batches for i in b["index"].tolist()])
        local_tokens = sum((b["labels"] != -100).sum() for b in micro_batches)
        step_tokens = accelerator.reduce(local_tokens, "sum")  # a scalar all-reduce; no host sync
        # accelerator.backward (and DeepSpeed's engine) divide by gradient_accumulation_steps and
        # gradient averaging divides by the world size: undo both, so the update follows
        # sum(per-token loss over the whole step) / step_tokens, not a mean of means. (With tensor
        # parallelism the reduce counts each TP group's tokens tp times and gradients are averaged
        # over the data-parallel ranks only: world / step_tokens is still data ranks / real tokens.)
        scale = cfg.gradient_accumulation_steps * accelerator.num_processes / step_tokens
        loss_sum = torch.zeros((), device=accelerator.device)
        for i, batch in enumerate(micro_batches):
            if tensor_parallel and tensor_parallel["dp_shard"] > 1:  # our own fully_shard: accelerate cannot pause it
                model.set_requires_gradient_sync(i == len(micro_batches) - 1)
            with accelerator.accumulate(model):  # no gradient all-reduce before the last micro-batch
                micro_sum = modeling.causal_lm_loss(model, batch["input_ids"], batch["labels"], reduction="sum")
                accelerator.backward(micro_sum * scale)
            loss_sum += micro_sum.detach()
        if step == memory_probe_step:  # activations freed, gradients held (DeepSpeed: already stepped)
            memory_points["after_backward"] = metrics.memory_in_use(accelerator.device)
        # One all-reduce carries the loss and each rank's preemption vote: every rank then stops
        # after the same step, whichever of them got the signal, and when.
        loss_and_votes = accelerator.reduce(torch.stack([loss_sum, watch.vote(loss_sum.device)]), "sum")
        step_loss = loss_and_votes[0] / step_tokens  # token mean of the step, all ranks

        # A NaN/inf loss must not reach the weights. Deciding needs the value on the host: one
        # CPU-GPU sync per step (for both numbers), small next to a step of a model worth GPUs.
        finite, stop_votes = torch.stack([torch.isfinite(step_loss).float(), loss_and_votes[1]]).tolist()
        if finite:
            nonfinite_in_row = 0
            # The last micro-batch synchronised the gradients: unscale (fp16) and clip once, on the
            # full gradient. The returned norm is the pre-clip one (inf max = measure, don't clip).
            grad_norm = accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm or float("inf"))
            scale_before = accelerator.scaler.get_scale() if accelerator.scaler is not None else None
            optimizer.step()
            # fp16: the GradScaler skips a step with inf/NaN gradients and halves its scale. A fused
            # AdamW applies the skip itself, which accelerate's optimizer_step_was_skipped does not
            # see (it reports False): the scale going down is the reliable sign. DeepSpeed has its
            # own fp16 loss scaler, whose overflow flag accelerate does report.
            if scale_before is not None:
                skipped = accelerator.scaler.get_scale() < scale_before
            else:
                skipped = accelerator.optimizer_step_was_skipped
            if skipped:
                skipped_overflow += 1
            else:
                scheduler.step()  # a skipped step does not advance the schedule
        else:
            nonfinite_in_row += 1
            skipped_nonfinite += 1
            stop = None
            if accelerator.distributed_type == DistributedType.DEEPSPEED:
                stop = (f"non-finite loss at step {step}: DeepSpeed steps inside backward, so this update is "
                        "already applied; stopping without writing anything")
            elif nonfinite_in_row >= cfg.max_nonfinite_steps:
                stop = (f"non-finite loss in {nonfinite_in_row} steps in a row (last: step {step}); stopping "
                        "without writing anything (lower --lr, check the data, or use bf16 instead of fp16)")
            if stop:
                bar.close()  # the error line must start on a line of its own
                raise config.TrainingError(stop)
            grad_norm = None  # skipped: the gradients are dropped below, the schedule waits
        optimizer.zero_grad(set_to_none=True)
        if step == memory_probe_step:  # at rest between steps
            memory_points["after_step"] = metrics.memory_in_use(accelerator.device)
        loss_scale = accelerator.scaler.get_scale() if accelerator.scaler is not None else None
        lr = optimizer.param_groups[0]["lr"]  # what the optimizer will really use next, not what the schedule says
        pending.append((step, lr, step_loss, metrics.as_tensor(grad_norm), loss_scale))
        interval_steps += 1

        if stop_votes > 0:
            preempted = {"step": step, "signal": watch.signal_name or "another rank's signal"}
        if step % cfg.log_every == 0 or step == cfg.max_steps or preempted:
            # Losses are already means over all ranks' tokens; .tolist() is the sync that makes the timing honest.
            step_losses = torch.stack([row[2] for row in pending]).tolist()
            grad_norms = torch.stack([row[3] for row in pending]).tolist()
            elapsed = time.perf_counter() - interval_start
            interval_start = time.perf_counter()  # what logging costs below counts in the next interval
            step_times.append(elapsed / interval_steps)
            stats = metrics.interval_stats(
                steps=interval_steps, seconds=elapsed, tokens_per_step=tokens_per_step,
                world_size=accelerator.num_processes, flops_per_token=flops_per_token,
                peak_tflops_per_device=peak["tflops"], steps_left=cfg.max_steps - step, step_times=step_times)
            memory = metrics.peak_memory(accelerator)  # every rank's (a small gather per interval)
            for (s, lr, _, _, loss_scale), value, norm in zip(pending, step_losses, grad_norms):
                row = {"step": s, "loss": value, "lr": lr, "grad_norm": norm}
                if loss_scale is not None:
                    row["loss_scale"] = loss_scale
                summary["losses"].append(row)
                accelerator.log({f"train/{k}": v for k, v in row.items() if k != "step"}, step=s)
            summary["throughput"].append({"step": step, **stats, "memory_per_rank": memory})
            accelerator.log({f"perf/{k}": v for k, v in stats.items() if v is not None}
                            | {f"memory/rank{m['rank']}_{k}": v for m in memory for k, v in m.items() if k != "rank"},
                            step=step)
            tokens_per_s = stats["tokens_per_s"]
            bar.set_postfix(loss=f"{step_losses[-1]:.4f}", lr=f"{pending[-1][1]:.2e}", tok_s=f"{tokens_per_s:,.0f}",
                            **({"mfu": f"{stats['mfu']:.1%}"} if stats["mfu"] is not None else {}))
            bar.update(interval_steps)
            pending, interval_steps = [], 0
        paused = time.perf_counter()  # eval and checkpoint time is not training time: keep it out of tokens/s
        if cfg.eval_every > 0 and (step % cfg.eval_every == 0 or step == cfg.max_steps) and not preempted:
            run_eval(step)
        if preempted or (cfg.save_every and (step % cfg.save_every == 0 or step == cfg.max_steps)):
            saved = save_checkpoint(step)
        interval_start += time.perf_counter() - paused
        if preempted:  # the grace period is short: no eval, no export, just the checkpoint
            if accelerator.is_main_process:
                preempted["marker"] = str(preemption.write_marker(cfg.output_dir, step, saved, preempted["signal"]))
            preempted["checkpoint"] = str(saved)
            break
    bar.close()
    if start_step >= cfg.max_steps and cfg.eval_every > 0:  # nothing trained: still report the final model
        run_eval(cfg.max_steps)
    sampled_at_end = bool(summary["samples"]) and summary["samples"][-1]["step"] == cfg.max_steps  # --sample_at_eval
    if cfg.sample_length and not preempted and not sampled_at_end:  # what the final model writes
        run_sample(cfg.max_steps)
    if cfg.log_sample_ids:
        summary["sample_ids_per_rank"] = gather_object([sample_ids]) if accelerator.num_processes > 1 else [sample_ids]
    summary["skipped_steps"] = {"nonfinite_loss": skipped_nonfinite, "fp16_overflow": skipped_overflow}

    # ---- export and record ----
    summary["tokens_seen"] = cfg.max_steps * tokens_per_step  # of the whole run, resumed or not
    if preempted:  # the losses so far and where to go on from; no export of an unfinished model
        summary["preempted"] = preempted
        summary["tokens_seen"] = preempted["step"] * tokens_per_step
        if accelerator.is_main_process:
            metrics.write_summary(f"{cfg.output_dir}/run_summary.json", summary)
        accelerator.wait_for_everyone()
        accelerator.end_training()
        raise preemption.Preempted(f"preempted ({preempted['signal']}) at step {preempted['step']}: saved "
                                   f"{preempted['checkpoint']} and {cfg.output_dir}/{preemption.REQUEUE_MARKER}; "
                                   "rerun with --resume_from_checkpoint auto")
    if cfg.save_model:
        out = checkpoint.export_pretrained(accelerator, model, tokenizer, f"{cfg.output_dir}/model")
        probe = eval_set[0]["input_ids"][:8]
        summary["export"] = {
            "path": str(out),
            "probe_input_ids": probe.tolist(),
            "probe_logits": checkpoint.probe_logits(accelerator, model, probe),
        }
    summary["peak_memory_per_rank"] = metrics.peak_memory(accelerator)
    if tensor_parallel:  # the copies TP keeps on every rank of a group must still be equal
        summary["tensor_parallel_replica_max_difference"] = parallel.replica_max_difference(model, accelerator)
    memory_points["rank"] = accelerator.process_index
    summary["memory_points_per_rank"] = (gather_object([memory_points]) if accelerator.num_processes > 1
                                         else [memory_points])
    if accelerator.is_main_process:
        rates = [t["tokens_per_s"] for t in summary["throughput"]]
        summary["tokens_per_s_median"] = float(np.median(rates)) if rates else None
        mfus = [t["mfu"] for t in summary["throughput"] if t["mfu"] is not None]
        summary["mfu_median"] = float(np.median(mfus)) if mfus else None
        metrics.write_summary(f"{cfg.output_dir}/run_summary.json", summary)
        if not rates:  # resumed at max_steps: nothing trained, only exported
            print(f"done: no steps to run (resumed at step {start_step}) -> {cfg.output_dir}", flush=True)
        else:
            if summary["eval"]:
                quality = (f"final eval loss {summary['eval'][-1]['loss']:.4f} (bigram entropy of held-out data "
                           f"{summary['data']['eval_bigram_entropy']:.4f})")
            else:
                quality = f"last train loss {summary['losses'][-1]['loss']:.4f} (no eval: --eval_every 0)"
            print(f"done: {cfg.max_steps} steps, {quality}, median {summary['tokens_per_s_median']:,.0f} tokens/s"
                  + (f", MFU {summary['mfu_median']:.1%}" if summary["mfu_median"] is not None else "")
                  + f" -> {cfg.output_dir}", flush=True)
    accelerator.wait_for_everyone()  # no rank tears down the process group while another still uses it
    accelerator.end_training()


if __name__ == "__main__":
    sys.exit(config.run_cli(main))
