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
   all-reduce of the activations forward and one backward. What the plan does not name (Llama's
   embeddings, norms, LM head) stays whole on every rank of the group (its gradients come out
   identical on every TP rank). Each style a family may declare is one torch ParallelStyle
   (`TORCH_STYLES`, below), from transformers' own definitions (transformers/distributed/
   tensor_parallel.py, `ALL_PARALLEL_STYLES`); the styles of mixture-of-experts blocks (experts
   stored as 3-D parameters, not modules) and of a few exotic layers are refused by `check`.
2. 2D: then `fully_shard` (FSDP2) on mesh["dp_shard"], per decoder layer and at the root: every
   parameter becomes a DTensor on the 2-D mesh, sharded by TP and again by FSDP.

Why torch's parallelize_module and not transformers' `from_pretrained(..., tp_plan="auto")` (which
recipes/tensor_parallel.py shows for TP alone): transformers 5.24 builds its own mesh over all ranks
and ignores the sub-mesh it is given, so its TP cannot be combined with fully_shard on the data
dimension ("Cannot concatenate overlapping meshes"), and accelerate 1.15's own 2D route fails with
it (ImportError ReplicateParallel). parallelize_module also works on a model built in memory (a
random-init preset), where tp_plan needs a saved folder.
transformers' style objects are not used either, although they take any mesh: its
"replicated_with_grad_allreduce" (Qwen3's q/k norms) all-reduces `param.grad` after each backward,
which under gradient accumulation sums the earlier micro-batches' already reduced gradient again
(measured, tiny Qwen3 on 2 ranks, 2 micro-batches: q_norm gradients off by 2.7e-3, 1 micro-batch:
6.7e-8); here the weight is a Replicate DTensor whose each backward's gradient is reduced.

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
import functools
import math
import os
from pathlib import Path
from types import MethodType

import torch
from torch import nn

from common.config import ConfigError, tensor_parallel_size
from common.model import enable_checkpointing

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
    family = type(text).__name__.replace("Config", "")
    if not getattr(text, "base_model_tp_plan", None):
        raise ConfigError(f"{recipe}: the {family} model declares no tensor-parallel "
                          "plan (base_model_tp_plan in its transformers config), so tensor parallelism cannot "
                          "split it; use a data-parallel or FSDP config")
    refused = unsupported_styles(text.base_model_tp_plan)
    if refused:  # mixture-of-experts blocks (packed_colwise, moe_tp_experts), MLA, attention sinks
        raise ConfigError(f"{recipe}: the {family} model's tensor-parallel plan uses {_listed(refused)}, which this "
                          f"code does not apply (it applies {', '.join(TORCH_STYLES)}); use a data-parallel or "
                          "FSDP config")
    check_plan_covers_the_model(model_config, recipe)
    split_embedding = [p for p, style in text.base_model_tp_plan.items() if style.startswith("embedding_")]
    tied = getattr(model_config, "tie_word_embeddings", False) or getattr(text, "tie_word_embeddings", False)
    if split_embedding and tied:
        raise ConfigError(f"{recipe}: the {family} model ties its LM head to the input embedding, which its "
                          f"tensor-parallel plan splits ({split_embedding[0]}); the LM head here stays whole: "
                          "untie the embeddings or use a data-parallel or FSDP config")
    tp = shape["tp"]
    for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        value = getattr(text, key, None)
        if value is not None and value % tp:
            raise ConfigError(f"{recipe}: tp_size {tp} does not divide the model's {key} ({value}); "
                              "choose a tp_size that divides heads, key/value heads and the MLP width")


def check_plan_covers_the_model(model_config, recipe: str) -> None:
    """What the plan splits, read on the model built on the meta device (no memory, before the real
    build): refuse a mixture of experts (the plans name the dense MLP's projections, which a sparse
    layer does not have: its experts would stay whole on every rank, or the plan names modules it
    lacks), a plan that splits no decoder layer (only the embedding: Falcon-H1, LFM2), and a plan
    naming a module the model does not have."""
    from train_extras.moe import routing
    from train_extras.observe.flops import meta_model, text_config

    family = type(text_config(model_config)).__name__.replace("Config", "")
    plan = text_config(model_config).base_model_tp_plan
    model = meta_model(model_config)
    if routing(model_config, model) is not None:
        raise ConfigError(f"{recipe}: the {family} model is a mixture of experts, and tensor parallelism here splits "
                          "attention and dense MLPs only (its plan has no expert-parallel styles this code applies): "
                          "use a data-parallel, FSDP or DeepSpeed config")
    if not any(pattern.startswith("layers.") for pattern in plan):
        raise ConfigError(f"{recipe}: the {family} model's tensor-parallel plan splits only {', '.join(plan)}: every "
                          "decoder layer would stay whole on every rank; use a data-parallel or FSDP config")
    missing = unmatched_paths(model, plan)
    if missing:
        raise ConfigError(f"{recipe}: the {family} model's tensor-parallel plan names {missing[0]}, which matches no "
                          "module of the model; use a data-parallel or FSDP config")


def unmatched_paths(model: nn.Module, plan: dict) -> list[str]:
    """The plan's module paths (under the model's base prefix) that match no module of `model`."""
    names = [name for name, _ in model.named_modules()]
    paths = (f"{model.base_model_prefix}.{pattern}" for pattern in plan)
    return [path for path in paths if not fnmatch.filter(names, path)]


# transformers' TP plan styles (ALL_PARALLEL_STYLES in transformers/distributed/tensor_parallel.py)
# as the torch ParallelStyle that does the same on a rank (what it keeps, what it communicates):
# (class, its layout arguments set to Replicate()).
TORCH_STYLES = {
    "colwise": ("ColwiseParallel", ()),  # Linear: output rows Shard(0); the output stays split
    "rowwise": ("RowwiseParallel", ()),  # Linear: input columns Shard(1), split input; partial outputs all-reduced
    # the output all-gathered: the next op needs every feature (OLMo2's q/k norms span all heads,
    # Phi-3 splits its fused qkv and gate_up outputs itself)
    "colwise_gather_output": ("ColwiseParallel", ("output_layouts",)),
    "colwise_rep": ("ColwiseParallel", ("output_layouts",)),
    # the partner of a gathered output: each rank takes its slice of the whole input (no communication)
    "rowwise_split_input": ("RowwiseParallel", ("input_layouts",)),
    "rowwise_rep": ("RowwiseParallel", ("input_layouts",)),
    # Embedding: the vocabulary split (Shard(0)), the partial lookups all-reduced; or the hidden
    # dimension split (Shard(1)), the slices all-gathered
    "embedding_rowwise": ("RowwiseParallel", ("input_layouts",)),
    "embedding_colwise": ("ColwiseParallel", ("output_layouts",)),
    # Qwen3's, Gemma3's per-head q/k norm after a column-wise q/k_proj: the weight whole on every
    # rank (a Replicate DTensor), its input this rank's heads (Shard on the heads dimension); each
    # backward's partial gradient (this rank's heads only) summed over the TP group
    "replicated_with_grad_allreduce": ("ReplicatedWithGradAllReduce", ()),
}


def unsupported_styles(plan: dict) -> dict:
    """{style: the first pattern using it} for the plan's styles this module does not apply."""
    found = {}
    for pattern, style in plan.items():
        if style not in TORCH_STYLES:
            found.setdefault(style, pattern)
    return found


def _torch_style(name: str):
    from torch.distributed.tensor import Replicate, parallel

    class_name, replicated = TORCH_STYLES[name]
    if class_name == "ReplicatedWithGradAllReduce":
        return _replicated_with_grad_allreduce()()
    return getattr(parallel, class_name)(**{layout: Replicate() for layout in replicated})


@functools.cache
def _replicated_with_grad_allreduce():
    """The ParallelStyle class (built on first use: importing torch's TP API costs ~0.5 s)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
    from torch.distributed.tensor.parallel import ParallelStyle

    def whole_gradient(grad):
        # DTensor's backward leaves the weight's gradient Partial (each rank summed over its own
        # heads); reduced here, per backward, so accumulation adds whole gradients
        if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
            return grad.redistribute(placements=[Replicate()] * grad.device_mesh.ndim)
        return grad

    class ReplicatedWithGradAllReduce(ParallelStyle):
        """A module (a norm) whose weight every rank keeps whole and whose input is this rank's heads.

        Its input, [..., heads, head_dim] with this rank's heads (the column-wise q/k_proj's output
        viewed per head), becomes a DTensor sharded on the heads dimension; the weight a Replicate
        DTensor (from rank 0, as distribute_tensor sends), so DTensor reduces its gradient over the
        ranks' heads. Under 2D, FSDP2 redistributes the gradient to the parameter's placement
        itself (torch's FSDPParam._get_grad_inner_tensor); the hook covers TP alone."""

        def __init__(self, head_dim: int = -2):
            super().__init__()
            self.input_layout = (Shard(head_dim),)

        def _partition(self, name, module, mesh):
            for p_name, param in list(module.named_parameters(recurse=False)):
                replicated = nn.Parameter(distribute_tensor(param.data, mesh, [Replicate()],
                                                            src_data_rank=self.src_data_rank),
                                          requires_grad=param.requires_grad)
                if replicated.requires_grad:
                    replicated.register_hook(whole_gradient)
                module.register_parameter(p_name, replicated)

        def _input(self, module, inputs, mesh):
            x, *rest = inputs
            if isinstance(x, DTensor):
                x = x if x.placements == self.input_layout else x.redistribute(placements=self.input_layout)
            else:
                x = DTensor.from_local(x, mesh, self.input_layout, run_check=False)
            return (x, *rest)

        def _output(self, module, output, mesh):
            return output.to_local() if isinstance(output, DTensor) else output

        def _apply(self, module, device_mesh):
            return distribute_module(module, device_mesh, self._partition, self._input, self._output)

    return ReplicatedWithGradAllReduce


def tp_plan(model: nn.Module) -> dict:
    """The model's declared TP plan as torch ParallelStyles (TORCH_STYLES), keyed by module path patterns."""
    declared = getattr(model.config, "base_model_tp_plan", None) or {}
    if not declared:
        raise ConfigError(f"{type(model).__name__} declares no tensor-parallel plan (config.base_model_tp_plan)")
    refused = unsupported_styles(declared)
    if refused:
        raise ConfigError(f"{type(model).__name__}'s TP plan uses {_listed(refused)}, which this code does not apply")
    missing = unmatched_paths(model, declared)
    if missing:  # check() refuses this before the build; kept for a model built another way
        raise ConfigError(f"the TP plan names {missing[0]}, which matches no module of {type(model).__name__}")
    return {f"{model.base_model_prefix}.{pattern}": _torch_style(style) for pattern, style in declared.items()}


def _listed(refused: dict) -> str:
    return ", ".join(f"{style!r} (for {pattern})" for style, pattern in refused.items())


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
        folder, attn_implementation="sdpa", dtype=torch.float32, trust_remote_code=cfg.trust_remote_code,
        distributed_config=DistributedConfig(tp_plan="auto", tp_size=tp_size))
    # transformers 5.24 builds its own mesh over the ranks; it must be accelerate's "tp" mesh, whose
    # groups decide which ranks get the same batch.
    expected = accelerator.torch_device_mesh["tp"].mesh.flatten().tolist()
    meshes = {tuple(p.device_mesh.mesh.flatten().tolist()) for p in model.parameters() if hasattr(p, "device_mesh")}
    if meshes != {tuple(expected)}:
        raise ConfigError(f"transformers sharded the model over ranks {sorted(meshes)}, not accelerate's TP group "
                          f"{expected}; this transformers version needs another route "
                          "(train_extras/parallel/tensor_parallel.parallelize)")
    enable_checkpointing(model, cfg.gradient_checkpointing)
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
