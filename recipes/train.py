"""The complete recipe: trains a causal LM with whatever strategy the launch config names.

    accelerate launch recipes/train.py                       # CPU or 1 GPU, tiny Shakespeare, no download
    accelerate launch --config_file accelerate_configs/cpu.yaml recipes/train.py --preset debug
    accelerate launch --config_file accelerate_configs/single_gpu.yaml recipes/train.py --preset small

    accelerate launch --config_file accelerate_configs/fsdp.yaml recipes/train.py --preset 1b
    accelerate launch recipes/train.py --save_every 50 --resume_from_checkpoint auto

Options: `python recipes/train.py --help` (or a YAML file with --config). `main` is the data flow,
one named step each: configure -> Accelerator (+ start-up guard) -> resume point (checked before
anything heavy) -> tokenizer and model config -> data -> the run's record -> model, optimizer,
schedule, prepare -> restore the checkpoint -> train (forward, loss, backward, clip, step,
schedule, log, eval, checkpoint) -> finish (eval, sample, a checkpoint of the final step, Hugging
Face export, run_summary.json).

Models: a random-init Llama preset, or any causal LM folder or Hub id (--model_name_or_path:
Llama, Qwen, Mistral, GPT-2, GPT-NeoX, Gemma...): FSDP2 shards by the model's own block class,
FLOPs are counted from its real parameters, tied embeddings stay tied, TP uses the model's plan.

Features: every config in accelerate_configs/ (single process, DDP, FSDP2, DeepSpeed ZeRO-1/2/3,
tensor parallel and 2D FSDP2 x TP from parallelism_config: train_extras/parallel/);
mixed precision from the launch config (no / bf16 / fp16 with a GradScaler whose skipped steps
hold the schedule); gradient accumulation with the loss normalised by the step's target tokens
over all micro-batches and ranks; clipping on the full gradient (pre-clip norm logged); NaN/inf
losses skipped, counted, and fatal after --max_nonfinite_steps in a row; four LR schedules;
held-out eval; data as text or conversations (chat template, loss on the assistant's tokens),
packed with document masks that fit the model (asked of it: positions restart, attention and
recurrent state kept apart where its layers can, else said), from one source
or a weighted mixture with a held-out loss per source (train_extras/data/: sources, formats,
render, packing); gradient checkpointing; pretrained start; resumable, atomic, rotated checkpoints
with exact resume; fused AdamW; tqdm bar with loss, lr and tokens/s on a terminal, one plain line
per interval in a log file; <output_dir>/metrics.jsonl appended as the run goes. Preemption
(SIGTERM/SIGUSR1 on any rank): every rank finishes the step (or leaves an eval or a sample within a
few batches or tokens), a checkpoint and <output_dir>/requeue.json are written, exit code 75
(train_extras/resume/preemption.py). A rank that dies or hangs makes the others stop within
--collective_timeout seconds with a message, not hang. Per log interval: tokens/s (global, per
device), step time, MFU, memory per rank, ETA, into run_summary.json and the trackers of --report_to
(one tracker run across every resume, its id kept in the checkpoints): the whole record is written
by one object, train_extras/observe/run_record.py's RunRecord. Token-shaped values in options are
redacted from everything the run writes and prints (train_extras/observe/tracking.py). --compile
compiles each decoder layer once
(accelerate's regional compilation).

Host syncs per optimizer step: one (the NaN/inf and preemption decision, which must be known
before the update), plus one under fp16 (the GradScaler's scale, to see a skipped step). Losses
and gradient norms stay on the device until the log interval fetches them all at once.
"""

import dataclasses
import os
import shutil
import sys
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import (DataLoaderConfiguration, DistributedType, GradientAccumulationPlugin,
                               GradScalerKwargs, InitProcessGroupKwargs, compile_regions_fsdp2,
                               set_seed)

from common import config, data, guard
from common import model as modeling
from common.export import export_pretrained
from common.files import partial_dir
from train_extras import chunked_loss, document_mask, lora, moe, muon
from train_extras.attention import check_flash
from train_extras.data import assemble, at_scale, render
from train_extras.observe import flops, metrics, run_record, tracking
from train_extras.observe.run_record import RunRecord
from train_extras.observe.sampling import sample_text
from train_extras.options import TrainConfig
from train_extras.parallel import (cpu_threads, ddp_settings, deepspeed_settings, fsdp_settings,
                                   tensor_parallel)
from train_extras.resume import checkpoint, output_dir, preemption


def main(argv=None):
    cfg, watch = configure(argv)
    accelerator = build_accelerator(cfg)
    resume_path, resume_meta = resume_point(cfg, accelerator)  # (None, None): a fresh start
    set_seed(cfg.seed)  # the same seed on every rank: identical initial weights everywhere

    tokenizer = data.build_tokenizer(cfg)
    facts = model_facts(cfg, accelerator, len(tokenizer))  # from its config: no weights yet
    train_data = prepare_data(cfg, accelerator, tokenizer, facts, resume_path, resume_meta)
    record = start_record(cfg, accelerator, train_data, facts)
    run = build(cfg, accelerator, tokenizer, train_data, facts, record, resume_meta)
    run.saved["tracker_run"] = record.start_trackers(resume_meta)
    run.saved["run_id"] = checkpoint.run_id(cfg, resume_path, resume_meta, accelerator)
    start = restore(run, record, resume_path, resume_meta)
    if cfg.eval_only:  # the model as it is, on the held-out data: nothing trains or is saved
        result = assemble.evaluate(run.model, run.eval_loaders, accelerator, cfg.eval_batches,
                                   loss=chunked_loss.loss_of(run.loss_head))
        record.evaluated_only(start.step, result)
        return end(accelerator)

    record.open_metrics(start.step if resume_path is not None else None)
    preempted = None
    # Step 0's eval, or the one a preemption interrupted at the step this run resumes from.
    if cfg.eval_every > 0 and (resume_path is None or resume_meta.get("eval_pending")):
        interrupted = evaluate(run, record, start.step, watch)
        if interrupted:  # nothing trained since the checkpoint (or at all): nothing new to save
            preempted = {"step": start.step, "signal": watch.signal_name or "another rank's signal",
                         "interrupted": interrupted,
                         "checkpoint": None if resume_path is None else str(resume_path)}
    if not preempted:
        preempted, micro_batches_done = train(run, record, start, watch)
    if not preempted:
        preempted = finish(run, record, start.step, watch, micro_batches_done)
    if preempted:  # the grace period is short: the checkpoint and the record, no eval, no export
        stop_preempted(run, record, preempted)
    end(accelerator)


# ---- before anything heavy ----

def configure(argv):
    """The options, and every check that needs no Accelerator; the process set up to train."""
    cfg = config.parse(TrainConfig, argv, recipe="train.py")
    tracking.warn_command_line(sys.argv[1:] if argv is None else argv,
                               os.environ.get("RANK", "0") == "0")
    modeling.check_seq_len(cfg)
    tensor_parallel.check_launch_sizes("train.py")  # the process count, before the mesh exists
    cpu_threads.use_available_cores()  # accelerate's default for one CPU process is one thread
    if not run_record.draw_bar():  # a scheduler's log file: plain lines, no progress-bar redraws
        run_record.library_bars_off()
    # From here on a SIGTERM/SIGUSR1 means "save and stop after this step", not "die now".
    watch = preemption.PreemptionWatch()
    return cfg, watch.install() if cfg.save_on_preemption else watch


def build_accelerator(cfg) -> Accelerator:
    """The Accelerator of the launch config, checked against what the config asked for."""
    # FSDP2's shard unit and policies (None unless the launch config asks for FSDP)
    fsdp_plugin = fsdp_settings.plugin(modeling.model_config(cfg))
    if fsdp_plugin is None and not cfg.fsdp_sync_each_batch:
        raise config.ConfigError("--fsdp_sync_each_batch false is an FSDP2 setting: "
                                 "this launch is not FSDP")
    # Sync on a count of micro-batches, not at the end of the dataloader: an epoch boundary in
    # the middle of an accumulation window must not trigger an early optimizer step. FSDP2:
    # reduce-scatter every micro-batch (a shard's gradient, not the model's, between them).
    sync_each_batch = fsdp_plugin is not None and cfg.fsdp_sync_each_batch
    plugin = GradientAccumulationPlugin(num_steps=cfg.gradient_accumulation_steps,
                                        sync_with_dataloader=False, sync_each_batch=sync_each_batch)
    accelerator = Accelerator(
        gradient_accumulation_plugin=plugin,
        # Batches copied from pinned memory without waiting for the copy (accelerate waits by default)
        dataloader_config=DataLoaderConfiguration(non_blocking=True),
        # We step the LR schedule ourselves, once per optimizer step (accelerate would step it
        # once per process per optimizer step: world_size times too fast for a schedule in steps).
        step_scheduler_with_optimizer=False,
        fsdp_plugin=fsdp_plugin,
        log_with=cfg.report_to or None,  # trackers see redacted options (observe/tracking.py)
        project_dir=cfg.output_dir,
        kwargs_handlers=[
            GradScalerKwargs(init_scale=cfg.fp16_init_scale),  # used by fp16 only
            # A collective that waits longer than this raises on this rank: a dead or hung rank
            # ends the job with a message instead of hanging it (torch's default is 10-30 min).
            InitProcessGroupKwargs(timeout=timedelta(seconds=cfg.collective_timeout)),
        ],
    )
    guard.check_launch(accelerator, "train.py",
                       supports=("single", "ddp", "fsdp", "deepspeed", "tp", "fsdp+tp"))
    deepspeed_settings.configure(accelerator, cfg)  # DeepSpeed clips in its own step
    threads = cpu_threads.for_offloaded_optimizer(cpu_threads.offloads_optimizer(accelerator))
    if threads and accelerator.is_main_process:  # (a GPU node: one thread per rank otherwise)
        print(f"cpu threads      : {threads} per rank, for the optimizer step offloaded to the CPU",
              flush=True)
    muon.check_launch(cfg, accelerator)  # Muon needs whole matrices: not sharded ones
    chunked_loss.check_launch(cfg, accelerator)  # nor a head split across ranks
    return accelerator


def resume_point(cfg, accelerator):
    """(checkpoint folder, its checkpoint.json) to resume from, or (None, None), after every check
    that needs no model: each file's size and checksum (auto: the newest checkpoint that
    verifies), then the model, strategy, world size and batch, and the output folder's rules."""
    existed = os.path.isdir(cfg.output_dir)
    if not cfg.eval_only:  # one live run per folder (an OS lock), before anything is written there
        output_dir.claim(cfg.output_dir, accelerator)
        output_dir.check_ours(cfg)  # what a run replaces is the project's, before anything is
        checkpoint.check_writable(cfg)
        if accelerator.is_main_process:
            # A requeued run has started: if it fails before it trains (say its checkpoint is
            # damaged), the job must not be requeued again and again for the old preemption.
            preemption.clear_marker(cfg.output_dir)
    path, meta = checkpoint.resume_point(cfg, accelerator)
    if path is not None:
        checkpoint.check_compatible(path, cfg, accelerator, meta)
    elif cfg.eval_only and not cfg.model_name_or_path:  # `auto` found nothing to evaluate
        raise config.ConfigError(
            f"--eval_only: no complete checkpoint in {cfg.output_dir}/checkpoints to evaluate")
    elif cfg.resume_from_checkpoint == "auto" and not cfg.eval_only and accelerator.is_main_process:
        print(f"note: --resume_from_checkpoint auto: no checkpoint in "  # a mistyped folder?
              f"{cfg.output_dir}/checkpoints{'' if existed else ' (a new folder)'}; starting afresh",
              flush=True)
    if not cfg.eval_only:  # which writes no checkpoint, and its record apart (eval_summary.json)
        checkpoint.check_output_dir(cfg, meta["step"] if path is not None else 0)
        output_dir.check_not_finished(cfg, path)
    return path, meta


@dataclasses.dataclass
class ModelFacts:
    tp_layout: dict | None  # the mesh parallelism_config asks for: {"dp_shard": M, "tp": N}
    flops: dict  # flops.flops(): per token as the model spends them (for MFU), the active figure
    inactive_parameters: int  # MoE: the routed experts' weights a token does not go through
    route: dict | None  # a mixture of experts: experts, top-k, the router loss's weight
    attention: str  # the attention kernel that runs (auto: the one transformers picks)
    frozen: set  # parameters the family builds frozen (a router's correction bias): kept so


def model_facts(cfg, accelerator, vocab_size: int) -> ModelFacts:
    """What the model is, read from its config and its class on the meta device, with the checks
    that need it (the mesh, the tensor-parallel plan, the router option), before the data."""
    model_cfg = modeling.model_config(cfg, vocab_size)
    tensor_parallel.check(accelerator, cfg, model_cfg, "train.py")
    meta = flops.meta_model(model_cfg)  # built once (an 8B one takes ~0.7 s), read four ways
    attention = cfg.attn_implementation
    if attention == "auto":
        attention = meta.config._attn_implementation
    check_flash(attention, accelerator)  # its package, a GPU, bf16/fp16: now, not at a forward
    counts = flops.parameter_counts(model_cfg, meta)
    inactive = counts["total"] - counts["active"]
    counted = flops.flops(model_cfg, cfg.seq_len, meta)
    return ModelFacts(tensor_parallel.layout(accelerator), counted, inactive,
                      moe.route_for(cfg, model_cfg, meta), attention, moe.declared_frozen(meta))


@dataclasses.dataclass
class TrainData:
    train_set: object
    eval_sets: dict  # {source name: held-out set}; one source: {"": its held-out set}
    train_loader: object
    eval_loaders: dict  # as eval_sets
    identity: dict  # what the data options resolved to: kept in checkpoints, checked on resume
    kind: str  # "text", "completions", "conversations" or "mixed" (a mixture)
    facts: dict  # conversations' fates, a mixture's shares (assemble.Datasets.facts)


def prepare_data(cfg, accelerator, tokenizer, facts: ModelFacts, resume_path,
                 resume_meta) -> TrainData:
    """Rank 0 tokenises and caches first (the others wait up to --data_timeout), then the others
    read its cache; or each rank streams its own part (train_extras/data/at_scale.py)."""
    if cfg.streaming and facts.tp_layout:
        raise config.ConfigError(
            "--streaming splits the stream over all ranks: not with tensor parallelism")
    with at_scale.main_process_first(accelerator, cfg.data_timeout):
        if cfg.streaming:
            train_set = at_scale.StreamedBlocks(cfg, tokenizer, rank=accelerator.process_index,
                                                world_size=accelerator.num_processes)
            built = assemble.Datasets(train_set, {"": at_scale.held_out_set(cfg, tokenizer)},
                                      "text", {})
        else:  # text or conversations, from one source or a mixture
            built = assemble.build(cfg, tokenizer, num_proc=cfg.dataset_num_proc)
    train_set, eval_sets = built.train, built.held_out
    identity = {**checkpoint.data_identity(cfg, None if cfg.streaming else len(train_set)),
                **assemble.identity(cfg, tokenizer, built.kind)}
    if resume_meta is not None and not cfg.eval_only:  # a file rewritten in place
        checkpoint.check_same_data(resume_path, resume_meta, identity)
    pin_memory = accelerator.device.type == "cuda"
    loaders = {}
    for name, eval_set in eval_sets.items():
        if cfg.streaming:
            loaders[name] = at_scale.streamed_loaders(cfg, train_set, eval_set, pin_memory)
        else:  # --eval_only trains nothing: its training set may hold less than a batch per rank
            loaders[name] = data.build_loaders(cfg, train_set, eval_set, pin_memory=pin_memory,
                                               trains=not cfg.eval_only)
    train_loader = next(iter(loaders.values()))[0]
    eval_loaders = {name: pair[1] for name, pair in loaders.items()}
    return TrainData(train_set, eval_sets, train_loader, eval_loaders, identity, built.kind,
                     built.facts)


def start_record(cfg, accelerator, train_data: TrainData, facts: ModelFacts) -> RunRecord:
    """The run's record, and the setup block, printed once the data is known to be good (bad
    input stays a one-line error). Logs get copied around: the options are printed and recorded
    with secrets removed, as trackers get them."""
    setup = config.setup_facts(cfg, accelerator, options=tracking.redact(dataclasses.asdict(cfg)))
    peak = metrics.peak_flops(accelerator)  # per device, for MFU (measured on a CPU: ~0.7 s)
    train_set, eval_sets = train_data.train_set, train_data.eval_sets
    eval_count = sum(len(eval_set) for eval_set in eval_sets.values())
    counted, route = facts.flops, facts.route
    if accelerator.is_main_process:
        print(config.describe_setup(setup, {
            "model": cfg.model_name_or_path or f"preset {cfg.preset} (random init)",
            "attention": facts.attention + (" (auto)" if cfg.attn_implementation == "auto" else ""),
            "FLOPs/token": f"{counted['per_token']:.3e} ({counted['counted']})",
            "peak for MFU": (f"{peak['tflops']:.3g} TFLOP/s per device, {peak['source']}"
                             if peak["tflops"] else f"unknown ({peak['source']}): no MFU"),
            "data": f"{'streamed' if cfg.streaming else len(train_set)} train / "
                    f"{eval_count} held-out " + (f"blocks of {cfg.seq_len + 1} tokens"
                                                 if cfg.packing else "documents, padded"),
            **assemble.describe(train_data.facts),  # conversations dropped, a mixture's shares
            **tensor_parallel.describe_mesh(accelerator),  # HSDP: dp_replicate x dp_shard
            **({"experts": moe.describe(route)} if route else {}),
            **({"frozen": f"{ddp_settings.fold(facts.frozen)} (the family builds them frozen)"}
               if facts.frozen else {}),
        }), flush=True)
    held_out_tokens = [metrics.token_stream(eval_set) for eval_set in eval_sets.values()]
    data_facts = {"train_blocks": None if cfg.streaming else len(train_set),
                  "eval_blocks": eval_count, "kind": train_data.kind, **train_data.facts,
                  "eval_bigram_entropy": metrics.bigram_entropy(np.concatenate(held_out_tokens))}
    tokens_per_step = (cfg.micro_batch_size * cfg.seq_len * cfg.gradient_accumulation_steps
                       * config.data_parallel_size(accelerator))  # ranks with batches of their own
    return RunRecord(accelerator, cfg, setup, peak=peak, data=data_facts,
                     tokens_per_step=tokens_per_step, flops_per_token=counted["per_token"],
                     flops=counted)


# ---- the model and what trains it ----

@dataclasses.dataclass
class Run:
    """What the steps below share, built once by `build`."""
    cfg: TrainConfig
    accelerator: Accelerator
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    tokenizer: object
    train_loader: object
    eval_loaders: dict  # {source name: loader}; one source: {"": its loader}
    sample_prompt: str  # conversations: a user message through the chat template
    tp_layout: dict | None  # {"dp_shard": M, "tp": N} under tensor parallelism
    route: dict | None  # a mixture-of-experts model's experts, top-k and router-loss weight
    saved: dict  # what every checkpoint.json records besides the step and the data position
    loss_head: object  # --loss_chunk_size: the output head that computes chunked losses; None: plain loss


def build(cfg, accelerator, tokenizer, train_data: TrainData, facts: ModelFacts,
          record: RunRecord, resume_meta: dict | None) -> Run:
    """Model (random-init preset or pretrained), optimizer and schedule, through `prepare`; what
    keeps packed documents apart in it (asked of it), given to its forward from here on."""
    dtype = deepspeed_settings.weights_dtype(accelerator)
    model = modeling.build_model(cfg, len(tokenizer), dtype=dtype)
    # from_pretrained makes every loaded parameter trainable; what the family builds frozen (a
    # router's correction bias) stays frozen, out of the optimizer (train_extras/moe.py)
    moe.keep_frozen(model, facts.frozen)
    # --lora_r: the base frozen, low-rank adapters trained (train_extras/lora.py)
    adapters = lora.apply(model, cfg, bool(facts.tp_layout))
    if adapters and accelerator.is_main_process:
        print(f"lora             : {lora.describe(adapters)}", flush=True)
    # DDP: trainable parameters that get no gradient, found by one probe backward (DDP is told);
    # before compiling, which the probe's eval mode would make compile twice
    def objective(m, ids, labels):  # reaches the parameters training reaches
        loss, aux, _ = micro_batch_losses(m, {"input_ids": ids, "labels": labels}, facts.route, None)
        return loss if aux is None else loss + aux
    unused = ddp_settings.find_unused(model, accelerator, objective, len(tokenizer))
    if unused and accelerator.is_main_process:
        print(f"ddp              : {ddp_settings.describe(unused)}", flush=True)
    if cfg.compile:
        # accelerate's regional compilation, in place (its FSDP2 and DeepSpeed route, here for
        # every strategy): each repeated block compiled once and reused, the rest apart. In
        # place, the parameter names stay as they are (its out-of-place variant, accelerate's
        # route for one process and DDP, prefixes them with _orig_mod: the export would not
        # load), and FSDP2's hooks, added later by prepare, still run.
        compile_regions_fsdp2(model)
    loss_head = chunked_loss.install(model, cfg.loss_chunk_size)  # None: the plain loss
    parameters = metrics.count_parameters(model)
    tp_layout = facts.tp_layout
    if tp_layout:  # TP (then FSDP2 for 2D) on accelerate's mesh, by torch's own APIs
        model = tensor_parallel.parallelize(model, accelerator)
    deepspeed_settings.gather_moe_blocks_whole(accelerator, model)  # ZeRO-3: experts gathered whole
    optimizer = muon.build_optimizer(model, cfg, accelerator.device)  # AdamW, or Muon + AdamW
    scheduler = modeling.build_scheduler(optimizer, cfg)
    train_loader, names = train_data.train_loader, list(train_data.eval_loaders)
    eval_loaders = list(train_data.eval_loaders.values())
    if tp_layout:  # accelerate takes TP models from transformers' tp_plan only: not the model
        train_loader, *eval_loaders, scheduler = accelerator.prepare(
            train_loader, *eval_loaders, scheduler)
    else:
        # FSDP2: accelerate's loading fails on persistent buffers (DeepSeek-V3's correction bias)
        buffers = fsdp_settings.buffers_aside(model, accelerator)
        if cfg.streaming:  # a streamed loader stays ours: each rank already reads its own part
            model, optimizer, *eval_loaders, scheduler = accelerator.prepare(
                model, optimizer, *eval_loaders, scheduler)
        else:
            model, optimizer, train_loader, *eval_loaders, scheduler = accelerator.prepare(
                model, optimizer, train_loader, *eval_loaders, scheduler)
        fsdp_settings.buffers_back(model, buffers, accelerator)
    documents = document_mask.resolve(model, accelerator, cfg, len(tokenizer),  # a resume: as it trained
                                      checkpoint.saved_documents(resume_meta, cfg))
    document_mask.install(model, accelerator, documents[0])
    record.documents(*documents)
    chunked_loss.check_plain_head(model, loss_head, accelerator, len(tokenizer))
    active = parameters - facts.inactive_parameters  # MoE: a token goes through top-k experts
    record.model(parameters, active, metrics.compiled_regions(model), frozen=sorted(facts.frozen),
                 ddp_unused_parameters=unused, lora=adapters,
                 **({"router": facts.route} if facts.route else {}))
    setup = record.summary["setup"]
    saved = {"batches_per_epoch": None if cfg.streaming else len(train_loader),
             "documents": documents[0],  # what kept packed documents apart: a resume keeps it
             "data": tracking.redact_strings(train_data.identity),  # no secret at rest: redacted
             "config": checkpoint.recorded_options(cfg),
             "setup": {k: setup[k] for k in ("distributed_type", "world_size", "data_parallel_size",
                                             "tensor_parallel_size", "mixed_precision")}}
    prompt = cfg.sample_prompt
    if "conversations" in train_data.facts:  # conversations, alone or mixed: an answer
        prompt = render.sample_prompt(tokenizer, cfg.sample_message)
    return Run(cfg, accelerator, model, optimizer, scheduler, tokenizer, train_loader,
               dict(zip(names, eval_loaders)), prompt, tp_layout, facts.route, saved, loss_head)


@dataclasses.dataclass
class Position:
    """Where training starts: the last step done, and the data position in this run's geometry."""
    step: int = 0
    epoch: int = 0
    skip: int = 0  # micro-batches into the epoch (a stream: into the stream)


def restore(run: Run, record: RunRecord, path, meta) -> Position:
    """Model, optimizer, schedule, scaler, RNG of every rank and the data position."""
    if path is None:
        return Position()
    cfg = run.cfg
    checkpoint.load(run.accelerator, path, run.optimizer, run.scheduler, cfg, run.model)
    # (epoch, batches into it) in this run's geometry: FSDP2 and replicated checkpoints may
    # resume on another number of ranks with the same global batch. A stream: batches into it.
    if cfg.streaming:
        epoch, skip = 0, meta["micro_batches_done"]
    else:
        data_ranks = config.data_parallel_size(run.accelerator)
        epoch, skip = checkpoint.data_position(meta, cfg, data_ranks, len(run.train_loader))
    # Options a resumed run may change (lr, schedule, length, cadences) hold from its first step.
    record.resumed(path, meta, checkpoint.resume_changes(meta, cfg))
    return Position(meta["step"], epoch, skip)


# ---- training ----

def train(run: Run, record: RunRecord, start: Position, watch) -> tuple[dict | None, int]:
    """The loop, from the step after `start` to --max_steps. Returns None, or what a preemption
    left (its step, signal, checkpoint and requeue marker) when a signal stopped it early, and the
    micro-batches done (the data position a checkpoint records)."""
    cfg, accelerator, optimizer = run.cfg, run.accelerator, run.optimizer
    run.model.train()
    if cfg.streaming:
        batches = at_scale.streamed_batches(accelerator, run.train_loader, start.skip)
        micro_batches_done = start.skip
    else:
        batches = batches_forever(accelerator, run.train_loader, start.epoch, start.skip)
        micro_batches_done = start.epoch * len(run.train_loader) + start.skip
    nonfinite = NonFinitePolicy(accelerator, cfg.max_nonfinite_steps)
    overflow = OverflowSkips(accelerator)  # after the resume: it starts from the loaded scale
    preempted = None
    with record.training(start.step):
        for step in range(start.step + 1, cfg.max_steps + 1):
            micro_batches = [next(batches) for _ in range(cfg.gradient_accumulation_steps)]
            micro_batches_done += len(micro_batches)
            step_loss, aux_loss, finite, stop_votes = forward_backward(run, micro_batches, watch,
                                                                       record)
            if nonfinite.stops_the_run(finite):
                lr = optimizer.param_groups[0]["lr"]
                record.step(step, lr, step_loss, None, overflow.scale, aux_loss)
                record.steps_to_file()  # the steps that led here, this one too, into metrics.jsonl
                raise nonfinite.error(step)
            # A skipped step: its gradients are dropped and the schedule waits.
            grad_norm = update(run, overflow) if finite else None
            optimizer.zero_grad(set_to_none=True)
            lr = optimizer.param_groups[0]["lr"]  # what the optimizer will really use next
            record.step(step, lr, step_loss, grad_norm, overflow.scale, aux_loss)

            if stop_votes:
                preempted = {"step": step, "signal": watch.signal_name or "another rank's signal"}
            if step % cfg.log_every == 0 or step == cfg.max_steps or preempted:
                record.interval(step)
            eval_now = (cfg.eval_every > 0 and not preempted
                        and (step % cfg.eval_every == 0 or step == cfg.max_steps))
            if eval_now:
                record.steps_to_file()  # its host sync waits for the steps: training time
            with record.paused():  # eval and checkpoint time is not training time (tokens/s)
                interrupted = eval_now and evaluate(run, record, step, watch)
                if interrupted:  # a signal during the eval or its sample: save now, not minutes later
                    preempted = {"step": step, "signal": watch.signal_name or "another rank's signal",
                                 "interrupted": interrupted}
                if preempted or (cfg.save_every and (step % cfg.save_every == 0
                                                     or step == cfg.max_steps)):
                    # an eval cut short is done again by the resumed run, before its first step
                    saved = save(run, record, step, micro_batches_done,
                                 **({"eval_pending": True} if interrupted == "eval" else {}))
            if preempted:
                preempted["checkpoint"] = str(saved)
                break
    record.skipped_steps(nonfinite_loss=nonfinite.skipped, fp16_overflow=overflow.skipped)
    return preempted, micro_batches_done


def forward_backward(run: Run, micro_batches: list, watch, record: RunRecord):
    """Gradients of one optimizer step, summed over its micro-batches. Returns the step's
    token-mean loss over all ranks and (MoE) its mean router loss, both on the device, whether the
    loss is finite and whether a rank was signalled; the experts' load goes to the record."""
    accelerator, model, accumulation = run.accelerator, run.model, len(micro_batches)
    # The whole step's target-token count over all micro-batches and ranks normalises the loss,
    # so every target token weighs the same whatever the length of its row (transformers'
    # num_items_in_batch is the same idea).
    step_tokens = accelerator.reduce(sum((b["labels"] != -100).sum() for b in micro_batches), "sum")
    # accelerator.backward (and DeepSpeed's engine) divide by gradient_accumulation_steps and
    # gradient averaging divides by the world size: undo both, so the update follows
    # sum(per-token loss over the whole step) / step_tokens, not a mean of means. (With tensor
    # parallelism the reduce counts each TP group's tokens tp times and gradients are averaged
    # over the data-parallel ranks only: world / step_tokens is still data ranks / real tokens.)
    scale = accumulation * accelerator.num_processes / step_tokens
    loss_sum = torch.zeros((), device=accelerator.device)
    aux_sum = torch.zeros((), device=accelerator.device)  # MoE: the router's load-balancing loss
    for i, batch in enumerate(micro_batches):
        if run.tp_layout and run.tp_layout["dp_shard"] > 1:  # our fully_shard: not accelerate's
            model.set_requires_gradient_sync(i == accumulation - 1)
        with accelerator.accumulate(model):  # no gradient all-reduce before the last micro-batch
            micro_sum, aux, slots = micro_batch_losses(model, batch, run.route, run.loss_head)
            if aux is None:  # dense, or a router without a load-balancing loss (DeepSeek-V3's)
                accelerator.backward(micro_sum * scale)
            else:  # the aux loss is a mean per micro-batch: backward's own scaling averages it
                accelerator.backward(micro_sum * scale + run.route["coef"] * aux)
                aux_sum += aux.detach()
            if slots is not None:
                record.expert_slots(slots)
        loss_sum += micro_sum.detach()
    # One all-reduce carries the loss, the router loss and each rank's preemption vote: every
    # rank then stops after the same step, whichever of them got the signal, and when.
    votes = watch.vote(loss_sum.device)
    loss_and_votes = accelerator.reduce(torch.stack([loss_sum, votes, aux_sum]), "sum")
    step_loss = loss_and_votes[0] / step_tokens
    with_aux = run.route and run.route["loss"]
    aux_loss = loss_and_votes[2] / (accumulation * accelerator.num_processes) if with_aux else None
    # The step's one host sync: whether the loss is finite (a NaN must not reach the weights)
    # and whether any rank was signalled.
    finite, stop_votes = torch.stack([torch.isfinite(step_loss).float(),
                                      loss_and_votes[1]]).tolist()
    return step_loss, aux_loss, bool(finite), stop_votes > 0


def micro_batch_losses(model, batch: dict, route: dict | None, loss_head):
    """(token-summed loss, the router's load-balancing loss, routing slots) of one micro-batch: no
    router loss for a dense model or a router without one, no slots for a dense model."""
    ids, labels = batch["input_ids"], batch["labels"]
    positions = batch.get("position_ids")  # --document_mask: restart at each document
    if route is None:
        return chunked_loss.causal_lm_loss(model, loss_head, ids, labels, "sum", positions), None, None
    return moe.losses(model, ids, labels, route, positions, loss_head)


def update(run: Run, overflow: "OverflowSkips"):
    """The optimizer step on the gradients the last micro-batch synchronised: unscale (fp16) and
    clip once, on the full gradient. Returns the pre-clip norm (inf max: measure, don't clip)."""
    max_norm = run.cfg.max_grad_norm or float("inf")
    grad_norm = run.accelerator.clip_grad_norm_(run.model.parameters(), max_norm)
    run.optimizer.step()
    if not overflow.step_was_skipped():
        run.scheduler.step()  # a step the fp16 scaler skipped does not advance the schedule
    return grad_norm


def evaluate(run: Run, record: RunRecord, step: int, watch) -> str | None:
    """The held-out loss (and --sample_at_eval's sample). A preemption signal ends either within
    seconds, on every rank at the same batch or token: returns what it interrupted ("eval", whose
    part-result is not recorded, or "sample"), else None."""
    cfg = run.cfg
    result = assemble.evaluate(run.model, run.eval_loaders, run.accelerator, cfg.eval_batches,
                               watch.stop_check(run.accelerator),
                               chunked_loss.loss_of(run.loss_head))
    if result is None:
        return "eval"
    record.eval(step, result)
    if cfg.sample_at_eval and cfg.sample_length:
        return sample(run, record, step, watch)
    return None


def sample(run: Run, record: RunRecord, step: int, watch) -> str | None:
    """What the model writes now: read it to judge the run, not only its loss. "sample" when a
    preemption signal ended it (nothing recorded), else None."""
    cfg = run.cfg
    text = sample_text(run.accelerator, run.model, run.tokenizer, run.sample_prompt,
                       cfg.sample_length, cfg.seed, stop=watch.stop_check(run.accelerator))
    if text is None:
        return "sample"
    record.sample(step, run.sample_prompt, text)
    return None


def save(run: Run, record: RunRecord, step: int, micro_batches_done: int, **extra):
    record.sync()  # metrics.jsonl up to this checkpoint survives a crash of the machine too
    metadata = {"micro_batches_done": micro_batches_done,  # per rank: with batches_per_epoch,
                "tokens_seen": step * record.tokens_per_step,  # the data position
                **run.saved, **extra}
    return checkpoint.save(run.accelerator, run.cfg.output_dir, step, keep=run.cfg.save_total_limit,
                           model=run.model, optimizer=run.optimizer, metadata=metadata)


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
            raise config.TrainingError(
                f"epoch {epoch} of the training data gave rank {accelerator.process_index} no "
                "micro-batch: lower --micro_batch_size or --seq_len, or give more data")
        skip, epoch = 0, epoch + 1


class NonFinitePolicy:
    """A step whose loss is NaN/inf is skipped (no update, the schedule waits);
    --max_nonfinite_steps of them in a row stop the run. Under DeepSpeed the update already
    happened inside backward, so the first one stops the run. Decided on the host from the
    step's one sync."""

    def __init__(self, accelerator, limit: int):
        self.deepspeed = accelerator.distributed_type == DistributedType.DEEPSPEED
        self.limit, self.in_a_row, self.skipped = limit, 0, 0

    def stops_the_run(self, finite: bool) -> bool:
        """Counts a non-finite step; True when the run must stop (raise `error`)."""
        if finite:
            self.in_a_row = 0
            return False
        self.in_a_row += 1
        self.skipped += 1
        return self.deepspeed or self.in_a_row >= self.limit

    def error(self, step: int) -> config.TrainingError:
        if self.deepspeed:
            return config.TrainingError(
                f"non-finite loss at step {step}: DeepSpeed steps inside backward, so this update "
                "is already applied; stopping without a checkpoint or an export")
        return config.TrainingError(
            f"non-finite loss in {self.in_a_row} steps in a row (last: step {step}); stopping "
            "without a checkpoint or an export (lower --lr, check the data, or use bf16 instead "
            "of fp16)")


class OverflowSkips:
    """fp16: the GradScaler skips a step whose gradients overflowed and halves its scale, and the
    LR schedule must then wait. A fused AdamW applies the skip itself, which accelerate's
    optimizer_step_was_skipped does not see (it says False): a lower scale than after the last
    step is the reliable sign (one host sync per step: get_scale). DeepSpeed has its own fp16
    loss scaler, whose overflow flag accelerate does report (no sync)."""

    def __init__(self, accelerator):
        self.accelerator, self.skipped = accelerator, 0
        self.scaler = accelerator.scaler
        self.scale = self.scaler.get_scale() if self.scaler is not None else None

    def step_was_skipped(self) -> bool:
        if self.scaler is None:
            skipped = self.accelerator.optimizer_step_was_skipped
        else:
            before, self.scale = self.scale, self.scaler.get_scale()
            skipped = self.scale < before
        self.skipped += skipped
        return skipped


# ---- the end ----

def finish(run: Run, record: RunRecord, start_step: int, watch, micro_batches_done: int) -> dict | None:
    """The final model: eval, sample, a checkpoint of the final step (the export must not cost the
    run), export, run_summary.json and the last line. Returns None, or what a preemption left when a
    signal interrupted the eval or the sample: the trained model is saved at --max_steps (unless that
    checkpoint exists), and the requeued run exports it."""
    cfg = run.cfg
    interrupted = None
    # Nothing trained: still report the final model (metrics.jsonl, closed, has the run's evals).
    if start_step >= cfg.max_steps and cfg.eval_every > 0 and not record.has_eval_at(cfg.max_steps):
        interrupted = evaluate(run, record, cfg.max_steps, watch)
    if not interrupted and cfg.sample_length and not record.has_sample_at(cfg.max_steps):
        interrupted = sample(run, record, cfg.max_steps, watch)  # --sample_at_eval may have
    if interrupted:  # decided from the options alone: the same on every rank, as a save must be
        last = os.path.join(cfg.output_dir, checkpoint.CHECKPOINT_DIR, f"step_{cfg.max_steps}")
        resumed = record.summary.get("resumed_from", {}).get("path")
        # the loop's, or the one resumed from
        have = (cfg.save_every and start_step < cfg.max_steps) or (
            resumed is not None and os.path.realpath(resumed) == os.path.realpath(last))
        saved = last if have else save(run, record, cfg.max_steps, micro_batches_done)
        return {"step": cfg.max_steps, "signal": watch.signal_name or "another rank's signal",
                "interrupted": interrupted, "checkpoint": str(saved)}
    export = None
    if cfg.save_model:  # export_dtype auto (None): the run's precision
        kept = checkpoint_before_export(run, record, start_step, micro_batches_done)
        dtype = None if cfg.export_dtype == "auto" else getattr(torch, cfg.export_dtype)
        try:
            merged = f"{cfg.output_dir}/model_merged" if cfg.lora_merge else None
            write = lora.writer(merged, run.tokenizer) if cfg.lora_r else None  # the adapter folder
            export = export_pretrained(run.accelerator, run.model, run.tokenizer,
                                       f"{cfg.output_dir}/model", dtype, write=write)
        except Exception as err:
            if not output_dir.disk_full(err):
                raise
            raise export_failed(run, err, kept) from None
    record.finished(export, start_step)
    if cfg.save_model and cfg.save_every == 0:  # no checkpoint asked for: those kept for the export go
        if run.accelerator.is_main_process:
            checkpoint.remove_for_export(cfg.output_dir, run.saved["run_id"])
        run.accelerator.wait_for_everyone()
    return None


def stop_preempted(run: Run, record: RunRecord, preempted: dict) -> None:
    """After the checkpoint (if anything trained): the requeue marker, the record, one line, exit 75."""
    cfg, accelerator = run.cfg, run.accelerator
    saved, step = preempted["checkpoint"], preempted["step"]
    if accelerator.is_main_process:
        marker = preemption.write_marker(cfg.output_dir, step, saved, preempted["signal"])
        preempted["marker"] = str(marker)
    record.preempted(preempted)
    end(accelerator)
    raise preemption.stopped(preempted, cfg.output_dir, accelerator.process_index, accelerator.num_processes)


def checkpoint_before_export(run: Run, record: RunRecord, start_step: int,
                             micro_batches_done: int) -> Path | None:
    """The checkpoint of the final step. With --save_every the loop saved it; when nothing
    trained, the resumed checkpoint is it; else (--save_every 0) it is saved now, marked
    `for_export` (removed once an export is done). None: the disk had no room for it (the
    export, smaller, is still tried)."""
    cfg, resumed = run.cfg, record.summary.get("resumed_from")
    if start_step >= cfg.max_steps:
        return Path(resumed["path"])
    if cfg.save_every:
        return Path(cfg.output_dir) / checkpoint.CHECKPOINT_DIR / f"step_{cfg.max_steps}"
    try:
        return save(run, record, cfg.max_steps, micro_batches_done, for_export=True)
    except checkpoint.DiskFull as err:
        if run.accelerator.is_main_process:
            print(f"warning: {err}; the export is tried all the same", flush=True)
        return None


def export_failed(run: Run, err: Exception, kept) -> config.ConfigError:
    """The line for a disk that filled during the export, naming what truly exists."""
    cfg = run.cfg
    if run.accelerator.is_main_process:  # room for the next try
        shutil.rmtree(partial_dir(f"{cfg.output_dir}/model"), ignore_errors=True)
    if kept is None:
        return config.ConfigError(
            f"disk full while writing the export {cfg.output_dir}/model ({config.one_line(err)}): "
            f"the export was not written and there was no room for a checkpoint of step "
            f"{cfg.max_steps} either; {checkpoint.kept(cfg.output_dir)}")
    return config.ConfigError(
        f"disk full while writing the export {cfg.output_dir}/model ({config.one_line(err)}): the "
        f"export was not written; the trained model is in the checkpoint {kept} (step "
        f"{cfg.max_steps}): free space, then rerun with --resume_from_checkpoint {kept} "
        f"--max_steps {cfg.max_steps} to export it")


def end(accelerator) -> None:
    accelerator.wait_for_everyone()  # no rank tears down the process group while another uses it
    preemption.keep_process_group()  # freed by no one before the process ends (see there)
    accelerator.end_training()


if __name__ == "__main__":
    tracking.redact_printed_lines()  # a token in an option, printed by anyone: [redacted]
    sys.exit(preemption.run_cli(main))
