"""Checkpoints and export.

For now: the final Hugging Face export (safetensors + config + tokenizer) that any
`AutoModelForCausalLM.from_pretrained` can load. Resumable training checkpoints come with the
checkpointing work (see the README's status table).
"""

from __future__ import annotations

from pathlib import Path

import torch
from accelerate.utils import DistributedType


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
