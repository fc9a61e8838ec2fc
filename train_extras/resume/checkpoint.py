"""Resumable checkpoints: save, verify, resume the same run (or refuse).

`<output_dir>/checkpoints/step_<N>/` holds accelerate's `save_state` (model,
optimizer, scheduler, GradScaler, every rank's RNG; sharded per rank under FSDP2 and DeepSpeed;
under tensor parallelism, where the model and optimizer are not accelerate's, their shards go to
torch.distributed.checkpoint in `model_optimizer_dcp/`, train_extras/parallel/tensor_parallel.py) plus
`checkpoint.json`: the step, the data position, the resolved config and the list of every file
with its size and checksum, plus a checksum of its own content. Rotation keeps the newest
--save_total_limit by step number (never sorted as text: step_9 < step_10), of this run's own:
every checkpoint.json records the run's id (`run_id`: new for a fresh run or one resumed from
another folder's checkpoint, kept by a run that resumes one of its folder's own), and rotation
removes only checkpoints with this run's id. Another run's (or one saved before run ids, which has
none) are kept, and the run says so once.

Crash safety: a checkpoint is written under `.step_<N>.partial`, its files are fsynced, and it is
renamed to `step_<N>` only when every rank has finished and checkpoint.json is complete. A folder
named step_<N> with a checkpoint.json is therefore always whole, whatever moment a crash hits;
an old checkpoint is first renamed aside (`.step_<N>.deleting`) and only then removed, so a crash
during rotation never leaves a half-deleted folder that looks complete. Leftovers of a crash are
cleared by the next save (only folders with the names a save gives them; a link of that name
is removed, never followed). A checkpoints/ folder that cannot be written is one line before any
work (`check_writable`), or, if it becomes so during the run, one line at the save. A full disk or
quota stops every rank with one line, before the save when the space is visibly short, else with
the partial save removed; the complete checkpoints are kept, and each line names them (or says
there are none: `kept`). Requires the output folder on a filesystem every rank sees.

Content checksums: every file's xxh3-128 digest is recorded in checkpoint.json as the save commits
(read back from the page cache right after writing, split over the ranks and over threads), and
before a resume `verify` checks each file's size and then its digest, before any model is built:
bit rot, a bad copy or a file overwritten in place is one line naming the file. The checksums find
damage, not tampering (whoever can write the folder can recompute them): every file a loader would
unpickle is also checked by train_extras/resume/safe_load.py, with or without --verify_checkpoint. `auto` then falls
back to the newest checkpoint that verifies, setting the damaged ones aside as `step_<N>.damaged`
(kept, never deleted, out of auto's and rotation's way). --verify_checkpoint false checks sizes
only. (xxh3 runs at ~25 GB/s on one core here; benchmarks/checkpoint_checksums.py measures the cost.)
`load` turns any remaining load failure into one line naming the checkpoint.

Resuming is the same run or a refusal (`check_compatible`): another model, tokenizer, data, seed,
seq_len, strategy or global batch is refused in one line naming the setting; the schedule, its
length and the cadences may change and are applied from the first resumed step (`apply_schedule`)
and recorded (run_summary.json `resumed_from.changed`, and the new checkpoints' config).

The export at the end of a run is common/export.py.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import re
import shutil
import tempfile
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import xxhash
from accelerate.utils import DistributedType, broadcast_object_list, gather_object

from common.config import (ConfigError, TrainingError, data_file_list, data_parallel_size, one_line,
                           same_on_every_rank, tensor_parallel_size)
from common.files import write_json
from train_extras import document_mask, muon
from train_extras.observe.tracking import redact, redact_strings
from train_extras.parallel import tensor_parallel
from train_extras.resume import safe_load
from train_extras.resume.output_dir import disk_full, free_bytes, own_checkpoint

CHECKPOINT_DIR = "checkpoints"
METADATA = "checkpoint.json"
DIGEST = "xxh3_128"  # non-cryptographic: it finds damage, not tampering
_CHUNK = 16 << 20
LEFTOVER = re.compile(r"\.step_\d+\.(partial|deleting)")  # the names save and rotation give their work in progress


class DiskFull(ConfigError):
    """A save stopped by a full disk or quota (every rank alike; the partial save removed)."""


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


def run_id(cfg, path: Path | None, meta: dict | None, accelerator) -> str:
    """This run's id, recorded in each of its checkpoints: the resumed checkpoint's when it is one of
    this folder's own (the same run goes on), else a new one (a fresh run, or a checkpoint of another
    folder: a new run here). Rank 0's, on every rank. uuid4: the OS's randomness, not the seeded RNGs."""
    if path is not None and own_checkpoint(cfg.output_dir, path) and meta.get("run_id"):
        return meta["run_id"]
    new = uuid.uuid4().hex[:16]
    return broadcast_object_list([new])[0] if accelerator.num_processes > 1 else new


def _saved(path: Path) -> dict:
    """A checkpoint's checkpoint.json as it is ({} if unreadable: then nothing of it is this run's)."""
    try:
        meta = json.loads((path / METADATA).read_text())
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


def metadata_digest(meta: dict) -> str:
    """xxh3-128 of checkpoint.json's content (its own checksum left out), in one canonical form."""
    body = {k: v for k, v in meta.items() if k != "metadata_checksum"}
    return xxhash.xxh3_128(json.dumps(body, sort_keys=True).encode()).hexdigest()


def read_metadata(path: str | Path) -> dict:
    """checkpoint.json, checked against its own checksum: it holds the data position and the step,
    which no other file's checksum covers, so an edit there would silently resume elsewhere."""
    meta_file = Path(path) / METADATA
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"unreadable checkpoint metadata {meta_file}: {err}") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("files"), dict):
        raise ConfigError(f"{meta_file} has no file list: not a checkpoint this code wrote")
    if "metadata_checksum" not in meta and "data" not in meta:
        return meta  # written before checkpoint.json had a checksum of its own (and its data record)
    if meta.get("metadata_checksum") != metadata_digest(meta):
        what = "has no checksum of its own" if "metadata_checksum" not in meta else "does not match its own checksum"
        raise ConfigError(f"{meta_file} {what} (edited or damaged since it was written: its step and data position "
                          "cannot be trusted); resume from another checkpoint")
    return meta


def file_digest(path: Path, sync: bool = False) -> str:
    """xxh3-128 of a file's bytes (and, with sync, the file fsynced first)."""
    digest, buffer = xxhash.xxh3_128(), bytearray(_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb") as f:
        if sync:
            os.fsync(f.fileno())
        while n := f.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


# A file a rank wrote carries its rank in its name: torch.distributed.checkpoint's shards (`__3_0.distcp`),
# DeepSpeed's (`zero_pp_rank_3_...`, `bf16_zero_pp_rank_3_...` under bf16), accelerate's RNG states
# (`random_states_3.pkl`); the main process writes the others (an unsharded run's model, optimizer and
# scheduler, the metadata).
WRITER = re.compile(r"(?:^|/)(?:__(\d+)_\d+\.distcp|(?:bf16_)?zero_pp_rank_(\d+)_.*|random_states_(\d+)\.pkl)$")


def writer_rank(name: str, world: int) -> int:
    match = WRITER.search(name)
    return int(next(g for g in match.groups() if g is not None)) % world if match else 0


def _digests(folder: Path, names: list[str], accelerator, sync: bool = False) -> dict:
    """{name: digest} of every file, each rank reading the files it wrote (`writer_rank`: from its
    page cache, not across a shared file system from another machine's writes) with a few threads
    (xxhash and file reads release the GIL); every rank gets the whole answer."""
    world = accelerator.num_processes if accelerator is not None else 1
    rank = accelerator.process_index if accelerator is not None else 0
    mine = [name for name in names if writer_rank(name, world) == rank]
    with ThreadPoolExecutor(max_workers=max(1, min(8, len(mine), os.cpu_count() or 1))) as pool:
        found = dict(zip(mine, pool.map(lambda name: file_digest(folder / name, sync), mine)))
    if world > 1:
        found = {k: v for part in gather_object([found]) for k, v in part.items()}
    return found


def verify(path: str | Path, accelerator=None, contents: bool = True) -> dict:
    """Every file the save wrote is there with its size and (contents=True, where checkpoint.json
    has them) its checksum; returns checkpoint.json. With an accelerator, call on every rank: they
    share the reading. Raises ConfigError naming the first damaged file."""
    path = Path(path)
    meta = read_metadata(path)
    damaged = None
    for name, size in meta["files"].items():
        file = path / name
        if not file.is_file():
            damaged = f"{file} is missing"
        elif file.stat().st_size != size:
            damaged = f"{file} has {file.stat().st_size} bytes, the save wrote {size} (truncated or overwritten)"
        if damaged:
            break
    checksums = meta.get("checksums") or {}
    if damaged is None and contents and checksums:
        found = _digests(path, sorted(checksums), accelerator)
        bad = [name for name in sorted(checksums) if found[name] != checksums[name]]
        if bad:
            damaged = (f"{path / bad[0]} does not match its {DIGEST} checksum (changed since it was written: bit rot, "
                       f"a bad copy or an overwrite{f'; {len(bad) - 1} more file(s) too' if len(bad) > 1 else ''})")
    if damaged is None:
        try:  # what a loader would unpickle (always, also with contents=False): nothing in it may run
            safe_load.check_folder(path)
        except safe_load.Refused:
            raise
        except ConfigError as err:
            damaged = str(err)
    if damaged:
        raise ConfigError(f"checkpoint {path} is damaged: {damaged}; resume from an older checkpoint")
    return meta


def _set_aside(path: Path) -> Path:
    """step_<N> -> step_<N>.damaged (.damaged.2, ... if one is there already: the same step can go bad twice)."""
    target, n = path.with_name(path.name + ".damaged"), 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.damaged.{n}")
    path.rename(target)
    return target


@same_on_every_rank()  # every rank reads the same files and options
def resume_point(cfg, accelerator) -> tuple[Path | None, dict | None]:
    """The checkpoint to resume from and its checkpoint.json, verified (every rank calls this).
    An explicit path that fails is an error. With `auto` the newest that verifies; the newer,
    damaged ones are then set aside as step_<N>.damaged (kept, out of auto's and rotation's way),
    and the run says so. None verifying is an error (nothing is moved): a person must look."""
    path = resolve_resume(cfg)
    if path is None or cfg.resume_from_checkpoint != "auto":
        return path, None if path is None else verify(path, accelerator, cfg.verify_checkpoint)
    damaged = []
    for candidate in reversed(list_complete(cfg.output_dir)):
        try:
            meta = verify(candidate, accelerator, cfg.verify_checkpoint)
        except safe_load.Refused:  # not damage: someone wrote into the folder; a person must look
            raise
        except ConfigError as err:
            damaged.append((candidate, err))
            continue
        accelerator.wait_for_everyone()  # every rank has read them before they move
        if accelerator.is_main_process:
            aside = []
            for bad, err in damaged:
                print(f"warning: {err}", flush=True)
                if not cfg.eval_only:  # which writes nothing into the folder but its summary
                    try:
                        aside.append(_set_aside(bad).name)
                    except OSError as why:  # then check_output_dir refuses the newer checkpoint on every rank
                        print(f"warning: could not set {bad} aside ({why.strerror})", flush=True)
            if damaged:
                print(f"warning: resuming from {candidate}, the newest checkpoint that verifies"
                      + (f"; set aside: {', '.join(aside)}" if aside else ""), flush=True)
        accelerator.wait_for_everyone()
        return candidate, meta
    raise ConfigError(f"no checkpoint in {Path(cfg.output_dir) / CHECKPOINT_DIR} verifies (newest: {damaged[0][1]}); "
                      "nothing was moved: restore the folder from a copy, or start afresh in another --output_dir")


# Strategies whose checkpoints hold full (unsharded) model and optimizer states: any of them
# resumes any other, at any world size.
REPLICATED = ("NO", "MULTI_CPU", "MULTI_GPU")


# What a run trains on and from: a resumed run that changes one of them would train another model
# on other data (or its data position would point elsewhere), so it is refused. The optimizer's own
# hyperparameters are kept in its state (load_state restores them): refused too, not silently undone.
# (--data_files and --eval_data_files: as the files they resolve to, see data_identity.)
TRAINED_ON = ("seed", "seq_len", "preset", "model_name_or_path", "tokenizer_name_or_path", "dataset_name",
              "dataset_config", "dataset_split", "eval_split", "txt_documents", "text_column", "eval_fraction",
              "add_bos", "packing", "chat_column", "overlong", "completion_only_loss", "last_turn_only",
              "weight_decay", "adam_beta1",
              "adam_beta2", "adam_eps", "optimizer", "muon_weight_decay", "muon_momentum", "muon_adjust_lr",
              "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules")
# What a resumed run may change, applied from its first step and recorded as applied; every other
# option changes nothing that was trained (cadences of logs, samples, trackers, timeouts, export).
# (--warmup_ratio is compared as what it sets, warmup_steps.)
APPLIED_ON_RESUME = ("lr", "muon_lr", "lr_schedule", "warmup_steps", "min_lr_ratio", "decay_fraction",
                     "max_steps", "max_grad_norm", "eval_every", "eval_batches", "save_every", "save_total_limit",
                     "log_every")

# What a checkpoint saved before an option existed was trained with: packed documents were not
# masked apart before --document_mask (a resume with the mask on would train another model:
# saved_documents, check_documents).
# Any other option it does not record takes its default (saved_options).
BEFORE_THE_OPTION = {"document_mask": False, "optimizer": "adamw"}


def saved_options(meta: dict, cfg) -> dict:
    """The options a checkpoint was trained with: those checkpoint.json records, and for an option
    added since (not recorded), what the code that wrote it did: BEFORE_THE_OPTION's value, else
    the option's default (an option is added with the old behaviour as its default). So a resume
    checks and reports a newer option against that, instead of skipping it."""
    return {**dataclasses.asdict(type(cfg)()), **BEFORE_THE_OPTION, **meta.get("config", {})}


def saved_documents(meta: dict | None, cfg) -> str | None:
    """What kept packed documents apart in the run a checkpoint saved (train_extras/document_mask.py's
    mode: checkpoint.json's "documents"; before --document_mask auto, its true/false said it: position
    ids, or none); None for no checkpoint."""
    if meta is None:
        return None
    if "documents" in meta:
        return meta["documents"]
    masked = saved_options(meta, cfg)["document_mask"] in (True, "true")
    return document_mask.POSITIONS if masked else document_mask.NONE


def check_documents(meta_file, saved: str, cfg) -> None:
    """A resumed run trains its documents as the checkpoint did: --document_mask auto takes the
    checkpoint's way (train.py's probe checks it still holds); true and false must name it."""
    if cfg.document_mask == "false" and saved != document_mask.NONE:
        raise ConfigError(f"{meta_file} was trained with packed documents kept apart ({saved}): resume with "
                          "--document_mask auto (or true), or start afresh in another --output_dir")
    if cfg.document_mask == "true" and saved == document_mask.NONE:
        raise ConfigError(f"{meta_file} was trained with packed documents that see each other: resume with "
                          "--document_mask auto (or false), or start afresh in another --output_dir")


def recorded_options(cfg) -> dict:
    """The options as checkpoint.json records them: secrets redacted (observe/tracking.py). A resume
    compares this run's options in that form too (`_same_option`), so a redacted option is the same
    option (a token in a URL that was rotated since included: it names the same data)."""
    return redact(dataclasses.asdict(cfg))


# What makes a stream the same stream: a resumed streamed run skips that many blocks of it.
STREAM_IDENTITY = ("data_files", "dataset_name", "dataset_config", "dataset_split", "text_column", "txt_documents",
                   "add_bos", "seq_len", "seed", "tokenizer_name_or_path", "model_name_or_path")


@same_on_every_rank()  # every rank reads the same files and options
def check_compatible(path: str | Path, cfg, accelerator, meta: dict) -> dict:
    """Refuse, before any heavy work, a checkpoint this run cannot continue: another model, another
    strategy, another global batch, or a world-size change the strategy cannot reshard. `meta`: its
    checkpoint.json as resume_point verified it. Returns it."""
    meta_file = Path(path) / METADATA
    saved_cfg, saved_setup = saved_options(meta, cfg), meta.get("setup", {})
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
        if saved_cfg["optimizer"] != cfg.optimizer:  # but load_state restores the optimizer's state too
            raise ConfigError(f"{meta_file} was trained with --optimizer {saved_cfg['optimizer']}, whose state "
                              f"loads only into that optimizer (this run: {cfg.optimizer}): add --optimizer "
                              f"{saved_cfg['optimizer']} (--eval_only trains nothing with it)")
        return meta
    streamed = (bool(saved_cfg.get("streaming")), saved_world, saved_cfg.get("micro_batch_size"))
    if (streamed[0] or cfg.streaming) and streamed != (cfg.streaming, this_world, cfg.micro_batch_size):
        raise ConfigError(f"{meta_file} was saved by a run with streaming {streamed[0]}, {saved_world} data ranks and "
                          f"micro-batch {streamed[2]}: a streamed run resumes only as it was (each rank's place in "
                          "its part of the stream is a count of its own micro-batches)")
    changed = [key for key in STREAM_IDENTITY if cfg.streaming and not _same_option(saved_cfg.get(key),
                                                                                     getattr(cfg, key))]
    if changed:
        raise ConfigError(f"{meta_file} streamed other data: --{', --'.join(changed)} differ; a streamed run resumes "
                          "by reading the same stream again up to its place")
    if cfg.packing and saved_cfg["packing"]:
        check_documents(meta_file, saved_documents(meta, cfg), cfg)
    if cfg.max_steps < meta["step"]:
        raise ConfigError(f"{meta_file} is at step {meta['step']}, past --max_steps {cfg.max_steps}: nothing to "
                          f"train; to export it, resume with --max_steps {meta['step']}")
    files = "data" in meta and {key: meta["data"][key] for key in ("data_files", "eval_data_files")}
    now = files and {key: _resolved(getattr(cfg, key)) for key in files}
    changed = [key for key in TRAINED_ON + (() if files else ("data_files", "eval_data_files"))
               if key in saved_cfg and not _same_option(saved_cfg[key], getattr(cfg, key))]
    changed += [key for key in files or () if not _same_option(files[key], now[key])]
    if changed:  # shown as recorded: secrets redacted
        shown = {**saved_cfg, **(files or {})}, redact_strings({**vars(cfg), **(now or {})})
        diffs = ", ".join(f"--{key} {shown[0][key]!r} (this run: {shown[1][key]!r})" for key in changed)
        raise ConfigError(f"{meta_file} was trained with {diffs}: that would train on other data or from another "
                          "model, not continue this run; resume with the checkpoint's settings, or start afresh in "
                          "another --output_dir")
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


def _resolved(paths: list[str] | None) -> list[str]:
    """--data_files as the real paths of the files they name (a folder or glob as what it matches)."""
    return [os.path.realpath(f) for f in data_file_list(paths)]


def _same_option(saved, this) -> bool:
    """Equal, or equal to this value as checkpoint.json records it (secrets redacted; a checkpoint
    saved before they were holds the value itself), or the same local folder named two ways (a
    relative and an absolute path)."""
    if saved == this or saved == redact_strings(this):
        return True
    return isinstance(saved, str) and isinstance(this, str) and os.path.isdir(this) and \
        os.path.realpath(saved) == os.path.realpath(this)


def data_identity(cfg, train_blocks: int | None) -> dict:
    """What the data options resolved to, made once after the data is built: the files (a folder or
    glob as the files it matched) and the number of training blocks (or documents) they made."""
    return {"data_files": _resolved(cfg.data_files), "eval_data_files": _resolved(cfg.eval_data_files),
            "train_blocks": train_blocks}


@same_on_every_rank()  # every rank reads the same files and options
def check_same_data(path, meta: dict, data: dict) -> None:
    """The same files can hold other data (rewritten in place): refused when the number of training
    blocks differs from the checkpoint's, or the chat template or a mixture's sources do. (The files
    themselves: check_compatible, before any work.)"""
    saved = meta.get("data")
    if saved is None:
        return
    differs = {"train_blocks": f"{saved['train_blocks']} training blocks, this run has {data['train_blocks']}",
               "chat_template_sha256": "another chat template rendered its conversations",
               "mixture": "its data mixture was another (sources, files or weights)"}
    packed = saved.get("packing", "concatenate")  # before best fit, every packed run concatenated
    if data.get("packing") and packed != data["packing"]:
        raise ConfigError(f"{Path(path) / METADATA} packed its examples by {packed}, and this run packs them by "
                          f"{data['packing']}: resume with --packing_strategy {packed}, or start afresh in another "
                          "--output_dir")
    for key, what in differs.items():
        if not _same_option(saved.get(key), data.get(key)):  # recorded with secrets redacted
            raise ConfigError(f"{Path(path) / METADATA} was trained on other data: {what} from the same options; "
                              "resume on the same data, or start afresh in another --output_dir")


def resume_changes(meta: dict, cfg) -> dict:
    """{option: [checkpoint's value, this run's]} for the options a resumed run may change (the
    schedule, its length, clipping, cadences): this run applies its own (`apply_schedule`)."""
    saved_cfg = saved_options(meta, cfg)
    return {key: [saved_cfg[key], getattr(cfg, key)] for key in APPLIED_ON_RESUME
            if saved_cfg[key] != getattr(cfg, key)}


def apply_schedule(scheduler, cfg) -> None:
    """After load_state, the schedule's base rate and each group's current lr are the checkpoint's;
    its lr functions were built from this run's options. Set both from this run's --lr and schedule,
    at the resumed step, so a changed --lr, schedule or --max_steps holds from the first resumed
    step; unchanged, the values are bitwise those saved (the same expression LambdaLR computes)."""
    inner = getattr(scheduler, "scheduler", scheduler)  # accelerate's AcceleratedScheduler wraps it
    inner.base_lrs = muon.peak_lrs(inner.optimizer, cfg)  # --lr, and --muon_lr for Muon's groups
    for group, base, lr_at in zip(inner.optimizer.param_groups, inner.base_lrs, inner.lr_lambdas, strict=True):
        group["initial_lr"], group["lr"] = base, base * lr_at(inner.last_epoch)
    inner._last_lr = [group["lr"] for group in inner.optimizer.param_groups]


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
    saved_cfg = saved_options(meta, cfg)
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


@same_on_every_rank()  # every rank reads the same files and options
def check_output_dir(cfg, start_step: int) -> None:
    """Refuse to write into a folder that holds checkpoints past where this run starts: rotation
    by step number would delete this run's own new checkpoints first, and `auto` would later
    resume the other run's."""
    newer = [p.name for p in list_complete(cfg.output_dir) if int(p.name[5:]) > start_step]
    if newer:
        raise ConfigError(
            f"{Path(cfg.output_dir) / CHECKPOINT_DIR} already holds {', '.join(newer[-3:])} past this run's start "
            f"(step {start_step}): use --resume_from_checkpoint auto to continue it, or another --output_dir")


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(accelerator, output_dir: str | Path, step: int, metadata: dict, keep: int = 0,
         model=None, optimizer=None) -> Path:
    """Write step_<step> atomically (all ranks call this), then rotate old checkpoints: with `keep`,
    the newest `keep` of those whose run id is metadata["run_id"] are kept (another run's all are).

    Under tensor parallelism the model and optimizer are not accelerate's (train_extras/parallel/tensor_parallel.py):
    pass them, and their shards go to torch.distributed.checkpoint next to save_state's files."""
    root = Path(output_dir) / CHECKPOINT_DIR
    final, partial = root / f"step_{step}", root / f".step_{step}.partial"
    if accelerator.is_main_process:
        root.mkdir(parents=True, exist_ok=True)
        for leftover in root.iterdir():  # left by a crash during an earlier save
            if LEFTOVER.fullmatch(leftover.name):
                if leftover.is_symlink():  # not ours: the link goes, never what it points to
                    leftover.unlink()
                elif leftover.is_dir():
                    shutil.rmtree(leftover, ignore_errors=True)
    accelerator.wait_for_everyone()
    _check_space(accelerator, root, final)

    def write_state():
        accelerator.save_state(str(partial))  # every rank writes its part (shards, RNG)
        if tensor_parallel.layout(accelerator) is not None:
            tensor_parallel.save_sharded(model, optimizer, partial)

    _unless_disk_full(write_state, accelerator, root, partial, final)
    # Every file fsynced (so the rename below cannot reach the disk before the data does) and its
    # checksum taken from the bytes just written, each rank hashing the files it wrote.
    # Listed once (rank 0) for all: a shared file system's directory cache may show ranks different lists.
    names = (sorted(p.relative_to(partial).as_posix() for p in partial.rglob("*") if p.is_file())
             if accelerator.is_main_process else None)
    if accelerator.num_processes > 1:
        names = broadcast_object_list([names])[0]
    checksums = _digests(partial, names, accelerator, sync=True)

    def write_metadata():
        if accelerator.is_main_process:
            files = {name: (partial / name).stat().st_size for name in names}
            meta = {"step": step, **metadata, "files": files, "checksum": DIGEST, "checksums": checksums}
            write_json(partial / METADATA, {**meta, "metadata_checksum": metadata_digest(meta)})

    _unless_disk_full(write_metadata, accelerator, root, partial, final)
    if accelerator.is_main_process:
        replaced = root / f".step_{step}.deleting"
        if final.exists():  # the same step saved before (e.g. a rerun): set it aside only now
            final.rename(replaced)
        partial.rename(final)  # the commit point
        _fsync_dir(root)
        shutil.rmtree(replaced, ignore_errors=True)
        if keep:
            _rotate(root, metadata.get("run_id"), keep)
    accelerator.wait_for_everyone()
    return final


_told = set()  # the folders whose other runs' checkpoints the run has named (once each)


def _rotate(root: Path, run: str | None, keep: int) -> None:
    """Keep the newest `keep` of this run's checkpoints; another run's stay, said once."""
    mine, others = [], []
    for path in list_complete(root.parent):
        (mine if run is not None and _saved(path).get("run_id") == run else others).append(path)
    for old in mine[:-keep]:
        remove(old)
    if others and root not in _told:
        _told.add(root)
        names = ", ".join(p.name for p in others[:3]) + (", ..." if len(others) > 3 else "")
        print(f"note: {root} also holds {len(others)} checkpoint(s) of another run ({names}): --save_total_limit "
              "rotates only this run's, those are kept", flush=True)


def remove_for_export(output_dir: str | Path, run: str) -> None:
    """Once the export is done (--save_every 0): this run's checkpoints saved only to keep the run
    safe during it, and checkpoints/ if that leaves it empty."""
    for path in list_complete(output_dir):
        if _saved(path).get("for_export") and _saved(path).get("run_id") == run:
            remove(path)
    root = Path(output_dir) / CHECKPOINT_DIR
    if root.is_dir() and not root.is_symlink() and not any(root.iterdir()):
        root.rmdir()


def remove(path: Path) -> None:
    """A complete checkpoint, renamed aside first: it is either whole or gone from the list."""
    trash = path.with_name(f".{path.name}.deleting")
    path.rename(trash)
    shutil.rmtree(trash)


@same_on_every_rank()  # every rank tries the same folder
def check_writable(cfg) -> None:
    """Before any work: an existing checkpoints/ folder the run cannot write into (a read-only mount,
    its permissions) is one line, not a traceback at the first save."""
    root = Path(cfg.output_dir) / CHECKPOINT_DIR
    if not os.path.lexists(root):
        return  # made by the first save, inside the output folder the run has claimed
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".write_test", dir=root))
    except OSError as err:
        raise ConfigError(f"{root} cannot be written ({err.strerror}): the run saves its checkpoints there (at "
                          "--save_every, at a preemption, before the export); make it writable, or choose another "
                          "--output_dir") from None


LOW_SPACE = 64 << 20
# torch.save's error on a full disk or quota names no cause: "unexpected pos ...", "file write failed"
TORCH_WRITE_FAILED = ("unexpected pos", "file write failed")


def _out_of_space(err: BaseException, root: Path) -> bool:
    free = free_bytes(root)
    return disk_full(err) or any(t in str(err) for t in TORCH_WRITE_FAILED) or (
        isinstance(err, (OSError, RuntimeError)) and free is not None and free < LOW_SPACE)


def _checkpoint_bytes(root: Path) -> int | None:
    complete = list_complete(root.parent)
    return sum(read_metadata(complete[-1])["files"].values()) if complete else None


def kept(output_dir: str | Path, then: str = "free space (or quota)") -> str:
    """What a rerun can go on from, as it truly is (for the lines that stop a run)."""
    complete = list_complete(output_dir)
    if not complete:
        return f"no complete checkpoint is in {Path(output_dir) / CHECKPOINT_DIR}: {then} and rerun (it starts afresh)"
    return (f"{len(complete)} complete checkpoint(s) kept, the newest {complete[-1]}: {then} and rerun with "
            "--resume_from_checkpoint auto")


def _disk_full_error(final: Path, root: Path, cause: str) -> ConfigError:
    need, free = _checkpoint_bytes(root), free_bytes(root)
    took = f"; the last checkpoint took {need / 1e6:,.0f} MB" if need else ""
    return DiskFull(f"disk full while saving {final} ({cause}){took}, {(free or 0) / 1e6:,.0f} MB free: the "
                    f"partial save was removed; {kept(root.parent)}")


def _check_space(accelerator, root: Path, final: Path) -> None:
    """Before any rank writes: less free space than the last checkpoint took stops every rank with one
    line (rank 0 decides for all, so no rank is left waiting inside a save that another abandoned)."""
    short = None
    if accelerator.is_main_process:
        need, free = _checkpoint_bytes(root), free_bytes(root)
        if need and free is not None and free < need:
            short = f"{free / 1e6:,.0f} MB free, the last checkpoint took {need / 1e6:,.0f} MB"
    if accelerator.num_processes > 1:
        short = broadcast_object_list([short])[0]
    if short:
        raise DiskFull(f"not enough space to save {final}: {short}; nothing was written; {kept(root.parent)}")


def _unless_disk_full(write, accelerator, root: Path, partial: Path, final: Path) -> None:
    """Run write() on every rank, then agree: if any rank failed, every rank stops (a full disk or
    quota: one line, the partial checkpoint removed, the complete ones untouched; any other error:
    the failing rank raises it, the others say which rank failed)."""
    try:
        write()
        failure = None
    except Exception as err:  # noqa: BLE001 - each writer reports a full disk its own way
        failure, mine = (f"space:{one_line(err)}" if _out_of_space(err, root) else f"error:{one_line(err)}"), err
        if isinstance(err, OSError) and err.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
            failure = f"write:{err.strerror}: {err.filename}"  # remounted read-only, permissions changed
    failures = gather_object([failure]) if accelerator.num_processes > 1 else [failure]
    if not any(failures):
        return
    if any(f and f.startswith("space:") for f in failures):
        if accelerator.is_main_process:
            shutil.rmtree(partial, ignore_errors=True)
        accelerator.wait_for_everyone()
        raise _disk_full_error(final, root, next(f for f in failures if f and f.startswith("space:"))[6:])
    if any(f and f.startswith("write:") for f in failures):
        if accelerator.is_main_process:
            shutil.rmtree(partial, ignore_errors=True)
        raise ConfigError(f"cannot write {final} ({next(f for f in failures if f and f.startswith('write:'))[6:]}): "
                          f"{kept(root.parent, 'make it writable')}")
    if failure:
        raise mine
    rank = next(i for i, f in enumerate(failures) if f)
    raise TrainingError(f"rank {rank} failed while saving {final}: {failures[rank][6:]}")


def load(accelerator, path: str | Path, optimizer, scheduler, cfg, model=None) -> None:
    """Restore everything save_state wrote (call on every rank); checkpoint.json was verified by
    resume_point and the run checked against it by check_compatible, before any work.

    A failure here (a file damaged in place, with its size intact) leaves the model half loaded:
    it becomes one error line naming the checkpoint and the run stops; it never trains on."""
    try:
        accelerator.load_state(str(path))
        if tensor_parallel.layout(accelerator) is not None:
            tensor_parallel.load_sharded(model, optimizer, Path(path))
    except Exception as err:  # noqa: BLE001 - any reader's error: safetensors, torch.load, DCP, DeepSpeed
        raise ConfigError(f"checkpoint {path} could not be loaded ({one_line(err)}); "
                          "resume from an older checkpoint") from None
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        # DeepSpeed's load_checkpoint gives its optimizer new param_group dicts; the torch LR
        # scheduler would keep setting the lr of the old ones and the real lr would freeze at its
        # value at save time (measured: resumed ZeRO-3 losses drifted from step N+3 on).
        scheduler.scheduler.optimizer = optimizer.optimizer
    apply_schedule(scheduler, cfg)
