"""What a run measures: held-out loss, per-rank parameter facts, and run_summary.json.

run_summary.json is the run's record for tests, benchmarks and the GPU check; they read it instead
of parsing logs. Only the main process writes it.
"""

from __future__ import annotations

import json
import math
import os
import resource
from pathlib import Path

import torch
from accelerate.utils import gather_object

from common.model import causal_lm_loss


@torch.no_grad()
def evaluate(model, eval_loader, accelerator, max_batches: int = 0) -> dict:
    """Token-weighted mean loss over the held-out blocks, across all ranks.

    Sums and token counts are gathered per sequence with gather_for_metrics, which drops the
    duplicates accelerate adds to even out the last batch across ranks (a mean of per-rank means
    would count them). One CPU-GPU sync at the end, none per batch.
    """
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=accelerator.device)
    token_count = torch.zeros((), dtype=torch.float64, device=accelerator.device)
    for i, batch in enumerate(eval_loader):
        if max_batches and i >= max_batches:
            break
        labels = batch["labels"]
        per_token = causal_lm_loss(model, batch["input_ids"], labels, reduction="none").view(labels.shape)
        per_seq = torch.stack([per_token.sum(1).double(), (labels != -100).sum(1).double()], dim=1)
        per_seq = accelerator.gather_for_metrics(per_seq)
        loss_sum += per_seq[:, 0].sum()
        token_count += per_seq[:, 1].sum()
    model.train()
    loss = (loss_sum / token_count).item()
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": int(token_count.item())}


def parameter_facts(model, accelerator) -> list[dict]:
    """Per rank: how many parameter elements it holds locally, and how sharded tensors are placed.

    Replicated strategies (DDP) hold every element on every rank; sharded ones (FSDP2 DTensors)
    hold a slice. Collected from every rank (a collective: call it on all of them).
    """
    local, total, placements = 0, 0, {}
    for param in model.parameters():
        if hasattr(param, "to_local") and hasattr(param, "placements"):  # DTensor (FSDP2, TP)
            local += param.to_local().numel()
            key = f"{tuple(str(p) for p in param.placements)} over mesh {tuple(param.device_mesh.shape)}"
            placements[key] = placements.get(key, 0) + 1
        elif hasattr(param, "ds_tensor"):  # DeepSpeed ZeRO-3: `param` is an empty placeholder
            local += param.ds_tensor.numel()
            placements["zero3 partition"] = placements.get("zero3 partition", 0) + 1
        else:
            local += param.numel()
        total += getattr(param, "ds_numel", param.numel())
    mine = {
        "rank": accelerator.process_index,
        "local_numel": local,
        "global_numel": total,
        "sharded_tensors": placements,
    }
    return gather_object([mine]) if accelerator.num_processes > 1 else [mine]


def optimizer_facts(optimizer) -> list[dict]:
    """Hyperparameters of each parameter group of the optimizer that really steps (under DeepSpeed,
    its own optimizer, to which accelerate mapped ours): shows nothing was lost on the way."""
    inner = getattr(optimizer, "optimizer", optimizer)
    keys = ("lr", "betas", "eps", "weight_decay")
    return [{k: (list(g[k]) if k == "betas" else g[k]) for k in keys if k in g} for g in inner.param_groups]


def as_tensor(grad_norm) -> torch.Tensor:
    """A clip_grad_norm_ result as a plain tensor: FSDP2 returns a DTensor, DeepSpeed a float,
    a skipped step None (NaN)."""
    if grad_norm is None:
        return torch.tensor(float("nan"))
    if hasattr(grad_norm, "full_tensor"):
        grad_norm = grad_norm.full_tensor()
    if isinstance(grad_norm, torch.Tensor):
        return grad_norm.detach().float().cpu()
    return torch.tensor(float(grad_norm))


def count_parameters(model) -> int:
    """All parameter elements, also when ZeRO-3 has partitioned them away (ds_numel)."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())


# Dense peak tensor-core throughput in TFLOP/s from the vendors' datasheets (SXM parts; no
# sparsity). "fp32" is plain fp32; with TF32 matmuls enabled (common/model.py) fp32 matmuls run
# at the "tf32" rate. MFU = achieved model FLOPs / this peak.
PEAK_TFLOPS = {
    "H200": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0},
    "H100": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0},
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "L40S": {"bf16": 362.0, "fp16": 362.0, "tf32": 183.0, "fp32": 91.6},
    "L4": {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3},
    "A10G": {"bf16": 70.0, "fp16": 70.0, "tf32": 35.0, "fp32": 31.2},
}


def peak_tflops(device_name: str, precision: str) -> float | None:
    """Datasheet peak for a GPU name as torch reports it (e.g. 'NVIDIA H200'), or None if unknown."""
    kind = {"bf16": "bf16", "fp16": "fp16"}.get(precision, "tf32")
    for gpu in sorted(PEAK_TFLOPS, key=len, reverse=True):  # "L40S" before "L4"
        if gpu in device_name.upper():
            return PEAK_TFLOPS[gpu][kind]
    return None


def peak_memory(accelerator) -> list[dict]:
    """Peak memory of every rank: CUDA allocated/reserved bytes, and the process's peak RSS."""
    mine = {"rank": accelerator.process_index,
            "cpu_max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}  # Linux: KiB
    if accelerator.device.type == "cuda":
        mine["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated(accelerator.device)
        mine["cuda_max_reserved_bytes"] = torch.cuda.max_memory_reserved(accelerator.device)
    return gather_object([mine]) if accelerator.num_processes > 1 else [mine]


def write_summary(path: str | os.PathLike, summary: dict) -> None:
    """Write atomically: a reader never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(summary, indent=1))
    os.replace(tmp, path)
