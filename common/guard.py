"""The start-up guard: stop a run that silently became something else. Without the GPUs a config
assumes, accelerate falls back without an error (docs/toolchain.md#fallbacks: N independent
processes, FSDP turned into DDP, fp16 in fp32). `accelerate launch` passes what the config asked
for to every worker in environment variables; each recipe compares, right after its Accelerator.
"""

from __future__ import annotations

import json
import os

from accelerate.utils import DistributedType

from common.config import ConfigError, same_on_every_rank, tensor_parallel_size

HARNESS_ENV = "ACCELERATE_RECIPES_CPU_HARNESS"


def flag(name: str) -> bool:
    return os.environ.get(name, "false").lower() in ("1", "true", "yes")


def requested() -> dict:
    """What the launch (config file + command-line overrides) asked for, as accelerate passed it on.
    Strategy None: plain data parallel or single process, told apart by the world size."""
    kind = "DEEPSPEED" if flag("ACCELERATE_USE_DEEPSPEED") else "FSDP" if flag("ACCELERATE_USE_FSDP") else None
    precision = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    if kind == "DEEPSPEED":  # with a DeepSpeed JSON the precision it enables explicitly is what was asked for
        precision = deepspeed_json_precision(os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")) or precision
    return {"strategy": kind, "world_size": int(os.environ.get("WORLD_SIZE", "1")), "mixed_precision": precision}


def deepspeed_json_precision(path: str | None) -> str | None:
    """'bf16' or 'fp16' when the DeepSpeed JSON enables one explicitly (not "auto"), else None.
    accelerate refuses mixed_precision in a YAML beside a JSON, and a launch's --mixed_precision
    does not override an explicit value, so the JSON decides (docs/toolchain.md#deepspeed-precision)."""
    if not path or path == "none" or not os.path.isfile(path):
        return None
    with open(path) as f:
        ds_config = json.load(f)
    enabled = [name for name in ("bf16", "fp16") if str(ds_config.get(name, {}).get("enabled")).lower() == "true"]
    return enabled[0] if enabled else None


KINDS = {DistributedType.NO: "single", DistributedType.MULTI_GPU: "ddp", DistributedType.MULTI_CPU: "ddp",
         DistributedType.FSDP: "fsdp", DistributedType.DEEPSPEED: "deepspeed"}


@same_on_every_rank()  # every rank sees the same launch: one process per launcher says so
def check_launch(accelerator, recipe: str, supports: tuple[str, ...]) -> None:
    """Stop unless what runs is what was asked for, and is something this recipe implements.

    `supports` names the strategies the recipe is written for: "single" (one process), "ddp",
    "fsdp", "deepspeed", "tp" (tensor parallel), "fsdp+tp" (2D; both from parallelism_config).
    """
    asked, dtype, world = requested(), accelerator.distributed_type, accelerator.num_processes
    if world != asked["world_size"]:
        raise ConfigError(f"the launch started {asked['world_size']} processes but each runs alone (distributed type "
                          f"{dtype.value}, world size {world}): accelerate found no GPU backend. On a CPU-only "
                          "machine use ACCELERATE_USE_CPU=true for DDP, or the CPU harness (scripts/cpu_harness) "
                          "for FSDP/DeepSpeed")
    if asked["strategy"] == "FSDP" and dtype != DistributedType.FSDP:
        raise ConfigError(f"the config asks for FSDP but accelerate runs {dtype.value} (with ACCELERATE_USE_CPU "
                          "accelerate turns FSDP into DDP); on CPU use the CPU harness (scripts/cpu_harness)")
    if asked["strategy"] == "DEEPSPEED" and dtype != DistributedType.DEEPSPEED:
        raise ConfigError(f"the config asks for DeepSpeed but accelerate runs {dtype.value}")
    if asked["strategy"] is None and dtype in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        raise ConfigError(f"accelerate runs {dtype.value} although the launch config did not ask for it")
    if accelerator.mixed_precision != asked["mixed_precision"]:
        raise ConfigError(f"the config asks for mixed precision {asked['mixed_precision']!r} "
                          f"but accelerate runs {accelerator.mixed_precision!r}")
    if accelerator.mixed_precision == "fp16" and dtype != DistributedType.DEEPSPEED and accelerator.scaler is None:
        raise ConfigError("fp16 without a GradScaler: accelerate builds none on this device (CPU), so it would train "
                          "in fp32 while reporting fp16; use mixed_precision 'no' or 'bf16' here")
    kind = KINDS.get(dtype)
    if tensor_parallel_size(accelerator) > 1:
        kind = "fsdp+tp" if accelerator.parallelism_config.dp_shard_size > 1 else "tp"
    elif flag("ACCELERATE_USE_PARALLELISM_CONFIG") and int(os.environ.get("PARALLELISM_CONFIG_TP_SIZE", "1")) > 1:
        raise ConfigError("the config asks for tensor parallelism but accelerate built no tensor-parallel mesh")
    if kind not in supports:
        running = {"tp": "tensor parallel (tp)", "fsdp+tp": "2D FSDP2 x tensor parallel (fsdp+tp)"}.get(kind)
        raise ConfigError(f"{recipe} is written for {', '.join(supports)}, not {running or dtype.value}; "
                          "recipes/train.py runs with every config")
    if kind == "fsdp" and accelerator.state.fsdp_plugin.fsdp_version != 2:
        raise ConfigError(f"{recipe} uses FSDP2 (fsdp_version: 2); the config has fsdp_version "
                          f"{accelerator.state.fsdp_plugin.fsdp_version}")
    if os.environ.get(HARNESS_ENV) == "1" and accelerator.device.type != "cpu":
        raise ConfigError("the CPU harness is active on a machine where accelerate found an accelerator")
