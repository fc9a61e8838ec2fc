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
tensor parallel and 2D FSDP2 x TP from parallelism_config: train_extras/parallel/tensor_parallel.py);
mixed precision from the launch config (no / bf16 / fp16 with a GradScaler whose skipped steps
hold the schedule); gradient accumulation with the loss normalised by the step's target tokens
over all micro-batches and ranks; clipping on the full gradient (pre-clip norm logged); NaN/inf
losses skipped, counted, and fatal after --max_nonfinite_steps in a row; four LR schedules;
held-out eval; gradient checkpointing; pretrained start; resumable, atomic, rotated checkpoints
with exact resume; fused AdamW; tqdm bar with loss, lr and tokens/s on a terminal, one plain line
per interval in a log file; <output_dir>/metrics.jsonl appended as the run goes (train_extras/run_record.py).
Preemption (SIGTERM/SIGUSR1 on any rank): every rank finishes the step, a checkpoint and
<output_dir>/requeue.json are written, exit code 75 (train_extras/resume/preemption.py). A rank that dies
or hangs makes the others stop within --collective_timeout seconds with a message, not hang.
Per log interval: tokens/s (global, per device), step time, MFU, memory per rank, ETA, into
run_summary.json and the trackers of --report_to (secrets removed first; one tracker run across
every resume, its id kept in the checkpoints). --compile compiles
each decoder layer once (accelerate's regional compilation).

Host syncs per optimizer step: one (the NaN/inf and preemption decision, which must be known before
the update), plus one under fp16 (the GradScaler's scale, to see a skipped step). Losses and
gradient norms stay on the device until the log interval fetches them all at once.
"""

import dataclasses
import sys
from datetime import timedelta

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import (DistributedType, GradientAccumulationPlugin, GradScalerKwargs, InitProcessGroupKwargs,
                               compile_regions_fsdp2, set_seed)
from tqdm.auto import tqdm

from common import config, data, guard
from common import model as modeling
from common.export import export_pretrained
from common.files import write_json
from train_extras import data_at_scale
from train_extras.observe import flops, metrics, run_record, tracking
from train_extras.parallel import cpu_threads, deepspeed_settings, fsdp_settings, tensor_parallel
from train_extras.resume import checkpoint, output_dir, preemption
from train_extras.options import TrainConfig
from train_extras.observe.sampling import sample_text


def batches_forever(accelerator, loader, epoch: int = 0, skip: int = 0):
    """Micro-batches across epochs, starting `skip` micro-batches into `epoch` (a resumed run).

    Each epoch's order is a function of (seed, epoch) alone (data.EpochShuffleSampler), so the
    position is (epoch, batches into it) and skipping is exact even after load_state has
    restored the global RNG. An epoch that gives no batch raises: this loop would never end
    (data.build_loaders refuses such data first)."""
    while True:
        loader.set_epoch(epoch)
        empty = True
        for batch in accelerator.skip_first_batches(loader, skip) if skip else loader:
            empty = False
            yield batch
        if empty and not skip:
            raise config.TrainingError(f"epoch {epoch} of the training data gave rank {accelerator.process_index} "
                                       "no micro-batch: lower --micro_batch_size or --seq_len, or give more data")
        skip, epoch = 0, epoch + 1


class NonFinitePolicy:
    """A step whose loss is NaN/inf is skipped (no update, the schedule waits); --max_nonfinite_steps
    of them in a row stop the run. Under DeepSpeed the update already happened inside backward, so
    the first one stops the run. Decided on the host from the step's one sync."""

    def __init__(self, accelerator, limit: int):
        self.deepspeed = accelerator.distributed_type == DistributedType.DEEPSPEED
        self.limit, self.in_a_row, self.skipped = limit, 0, 0

    def check(self, step: int, finite: bool) -> bool:
        """True if the step may update the weights; raises TrainingError when the run must stop."""
        if finite:
            self.in_a_row = 0
            return True
        self.in_a_row += 1
        self.skipped += 1
        if self.deepspeed:
            raise config.TrainingError(f"non-finite loss at step {step}: DeepSpeed steps inside backward, so this "
                                       "update is already applied; stopping without a checkpoint or an export")
        if self.in_a_row >= self.limit:
            raise config.TrainingError(
                f"non-finite loss in {self.in_a_row} steps in a row (last: step {step}); stopping without a checkpoint "
                "or an export (lower --lr, check the data, or use bf16 instead of fp16)")
        return False


class OverflowSkips:
    """fp16: the GradScaler skips a step whose gradients overflowed and halves its scale, and the LR
    schedule must then wait. A fused AdamW applies the skip itself, which accelerate's
    optimizer_step_was_skipped does not see (it says False): a lower scale than after the last step
    is the reliable sign (one host sync per step: get_scale). DeepSpeed has its own fp16 loss
    scaler, whose overflow flag accelerate does report (no sync)."""

    def __init__(self, accelerator):
        self.accelerator, self.skipped = accelerator, 0
        self.scaler = accelerator.scaler
        self.scale = self.scaler.get_scale() if self.scaler is not None else None  # after a resume: the loaded one

    def step_was_skipped(self) -> bool:
        if self.scaler is None:
            skipped = self.accelerator.optimizer_step_was_skipped
        else:
            before, self.scale = self.scale, self.scaler.get_scale()
            skipped = self.scale < before
        self.skipped += skipped
        return skipped


def main(argv=None):
    # ---- config: every check that needs no model runs here, before anything heavy ----
    cfg = config.parse(TrainConfig, argv, recipe="train.py")
    modeling.check_seq_len(cfg)
    tensor_parallel.check_launch_sizes("train.py")  # the process count against parallelism_config, before the mesh
    cpu_threads.use_available_cores()  # accelerate's default for one CPU process is one thread
    if not run_record.draw_bar():  # a scheduler's log file: plain lines, no progress-bar redraws
        run_record.library_bars_off()
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
        fsdp_plugin=fsdp_settings.plugin(modeling.model_config(cfg)),  # None unless the config asks for FSDP
        log_with=cfg.report_to or None,  # trackers see only redacted options (train_extras/observe/tracking.py)
        project_dir=cfg.output_dir,
        kwargs_handlers=[
            GradScalerKwargs(init_scale=cfg.fp16_init_scale),  # used by fp16 only
            # A collective that waits longer than this raises on this rank: a dead or hung rank
            # ends the job with a message instead of hanging it (torch's default is 10-30 min).
            InitProcessGroupKwargs(timeout=timedelta(seconds=cfg.collective_timeout)),
        ],
    )
    guard.check_launch(accelerator, "train.py", supports=("single", "ddp", "fsdp", "deepspeed", "tp", "fsdp+tp"))
    deepspeed_settings.configure(accelerator, cfg)  # DeepSpeed clips in its step: pass --max_grad_norm on
    if not cfg.eval_only:  # one live run per folder (an OS lock), before anything is written into it
        output_dir.claim(cfg.output_dir, accelerator)
    if accelerator.is_main_process and not cfg.eval_only:
        # A requeued run has started: if it fails before it trains (say its checkpoint is damaged),
        # the job must not be requeued again and again for the old preemption.
        preemption.clear_marker(cfg.output_dir)
    # Before any heavy work: every file's size and checksum (auto: the newest checkpoint that
    # verifies), then the model, strategy, world size and batch.
    resume_path, resume_meta = checkpoint.resume_point(cfg, accelerator)
    if resume_path is not None:
        checkpoint.check_compatible(resume_path, cfg, accelerator, resume_meta)
    elif cfg.eval_only and not cfg.model_name_or_path:  # `auto` found nothing: there is no model to evaluate
        raise config.ConfigError(f"--eval_only: no complete checkpoint in {cfg.output_dir}/checkpoints to evaluate")
    if not cfg.eval_only:  # which writes no checkpoint, and its record apart (eval_summary.json)
        checkpoint.check_output_dir(cfg, resume_meta["step"] if resume_path is not None else 0)
        output_dir.check_not_finished(cfg, resume_path)
    set_seed(cfg.seed)  # the same seed on every rank: identical initial weights everywhere

    tokenizer = data.build_tokenizer(cfg)
    model_cfg = modeling.model_config(cfg, len(tokenizer))
    tp_layout = tensor_parallel.layout(accelerator)  # {"dp_shard": M, "tp": N} from parallelism_config, or None
    tensor_parallel.check(accelerator, cfg, model_cfg, "train.py")  # the mesh parallelism_config asks for, as it runs
    flops_per_token = flops.flops_per_token(model_cfg, cfg.seq_len)

    # ---- data: rank 0 tokenises and caches first (the others wait up to --data_timeout), then the
    # others read its cache; or each rank streams its own part (train_extras/data_at_scale.py) ----
    if cfg.streaming and tp_layout:
        raise config.ConfigError("--streaming splits the stream over all ranks: not with tensor parallelism")
    with data_at_scale.main_process_first(accelerator, cfg.data_timeout):
        if cfg.streaming:
            train_set = data_at_scale.StreamedBlocks(cfg, tokenizer, rank=accelerator.process_index,
                                                     world_size=accelerator.num_processes)
            eval_set = data_at_scale.held_out_set(cfg, tokenizer)
        else:
            train_set, eval_set = data.build_datasets(cfg, tokenizer)
    loaders = data_at_scale.streamed_loaders if cfg.streaming else data.build_loaders
    data_record = checkpoint.data_identity(cfg, None if cfg.streaming else len(train_set))  # kept in checkpoints
    if resume_meta is not None and not cfg.eval_only:  # a file rewritten in place
        checkpoint.check_same_data(resume_path, resume_meta, data_record)
    train_loader, eval_loader = loaders(cfg, train_set, eval_set, pin_memory=accelerator.device.type == "cuda")
    # Printed once the data is known to be good, so bad input stays a one-line error. Logs get
    # copied around: the options are printed (and recorded) with secrets removed, as trackers get them.
    setup = config.setup_facts(cfg, accelerator, options=tracking.redact(dataclasses.asdict(cfg)))
    peak = metrics.peak_flops(accelerator)  # per device, for MFU (measured on CPU: ~0.7 s)
    if accelerator.is_main_process:
        print(config.describe_setup(setup, {
            "model": cfg.model_name_or_path or f"preset {cfg.preset} (random init)",
            "FLOPs/token": f"{flops_per_token:.3e} (6N + 12LHQT)",
            "peak for MFU": f"{peak['tflops']:.3g} TFLOP/s per device, {peak['source']}" if peak["tflops"]
                            else f"unknown ({peak['source']}): no MFU",
            "data": f"{'streamed' if cfg.streaming else len(train_set)} train / {len(eval_set)} held-out "
                    + (f"blocks of {cfg.seq_len + 1} tokens" if cfg.packing else "documents, padded"),
            **tensor_parallel.describe_mesh(accelerator),  # HSDP: accelerate's dp_replicate x dp_shard mesh
        }), flush=True)

    # ---- model, optimizer, schedule ----
    model = modeling.build_model(cfg, len(tokenizer), dtype=deepspeed_settings.weights_dtype(accelerator))
    if cfg.compile:
        # accelerate's regional compilation, in place (its FSDP2 and DeepSpeed route, here for every
        # strategy): each repeated block compiled once and reused, the rest apart. In place, the
        # parameter names stay as they are (its out-of-place variant, accelerate's route for one
        # process and DDP, prefixes them with _orig_mod: the export would not load), and FSDP2's
        # hooks, added later by prepare, still run.
        compile_regions_fsdp2(model)
    num_params = metrics.count_parameters(model)
    if tp_layout:  # TP (then FSDP2 for 2D) on accelerate's mesh, by torch's own APIs
        model = tensor_parallel.parallelize(model, accelerator)
    optimizer = modeling.build_optimizer(model, cfg, accelerator.device)
    scheduler = modeling.build_scheduler(optimizer, cfg)
    # A streamed loader stays ours: each rank already reads its own part (accelerate would split it again).
    loaders = (eval_loader,) if cfg.streaming else (train_loader, eval_loader)
    if tp_layout:  # accelerate takes TP models from transformers' tp_plan only: it gets the data and schedule
        *loaders, scheduler = accelerator.prepare(*loaders, scheduler)
    else:
        model, optimizer, *loaders, scheduler = accelerator.prepare(model, optimizer, *loaders, scheduler)
    train_loader, eval_loader = (train_loader, *loaders) if cfg.streaming else loaders

    # The run's record (<output_dir>/run_summary.json): what a user keeps of it.
    summary = {
        "recipe": "train.py",
        "setup": setup,
        "model": {"parameters": num_params, "flops_per_token": flops_per_token,
                  "compiled_regions": metrics.compiled_regions(model)},
        "peak_flops_per_device": peak,
        "data": {"train_blocks": None if cfg.streaming else len(train_set), "eval_blocks": len(eval_set),
                 "eval_bigram_entropy": metrics.bigram_entropy(metrics.token_stream(eval_set))},
        "losses": [], "eval": [], "samples": [], "throughput": [],
    }
    data_ranks = config.data_parallel_size(accelerator)  # the world size over the tensor-parallel size
    tokens_per_step = cfg.micro_batch_size * cfg.seq_len * cfg.gradient_accumulation_steps * data_ranks
    tracker_run = tracking.run_identity(cfg, resume_meta)
    summary["tracker_run"] = tracker_run
    if not cfg.eval_only:  # one tracker run across every restart: its identity travels in the checkpoints
        continued = resume_meta is not None and tracker_run == resume_meta.get("tracker_run")
        tracking.start(accelerator, cfg, setup, tracker_run, resume_meta["step"] if continued else 0)

    def run_eval(step):
        result = modeling.evaluate(model, eval_loader, accelerator, cfg.eval_batches)
        summary["eval"].append({"step": step, **result})
        accelerator.log({"eval/loss": result["loss"], "eval/perplexity": result["perplexity"]}, step=step)
        record.write([{"kind": "eval", "step": step, **result, "time": run_record.now()}])
        if accelerator.is_main_process:
            tqdm.write(f"step {step}: eval loss {result['loss']:.4f}  perplexity {result['perplexity']:.2f}")
        if cfg.sample_at_eval and cfg.sample_length:
            run_sample(step)

    def run_sample(step):
        """What the model writes now: read it to judge the run, not only its loss."""
        text = sample_text(accelerator, model, tokenizer, cfg.sample_prompt, cfg.sample_length, cfg.seed)
        summary["samples"].append({"step": step, "prompt": cfg.sample_prompt, "text": text})
        if accelerator.is_main_process:
            tqdm.write(f"step {step}: sample ({cfg.sample_length} tokens from {cfg.sample_prompt!r}):\n{text}\n")

    # ---- resume: model, optimizer, schedule, scaler, RNG of every rank, data position ----
    start_step, epoch, skip = 0, 0, 0
    if resume_path is not None:
        checkpoint.load(accelerator, resume_path, optimizer, scheduler, cfg, model)
        start_step = resume_meta["step"]
        # (epoch, batches into it) in this run's geometry: FSDP2 and replicated checkpoints may
        # resume on another number of ranks with the same global batch. A stream: batches into it.
        epoch, skip = ((0, resume_meta["micro_batches_done"]) if cfg.streaming
                       else checkpoint.data_position(resume_meta, cfg, data_ranks, len(train_loader)))
        # Options a resumed run may change (lr, schedule, length, cadences) hold from its first step.
        changed = checkpoint.resume_changes(resume_meta, cfg)
        summary["resumed_from"] = {"path": str(resume_path), "step": start_step,
                                   "world_size": resume_meta["setup"]["world_size"], "changed": changed}
        if accelerator.is_main_process:
            applied = "".join(f"; --{key} {old!r} -> {new!r}" for key, (old, new) in changed.items())
            print(f"resumed from {resume_path} at step {start_step}"
                  + (f", with this run's settings from step {start_step + 1}{applied}"
                     if changed and not cfg.eval_only else ""), flush=True)
    if cfg.eval_only:  # the model as it is, on the held-out data: nothing trains, nothing else is written
        return evaluate_only(accelerator, cfg, summary, modeling.evaluate(model, eval_loader, accelerator,
                                                                          cfg.eval_batches), start_step)
    # <output_dir>/metrics.jsonl, appended as the run goes (a resumed run goes on with it from its step)
    record = run_record.MetricsFile(cfg.output_dir, start_step if resume_path is not None else None,
                                 enabled=accelerator.is_main_process)
    if resume_path is None and cfg.eval_every > 0:
        run_eval(0)
    micro_batches_done = skip if cfg.streaming else epoch * len(train_loader) + skip

    def save_checkpoint(step):
        record.sync()
        return checkpoint.save(accelerator, cfg.output_dir, step, keep=cfg.save_total_limit, model=model,
                               optimizer=optimizer, metadata={
            "micro_batches_done": micro_batches_done,  # per rank; with batches_per_epoch, the data position
            "batches_per_epoch": None if cfg.streaming else len(train_loader),
            "data": data_record,  # what the data options resolved to: checked on resume
            "tokens_seen": step * tokens_per_step, "config": dataclasses.asdict(cfg), "tracker_run": tracker_run,
            "setup": {k: setup[k] for k in ("distributed_type", "world_size", "data_parallel_size",
                                            "tensor_parallel_size", "mixed_precision")}})

    # ---- training loop ----
    model.train()
    batches = (data_at_scale.streamed_batches(accelerator, train_loader, skip) if cfg.streaming
               else batches_forever(accelerator, train_loader, epoch, skip))
    log = run_record.IntervalLog(accelerator, cfg, summary, record, tokens_per_step, flops_per_token, peak["tflops"],
                              start_step)
    nonfinite, overflow = NonFinitePolicy(accelerator, cfg.max_nonfinite_steps), OverflowSkips(accelerator)
    preempted = None
    for step in range(start_step + 1, cfg.max_steps + 1):
        # The whole optimizer step's micro-batches first: their target-token count over all
        # micro-batches and ranks normalises the loss, so every target token weighs the same
        # whatever the length of its row (transformers' num_items_in_batch is the same idea).
        micro_batches = [next(batches) for _ in range(cfg.gradient_accumulation_steps)]
        micro_batches_done += len(micro_batches)
        step_tokens = accelerator.reduce(sum((b["labels"] != -100).sum() for b in micro_batches), "sum")
        # accelerator.backward (and DeepSpeed's engine) divide by gradient_accumulation_steps and
        # gradient averaging divides by the world size: undo both, so the update follows
        # sum(per-token loss over the whole step) / step_tokens, not a mean of means. (With tensor
        # parallelism the reduce counts each TP group's tokens tp times and gradients are averaged
        # over the data-parallel ranks only: world / step_tokens is still data ranks / real tokens.)
        scale = cfg.gradient_accumulation_steps * accelerator.num_processes / step_tokens
        loss_sum = torch.zeros((), device=accelerator.device)
        for i, batch in enumerate(micro_batches):
            if tp_layout and tp_layout["dp_shard"] > 1:  # our own fully_shard: accelerate cannot pause it
                model.set_requires_gradient_sync(i == len(micro_batches) - 1)
            with accelerator.accumulate(model):  # no gradient all-reduce before the last micro-batch
                micro_sum = modeling.causal_lm_loss(model, batch["input_ids"], batch["labels"], reduction="sum")
                accelerator.backward(micro_sum * scale)
            loss_sum += micro_sum.detach()
        # One all-reduce carries the loss and each rank's preemption vote: every rank then stops
        # after the same step, whichever of them got the signal, and when.
        loss_and_votes = accelerator.reduce(torch.stack([loss_sum, watch.vote(loss_sum.device)]), "sum")
        step_loss = loss_and_votes[0] / step_tokens  # token mean of the step, all ranks
        # The step's one host sync: whether the loss is finite (a NaN must not reach the weights)
        # and whether any rank was signalled.
        finite, stop_votes = torch.stack([torch.isfinite(step_loss).float(), loss_and_votes[1]]).tolist()

        grad_norm = None  # a skipped step: its gradients are dropped below, the schedule waits
        try:
            may_step = nonfinite.check(step, finite)
        except config.TrainingError:
            log.add(step, optimizer.param_groups[0]["lr"], step_loss, None, overflow.scale)
            log.record_steps()  # the steps that led here, this one too, into metrics.jsonl
            log.close()  # the error line must start on a line of its own
            raise
        if may_step:
            # The last micro-batch synchronised the gradients: unscale (fp16) and clip once, on the
            # full gradient. The returned norm is the pre-clip one (inf max = measure, don't clip).
            grad_norm = accelerator.clip_grad_norm_(model.parameters(), cfg.max_grad_norm or float("inf"))
            optimizer.step()
            if not overflow.step_was_skipped():
                scheduler.step()  # a skipped step does not advance the schedule
        optimizer.zero_grad(set_to_none=True)
        lr = optimizer.param_groups[0]["lr"]  # what the optimizer will really use next, not what the schedule says
        log.add(step, lr, step_loss, grad_norm, overflow.scale)

        if stop_votes > 0:
            preempted = {"step": step, "signal": watch.signal_name or "another rank's signal"}
        if step % cfg.log_every == 0 or step == cfg.max_steps or preempted:
            log.flush(step)
        eval_now = cfg.eval_every > 0 and (step % cfg.eval_every == 0 or step == cfg.max_steps) and not preempted
        if eval_now:
            log.record_steps()  # its host sync waits for the steps themselves: training time, outside the pause
        with log.paused():  # eval and checkpoint time is not training time: kept out of tokens/s
            if eval_now:
                run_eval(step)
            if preempted or (cfg.save_every and (step % cfg.save_every == 0 or step == cfg.max_steps)):
                try:
                    saved = save_checkpoint(step)
                except config.RecipeStop:  # a full disk: the line must start on a line of its own
                    log.close()
                    raise
        if preempted:  # the grace period is short: no eval, no export, just the checkpoint
            if accelerator.is_main_process:
                preempted["marker"] = str(preemption.write_marker(cfg.output_dir, step, saved, preempted["signal"]))
            preempted["checkpoint"] = str(saved)
            break
    log.close()
    summary["skipped_steps"] = {"nonfinite_loss": nonfinite.skipped, "fp16_overflow": overflow.skipped}

    if preempted:  # the losses so far and where to go on from; no export of an unfinished model
        summary.update(preempted=preempted, tokens_seen=preempted["step"] * tokens_per_step)
        if accelerator.is_main_process:
            write_json(f"{cfg.output_dir}/run_summary.json", summary)
        accelerator.wait_for_everyone()
        accelerator.end_training()
        raise preemption.Preempted(f"preempted ({preempted['signal']}) at step {preempted['step']}: saved "
                                   f"{preempted['checkpoint']} and {cfg.output_dir}/{preemption.REQUEUE_MARKER}; "
                                   "rerun with --resume_from_checkpoint auto")

    # ---- the final model: eval, sample, export, record ----
    # Nothing trained: still report the final model (metrics.jsonl, closed above, has the run's own evals).
    if start_step >= cfg.max_steps and cfg.eval_every > 0:
        run_eval(cfg.max_steps)
    sampled_at_end = bool(summary["samples"]) and summary["samples"][-1]["step"] == cfg.max_steps  # --sample_at_eval
    if cfg.sample_length and not sampled_at_end:
        run_sample(cfg.max_steps)
    summary["tokens_seen"] = cfg.max_steps * tokens_per_step  # of the whole run, resumed or not
    if cfg.save_model:
        dtype = None if cfg.export_dtype == "auto" else getattr(torch, cfg.export_dtype)  # None: the run's precision
        summary["export"] = str(export_pretrained(accelerator, model, tokenizer, f"{cfg.output_dir}/model", dtype))
    summary["peak_memory_per_rank"] = metrics.peak_memory(accelerator)
    if accelerator.is_main_process:
        rates = [t["tokens_per_s"] for t in summary["throughput"]]
        mfus = [t["mfu"] for t in summary["throughput"] if t["mfu"] is not None]
        summary["tokens_per_s_median"] = float(np.median(rates)) if rates else None
        summary["mfu_median"] = float(np.median(mfus)) if mfus else None
        write_json(f"{cfg.output_dir}/run_summary.json", summary)
        print(final_line(cfg, summary, start_step), flush=True)
    accelerator.wait_for_everyone()  # no rank tears down the process group while another still uses it
    accelerator.end_training()


def evaluate_only(accelerator, cfg, summary, result: dict, step: int) -> None:
    """--eval_only: the held-out loss of --model_name_or_path or of a checkpoint, into
    <output_dir>/eval_summary.json (a training run's own record there is left alone)."""
    summary["eval"].append({"step": step, **result})
    if accelerator.is_main_process:
        write_json(f"{cfg.output_dir}/eval_summary.json", summary)
        source = summary.get("resumed_from", {}).get("path") or cfg.model_name_or_path
        print(f"eval only: {source}: held-out loss {result['loss']:.4f}  perplexity {result['perplexity']:.2f} "
              f"({result['tokens']:,} tokens; bigram entropy {summary['data']['eval_bigram_entropy']:.4f})", flush=True)
    accelerator.wait_for_everyone()
    accelerator.end_training()


def final_line(cfg, summary, start_step) -> str:
    if not summary["throughput"]:  # resumed at max_steps: nothing trained, only exported
        return f"done: no steps to run (resumed at step {start_step}) -> {cfg.output_dir}"
    if summary["eval"]:
        quality = (f"final eval loss {summary['eval'][-1]['loss']:.4f} (bigram entropy of held-out data "
                   f"{summary['data']['eval_bigram_entropy']:.4f})")
    else:
        quality = f"last train loss {summary['losses'][-1]['loss']:.4f} (no eval: --eval_every 0)"
    mfu = f", MFU {summary['mfu_median']:.1%}" if summary["mfu_median"] is not None else ""
    return (f"done: {cfg.max_steps} steps, {quality}, median {summary['tokens_per_s_median']:,.0f} tokens/s{mfu}"
            f" -> {cfg.output_dir}")


if __name__ == "__main__":
    sys.exit(preemption.run_cli(main))
