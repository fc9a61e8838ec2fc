"""Model parallelism: tensor parallel (TP) and 2D (FSDP2 over the data dimension, TP inside) on
accelerate's mesh, used by train.py; transformers' own TP loading (recipes/tensor_parallel.py).
(Pipeline stages: train_extras/parallel/pipeline.py.)

The launch config's `parallelism_config` (accelerate_configs/tp.yaml, fsdp_tp.yaml) makes the
Accelerator build a device mesh: ("tp",) or ("dp_shard", "tp"), tp the inner dimension, so a TP
group is consecutive ranks (the GPUs of one machine). accelerate also gives the ranks of one TP group
the same batch, and different batches to the dp_shard groups. This module shards the model on that
mesh with torch's own APIs:

1. TP, `parallelize_module` on mesh["tp"], with the plan the model's authors declare in its
   transformers config (`base_model_tp_plan`; Llama: q/k/v/gate/up "colwise", o/down "rowwise").
   Column-wise: the weight's output rows are split (Shard(0)); each rank computes its slice of the
   output (its attention heads, its slice of the MLP width) from the full, replicated input; no
   communication in forward, an all-reduce of the input's gradient in backward. Row-wise: the
   weight's input columns are split (Shard(1)); each rank multiplies its slice of the input (the
   column-wise partner's output, already split the same way) and the partial outputs are summed by
   an all-reduce in forward (nothing in backward). So each attention block and each MLP costs one
   all-reduce of the activations forward and one backward. Embeddings, norms and the LM head stay
   whole on every rank of the group (their gradients come out identical on every TP rank).
2. 2D: then `fully_shard` (FSDP2) on mesh["dp_shard"], per decoder layer and at the root: every
   parameter becomes a DTensor on the 2-D mesh, sharded by TP and again by FSDP.

Why torch's parallelize_module and not transformers' `from_pretrained(..., tp_plan="auto")` (which
recipes/tensor_parallel.py shows for TP alone): transformers 5.24 builds its own mesh over all ranks
and ignores the sub-mesh it is given, so its TP cannot be combined with fully_shard on the data
dimension ("Cannot concatenate overlapping meshes"), and accelerate 1.15's own 2D route fails with
it (ImportError ReplicateParallel). parallelize_module also works on a model built in memory (a
random-init preset), where tp_plan needs a saved folder.

HSDP (accelerate_configs/multi_node_hsdp.yaml: FSDP2 over dp_shard, replicated over dp_replicate)
needs nothing here: accelerate shards on its 2-D mesh itself. `check` refuses a dp_shard mesh that
accelerate would run as DDP, and `describe_mesh` names HSDP in the setup block.

The sharded model is not passed to `accelerator.prepare` (accelerate 1.15 accepts a TP model only
from transformers' tp_plan loading: NotImplementedError otherwise); the optimizer neither, so
accelerate's save_state keeps what it can save (scheduler, every rank's RNG) and the model and
optimizer go to torch.distributed.checkpoint (save_sharded/load_sharded).
"""

from __future__ import annotations

import fnmatch
import math
import os
from pathlib import Path
from types import MethodType

import torch
from torch import nn

from common.config import ConfigError, tensor_parallel_size

SHARDED_STATE_DIR = "model_optimizer_dcp"  # inside a checkpoint folder


MESH_DIMS = ("dp_replicate", "dp_shard", "cp", "sp", "tp")  # accelerate's parallelism_config sizes


def check_launch_sizes(recipe: str) -> None:
    """Before the Accelerator builds its device mesh: the launch's process count must be the product
    of the config's parallelism_config sizes (otherwise torch stops inside accelerate with "Mesh
    should not be bigger than default world size", a traceback). accelerate launch passes the
    sizes as PARALLELISM_CONFIG_<DIM>_SIZE and the process count as WORLD_SIZE."""
    if os.environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() != "true":
        return
    sizes = {dim: int(os.environ.get(f"PARALLELISM_CONFIG_{dim.upper()}_SIZE", "1")) for dim in MESH_DIMS}
    needed, launched = math.prod(sizes.values()), int(os.environ.get("WORLD_SIZE", "1"))
    if needed != launched and min(sizes.values()) >= 1:
        shown = " x ".join(f"{dim}_size {n}" for dim, n in sizes.items() if n > 1)
        raise ConfigError(f"{recipe}: the launch config's parallelism_config ({shown}) needs {needed} processes; "
                          f"this launch has {launched}: launch with --num_processes {needed}, or choose sizes "
                          f"whose product is {launched}")


def layout(accelerator) -> dict | None:
    """{"dp_shard": M, "tp": N} when the launch config asks for tensor parallelism, else None."""
    tp = tensor_parallel_size(accelerator)
    return {"dp_shard": accelerator.parallelism_config.dp_shard_size, "tp": tp} if tp > 1 else None


def describe_mesh(accelerator) -> dict:
    """The setup block's row for HSDP (accelerate's own FSDP2 on its dp_replicate x dp_shard mesh), else {}."""
    pc = accelerator.parallelism_config
    if pc is None or not pc.dp_replicate_enabled or accelerator.distributed_type.value != "FSDP":
        return {}
    return {"mesh": f"dp_replicate {pc.dp_replicate_size} x dp_shard {pc.dp_shard_size} (HSDP: "
                    f"{pc.dp_replicate_size} copies, each sharded over {pc.dp_shard_size} ranks)"}


def check(accelerator, cfg, model_config, recipe: str) -> None:
    """Refuse, before any model is built, a parallelism_config launch this code does not run correctly."""
    shape = layout(accelerator)
    pc = accelerator.parallelism_config
    if shape is None:  # no TP: accelerate's own data parallelism (FSDP2 shards on its mesh, HSDP included)
        if pc is not None and (pc.cp_size > 1 or pc.sp_size > 1):  # the loop has no context-parallel context
            raise ConfigError(f"{recipe}: context/sequence parallelism (cp {pc.cp_size}, sp {pc.sp_size}) is not "
                              "implemented here: its ranks would each train the whole batch")
        if pc is not None and pc.dp_shard_size > 1 and accelerator.distributed_type.value in ("MULTI_GPU", "MULTI_CPU"):
            # accelerate shards on the mesh only under FSDP; otherwise it wraps the whole model in DDP
            raise ConfigError(f"{recipe}: parallelism_config dp_shard_size {pc.dp_shard_size} asks for sharding, but "
                              f"accelerate runs {accelerator.distributed_type.value}, which replicates the model: "
                              "use distributed_type FSDP (accelerate_configs/multi_node_hsdp.yaml)")
        return
    if pc.dp_replicate_size > 1 or pc.cp_size > 1 or pc.sp_size > 1:
        raise ConfigError(f"{recipe}: parallelism_config may set dp_shard_size and tp_size only "
                          f"(got dp_replicate {pc.dp_replicate_size}, cp {pc.cp_size}, sp {pc.sp_size})")
    if accelerator.distributed_type.value != "MULTI_GPU":
        raise ConfigError(f"{recipe}: tensor parallel configs use distributed_type MULTI_GPU (the recipe applies "
                          f"FSDP2 itself for dp_shard_size > 1); the config has {accelerator.distributed_type.value}")
    if accelerator.mixed_precision == "fp16":
        raise ConfigError(f"{recipe}: fp16 is not supported with tensor parallelism (no loss scaler here); use bf16")
    if getattr(cfg, "compile", False):
        raise ConfigError(f"{recipe}: --compile is not tested with tensor parallelism here; run without it")
    from train_extras.observe.flops import text_config

    text = text_config(model_config)
    if not getattr(text, "base_model_tp_plan", None):
        family = type(text).__name__.replace('Config', '')
        raise ConfigError(f"{recipe}: the {family} model declares no tensor-parallel "
                          "plan (base_model_tp_plan in its transformers config), so tensor parallelism cannot "
                          "split it; use a data-parallel or FSDP config")
    tp = shape["tp"]
    for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(text, key, None)
        if value is not None and value % tp:
            raise ConfigError(f"{recipe}: tp_size {tp} does not divide the model's {key} ({value}); "
                              "choose a tp_size that divides heads, key/value heads and the MLP width")


def tp_plan(model: nn.Module) -> dict:
    """The model's declared TP plan as torch ParallelStyles, keyed by module path patterns."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    declared = getattr(model.config, "base_model_tp_plan", None) or {}
    if not declared:
        raise ConfigError(f"{type(model).__name__} declares no tensor-parallel plan (config.base_model_tp_plan)")
    names = [name for name, _ in model.named_modules()]
    plan = {}
    for pattern, style in declared.items():
        if style not in styles:
            raise ConfigError(f"{type(model).__name__}'s TP plan uses {style!r} for {pattern}; "
                              f"this code applies {', '.join(styles)} only")
        path = f"{model.base_model_prefix}.{pattern}"
        if not fnmatch.filter(names, path):
            raise ConfigError(f"the TP plan names {path}, which matches no module of {type(model).__name__}")
        plan[path] = styles[style]()
    return plan


def parallelize(model: nn.Module, accelerator) -> nn.Module:
    """Shard `model` (the same full weights on every rank) by TP, then by FSDP2 for dp_shard > 1."""
    from torch.distributed.tensor.parallel import parallelize_module

    shape, mesh = layout(accelerator), accelerator.torch_device_mesh
    bf16 = accelerator.mixed_precision == "bf16"  # fp16 is refused with TP (check)
    # Sharded while still on the CPU: each weight goes to the GPU one at a time and only its shard
    # stays there (distribute_tensor / fully_shard move to the mesh's device), never the whole model.
    parallelize_module(model, mesh["tp"], tp_plan(model))
    if shape["dp_shard"] > 1:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        from train_extras.parallel import fsdp_settings

        # The same policy as accelerate's FSDP2 gets from train.py: compute in bf16, reduce in fp32.
        policy = fsdp_settings.mixed_precision_policy(accelerator.mixed_precision) or MixedPrecisionPolicy()
        block_classes = set(getattr(model, "_no_split_modules", None) or [])
        for module in model.modules():
            if type(module).__name__ in block_classes:
                fully_shard(module, mesh=mesh["dp_shard"], mp_policy=policy)
        fully_shard(model, mesh=mesh["dp_shard"], mp_policy=policy)
    model.to(accelerator.device)  # what no plan sharded: norms, embeddings (TP alone), buffers
    if bf16 and shape["dp_shard"] == 1:
        # TP alone: bf16 autocast around the forward, as accelerate's prepare does for DDP.
        # accelerator.unwrap_model(keep_fp32_wrapper=False) unwinds __wrapped__ down to
        # _original_forward: the plain function (transformers' own decorators stay on).
        model._original_forward = model.forward.__func__
        autocast = torch.autocast(device_type=accelerator.device.type, dtype=torch.bfloat16)
        model.forward = MethodType(autocast(model.forward.__func__), model)
    return model


def load_with_tp_plan(folder: str, cfg, tp_size: int, accelerator) -> nn.Module:
    """transformers' own TP loading (`tp_plan="auto"`, spelled DistributedConfig in 5.24): each rank
    reads only its slice of every sharded weight from the safetensors files."""
    from transformers import AutoModelForCausalLM, DistributedConfig

    model = AutoModelForCausalLM.from_pretrained(
        folder, attn_implementation="sdpa", dtype=torch.float32,
        distributed_config=DistributedConfig(tp_plan="auto", tp_size=tp_size))
    # transformers 5.24 builds its own mesh over the ranks; it must be accelerate's "tp" mesh, whose
    # groups decide which ranks get the same batch.
    expected = accelerator.torch_device_mesh["tp"].mesh.flatten().tolist()
    meshes = {tuple(p.device_mesh.mesh.flatten().tolist()) for p in model.parameters() if hasattr(p, "device_mesh")}
    if meshes != {tuple(expected)}:
        raise ConfigError(f"transformers sharded the model over ranks {sorted(meshes)}, not accelerate's TP group "
                          f"{expected}; this transformers version needs another route "
                          "(train_extras/parallel/tensor_parallel.parallelize)")
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False  # the KV cache is for generation; in training it only costs memory
    return model


def save_sharded(model: nn.Module, optimizer, folder: Path) -> None:
    """Every rank writes its shards of the model and optimizer (torch.distributed.checkpoint)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optimizer": optim_state}, checkpoint_id=str(folder / SHARDED_STATE_DIR))


def load_sharded(model: nn.Module, optimizer, folder: Path) -> None:
    """Read the shards save_sharded wrote into this run's model and optimizer (same layout)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optim_state}
    dcp.load(state, checkpoint_id=str(folder / SHARDED_STATE_DIR))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
