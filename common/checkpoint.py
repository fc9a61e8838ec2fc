"""Checkpoints and export.

Resumable checkpoints: `<output_dir>/checkpoints/step_<N>/` holds accelerate's `save_state` (model,
optimizer, scheduler, GradScaler, every rank's RNG; sharded per rank under FSDP2 and DeepSpeed)
plus `checkpoint.json`: the step, the data position and the resolved config. A checkpoint is
written under a temporary name and renamed only when every rank has finished and checkpoint.json
is in place, so a folder named step_<N> is always complete. Rotation keeps the newest
--save_total_limit by step number (never sorted as text: step_9 < step_10).

Export: a Hugging Face folder (safetensors + config + tokenizer) that any
`AutoModelForCausalLM.from_pretrained` can load.
"""

from __future__ import annotations

from pathlib import Path

import json
import re
import shutil

import torch
from accelerate.utils import DistributedType

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


def check_compatible(path: str | Path, cfg, accelerator) -> None:
    """Refuse, before any heavy work, a checkpoint this run cannot continue exactly: another model,
    another strategy, or another world size (sharded states and the per-rank data position depend
    on it; resharding on resume is not supported yet)."""
    from common.config import ConfigError

    meta_file = Path(path) / METADATA
    try:
        meta = json.loads(meta_file.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"unreadable checkpoint metadata {meta_file}: {err}") from None
    saved_cfg, saved_setup = meta.get("config", {}), meta.get("setup", {})
    saved_model = saved_cfg.get("model_name_or_path") or f"preset {saved_cfg.get('preset')!r}"
    this_model = cfg.model_name_or_path or f"preset {cfg.preset!r}"
    if saved_cfg.get("model_name_or_path") is None and cfg.model_name_or_path is None and saved_model != this_model:
        raise ConfigError(f"{meta_file} was saved from {saved_model}; this run builds {this_model}")
    this_setup = {"distributed_type": accelerator.distributed_type.value, "world_size": accelerator.num_processes}
    for key, value in this_setup.items():
        if saved_setup.get(key) != value:
            raise ConfigError(
                f"{meta_file} was saved with {key} {saved_setup.get(key)}; this run has {value}: resume with the "
                "launch config and process count it was saved with")


def save(accelerator, output_dir: str | Path, step: int, metadata: dict, keep: int = 0) -> Path:
    """Write step_<step> atomically (all ranks call this), then rotate old checkpoints."""
    root = Path(output_dir) / CHECKPOINT_DIR
    final, partial = root / f"step_{step}", root / f".step_{step}.partial"
    if accelerator.is_main_process:
        shutil.rmtree(partial, ignore_errors=True)  # left by a crash during an earlier save
        root.mkdir(parents=True, exist_ok=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(partial))  # every rank writes its part (shards, RNG)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (partial / METADATA).write_text(json.dumps({"step": step, **metadata}, indent=1))
        if final.exists():  # the same step saved before (e.g. a rerun): replace it only now
            shutil.rmtree(final)
        partial.rename(final)
        if keep:
            for old in list_complete(output_dir)[:-keep]:
                shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return final


def load(accelerator, path: str | Path, optimizer, scheduler) -> dict:
    """Restore everything save_state wrote (call on every rank); return checkpoint.json."""
    accelerator.load_state(str(path))
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        # DeepSpeed's load_checkpoint gives its optimizer new param_group dicts; the torch LR
        # scheduler would keep setting the lr of the old ones and the real lr would freeze at its
        # value at save time (measured: resumed ZeRO-3 losses drifted from step N+3 on).
        scheduler.scheduler.optimizer = optimizer.optimizer
    return json.loads((Path(path) / METADATA).read_text())


def export_pretrained(accelerator, model, tokenizer, out_dir: str | Path) -> Path:
    """Write a Hugging Face folder from the prepared model. Call on every rank.

    `accelerator.get_state_dict` returns full weights for replicated models; for sharded ones it
    gathers them, which is a collective, hence every rank calls this. Only the main process writes.
    """
    out_dir = Path(out_dir)
    if accelerator.distributed_type == DistributedType.FSDP:
        # FSDP2 with SHARDED_STATE_DICT: accelerator.get_state_dict returns an empty dict on rank 0
        # (FACTS.md). torch's own API gathers the full tensors; cpu_offload keeps them off the GPU
        # and on rank 0 only.
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state_dict = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        # DDP/single: the weights as they are. ZeRO-3: the 16-bit consolidated weights gathered
        # from every rank's partition (needs stage3_gather_16bit_weights_on_model_save).
        state_dict = accelerator.get_state_dict(model)
    unwrapped = accelerator.unwrap_model(model)
    unwrapped.save_pretrained(
        out_dir,
        state_dict=state_dict,
        is_main_process=accelerator.is_main_process,
        save_function=accelerator.save,
    )
    if accelerator.is_main_process:
        tokenizer.save_pretrained(out_dir)
    accelerator.wait_for_everyone()
    return out_dir


@torch.no_grad()
def probe_logits(accelerator, model, input_ids: torch.Tensor) -> list[list[float]]:
    """Logits of the trained model in fp32 (no autocast) on a short input. Stored in the run
    summary so a test can check that the exported folder reproduces the trained model exactly."""
    unwrapped = accelerator.unwrap_model(model, keep_fp32_wrapper=False)  # drops the autocast wrapper
    unwrapped.eval()
    logits = unwrapped(input_ids=input_ids.unsqueeze(0).to(accelerator.device)).logits[0]
    return logits.float().cpu().tolist()
