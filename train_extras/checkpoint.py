"""Checkpoints and export.

Resumable checkpoints: `<output_dir>/checkpoints/step_<N>/` holds accelerate's `save_state` (model,
optimizer, scheduler, GradScaler, every rank's RNG; sharded per rank under FSDP2 and DeepSpeed;
under tensor parallelism, where the model and optimizer are not accelerate's, their shards go to
torch.distributed.checkpoint in `model_optimizer_dcp/`, train_extras/parallel.py) plus
`checkpoint.json`: the step, the data position, the resolved config and the list of every file
with its size. Rotation keeps the newest --save_total_limit by step number (never sorted as
text: step_9 < step_10).

Crash safety: a checkpoint is written under `.step_<N>.partial`, its files are fsynced, and it is
renamed to `step_<N>` only when every rank has finished and checkpoint.json is complete. A folder
named step_<N> with a checkpoint.json is therefore always whole, whatever moment a crash hits;
an old checkpoint is first renamed aside (`.step_<N>.deleting`) and only then removed, so a crash
during rotation never leaves a half-deleted folder that looks complete. Leftovers of a crash are
cleared by the next save. Requires the output folder on a filesystem every rank sees.

Before a resume, `verify` checks each listed file exists with its recorded size (a truncated or
missing file is named before any model is built), and `load` turns any remaining load failure into
one line naming the checkpoint.

The export at the end of a run is common/export.py.
"""

from __future__ import annotations

from pathlib import Path

import json
import os
import re
import shutil

from accelerate.utils import DistributedType

from common.config import ConfigError, data_parallel_size, one_line, tensor_parallel_size
from common.files import write_json
from train_extras import parallel

CHECKPOINT_DIR = "checkpoints"
METADATA = "checkpoint.json"

def list_complete(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints (step_<N> with checkpoint.json), oldest first by step number."""
    root = Path(output_dir) / CHECKPOINT_DIR
    found = []
    for path in root.glob("step_*"):
        match = re.fullmatch(r"step_(\d+)", path.name)
        if match and (path / METADATA).is_file():
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


def resolve_resume(cfg) -> Path | None:
    """--resume_from_checkpoint: 'auto' = the newest complete checkpoint of output_dir, or None."""
    if cfg.resume_from_checkpoint is None:
        return None
    if cfg.resume_from_checkpoint == "auto":
        complete = list_complete(cfg.output_dir)
        return complete[-1] if complete else None
    return Path(cfg.resume_from_checkpoint)


def read_metadata(path: str | Path) -> dict:
    meta_file = Path(path) / METADATA
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"unreadable checkpoint metadata {meta_file}: {err}") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("files"), dict):
        raise ConfigError(f"{meta_file} has no file list: not a checkpoint this code wrote")
    return meta


def verify(path: str | Path) -> dict:
    """Every file the save wrote is there with its size; return checkpoint.json. Cheap (no
    reading of the data), so it runs on every resume before any heavy work."""
    path = Path(path)
    meta = read_metadata(path)
    for name, size in meta["files"].items():
        file = path / name
        if not file.is_file():
            raise ConfigError(f"checkpoint {path} is damaged: {file} is missing; resume from an older checkpoint")
        if file.stat().st_size != size:
            raise ConfigError(f"checkpoint {path} is damaged: {file} has {file.stat().st_size} bytes, the save "
                              f"wrote {size} (truncated or overwritten); resume from an older checkpoint")
    return meta


# Strategies whose checkpoints hold full (unsharded) model and optimizer states: any of them
# resumes any other, at any world size.
REPLICATED = ("NO", "MULTI_CPU", "MULTI_GPU")


# What makes a stream the same stream: a resumed streamed run skips that many blocks of it.
STREAM_IDENTITY = ("data_files", "dataset_name", "dataset_config", "dataset_split", "text_column", "txt_documents",
                   "add_bos", "seq_len", "seed", "tokenizer_name_or_path", "model_name_or_path")


def check_compatible(path: str | Path, cfg, accelerator) -> dict:
    """Refuse, before any heavy work, a checkpoint this run cannot continue: another model, another
    strategy, another global batch, or a world-size change the strategy cannot reshard. Returns
    checkpoint.json (verified)."""
    meta = verify(path)
    meta_file = Path(path) / METADATA
    saved_cfg, saved_setup = meta.get("config", {}), meta.get("setup", {})
    saved_model = saved_cfg.get("model_name_or_path") or f"preset {saved_cfg.get('preset')!r}"
    this_model = cfg.model_name_or_path or f"preset {cfg.preset!r}"
    if saved_cfg.get("model_name_or_path") is None and cfg.model_name_or_path is None and saved_model != this_model:
        raise ConfigError(f"{meta_file} was saved from {saved_model}; this run builds {this_model}")
    saved_type, this_type = saved_setup.get("distributed_type"), accelerator.distributed_type.value
    saved_mesh = (saved_setup.get("data_parallel_size", saved_setup.get("world_size")),
                  saved_setup.get("tensor_parallel_size", 1))
    this_mesh = (data_parallel_size(accelerator), tensor_parallel_size(accelerator))
    if max(saved_mesh[1], this_mesh[1]) > 1 and saved_mesh != this_mesh:  # TP shards (DCP): same mesh only
        raise ConfigError(
            f"{meta_file} was saved with {saved_mesh[0]} data-parallel x {saved_mesh[1]} tensor-parallel ranks; "
            f"this run has {this_mesh[0]} x {this_mesh[1]}: resume with the parallelism_config it was saved with")
    # from here on, "world" = ranks that see different batches
    saved_world, this_world = saved_mesh[0], this_mesh[0]
    same_family = saved_type == this_type or (saved_type in REPLICATED and this_type in REPLICATED)
    if not same_family:
        raise ConfigError(f"{meta_file} was saved with distributed_type {saved_type}; this run has {this_type}: "
                          "resume with the launch config it was saved with")
    if saved_world != this_world and this_type == "DEEPSPEED":
        raise ConfigError(
            f"{meta_file} was saved by {saved_world} DeepSpeed ranks; this run has {this_world}. ZeRO partitions "
            f"do not reshard here: resume with {saved_world} processes, or export its weights with "
            f"{saved_world} processes (--resume_from_checkpoint {path} --max_steps {meta.get('step')}) and start "
            "a new run from <output_dir>/model with --model_name_or_path (the optimizer state starts afresh)")
    if cfg.eval_only:  # evaluates the weights: the data position and the batch do not matter
        return meta
    streamed = (bool(saved_cfg.get("streaming")), saved_world, saved_cfg.get("micro_batch_size"))
    if (streamed[0] or cfg.streaming) and streamed != (cfg.streaming, this_world, cfg.micro_batch_size):
        raise ConfigError(f"{meta_file} was saved by a run with streaming {streamed[0]}, {saved_world} data ranks and "
                          f"micro-batch {streamed[2]}: a streamed run resumes only as it was (each rank's place in "
                          "its part of the stream is a count of its own micro-batches)")
    changed = [key for key in STREAM_IDENTITY if cfg.streaming and saved_cfg.get(key) != getattr(cfg, key)]
    if changed:
        raise ConfigError(f"{meta_file} streamed other data: --{', --'.join(changed)} differ; a streamed run resumes "
                          "by reading the same stream again up to its place")
    if saved_world != this_world:
        _samples_into_epoch(meta, cfg, this_world)  # raises if the position falls inside a micro-step here
    saved_batch = saved_cfg.get("micro_batch_size", 0) * saved_cfg.get("gradient_accumulation_steps", 0) * saved_world
    this_batch = cfg.micro_batch_size * cfg.gradient_accumulation_steps * this_world
    if saved_batch != this_batch:
        raise ConfigError(
            f"{meta_file} was trained with a global batch of {saved_batch} sequences; this run has {this_batch} "
            f"({cfg.micro_batch_size} micro x {cfg.gradient_accumulation_steps} accum x {this_world} ranks): "
            "choose --micro_batch_size and --gradient_accumulation_steps that keep it")
    return meta


def data_position(meta: dict, cfg, world_size: int, batches_per_epoch: int) -> tuple[int, int]:
    """(epoch, micro-batches into it) for this run's geometry, from the saved position.

    Within an epoch the global sample order does not depend on how it is cut into micro-batches
    and ranks (rank r takes the loader's batches r, r + world, ...), so the position moves across
    a world-size change as a count of samples into the epoch."""
    epoch, samples_into_epoch = _samples_into_epoch(meta, cfg, world_size)
    new_skip = samples_into_epoch // (world_size * cfg.micro_batch_size)
    if new_skip >= batches_per_epoch:  # the new geometry's epoch is shorter (drop_last): start the next one
        return epoch + 1, 0
    return epoch, new_skip


def _samples_into_epoch(meta: dict, cfg, world_size: int) -> tuple[int, int]:
    saved_cfg = meta["config"]
    saved_world = meta["setup"].get("data_parallel_size", meta["setup"]["world_size"])  # batch-splitting ranks
    epoch, skip = divmod(meta["micro_batches_done"], meta["batches_per_epoch"])
    samples_into_epoch = skip * saved_world * saved_cfg["micro_batch_size"]
    per_micro_step = world_size * cfg.micro_batch_size
    if samples_into_epoch % per_micro_step:
        raise ConfigError(
            f"the checkpoint stopped {samples_into_epoch} samples into an epoch (an epoch ended inside an optimizer "
            f"step), which is not a whole number of this run's micro-steps of {per_micro_step} samples; resume "
            f"with {saved_world} processes, or with a --micro_batch_size that divides {samples_into_epoch or 1}")
    return epoch, samples_into_epoch


def check_output_dir(cfg, start_step: int) -> None:
    """Refuse to write into a folder that holds checkpoints past where this run starts: rotation
    by step number would delete this run's own new checkpoints first, and `auto` would later
    resume the other run's."""
    newer = [p.name for p in list_complete(cfg.output_dir) if int(p.name[5:]) > start_step]
    if newer:
        raise ConfigError(
            f"{Path(cfg.output_dir) / CHECKPOINT_DIR} already holds {', '.join(newer[-3:])} past this run's start "
            f"(step {start_step}): use --resume_from_checkpoint auto to continue it, or another --output_dir")


def _fsync_tree(folder: Path) -> dict:
    """fsync every file under folder (so the rename below cannot reach the disk before the data
    does) and return {relative path: size}."""
    files = {}
    for file in sorted(p for p in folder.rglob("*") if p.is_file()):
        with open(file, "rb") as f:
            os.fsync(f.fileno())
        files[file.relative_to(folder).as_posix()] = file.stat().st_size
    return files


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(accelerator, output_dir: str | Path, step: int, metadata: dict, keep: int = 0,
         model=None, optimizer=None) -> Path:
    """Write step_<step> atomically (all ranks call this), then rotate old checkpoints.

    Under tensor parallelism the model and optimizer are not accelerate's (train_extras/parallel.py):
    pass them, and their shards go to torch.distributed.checkpoint next to save_state's files."""
    root = Path(output_dir) / CHECKPOINT_DIR
    final, partial = root / f"step_{step}", root / f".step_{step}.partial"
    if accelerator.is_main_process:
        root.mkdir(parents=True, exist_ok=True)
        for leftover in list(root.glob(".step_*.partial")) + list(root.glob(".step_*.deleting")):
            shutil.rmtree(leftover, ignore_errors=True)  # left by a crash during an earlier save
    accelerator.wait_for_everyone()
    accelerator.save_state(str(partial))  # every rank writes its part (shards, RNG)
    if parallel.layout(accelerator) is not None:
        parallel.save_sharded(model, optimizer, partial)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        files = _fsync_tree(partial)
        write_json(partial / METADATA, {"step": step, **metadata, "files": files})
        replaced = root / f".step_{step}.deleting"
        if final.exists():  # the same step saved before (e.g. a rerun): set it aside only now
            final.rename(replaced)
        partial.rename(final)  # the commit point
        _fsync_dir(root)
        shutil.rmtree(replaced, ignore_errors=True)
        if keep:
            for old in list_complete(output_dir)[:-keep]:
                trash = root / f".{old.name}.deleting"
                old.rename(trash)  # atomic: the checkpoint is either whole or gone from the list
                shutil.rmtree(trash)
    accelerator.wait_for_everyone()
    return final


def load(accelerator, path: str | Path, optimizer, scheduler, model=None) -> None:
    """Restore everything save_state wrote (call on every rank); checkpoint.json was read by check_compatible.

    A failure here (a file damaged in place, with its size intact) leaves the model half loaded:
    it becomes one error line naming the checkpoint and the run stops; it never trains on."""
    try:
        accelerator.load_state(str(path))
        if parallel.layout(accelerator) is not None:
            parallel.load_sharded(model, optimizer, Path(path))
    except Exception as err:  # noqa: BLE001 - any reader's error: safetensors, torch.load, DCP, DeepSpeed
        raise ConfigError(f"checkpoint {path} could not be loaded ({one_line(err)}); "
                          "resume from an older checkpoint") from None
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        # DeepSpeed's load_checkpoint gives its optimizer new param_group dicts; the torch LR
        # scheduler would keep setting the lr of the old ones and the real lr would freeze at its
        # value at save time (measured: resumed ZeRO-3 losses drifted from step N+3 on).
        scheduler.scheduler.optimizer = optimizer.optimizer
