"""The start-up guard: a run that would silently become something else stops with one line."""

from types import SimpleNamespace

import pytest
from accelerate.parallelism_config import ParallelismConfig
from accelerate.utils import DistributedType

from common import guard
from common.config import ConfigError
from conftest import ROOT, TWO_PROCESS_LAUNCH, launch


def our_error_lines(proc):
    return [line for line in proc.stderr.splitlines() if line.startswith("error: ")]


def test_fsdp_config_that_accelerate_turns_into_ddp_is_refused(tmp_path, hf_home):
    # With ACCELERATE_USE_CPU (and no harness) accelerate runs an FSDP config as MULTI_CPU DDP.
    proc = launch("train.py", ["--preset", "debug", "--output_dir", str(tmp_path)], hf_home, config="fsdp.yaml",
                  launch_args=TWO_PROCESS_LAUNCH, env={"ACCELERATE_USE_CPU": "true"}, check=False)
    assert proc.returncode != 0
    lines = our_error_lines(proc)
    # every rank refuses alike: the launcher's first process prints it, once (the other waits to be stopped)
    assert len(lines) == 1, proc.stderr[-3000:]
    assert "the config asks for FSDP but accelerate runs MULTI_CPU" in lines[0]
    assert "SIGTERM received" not in proc.stderr  # the other rank was stopped, not told to save and stop
    assert not (tmp_path / "run_summary.json").exists()


def test_multi_gpu_config_without_gpus_is_refused(tmp_path, hf_home):
    # No GPU, no ACCELERATE_USE_CPU: accelerate starts 2 processes that each train alone.
    proc = launch("ddp.py", ["--preset", "debug", "--output_dir", str(tmp_path)], hf_home, config="ddp.yaml",
                  launch_args=TWO_PROCESS_LAUNCH, env={"ACCELERATE_USE_CPU": "false"}, check=False)
    assert proc.returncode != 0
    lines = our_error_lines(proc)
    assert len(lines) == 1, proc.stderr[-3000:]  # as above: printed once, by the launcher's first process
    assert "the launch started 2 processes but each runs alone (distributed type NO" in lines[0]


def fake_accelerator(dtype=DistributedType.NO, world=1, precision="no", scaler=None, device="cpu", mesh=None):
    """mesh: {"dp_shard": M, "tp": N} for a launch with a tensor-parallel parallelism_config."""
    pc = ParallelismConfig(dp_shard_size=mesh["dp_shard"], tp_size=mesh["tp"]) if mesh else None
    return SimpleNamespace(distributed_type=dtype, num_processes=world, mixed_precision=precision, scaler=scaler,
                           device=SimpleNamespace(type=device), state=SimpleNamespace(fsdp_plugin=None),
                           parallelism_config=pc)


@pytest.fixture
def launched_as(monkeypatch):
    def set_env(**values):
        for key in ("ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_FSDP", "WORLD_SIZE", "ACCELERATE_MIXED_PRECISION",
                    "ACCELERATE_USE_PARALLELISM_CONFIG", "PARALLELISM_CONFIG_TP_SIZE", guard.HARNESS_ENV):
            monkeypatch.delenv(key, raising=False)
        for key, value in values.items():
            monkeypatch.setenv(key, value)
    return set_env


@pytest.mark.quick
def test_fp16_without_a_scaler_is_refused(launched_as):
    launched_as(ACCELERATE_MIXED_PRECISION="fp16")
    with pytest.raises(ConfigError, match="fp16 without a GradScaler"):
        guard.check_launch(fake_accelerator(precision="fp16"), "train.py", ("single",))


@pytest.mark.quick
def test_precision_mismatch_is_refused(launched_as):
    launched_as(ACCELERATE_MIXED_PRECISION="bf16")
    with pytest.raises(ConfigError, match="asks for mixed precision 'bf16' but accelerate runs 'no'"):
        guard.check_launch(fake_accelerator(precision="no"), "train.py", ("single",))


@pytest.mark.quick
def test_recipe_refuses_a_strategy_it_is_not_written_for(launched_as):
    launched_as(WORLD_SIZE="2", ACCELERATE_MIXED_PRECISION="no")
    ddp = fake_accelerator(DistributedType.MULTI_GPU, world=2)
    with pytest.raises(ConfigError, match="bf16_baseline.py is written for single, not MULTI_GPU"):
        guard.check_launch(ddp, "bf16_baseline.py", ("single",))
    guard.check_launch(ddp, "ddp.py", ("single", "ddp"))  # accepted


@pytest.mark.quick
def test_tensor_parallel_launches_are_told_apart_and_refused_where_not_written_for(launched_as):
    launched_as(WORLD_SIZE="4", ACCELERATE_MIXED_PRECISION="no", ACCELERATE_USE_PARALLELISM_CONFIG="true",
                PARALLELISM_CONFIG_TP_SIZE="2")
    tp = fake_accelerator(DistributedType.MULTI_GPU, world=4, mesh={"dp_shard": 1, "tp": 4})
    two_d = fake_accelerator(DistributedType.MULTI_GPU, world=4, mesh={"dp_shard": 2, "tp": 2})
    with pytest.raises(ConfigError, match=r"ddp.py is written for single, ddp, not tensor parallel \(tp\)"):
        guard.check_launch(tp, "ddp.py", ("single", "ddp"))
    with pytest.raises(ConfigError, match=r"tensor_parallel.py is written for tp, not 2D FSDP2 x tensor parallel"):
        guard.check_launch(two_d, "tensor_parallel.py", ("tp",))
    guard.check_launch(tp, "tensor_parallel.py", ("tp",))  # accepted
    guard.check_launch(two_d, "train.py", ("ddp", "tp", "fsdp+tp"))  # accepted
    # the launch asked for TP, but the Accelerator built no mesh for it
    with pytest.raises(ConfigError, match="asks for tensor parallelism but accelerate built no tensor-parallel mesh"):
        guard.check_launch(fake_accelerator(DistributedType.MULTI_GPU, world=4), "train.py", ("ddp", "tp"))


@pytest.mark.quick
def test_deepspeed_requested_but_not_running_is_refused(launched_as):
    launched_as(ACCELERATE_USE_DEEPSPEED="true", WORLD_SIZE="2")
    with pytest.raises(ConfigError, match="asks for DeepSpeed but accelerate runs MULTI_CPU"):
        guard.check_launch(fake_accelerator(DistributedType.MULTI_CPU, world=2), "train.py", ("ddp", "deepspeed"))


def test_harness_refuses_a_changed_accelerate(tmp_path):
    """The harness checks the accelerate version it was written against before patching."""
    import subprocess
    import sys

    code = ("import accelerate; accelerate.__version__ = '9.0.0'; import runpy; "
            f"runpy.run_path({str(ROOT / 'scripts' / 'cpu_harness' / 'sitecustomize.py')!r})")
    env = {"ACCELERATE_RECIPES_CPU_HARNESS": "1", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "PATH": ""}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode != 0 and "CPU harness: tested with accelerate" in proc.stderr


@pytest.mark.quick
def test_under_deepspeed_the_json_says_what_precision_was_asked(tmp_path, monkeypatch):
    """accelerate refuses mixed_precision in a YAML beside a DeepSpeed JSON and --mixed_precision does
    not override the JSON's explicit value: the guard takes the JSON's choice as the request."""
    import json

    from common import guard

    cases = {"bf16": {"bf16": {"enabled": True}}, "fp16": {"fp16": {"enabled": "true"}},
             None: {"bf16": {"enabled": "auto"}, "fp16": {"enabled": False}}}
    for expected, ds_config in cases.items():
        path = tmp_path / f"{expected}.json"
        path.write_text(json.dumps(ds_config))
        assert guard.deepspeed_json_precision(str(path)) == expected
        monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
        monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(path))
        monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
        assert guard.requested()["mixed_precision"] == (expected or "no")
    for shipped in ("deepspeed_zero1", "deepspeed_zero2", "deepspeed_zero3", "deepspeed_zero3_offload"):
        assert guard.deepspeed_json_precision(str(ROOT / "accelerate_configs" / f"{shipped}.json")) == "bf16"
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "false")  # not DeepSpeed: the launch's own value
    assert guard.requested()["mixed_precision"] == "no"
