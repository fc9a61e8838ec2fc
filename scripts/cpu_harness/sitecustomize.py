"""CPU harness: lets accelerate run its FSDP2 and DeepSpeed code paths on CPU processes over gloo.

For tests, and for rehearsing a GPU config on a laptop before paying for GPUs:

    ACCELERATE_RECIPES_CPU_HARNESS=1 PYTHONPATH=scripts/cpu_harness \\
        accelerate launch --config_file accelerate_configs/fsdp.yaml --num_processes 2 \\
        --mixed_precision no recipes/train.py --preset debug

Python imports `sitecustomize` from PYTHONPATH at start-up, so this runs in every launched worker
before the recipe. Without a GPU, accelerate reports DistributedType.NO for each worker (N
independent processes), and with ACCELERATE_USE_CPU it reports MULTI_CPU, which silently turns an
FSDP config into DDP and refuses DeepSpeed. The harness makes accelerate's backend probe report
MULTI_GPU with the gloo backend instead, with the device pinned to the CPU; accelerate then builds
the FSDP2 / DeepSpeed setup the config asks for, exactly as on GPUs.

With mixed precision fp16 it also gives accelerate a CPU GradScaler and fp16 autocast, which
accelerate does not build on CPU (it would train in fp32 while reporting fp16).

It patches accelerate internals (PartialState._prepare_backend, Accelerator.__init__), so it checks
the accelerate version and the functions' signatures first and stops the run if any moved.
"""

import inspect
import os

TESTED_ACCELERATE = ("1.15.",)  # versions whose PartialState._prepare_backend this was checked against


def _check_version():
    import accelerate

    if not accelerate.__version__.startswith(TESTED_ACCELERATE):
        raise RuntimeError(
            f"CPU harness: tested with accelerate {TESTED_ACCELERATE}, found {accelerate.__version__}; "
            "re-check the patched accelerate internals and update scripts/cpu_harness/sitecustomize.py"
        )


def _install():
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    original = PartialState._prepare_backend
    params = list(inspect.signature(original).parameters)
    if params != ["self", "cpu", "sagemaker_dp", "backend"]:
        raise RuntimeError(f"CPU harness: PartialState._prepare_backend changed its signature to {params}")

    def prepare_backend_on_cpu(self, cpu=False, sagemaker_dp=False, backend=None):
        found_backend, distributed_type = original(self, cpu, sagemaker_dp, backend)
        if distributed_type in (DistributedType.NO, DistributedType.MULTI_CPU):
            return "gloo", DistributedType.MULTI_GPU
        raise RuntimeError(f"CPU harness: unexpected backend probe result {distributed_type} ({found_backend})")

    PartialState._prepare_backend = prepare_backend_on_cpu


def _install_fp16_on_cpu():
    """fp16 autocast with a GradScaler on CPU, where accelerate builds neither (it would silently
    train in fp32). torch itself has both: torch.autocast("cpu", dtype=float16) and
    torch.amp.GradScaler("cpu"). Single process and DDP only: fp16 under FSDP2 and DeepSpeed is
    proven on GPUs (the GPU check)."""
    import torch
    from accelerate import Accelerator
    from accelerate.utils import DistributedType

    original_init = Accelerator.__init__
    params = list(inspect.signature(original_init).parameters)
    if "mixed_precision" not in params or "kwargs_handlers" not in params:
        raise RuntimeError(f"CPU harness: Accelerator.__init__ changed its signature to {params}")

    def init_with_cpu_scaler(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        if (
            self.state.mixed_precision == "fp16"
            and self.device.type == "cpu"
            and self.scaler is None
            and self.distributed_type in (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)
        ):
            scaler_kwargs = self.scaler_handler.to_kwargs() if self.scaler_handler is not None else {}
            self.scaler = torch.amp.GradScaler("cpu", **scaler_kwargs)
            self.native_amp = True  # prepare_model now wraps forward in torch.autocast("cpu", float16)

    Accelerator.__init__ = init_with_cpu_scaler


if os.environ.get("ACCELERATE_RECIPES_CPU_HARNESS") == "1":
    _check_version()
    # Only in launched workers (torchrun sets LOCAL_RANK) with several ranks, or with one rank of an
    # FSDP/DeepSpeed launch (e.g. resuming a 2-rank FSDP checkpoint on 1 rank): the backend probe.
    sharded = "true" in (os.environ.get("ACCELERATE_USE_FSDP"), os.environ.get("ACCELERATE_USE_DEEPSPEED"))
    if "LOCAL_RANK" in os.environ and (int(os.environ.get("WORLD_SIZE", "1")) > 1 or sharded):
        os.environ.setdefault("ACCELERATE_TORCH_DEVICE", "cpu")
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        _install()
    # Any process that trains: fp16 on CPU (one process or DDP).
    if os.environ.get("ACCELERATE_MIXED_PRECISION") == "fp16":
        _install_fp16_on_cpu()
