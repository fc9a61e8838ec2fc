"""FSDP2 settings, in one place: the shard unit of any model family, the mixed-precision policy and
CPU offload. train.py's FSDP plugin (accelerate applies fully_shard from it) and the 2D path's own
fully_shard (train_extras/parallel/tensor_parallel.py) both take them from here;
recipes/fsdp_full_shard.py writes the same policies in its own file, where a reader sees them, and
tests/test_strategy_settings.py holds the two equal for every precision.
"""

from __future__ import annotations

import os

import torch
from accelerate.utils import DistributedType

from common.config import ConfigError
from common.guard import flag, requested


def mixed_precision_policy(precision: str):
    """bf16/fp16: compute with copies of the weights in that dtype, reduce gradients in fp32; else None.

    With `mixed_precision: bf16` accelerate would reduce gradients in bf16 (8-bit mantissa), summing
    N ranks' contributions at that precision. fp32 reduction doubles the reduce-scatter bytes and
    keeps the sum exact to fp32, which is what torchtitan does by default."""
    compute = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    if compute is None:
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32, output_dtype=compute)


def offload_policy():
    """fsdp_offload_params: parameters (and so the optimizer step) on the host; None otherwise.
    accelerate builds CPUOffloadPolicy() with pinned host memory, which needs a GPU: without one the
    first copy fails ("Cannot access accelerator device"). Pinned only where there is a GPU."""
    if not flag("FSDP_OFFLOAD_PARAMS"):
        return None
    from torch.distributed.fsdp import CPUOffloadPolicy

    return CPUOffloadPolicy(pin_memory=torch.cuda.is_available())


def plugin(model_config=None):
    """accelerate's FSDP2 plugin with the settings the YAML cannot express, or None when the launch
    config does not ask for FSDP. Everything else comes from the launch config's environment.

    The shard unit: the block classes the YAML names (fsdp_transformer_layer_cls_to_wrap), else the
    model's own (`_no_split_modules`: LlamaDecoderLayer, GPT2Block, Qwen2DecoderLayer...), so the
    configs name no model class. Checked here against `model_config`'s model, before anything heavy:
    accelerate would otherwise raise deep inside `prepare`, or shard the whole model as one unit."""
    if requested()["strategy"] != "FSDP":
        return None
    from accelerate import FullyShardedDataParallelPlugin

    kwargs = {}
    if model_config is not None and os.environ.get("FSDP_AUTO_WRAP_POLICY") == "TRANSFORMER_BASED_WRAP":
        kwargs["transformer_cls_names_to_wrap"] = _blocks_to_wrap(model_config)
    for name, policy in (("cpu_offload", offload_policy()),
                         ("mixed_precision_policy", mixed_precision_policy(requested()["mixed_precision"]))):
        if policy is not None:
            kwargs[name] = policy
    return FullyShardedDataParallelPlugin(**kwargs)


def _blocks_to_wrap(model_config) -> list[str]:
    from train_extras.observe.flops import meta_model

    model = meta_model(model_config)  # structure only: no memory behind the weights
    family = type(model_config).__name__.replace("Config", "")
    own = sorted(getattr(model, "_no_split_modules", None) or [])
    named = [n.strip() for n in os.environ.get("FSDP_TRANSFORMER_CLS_TO_WRAP", "").split(",") if n.strip()]
    if not named:
        if not own:
            raise ConfigError(f"the {family} model declares no transformer block class (_no_split_modules) for FSDP "
                              "to shard by: set fsdp_transformer_layer_cls_to_wrap in the config")
        return own
    contained = sorted({type(m).__name__ for m in model.modules()})
    missing = [n for n in named if n not in contained]
    if missing:
        raise ConfigError(f"fsdp_transformer_layer_cls_to_wrap names {', '.join(missing)}, which the {family} model "
                          f"does not contain; its classes: {', '.join(contained)} (leave the key out to shard by "
                          f"its own blocks, {', '.join(own) or 'none declared'})")
    return named


def buffers_aside(model, accelerator) -> dict:
    """Under FSDP2 with fsdp_cpu_ram_efficient_loading, the model's persistent buffers (DeepSeek-V3's
    e_score_correction_bias, MiniMax's decay rates), taken off the model for `prepare`; {} otherwise.
    accelerate 1.15's fsdp2_load_full_state_dict takes every state-dict entry for a sharded parameter
    and fails on a buffer ("'Tensor' object has no attribute 'device_mesh'", accelerate issue 3898);
    and on the ranks but rank 0 transformers did not load it (it is still on the meta device).
    `buffers_back` puts them back after `prepare`, each with rank 0's values."""
    fsdp = accelerator.distributed_type == DistributedType.FSDP
    if not fsdp or not accelerator.state.fsdp_plugin.cpu_ram_efficient_loading:
        return {}
    persistent = model.state_dict(keep_vars=True).keys()
    aside = {}
    for name, buffer in list(model.named_buffers()):
        if name in persistent:
            owner, _, leaf = name.rpartition(".")
            aside[name] = buffer
            delattr(model.get_submodule(owner), leaf)
    return aside


def buffers_back(model, aside: dict, accelerator) -> None:
    """The buffers `buffers_aside` took, registered again (persistent: checkpoints and the export keep
    them) on the device, rank 0's values broadcast to every rank (a collective: every rank calls it)."""
    import torch.distributed as dist

    for name, buffer in aside.items():
        value = torch.empty(buffer.shape, dtype=buffer.dtype, device=accelerator.device)
        if accelerator.process_index == 0:
            value.copy_(buffer)
        dist.broadcast(value, src=0)
        owner, _, leaf = name.rpartition(".")
        model.get_submodule(owner).register_buffer(leaf, value)
