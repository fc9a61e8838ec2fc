"""Threads of a lone CPU process, and of an optimizer step offloaded to the CPU of a GPU node.

`accelerate launch` without a config file starts one CPU process with OMP_NUM_THREADS=1 (its
default when the config does not say use_cpu), which trains the default job at about half the speed
two cores give; this gives such a process every core it may use.

The worker sees OMP_NUM_THREADS=1 whether the user chose 1 or accelerate defaulted to it, so the
launcher itself (the worker's parent process) is asked, through psutil: its command line
(--num_cpu_threads_per_process), its environment (OMP_NUM_THREADS) and the config file it read
(num_cpu_threads_per_process). A count chosen in any of them stands, and so does accelerate's own
split of the cores between several processes.
"""

from __future__ import annotations

import os

import psutil
import torch
import yaml


def launcher_set_threads() -> bool:
    """Whether the user gave `accelerate launch` a thread count: --num_cpu_threads_per_process,
    OMP_NUM_THREADS in its environment, or num_cpu_threads_per_process in its config file."""
    try:
        launcher = psutil.Process(os.getppid())
        args, environ = launcher.cmdline(), launcher.environ()
    except psutil.Error:  # gone, or not ours to read: take the 1 for accelerate's default
        return False
    if any(a.startswith("--num_cpu_threads_per_process") for a in args) or "OMP_NUM_THREADS" in environ:
        return True
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
    """One CPU process launched without a thread count gets every core it may use (see above)."""
    if torch.cuda.is_available() or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        return
    launched_by_accelerate = "ACCELERATE_MIXED_PRECISION" in os.environ
    if not launched_by_accelerate or os.environ.get("OMP_NUM_THREADS") != "1" or launcher_set_threads():
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(cores)




def offloads_optimizer(accelerator) -> bool:
    """Whether the optimizer steps on the CPU: ZeRO's offload_optimizer to the CPU (DeepSpeedCPUAdam),
    or FSDP2's CPU offload (the shards, their gradients and AdamW's states live in CPU RAM)."""
    from accelerate.utils import DistributedType

    from common.guard import flag

    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        zero = accelerator.state.deepspeed_plugin.deepspeed_config.get("zero_optimization", {})
        return (zero.get("offload_optimizer") or {}).get("device") == "cpu"
    return accelerator.distributed_type == DistributedType.FSDP and flag("FSDP_OFFLOAD_PARAMS")


def for_offloaded_optimizer(offloading: bool) -> int | None:
    """On a GPU node torchrun and accelerate start each rank with OMP_NUM_THREADS=1, so an optimizer
    step on the CPU (offload) would run on one core. Such a rank gets its share of the cores it may
    use: the cores of its affinity (and at most SLURM_CPUS_PER_TASK, where SLURM set it) over the
    ranks of its machine (LOCAL_WORLD_SIZE). A thread count the user gave the launcher stands; a CPU
    run is use_available_cores' (above). Returns the count set, or None."""
    if not offloading or not torch.cuda.is_available() or launcher_set_threads():
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if os.environ.get("SLURM_CPUS_PER_TASK", "").isdigit():
        cores = min(cores, int(os.environ["SLURM_CPUS_PER_TASK"]))
    threads = max(1, cores // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    torch.set_num_threads(threads)  # torch's and OpenMP's pool: DeepSpeedCPUAdam's loop runs in OpenMP too
    return threads
