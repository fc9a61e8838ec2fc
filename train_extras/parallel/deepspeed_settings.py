"""DeepSpeed settings beyond its JSON, in one place: the clipping its engine does inside its own
step, and the dtype the model is built in. recipes/deepspeed_zero3_offload.py writes the clipping
rule in its own file, where a reader sees it; tests/test_strategy_settings.py holds the two equal.
"""

from __future__ import annotations

import torch
from accelerate.utils import DistributedType

from common.config import ConfigError


def clipping(ds_config: dict, max_grad_norm: float) -> None:
    """Make DeepSpeed's `gradient_clipping` say --max_grad_norm (0 = off), in place, before `prepare`.

    accelerate fills `gradient_clipping: "auto"` with 1.0 whatever the recipe clips at; DeepSpeed
    clips inside its own step, so --max_grad_norm must reach its config. A JSON with another number
    is refused: one of the two would silently lose."""
    clip = ds_config.get("gradient_clipping", "auto")
    if clip == "auto":
        ds_config["gradient_clipping"] = max_grad_norm
    elif float(clip) != max_grad_norm:
        raise ConfigError(
            f"the DeepSpeed config clips gradients at {clip} but --max_grad_norm is {max_grad_norm}; "
            'set gradient_clipping to "auto" in the JSON or pass the same value'
        )


def configure(accelerator, cfg) -> None:
    """DeepSpeed's config made to agree with the options (clipping); no-op under other strategies."""
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        clipping(accelerator.state.deepspeed_plugin.deepspeed_config, cfg.max_grad_norm)


def weights_dtype(accelerator) -> torch.dtype:
    """The dtype to build or load the model in. fp32 wherever mixed precision autocasts over fp32
    master weights (one process, DDP, FSDP2's MixedPrecisionPolicy); DeepSpeed's bf16/fp16 engine
    keeps its fp32 masters in the optimizer and casts the module to the compute dtype itself, so
    loading it in that dtype gives the same weights with half the host memory while it loads."""
    from common.export import PRECISION_DTYPES

    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        return PRECISION_DTYPES.get(accelerator.mixed_precision, torch.float32)
    return torch.float32


def gather_moe_blocks_whole(accelerator, model) -> list[str]:
    """Under ZeRO-3, make each sparse MoE block a leaf: DeepSpeed then gathers all of the block's
    parameters when it starts, instead of module by module as they run. Where a family keeps one
    module per expert, only the experts its router picks run, and those differ from rank to rank:
    ZeRO-3's per-module gathers would go out of step between the ranks. (transformers 5.24's
    Mixtral, Qwen3-MoE and OLMoE keep their experts fused in one module, which always runs; they
    trained the same, bitwise, with and without this on 2 CPU ranks.) Returns the classes marked
    (none: not ZeRO-3, or a dense model)."""
    if accelerator.distributed_type != DistributedType.DEEPSPEED or accelerator.state.deepspeed_plugin.zero_stage != 3:
        return []
    from train_extras.moe import sparse_block_classes

    classes = sparse_block_classes(model)
    if classes:
        from deepspeed.utils import set_z3_leaf_modules

        set_z3_leaf_modules(model, classes)
    return [c.__name__ for c in classes]
