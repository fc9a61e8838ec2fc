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

It patches one accelerate internal (PartialState._prepare_backend), so it checks the accelerate
version and the function's signature first and stops the run if either moved.
"""

import inspect
import os

TESTED_ACCELERATE = ("1.15.",)  # versions whose PartialState._prepare_backend this was checked against


def _install():
    import accelerate
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    if not accelerate.__version__.startswith(TESTED_ACCELERATE):
        raise RuntimeError(
            f"CPU harness: tested with accelerate {TESTED_ACCELERATE}, found {accelerate.__version__}; "
            "re-check PartialState._prepare_backend and update scripts/cpu_harness/sitecustomize.py"
        )
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


# Only in launched workers (torchrun sets LOCAL_RANK), only when asked, only with several ranks.
if (
    os.environ.get("ACCELERATE_RECIPES_CPU_HARNESS") == "1"
    and "LOCAL_RANK" in os.environ
    and int(os.environ.get("WORLD_SIZE", "1")) > 1
):
    os.environ.setdefault("ACCELERATE_TORCH_DEVICE", "cpu")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    _install()
