"""What train.py sets up for the strategy beyond the launch config: every core of a lone CPU
process, FSDP2's shard unit and mixed-precision policy (for any model family), and DeepSpeed's
clipping. The single-technique recipes (fsdp_full_shard.py, deepspeed_zero3_offload.py) set the
same things in their own file, where a reader sees them.
"""

from __future__ import annotations

import os

import torch
import yaml
from accelerate.utils import DistributedType

from common.config import ConfigError
from common.guard import flag, requested


def _launcher_set_threads() -> bool:
    """Whether the user gave `accelerate launch` a thread count: --num_cpu_threads_per_process,
    OMP_NUM_THREADS in its environment, or num_cpu_threads_per_process in its config file. Read from
    the launcher's own command line and environment (Linux /proc): the worker sees OMP_NUM_THREADS=1
    whether the user chose 1 or accelerate defaulted to it."""
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
        with open(f"/proc/{os.getppid()}/environ", "rb") as f:
            environ = f.read().split(b"\0")
    except OSError:  # no /proc (macOS): take accelerate's 1 for a default
        return False
    if any(a.startswith(b"--num_cpu_threads_per_process") for a in argv) or any(
            e.startswith(b"OMP_NUM_THREADS=") for e in environ):
        return True
    args = [a.decode(errors="replace") for a in argv]
    config_file = next((args[i + 1] for i, a in enumerate(args[:-1]) if a == "--config_file"), None)
    config_file = config_file or next((a.split("=", 1)[1] for a in args if a.startswith("--config_file=")), None)
    if config_file is None:
        from accelerate.commands.config import default_config_file as config_file
    try:
        with open(config_file) as f:
            launch_config = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError):
        return False
    return isinstance(launch_config, dict) and "num_cpu_threads_per_process" in launch_config


def use_available_cores() -> None:
    """One CPU process launched without a thread count gets every core it may use.

    `accelerate launch` without a config file starts one CPU process with OMP_NUM_THREADS=1 (its
    default), which trains the default job at about half the speed two cores give. A thread count
    the user chose (launcher option, OMP_NUM_THREADS, a config's num_cpu_threads_per_process) stands,
    and so does accelerate's split of the cores between several processes.
    """
    if torch.cuda.is_available() or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return
    launched_by_accelerate = "ACCELERATE_MIXED_PRECISION" in os.environ
    if not launched_by_accelerate or os.environ.get("OMP_NUM_THREADS") != "1" or _launcher_set_threads():
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(cores)


def fsdp_plugin(model_config=None):
    """FSDP2 settings the YAML cannot express, or None when FSDP is not requested.

    The shard unit: the block classes the YAML names (fsdp_transformer_layer_cls_to_wrap), else the
    model's own (`_no_split_modules`: LlamaDecoderLayer, GPT2Block, Qwen2DecoderLayer...), so the
    configs name no model class. Checked here against `model_config`'s model, before anything heavy:
    accelerate would otherwise raise deep inside `prepare`, or shard the whole model as one unit.

    Gradient reduction in fp32: with `mixed_precision: bf16` accelerate reduces gradients in bf16
    (8-bit mantissa), summing N ranks' contributions at that precision. fp32 reduction doubles the
    reduce-scatter bytes and keeps the sum exact to fp32, which is what torchtitan does by default.
    Everything else comes from the launch config's environment.
    """
    if requested()["strategy"] != "FSDP":
        return None
    from accelerate import FullyShardedDataParallelPlugin

    kwargs = {}
    if model_config is not None and os.environ.get("FSDP_AUTO_WRAP_POLICY") == "TRANSFORMER_BASED_WRAP":
        kwargs["transformer_cls_names_to_wrap"] = _blocks_to_wrap(model_config)
    if flag("FSDP_OFFLOAD_PARAMS"):
        # accelerate builds CPUOffloadPolicy() with pinned host memory, which needs a GPU: without one
        # the first copy fails ("Cannot access accelerator device"). Pin only where there is a GPU.
        from torch.distributed.fsdp import CPUOffloadPolicy

        kwargs["cpu_offload"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    precision = requested()["mixed_precision"]
    if precision in ("bf16", "fp16"):
        from torch.distributed.fsdp import MixedPrecisionPolicy

        compute = torch.bfloat16 if precision == "bf16" else torch.float16
        kwargs["mixed_precision_policy"] = MixedPrecisionPolicy(
            param_dtype=compute, reduce_dtype=torch.float32, output_dtype=compute)
    return FullyShardedDataParallelPlugin(**kwargs)


def _blocks_to_wrap(model_config) -> list[str]:
    from train_extras.flops import meta_model

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


def configure_deepspeed(accelerator, cfg) -> None:
    """Make DeepSpeed's config agree with the options before `prepare`; no-op otherwise.

    accelerate fills `gradient_clipping: "auto"` with 1.0 whatever the recipe clips at; DeepSpeed
    clips inside its own step, so --max_grad_norm must reach its config (0 = off). (The same as
    recipes/deepspeed_zero3_offload.py shows in its own file.)
    """
    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        return
    ds_config = accelerator.state.deepspeed_plugin.deepspeed_config
    clip = ds_config.get("gradient_clipping", "auto")
    if clip == "auto":
        ds_config["gradient_clipping"] = cfg.max_grad_norm
    elif float(clip) != cfg.max_grad_norm:
        raise ConfigError(
            f"the DeepSpeed config clips gradients at {clip} but --max_grad_norm is {cfg.max_grad_norm}; "
            'set gradient_clipping to "auto" in the JSON or pass the same value'
        )


def weights_dtype(accelerator) -> torch.dtype:
    """The dtype to build or load the model in. fp32 wherever mixed precision autocasts over fp32
    master weights (one process, DDP, FSDP2's MixedPrecisionPolicy); DeepSpeed's bf16/fp16 engine
    keeps its fp32 masters in the optimizer and casts the module to the compute dtype itself, so
    loading it in that dtype gives the same weights with half the host memory while it loads."""
    from common.export import PRECISION_DTYPES

    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        return PRECISION_DTYPES.get(accelerator.mixed_precision, torch.float32)
    return torch.float32
