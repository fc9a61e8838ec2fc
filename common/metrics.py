"""What a run measures: held-out loss, throughput and MFU, memory, per-rank parameter facts, and
run_summary.json.

Per log interval the recipe records tokens/s (global and per device), step time, MFU, memory per
rank and an ETA; per step loss, lr, pre-clip gradient norm and the fp16 loss scale. MFU = the model
FLOP/s a device achieves (flops_per_token x its tokens/s) over its peak: the datasheet's dense
tensor-core figure for known GPUs, and on a CPU (which has no such table) a square matmul in the
run's dtype measured once at start with the process's own threads.

run_summary.json is the run's record for tests, benchmarks and the GPU check; they read it instead
of parsing logs. Only the main process writes it.
"""

from __future__ import annotations

import ctypes
import gc
import json
import math
import os
import resource
import time
from pathlib import Path

import torch
from accelerate.utils import gather_object

from common.model import causal_lm_loss, class_name


@torch.no_grad()
def evaluate(model, eval_loader, accelerator, max_batches: int = 0) -> dict:
    """Token-weighted mean loss over the held-out blocks, across all ranks, each block counted once.

    Every rank gathers (sample index, loss sum, target tokens) per sequence, and the sums are taken
    over distinct sample indices at the end. That drops the rows accelerate repeats to even out the
    last batch across ranks (a mean of per-rank means would count them) and, under tensor
    parallelism, the identical rows of a TP group, which gather_for_metrics' trimming of the last
    batch does not expect (measured 1e-3 off). One CPU-GPU sync at the end, none per batch.
    """
    model.eval()
    rows = []
    for i, batch in enumerate(eval_loader):
        if max_batches and i >= max_batches:
            break
        labels = batch["labels"]
        per_token = causal_lm_loss(model, batch["input_ids"], labels, reduction="none").view(labels.shape)
        per_seq = torch.stack([batch["index"].to(per_token.device).double(), per_token.sum(1).double(),
                               (labels != -100).sum(1).double()], dim=1)
        rows.append(accelerator.gather(per_seq))
    model.train()
    by_index = {row[0]: row[1:] for row in (torch.cat(rows).tolist() if rows else [])}
    loss_sum = sum(loss for loss, _ in by_index.values())
    token_count = int(sum(tokens for _, tokens in by_index.values()))
    loss = loss_sum / token_count if token_count else float("nan")
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": token_count}


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


def strategy_facts(model, optimizer) -> dict:
    """What the prepared objects really do (not what the config asked for): DeepSpeed's ZeRO stage,
    offload targets and optimizer class; FSDP2's resharding, offload and compute dtype, read from a
    transformer block's parameter group; whether activation checkpointing is on (the recipe's
    --gradient_checkpointing or FSDP's fsdp_activation_checkpointing wrapper)."""
    def is_a(module, names) -> bool:  # by class name, through fully_shard's FSDP<Class> subclasses
        return any(cls.__name__ in names for cls in type(module).__mro__)

    inner = getattr(model, "module", model)  # DDP and DeepSpeed wrap the model
    facts = {"activation_checkpointing": bool(getattr(inner, "is_gradient_checkpointing", False)) or any(
        is_a(m, {"CheckpointWrapper"}) for m in model.modules())}
    if hasattr(model, "zero_optimization_stage"):  # a DeepSpeed engine
        return {"engine": "deepspeed", "zero_stage": model.zero_optimization_stage(),
                # the offload settings are config objects (None when off): keep their target device
                "offload_optimizer": str(getattr(model.zero_offload_optimizer(), "device", None)),
                "offload_param": str(getattr(model.zero_offload_param(), "device", None)),
                "optimizer": type(model.optimizer).__name__,
                "inner_optimizer": type(getattr(model.optimizer, "optimizer", None)).__name__, **facts}
    blocks = set(getattr(inner, "_no_split_modules", None) or [])
    for module in model.modules():
        state = getattr(module, "_get_fsdp_state", None)
        group = state()._fsdp_param_group if state else None
        # A block's unit (or its checkpoint wrapper's): accelerate never reshards the root unit
        # (embeddings, lm_head) after forward, whatever the config says.
        is_block = is_a(module, blocks) or any(is_a(m, blocks) for m in module.children())
        if group is not None and is_block:
            # the shard units, by the class fully_shard was applied to (it renames GPT2Block FSDPGPT2Block)
            units = [class_name(m) for m in model.modules() if hasattr(m, "_get_fsdp_state")]
            return {"engine": "fsdp2", "reshard_after_forward": group.post_forward_mesh_info is not None,
                    "shard_units": {name: units.count(name) for name in sorted(set(units))},
                    "offload_policy": type(group.offload_policy).__name__,
                    "offload_pin_memory": getattr(group.offload_policy, "pin_memory", None),
                    "param_dtype": str(group.mp_policy.param_dtype),
                    "sharded_param_device": str(group.fsdp_params[0].sharded_param.device),
                    "optimizer": type(getattr(optimizer, "optimizer", optimizer)).__name__, **facts}
    return {"engine": type(model).__name__, "optimizer": type(getattr(optimizer, "optimizer", optimizer)).__name__,
            **facts}


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


def measure_matmul_tflops(device: torch.device, dtype: torch.dtype, size: int = 1024, seconds: float = 0.1,
                          bursts: int = 5) -> float:
    """Best rate of a size x size matmul in `dtype` (TFLOP/s), best of `bursts` timed bursts of
    about `seconds` each after a warm-up of twice that: the practical ceiling of this device with
    this process's threads. (Noise only slows a burst down, so the best one is the estimate; a
    single short burst at start-up was measured up to 20% low.)"""
    rng = torch.Generator(device=device).manual_seed(0)  # never the global RNG: it seeds the model's init
    a = torch.randn(size, size, device=device, dtype=dtype, generator=rng)
    b = torch.randn(size, size, device=device, dtype=dtype, generator=rng)
    flops = 2 * size**3

    def burst(reps: int) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(reps):
            torch.mm(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    warm_until = time.perf_counter() + 2 * seconds  # warm-up: thread pool, kernel choice, clock
    while time.perf_counter() < warm_until:
        burst(1)
    reps = max(1, int(seconds / max(burst(1), 1e-6)))
    return max(flops * reps / burst(reps) for _ in range(bursts)) / 1e12


def peak_flops(accelerator) -> dict:
    """Per-device peak for MFU: {'tflops': float | None, 'source': str}."""
    precision = accelerator.mixed_precision
    if accelerator.device.type == "cuda":
        name = torch.cuda.get_device_name(accelerator.device)
        return {"tflops": peak_tflops(name, precision), "source": f"datasheet ({name}, {precision})"}
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
    threads = torch.get_num_threads()
    tflops = measure_matmul_tflops(accelerator.device, dtype)
    return {"tflops": tflops, "source": f"measured {str(dtype)[6:]} 1024x1024 matmul, {threads} threads"}


def interval_stats(*, steps: int, seconds: float, tokens_per_step: int, world_size: int, flops_per_token: float,
                   peak_tflops_per_device: float | None, steps_left: int, step_times: list[float]) -> dict:
    """Throughput of one log interval; `step_times` holds the mean step time of every interval so
    far (this one included) and gives the ETA by its median (robust to an eval or a save)."""
    tokens_per_s = steps * tokens_per_step / seconds
    per_device = tokens_per_s / world_size
    mfu = per_device * flops_per_token / (peak_tflops_per_device * 1e12) if peak_tflops_per_device else None
    median_step = sorted(step_times)[len(step_times) // 2]
    return {
        "tokens_per_s": tokens_per_s,
        "tokens_per_s_per_device": per_device,
        "step_time_s": seconds / steps,
        "model_tflops_per_device": per_device * flops_per_token / 1e12,
        "mfu": mfu,
        "eta_s": steps_left * median_step,
    }


def peak_memory(accelerator) -> list[dict]:
    """Every rank's peak memory so far (CUDA allocated/reserved, the process's peak RSS) and its
    CUDA allocation now. A collective: call on all ranks."""
    mine = {"rank": accelerator.process_index,
            "cpu_max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}  # Linux: KiB
    if accelerator.device.type == "cuda":
        mine["cuda_allocated_bytes"] = torch.cuda.memory_allocated(accelerator.device)
        mine["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated(accelerator.device)
        mine["cuda_max_reserved_bytes"] = torch.cuda.max_memory_reserved(accelerator.device)
    return gather_object([mine]) if accelerator.num_processes > 1 else [mine]


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _host_heap_reader():
    try:
        libc = ctypes.CDLL(None)
        libc.mallinfo2.restype = _Mallinfo2
        return libc.mallinfo2
    except Exception:  # not glibc >= 2.33 (musl, macOS, Windows): no host figure
        return None


_MALLINFO2 = _host_heap_reader()


def memory_in_use(device: torch.device) -> dict:
    """Bytes this process holds allocated right now: "host_bytes" from glibc's mallinfo2 (bytes in
    use in every malloc arena + mmapped chunks; absent without glibc >= 2.33), "rss_bytes" (Linux),
    and "cuda_bytes" from the CUDA allocator on a GPU.

    The host figure is what CPU tensors cost (torch's CPU allocator is malloc), C++-side buffers
    included (DDP's gradient buckets, DeepSpeed's flat partitions), which a walk over Python tensor
    objects would miss; freed memory that malloc keeps for reuse does not count. A full garbage
    collection runs first (~0.1 s), so call it at a few chosen points, not every step.
    """
    gc.collect()  # tensors only waiting for the cycle collector are not in use
    out = {}
    if _MALLINFO2 is not None:
        info = _MALLINFO2()
        out["host_bytes"] = info.hblkhd + info.uordblks
    try:  # resident set size now (Linux), to set the process's peak RSS against
        with open("/proc/self/statm") as f:
            out["rss_bytes"] = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    if device.type == "cuda":
        out["cuda_bytes"] = torch.cuda.memory_allocated(device)
    return out


def write_summary(path: str | os.PathLike, summary: dict) -> None:
    """Write atomically: a reader never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(summary, indent=1))
    os.replace(tmp, path)
