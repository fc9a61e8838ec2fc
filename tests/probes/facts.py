"""Facts about a prepared model that only the tests read, computed inside the recipe's process by
the probes of sitecustomize.py: how parameters are sharded, what the strategy really built, the
optimizer's groups, tensor-parallel layouts, and memory in use at chosen points."""

from __future__ import annotations

import ctypes
import gc
import os

import torch
from torch import nn


def class_name(model) -> str:
    """The model's own class, also once FSDP2 has swapped it for a FSDP<Class> subclass."""
    return next(c.__name__ for c in type(model).__mro__ if not c.__name__.startswith("FSDP"))


def parameter_facts(model, rank: int) -> dict:
    """This rank's parameter elements and how sharded tensors are placed: replicated strategies
    (DDP) hold every element on every rank; sharded ones (FSDP2 DTensors, ZeRO-3) a slice."""
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
    return {"rank": rank, "local_numel": local, "global_numel": total, "sharded_tensors": placements}


def strategy_facts(model, optimizer) -> dict:
    """What the prepared objects really do (not what the config asked for): DeepSpeed's ZeRO stage,
    offload targets and optimizer class; FSDP2's resharding, offload and compute dtype, read from a
    transformer block's parameter group; whether activation checkpointing is on (the recipe's
    --gradient_checkpointing or FSDP's fsdp_activation_checkpointing wrapper)."""
    def is_a(module, names) -> bool:  # by class name, through fully_shard's FSDP<Class> subclasses
        return any(cls.__name__ in names for cls in type(module).__mro__)

    inner = getattr(model, "module", model)  # DDP and DeepSpeed wrap the model
    new_name = hasattr(inner, "is_activation_checkpointing")  # transformers 5.2x renamed it
    checkpointing = getattr(inner, "is_activation_checkpointing" if new_name else "is_gradient_checkpointing", False)
    facts = {"activation_checkpointing": bool(checkpointing) or any(
        is_a(m, {"CheckpointWrapper"}) for m in model.modules())}
    if hasattr(model, "zero_optimization_stage"):  # a DeepSpeed engine
        return {"engine": "deepspeed", "zero_stage": model.zero_optimization_stage(),
                # the offload settings are config objects (None when off): keep their target device
                "offload_optimizer": str(getattr(model.zero_offload_optimizer(), "device", None)),
                "offload_param": str(getattr(model.zero_offload_param(), "device", None)),
                "optimizer": type(model.optimizer).__name__,
                "inner_optimizer": type(getattr(model.optimizer, "optimizer", None)).__name__,
                # where DeepSpeed clips inside its step: the engine's config, and the threshold its
                # ZeRO optimizer was built with (0 = off)
                "gradient_clipping": model.gradient_clipping(),
                "optimizer_clip_grad": getattr(model.optimizer, "clip_grad", None), **facts}
    blocks = set(getattr(inner, "_no_split_modules", None) or [])
    # the modules fully_shard was applied to (FSDPModule instances), by their own class
    units = [class_name(m) for m in model.modules() if hasattr(m, "_get_fsdp_state")]
    shard_units = {name: units.count(name) for name in sorted(set(units))}
    for module in model.modules():
        state = getattr(module, "_get_fsdp_state", None)
        group = state()._fsdp_param_group if state else None
        # A block's unit (or its checkpoint wrapper's): accelerate never reshards the root unit
        # (embeddings, lm_head) after forward, whatever the config says.
        is_block = is_a(module, blocks) or any(is_a(m, blocks) for m in module.children())
        if group is not None and is_block:
            # (by the class fully_shard was applied to: it renames GPT2Block FSDPGPT2Block)
            return {"engine": "fsdp2", "reshard_after_forward": group.post_forward_mesh_info is not None,
                    "shard_units": shard_units,
                    "offload_policy": type(group.offload_policy).__name__,
                    "offload_pin_memory": getattr(group.offload_policy, "pin_memory", None),
                    "param_dtype": str(group.mp_policy.param_dtype),
                    "sharded_param_device": str(group.fsdp_params[0].sharded_param.device),
                    "optimizer": type(getattr(optimizer, "optimizer", optimizer)).__name__, **facts}
    # no block is a shard unit: FSDP2 on the root alone (whole-model gathers), TP, or no sharding
    return {"engine": type(model).__name__, "optimizer": type(getattr(optimizer, "optimizer", optimizer)).__name__,
            **({"shard_units": shard_units} if shard_units else {}), **facts}


def optimizer_facts(optimizer) -> list[dict]:
    """Hyperparameters of each parameter group of the optimizer that really steps (under DeepSpeed,
    its own optimizer, to which accelerate mapped ours): shows nothing was lost on the way."""
    inner = getattr(optimizer, "optimizer", optimizer)
    keys = ("lr", "betas", "eps", "weight_decay")
    return [{k: (list(g[k]) if k == "betas" else g[k]) for k in keys if k in g} for g in inner.param_groups]




class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


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


def replica_max_difference(model: nn.Module, accelerator, dim: str = "tp") -> float:
    """Largest difference, over the whole run's groups along mesh dimension `dim`, between the copies
    each rank of a group holds. "tp": what TP does not split (norms, and in train.py's route
    embeddings and LM head; their FSDP2 shards in 2D). "dp_replicate" (HSDP): every parameter shard,
    held once per replica.

    Every rank updates its copy itself from gradients that should be bitwise equal; a
    nondeterministic kernel would let the copies drift apart silently, and the export reads rank 0's.
    Collective: call on every rank."""
    import torch.distributed as dist

    group = accelerator.torch_device_mesh[dim].get_group()
    worst = torch.zeros((), device=accelerator.device)
    for param in model.parameters():
        mesh = getattr(param, "device_mesh", None)
        if dim == "tp" and mesh is not None and "tp" in mesh.mesh_dim_names:
            if not param.placements[mesh.mesh_dim_names.index("tp")].is_replicate():
                continue  # split by TP: no copies (a Replicate one, Qwen3's q/k norms, has them)
        local = (param.to_local() if hasattr(param, "to_local") else param).detach()
        first = local.clone()
        dist.broadcast(first, group=group, group_src=0)
        worst = torch.maximum(worst, (local - first).abs().max())
    return accelerator.reduce(worst, "max").item()



def parameter_layout(model: nn.Module) -> dict:
    """Per parameter: global and local shape, placements and mesh (run_summary.json)."""
    facts = {}
    for name, param in model.named_parameters():
        row = {"global_shape": list(param.shape)}
        if hasattr(param, "to_local"):
            row.update(local_shape=list(param.to_local().shape), placements=[str(p) for p in param.placements],
                       mesh=dict(zip(param.device_mesh.mesh_dim_names, param.device_mesh.shape)))
        else:
            row.update(local_shape=list(param.shape), placements=[], mesh={})
        facts[name] = row
    return facts
