"""The Hugging Face export: a folder (safetensors + config + tokenizer) that any
`AutoModelForCausalLM.from_pretrained` loads, written from the prepared model under any strategy."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
from accelerate.utils import DistributedType
from torch import nn

from common.config import ConfigError, same_on_every_rank, tensor_parallel_size
from common.files import partial_dir, recover_dir, replace_dir, write_json

PRECISION_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}  # accelerate's mixed precision -> weights
MARKER = ".accelerate_recipes_export.json"  # in every export since issue 42, listing its files (not_an_export)


def export_pretrained(accelerator, model, tokenizer, out_dir: str | Path, dtype: torch.dtype | None = None,
                      write=None) -> Path:
    """Write the folder, its weights in `dtype` (default: the run's precision, so a bf16 run's export
    is bf16, half the size of fp32). Call on every rank: gathering sharded weights is a collective;
    only the main process writes, with save_pretrained or `write(folder, model, state_dict)` (train.py's
    LoRA adapters: train_extras/lora.py). The folder is written whole beside `out_dir`, then swapped in
    (common/files.py): a kill at any moment leaves `out_dir` the earlier export or this one (where the
    file system cannot swap, NFS, missing between two renames: the next export puts the old one back).
    It goes in with its MARKER; an `out_dir` that is not an export so marked is refused, left as it was."""
    out_dir, dtype = Path(out_dir), dtype or PRECISION_DTYPES.get(accelerator.mixed_precision, torch.float32)
    partial = partial_dir(out_dir)
    if accelerator.is_main_process:
        recover_dir(out_dir)  # what a killed export left, before any rank's save_pretrained creates `partial`
    accelerator.wait_for_everyone()
    check_replaceable(out_dir)  # every rank: the same folder, which nothing writes until the swap
    if accelerator.distributed_type == DistributedType.FSDP or tensor_parallel_size(accelerator) > 1:
        # FSDP2 with SHARDED_STATE_DICT: accelerator.get_state_dict returns an empty dict on rank 0
        # (docs/toolchain.md#fsdp2-export); under TP it returns DTensors. torch's own API gathers the
        # full tensors; cpu_offload keeps them off the GPU and on rank 0 only.
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state_dict = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    elif accelerator.distributed_type == DistributedType.DEEPSPEED:
        # ZeRO-3: the 16-bit consolidated weights gathered from every rank's partition (needs
        # stage3_gather_16bit_weights_on_model_save); ZeRO-1/2: the weights as they are.
        state_dict = accelerator.get_state_dict(model)
    else:  # DDP/single: the weights as they are
        state_dict = unwrap(accelerator, model).state_dict()
    unwrapped = unwrap(accelerator, model)
    # Only rank 0 writes. Elsewhere ZeRO-3 gives None, and save_pretrained would read the rank's own
    # empty partitions instead (an MoE's fused experts, split back per expert: a crash).
    state_dict = _without_tied_copies(unwrapped, state_dict) if accelerator.is_main_process else {}
    fp32 = tuple(getattr(unwrapped, "_keep_in_fp32_modules_strict", None) or ())  # as from_pretrained keeps them
    state_dict = state_dict and {k: v.to(dtype) if v.is_floating_point() and not any(m in k for m in fp32) else v
                                 for k, v in state_dict.items()}  # (a router's weight and correction bias)
    # The tokenizer's special ids, not the architecture's defaults (a preset Llama says eos=2, which
    # is the byte tokenizer's <unk>): `generate` on the exported folder then stops where training did.
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        for config in (unwrapped.config, unwrapped.generation_config):
            if getattr(tokenizer, name) is not None and config is not None:
                setattr(config, name, getattr(tokenizer, name))
    if write is None:
        with deepspeed_absent(accelerator.distributed_type != DistributedType.DEEPSPEED):
            unwrapped.save_pretrained(partial, state_dict=state_dict, is_main_process=accelerator.is_main_process,
                                      save_function=accelerator.save)
    elif accelerator.is_main_process:
        write(partial, unwrapped, state_dict)
    if accelerator.is_main_process:
        tokenizer.save_pretrained(partial)
        if write is None:  # save_pretrained wrote the live weights' dtype (fp32 masters): the files' dtype
            unwrapped.config.dtype = dtype  # (the model is done: nothing reads its config after the export)
            unwrapped.config.save_pretrained(partial)
        mark_export(partial)
    accelerator.wait_for_everyone()  # every rank is out of save_pretrained (it lists `partial`) before it moves
    if accelerator.is_main_process:
        replace_dir(out_dir)
    accelerator.wait_for_everyone()
    return out_dir


def mark_export(folder: Path) -> None:  # last into the new folder, before its swap: an export is whole with it
    files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    write_json(folder / MARKER, {"written_by": "accelerate-recipes", "files": files})


@same_on_every_rank()  # called on every rank, which all read the same folder
def check_replaceable(out_dir: Path) -> None:  # refused: an `out_dir` that is not an export (left as it was)
    if foreign := not_an_export(out_dir):
        raise ConfigError(f"{out_dir} ({foreign}): nothing marks it as an export of this project, and the export "
                          "would replace it; move it away, or choose another --output_dir")


def not_an_export(folder: str | Path) -> str | None:
    """None when `folder` is missing or an export with its marker and no file beyond those it lists
    (a file the user added makes the folder theirs too); else what is there instead, in a few words."""
    folder = Path(folder)
    if folder.is_symlink() or not folder.is_dir():  # a link, a file, or nothing
        return "a symbolic link" if folder.is_symlink() else "a file, not a folder" if folder.exists() else None
    present = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_symlink() or not p.is_dir())
    try:
        listed = {*json.loads((folder / MARKER).read_text())["files"], MARKER}
    except (OSError, ValueError, TypeError, KeyError):  # none, or not the marker's JSON
        shown = ", ".join(present[:4]) + (f" and {len(present) - 4} more" if len(present) > 4 else "")
        return f"no export marker {MARKER}; holds {shown or 'nothing'}"
    extra = [name for name in present if name not in listed]
    return f"an export with files it did not write: {', '.join(extra[:4])}" if extra else None


def unwrap(accelerator, model: nn.Module) -> nn.Module:
    with deepspeed_absent(accelerator.distributed_type != DistributedType.DEEPSPEED):
        return accelerator.unwrap_model(model, keep_torch_compile=False)


@contextlib.contextmanager
def deepspeed_absent(absent: bool):
    """accelerate's unwrapping (also inside save_pretrained) imports deepspeed whenever it is installed:
    seconds, and on a machine without a GPU DeepSpeed's "Setting accelerator to CPU" warning, in a run
    with no DeepSpeed engine to unwrap. There accelerate is told, for the call, that it is absent."""
    from accelerate.utils import other

    looked_up = other.is_deepspeed_available
    other.is_deepspeed_available = (lambda: False) if absent else looked_up
    try:
        yield
    finally:
        other.is_deepspeed_available = looked_up


def embeddings_tied(model: nn.Module) -> bool:
    """Whether the LM head multiplies by the input embedding table itself (one shared parameter)."""
    output = model.get_output_embeddings()
    return output is not None and output.weight is model.get_input_embeddings().weight


def _without_tied_copies(model: nn.Module, state_dict: dict) -> dict:
    """One entry per tied table. FSDP2's full state dict gathers a tied weight once per name
    (GPT-2's wte and lm_head, as two equal tensors), and save_pretrained, which recognises tied
    weights by shared storage, would then store the table twice."""
    if not state_dict or not embeddings_tied(model):
        return state_dict
    table = model.get_input_embeddings().weight
    names = [name for name, param in model.named_parameters(remove_duplicate=False) if param is table]
    keep = next(name for name, param in model.named_parameters() if param is table)  # the first name
    return {key: value for key, value in state_dict.items() if key == keep or key not in names}
