"""The FSDP2 and DeepSpeed settings agree wherever they are written, for bf16, fp16 and fp32 launches.

Three places build FSDP2's policies: train.py's plugin (train_extras/parallel/fsdp_settings.py), the
2D FSDP2 x TP path's own fully_shard (train_extras/parallel/tensor_parallel.parallelize) and the
focused recipe (recipes/fsdp_full_shard.py, `fsdp_policies`); two write DeepSpeed's clipping rule
(deepspeed_settings.clipping, recipes/deepspeed_zero3_offload.py's `set_clipping`).

In-process and fast: the environment is the one `accelerate launch` computes from the repository's
own configs (its parser and prepare_multi_gpu_env, from a shell with no ACCELERATE_/FSDP_ variables),
and "what reaches fully_shard" is recorded from accelerate's own fsdp2_prepare_model (and from
parallelize) with torch's fully_shard replaced by a recorder, on a meta-device model of the debug
preset. The launched runs that train with these settings are in test_distributed.py and
test_tensor_parallel.py.
"""

from __future__ import annotations

import copy
import inspect
import json
import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.fsdp as fsdp_api
import torch.distributed.tensor.parallel as tp_api
import yaml
from accelerate import FullyShardedDataParallelPlugin
from accelerate.parallelism_config import ParallelismConfig
from accelerate.state import AcceleratorState
from accelerate.utils import DistributedType
from accelerate.utils.fsdp_utils import fsdp2_prepare_model
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

from common.config import ConfigError
from common.model import model_config
from train_extras.observe.flops import meta_model
from train_extras.options import TrainConfig
from train_extras.parallel import deepspeed_settings, fsdp_settings, tensor_parallel
from conftest import ROOT, load_recipe


pytestmark = pytest.mark.quick  # launches nothing: docs/testing.md#running-the-tests

PRECISIONS = ["bf16", "fp16", "no"]  # "no": fp32
COMPUTE = {"bf16": torch.bfloat16, "fp16": torch.float16, "no": None}
FSDP_CONFIGS = ["fsdp.yaml", "fsdp_offload.yaml"]  # fsdp_offload_params false / true
DEBUG = TrainConfig(preset="debug")
VOCAB = 259  # the byte-level tokenizer


@pytest.fixture(scope="module")
def fsdp_recipe():
    return load_recipe("fsdp_full_shard")


@pytest.fixture(scope="module")
def deepspeed_recipe():
    return load_recipe("deepspeed_zero3_offload")


def clean_launch_shell(monkeypatch) -> None:
    """No ACCELERATE_/FSDP_ variable of the shell running the tests leaks into the launch."""
    for key in list(os.environ):
        if key.startswith(("ACCELERATE_", "FSDP_")):
            monkeypatch.delenv(key)


def launcher_env(config: str, precision: str) -> dict:
    """The ACCELERATE_/FSDP_ variables `accelerate launch --config_file <config> --mixed_precision
    <precision>` gives every worker (accelerate's own parser, checks and environment builder)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    args = launch_command_parser().parse_args([
        "--config_file", str(ROOT / "accelerate_configs" / config), "--num_processes", "2",
        "--main_process_port", "0", "--mixed_precision", precision, "recipe.py"])
    args, _, _ = _validate_launch_command(args)
    return {k: v for k, v in prepare_multi_gpu_env(args).items() if k.startswith(("ACCELERATE_", "FSDP_"))}


@pytest.fixture(params=[(c, p) for c in FSDP_CONFIGS for p in PRECISIONS], ids=lambda cp: f"{cp[0]}-{cp[1]}")
def fsdp_launch(request, monkeypatch):
    """An FSDP2 launch's environment set in this process; (precision, offloaded)."""
    config, precision = request.param
    clean_launch_shell(monkeypatch)
    env = launcher_env(config, precision)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert (env["ACCELERATE_USE_FSDP"], env["FSDP_VERSION"]) == ("true", "2")
    assert env["ACCELERATE_MIXED_PRECISION"] == precision
    return precision, env["FSDP_OFFLOAD_PARAMS"] == "true"


def expected_policies(precision: str, offloaded: bool):
    """What the docstrings of fsdp_settings promise: compute (and outputs) in the launch's half
    dtype, gradients reduced in fp32; offloaded parameters on the host, pinned only with a GPU."""
    compute = COMPUTE[precision]
    mixed = None if compute is None else MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32,
                                                                output_dtype=compute)
    return mixed, CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offloaded else None


def debug_layers() -> int:
    return model_config(DEBUG, VOCAB).num_hidden_layers


class _RootSharded(Exception):
    """Raised by the recorder at the root's fully_shard, the last call: nothing after it is needed."""


def recording_fully_shard(monkeypatch, root: torch.nn.Module) -> list[tuple]:
    """Replace torch's fully_shard (looked up by accelerate and by parallelize when they run) with a
    recorder of (unit, keyword arguments); it stops the caller at the root's call."""
    calls = []

    def record(module, **kwargs):
        unit = [type(m).__name__ for m in module] if isinstance(module, list) else type(module).__name__
        calls.append((unit, kwargs))
        if module is root:
            raise _RootSharded
        return module

    monkeypatch.setattr(fsdp_api, "fully_shard", record)
    return calls


def accelerate_fully_shard_calls(plugin, precision: str, monkeypatch) -> list[tuple]:
    """The fully_shard calls accelerate's FSDP2 prepare makes from `plugin` on the debug model.

    Before prepare, AcceleratorState.__init__ gives the plugin the launch's precision: that one
    statement is applied here as accelerate writes it (the source check below fails if it changes)."""
    source = inspect.getsource(AcceleratorState.__init__)
    assert 'if self._mixed_precision != "no" and fsdp_plugin is not None:' in source
    assert "fsdp_plugin.set_mixed_precision(self._mixed_precision)" in source
    if precision != "no":
        plugin.set_mixed_precision(precision)
    model = meta_model(model_config(DEBUG, VOCAB))
    calls = recording_fully_shard(monkeypatch, model)
    accelerator = SimpleNamespace(state=SimpleNamespace(fsdp_plugin=plugin), mixed_precision=precision,
                                  is_main_process=True, device=torch.device("cpu"))  # no device mesh: 1-D FSDP
    with pytest.raises(_RootSharded):
        fsdp2_prepare_model(accelerator, model)
    return calls


def two_d_fully_shard_calls(precision: str, monkeypatch) -> list[tuple]:
    """The fully_shard calls of the 2D path (dp_shard 2 x tp 2) on the debug model; TP's
    parallelize_module is replaced by a no-op (it changes no policy)."""
    model = meta_model(model_config(DEBUG, VOCAB))
    monkeypatch.setattr(tp_api, "parallelize_module", lambda module, mesh, plan: module)
    calls = recording_fully_shard(monkeypatch, model)
    with pytest.raises(_RootSharded):
        tensor_parallel.parallelize(model, tp_stand_in(precision))
    return calls


def tp_stand_in(precision: str, dp_shard: int = 2, tp: int = 2):
    """The attributes of an Accelerator under fsdp_tp.yaml that check and parallelize read."""
    return SimpleNamespace(parallelism_config=ParallelismConfig(dp_shard_size=dp_shard, tp_size=tp),
                           num_processes=dp_shard * tp, mixed_precision=precision,
                           distributed_type=DistributedType.MULTI_GPU, device=torch.device("cpu"),
                           torch_device_mesh={"dp_shard": "dp_shard mesh", "tp": "tp mesh"})


# ---- FSDP2: train.py's plugin and the focused recipe ----

def test_the_recipe_writes_the_policies_train_py_uses(fsdp_launch, fsdp_recipe):
    precision, offloaded = fsdp_launch
    policies = fsdp_recipe.fsdp_policies()
    mixed, offload = expected_policies(precision, offloaded)
    assert fsdp_settings.mixed_precision_policy(precision) == policies.get("mixed_precision_policy") == mixed
    assert fsdp_settings.offload_policy() == policies.get("cpu_offload") == offload
    # the recipe sets a key only where it has a policy: accelerate's own defaults fill the rest
    assert sorted(policies) == sorted(k for k, v in (("mixed_precision_policy", mixed), ("cpu_offload", offload))
                                      if v is not None)


def test_both_plugins_carry_the_same_policies(fsdp_launch, fsdp_recipe):
    precision, offloaded = fsdp_launch
    train_plugin = fsdp_settings.plugin(model_config(DEBUG, VOCAB))
    recipe_plugin = FullyShardedDataParallelPlugin(**fsdp_recipe.fsdp_policies())
    mixed, offload = expected_policies(precision, offloaded)
    assert train_plugin.mixed_precision_policy == recipe_plugin.mixed_precision_policy == mixed
    # a key left out is filled from FSDP_OFFLOAD_PARAMS by accelerate: OffloadPolicy() (no offload)
    assert train_plugin.cpu_offload == recipe_plugin.cpu_offload == (offload or OffloadPolicy())
    assert (train_plugin.fsdp_version, train_plugin.reshard_after_forward) == (2, True)
    assert (recipe_plugin.fsdp_version, recipe_plugin.reshard_after_forward) == (2, True)


def test_the_same_policies_reach_fully_shard(fsdp_launch, fsdp_recipe, monkeypatch):
    precision, offloaded = fsdp_launch
    train_calls = accelerate_fully_shard_calls(fsdp_settings.plugin(model_config(DEBUG, VOCAB)), precision, monkeypatch)
    recipe_calls = accelerate_fully_shard_calls(FullyShardedDataParallelPlugin(**fsdp_recipe.fsdp_policies()),
                                                precision, monkeypatch)
    assert train_calls == recipe_calls  # the same units, each with the same arguments
    mixed, offload = expected_policies(precision, offloaded)
    units = [unit for unit, _ in train_calls]
    assert units.count("LlamaDecoderLayer") == debug_layers() and units[-1] == "LlamaForCausalLM"
    for _, kwargs in train_calls:
        assert kwargs["mp_policy"] == (mixed or MixedPrecisionPolicy())  # fp32: accelerate passes the empty policy
        assert kwargs["offload_policy"] == (offload or OffloadPolicy())


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_without_the_policies_accelerate_would_reduce_in_half_precision_and_pin(precision, monkeypatch):
    """Why the keys exist: accelerate's own plugin (from the same launch) reduces gradients in the
    compute dtype and pins offloaded parameters whatever the machine."""
    clean_launch_shell(monkeypatch)
    for key, value in launcher_env("fsdp_offload.yaml", precision).items():
        monkeypatch.setenv(key, value)
    default = FullyShardedDataParallelPlugin()
    default.set_mixed_precision(precision)
    compute = COMPUTE[precision]
    assert default.mixed_precision_policy == MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=compute,
                                                                  output_dtype=compute)
    assert default.cpu_offload == CPUOffloadPolicy(pin_memory=True)
    assert fsdp_settings.mixed_precision_policy(precision).reduce_dtype == torch.float32


def test_no_plugin_unless_the_launch_asks_for_fsdp(monkeypatch):
    clean_launch_shell(monkeypatch)
    for key, value in launcher_env("ddp.yaml", "bf16").items():
        monkeypatch.setenv(key, value)
    assert fsdp_settings.plugin(model_config(DEBUG, VOCAB)) is None


# ---- the 2D path (FSDP2 over dp_shard, TP inside) ----

@pytest.mark.parametrize("precision", ["bf16", "no"])
def test_two_d_shards_with_the_policy_accelerate_gives_fsdp2(precision, monkeypatch):
    clean_launch_shell(monkeypatch)
    for key, value in launcher_env("fsdp.yaml", precision).items():
        monkeypatch.setenv(key, value)
    accelerate_calls = accelerate_fully_shard_calls(fsdp_settings.plugin(model_config(DEBUG, VOCAB)), precision,
                                                    monkeypatch)
    two_d_calls = two_d_fully_shard_calls(precision, monkeypatch)
    mixed, _ = expected_policies(precision, offloaded=False)
    policy = mixed or MixedPrecisionPolicy()  # fp32: the empty policy (no casts), as accelerate passes it
    assert {kwargs["mp_policy"] for _, kwargs in two_d_calls} == {policy}
    assert {kwargs["mp_policy"] for _, kwargs in accelerate_calls} == {policy}
    # the 2D path shards each block and the root (on the dp_shard mesh), no offload
    assert [unit for unit, _ in two_d_calls] == ["LlamaDecoderLayer"] * debug_layers() + ["LlamaForCausalLM"]
    assert {kwargs["mesh"] for _, kwargs in two_d_calls} == {"dp_shard mesh"}
    assert all("offload_policy" not in kwargs for _, kwargs in two_d_calls)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_tensor_parallel_refuses_fp16_only(precision):
    accelerator = tp_stand_in(precision)
    if precision == "fp16":
        with pytest.raises(ConfigError, match="fp16 is not supported with tensor parallelism"):
            tensor_parallel.check(accelerator, DEBUG, model_config(DEBUG, VOCAB), "train.py")
    else:
        tensor_parallel.check(accelerator, DEBUG, model_config(DEBUG, VOCAB), "train.py")


# ---- DeepSpeed: train.py's clipping and the focused recipe's ----

def deepspeed_json(config: str, precision: str) -> dict:
    """The DeepSpeed JSON a config names, with `precision` ("no" = fp32) set in its bf16/fp16 blocks."""
    ds_file = yaml.safe_load((ROOT / "accelerate_configs" / config).read_text())["deepspeed_config"]
    ds_config = json.loads((ROOT / ds_file["deepspeed_config_file"]).read_text())
    ds_config.update(bf16={"enabled": precision == "bf16"}, fp16={"enabled": precision == "fp16"})
    return ds_config


def outcome(set_clip, ds_config: dict, max_grad_norm: float):
    """(the config afterwards, the refusal's type and message or None)."""
    try:
        set_clip(ds_config, max_grad_norm)
    except ConfigError as err:
        return ds_config, (type(err), str(err))
    return ds_config, None


DS_CONFIGS = ["deepspeed_zero1.yaml", "deepspeed_zero2.yaml", "deepspeed_zero3.yaml", "deepspeed_zero3_offload.yaml"]
ABSENT = object()
CLIPS = [  # (gradient_clipping in the JSON, --max_grad_norm, the value DeepSpeed gets or None if refused)
    ("auto", 1.0, 1.0), ("auto", 0.5, 0.5), ("auto", 0.0, 0.0), (ABSENT, 0.3, 0.3),
    (1.0, 1.0, 1.0), (0.5, 0.5, 0.5), ("0.5", 0.5, "0.5"), (0.0, 0.0, 0.0),
    (0.5, 1.0, None), (1.0, 0.0, None), (2, 1.0, None),
]


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("config", DS_CONFIGS)
@pytest.mark.parametrize("clip, max_grad_norm, expected", CLIPS)
def test_deepspeed_clipping_is_the_same_rule(config, precision, clip, max_grad_norm, expected, deepspeed_recipe):
    ds_config = deepspeed_json(config, precision)
    if clip is ABSENT:
        ds_config.pop("gradient_clipping", None)
    else:
        ds_config["gradient_clipping"] = clip
    train = outcome(deepspeed_settings.clipping, copy.deepcopy(ds_config), max_grad_norm)
    recipe = outcome(deepspeed_recipe.set_clipping, copy.deepcopy(ds_config), max_grad_norm)
    assert train == recipe
    after, refusal = train
    if expected is None:
        assert refusal is not None and f"--max_grad_norm is {max_grad_norm}" in refusal[1]
        assert after == ds_config  # nothing changed by a refusal
    else:
        assert refusal is None
        assert after == {**ds_config, "gradient_clipping": expected}


@pytest.mark.parametrize("distributed_type", [DistributedType.DEEPSPEED, DistributedType.FSDP, DistributedType.NO])
def test_train_py_applies_the_clipping_to_the_deepspeed_plugin_only(distributed_type):
    ds_config = deepspeed_json("deepspeed_zero3_offload.yaml", "bf16")
    accelerator = SimpleNamespace(distributed_type=distributed_type,
                                  state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(deepspeed_config=ds_config)))
    deepspeed_settings.configure(accelerator, SimpleNamespace(max_grad_norm=0.25))
    assert ds_config["gradient_clipping"] == (0.25 if distributed_type == DistributedType.DEEPSPEED else "auto")
