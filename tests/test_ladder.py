"""The ZeRO / FSDP ladder: every rung's config launched once with 2 CPU processes on a 42.9M-parameter
Llama (6 layers x 768, saved as a folder), checked for what really ran, for training, and for its
per-rank model-state bytes against the planner (tools/plan/) within 10%. (Until 2026-12-01 this ran
the `small` preset, 113.7M parameters, in twice the time; the planner agreed within 10% on both.)

Memory is measured inside train.py (common/metrics.memory_in_use: glibc's count of the heap in use,
which on CPU holds every tensor, C++ buffers included) at the second step, minus the same count
taken just before the model was built. On CPU the "device" and the "host" are one memory, so the
offload rungs are compared on device + host together.

The fsdp.yaml rung runs with FSDP's own activation checkpointing (the planner's advice for FSDP):
its losses must still equal DDP's.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from common.data import build_tokenizer
from tools import plan
from train_extras.options import TrainConfig
from conftest import Run, launch_two_processes
from synthetic import corpus_file

# Big enough that model state (~10-16 bytes a parameter a rank) dwarfs what else the heap holds:
# measured on a 19.2M-parameter model, DeepSpeed's rungs held ~21 MB a rank more than the planner
# counts (11% there, ~5% here) and FSDP2's ~8 MB; small enough that the 8 launches stay cheap.
LADDER_MODEL = dict(hidden_size=768, num_hidden_layers=6, num_attention_heads=12, num_key_value_heads=12,
                    intermediate_size=2048, max_position_embeddings=256)
LADDER_ARGS = ["--seq_len", "32", "--micro_batch_size", "2", "--max_steps", "4",
               "--warmup_steps", "1", "--eval_every", "0", "--log_every", "1", "--save_model", "false",
               # the synthetic corpus at lr 3e-3, where 4 steps of this model reliably lower the loss; no
               # sample at the end (under ZeRO-3 every weight is gathered for each generated token)
               "--data_files", corpus_file(8000), "--lr", "3e-3", "--sample_length", "0",
        # The 4-step check below reads per-step losses of these very batches, calibrated without
        # document masks. With them, step 4's blocks (documents starting inside, whose earlier
        # documents the toy language would let it predict from) cost 5.91 against 4.55, above step
        # 1's 5.85, while over 16 steps the masked run ends lower (held-out 3.20 against 3.32,
        # measured 2026-12-02). The mask under DDP, FSDP2 and ZeRO-3 offload is tested by
        # test_distributed's parity runs and tests/test_documents.py.
        "--document_mask", "false"]
# FSDP's activation checkpointing switch, launched once (on the full-shard rung).
EXTRA_LAUNCH_ARGS = {"fsdp.yaml": ["--fsdp_activation_checkpointing", "true"]}

# What each rung must really run (read from the prepared engine / FSDP2 parameter groups).
EXPECTED = {
    "ddp.yaml": {"distributed_type": "MULTI_CPU"},
    "deepspeed_zero1.yaml": {"engine": "deepspeed", "zero_stage": 1, "offload_optimizer": "None",
                             "offload_param": "None", "optimizer": "DeepSpeedZeroOptimizer"},
    "deepspeed_zero2.yaml": {"engine": "deepspeed", "zero_stage": 2, "offload_optimizer": "None",
                             "offload_param": "None", "optimizer": "DeepSpeedZeroOptimizer"},
    "fsdp_shard_grad_op.yaml": {"engine": "fsdp2", "reshard_after_forward": False, "offload_policy": "OffloadPolicy"},
    "fsdp.yaml": {"engine": "fsdp2", "reshard_after_forward": True, "offload_policy": "OffloadPolicy"},
    "deepspeed_zero3.yaml": {"engine": "deepspeed", "zero_stage": 3, "offload_optimizer": "None",
                             "offload_param": "None", "optimizer": "DeepSpeedZeroOptimizer_Stage3"},
    "fsdp_offload.yaml": {"engine": "fsdp2", "reshard_after_forward": True, "offload_policy": "CPUOffloadPolicy",
                          "offload_pin_memory": False},  # pinning needs a GPU (train_extras/parallel/fsdp_settings.py)
    "deepspeed_zero3_offload.yaml": {"engine": "deepspeed", "zero_stage": 3, "offload_optimizer": "cpu",
                                     "offload_param": "cpu", "inner_optimizer": "DeepSpeedCPUAdam"},
}
RUNGS = list(EXPECTED)
SHARDS_PARAMETERS = {"fsdp_shard_grad_op.yaml", "fsdp.yaml", "fsdp_offload.yaml", "deepspeed_zero3.yaml",
                     "deepspeed_zero3_offload.yaml"}


@pytest.fixture(scope="session")
def ladder_model(tmp_path_factory):
    """The ladder's model as a Hugging Face folder (random init, seed 0) with the byte tokenizer."""
    folder = tmp_path_factory.mktemp("ladder_model")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=259, **LADDER_MODEL)).save_pretrained(folder)
    build_tokenizer(TrainConfig()).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def ladder_runs(tmp_path_factory, hf_home, ladder_model):
    runs = {}

    def get(config: str) -> Run:
        if config not in runs:
            out = tmp_path_factory.mktemp("ladder_" + config.removesuffix(".yaml"))
            args = LADDER_ARGS + ["--model_name_or_path", str(ladder_model), "--output_dir", str(out)]
            proc = launch_two_processes("train.py", config, args, hf_home,
                                        extra_launch_args=EXTRA_LAUNCH_ARGS.get(config, ()))
            runs[config] = Run(out, proc)
        return runs[config]

    return get


@pytest.mark.quick
def test_every_rung_of_the_planner_has_a_config_and_a_test():
    assert sorted(r.config for r in plan.LADDER) == sorted(RUNGS)


@pytest.mark.parametrize("config", RUNGS)
def test_rung_runs_what_its_config_says_and_trains(ladder_runs, config):
    run = ladder_runs(config)
    summary = run.summary
    assert summary["setup"]["world_size"] == 2
    expected = dict(EXPECTED[config])
    assert summary["setup"]["distributed_type"] == expected.pop(
        "distributed_type", "DEEPSPEED" if config.startswith("deepspeed") else "FSDP")
    expected["activation_checkpointing"] = config in EXTRA_LAUNCH_ARGS
    for key, value in expected.items():
        assert run.strategy[key] == value, (key, run.strategy)
    losses = [row["loss"] for row in summary["losses"]]
    assert losses[-1] < losses[0] - 0.5 and max(losses[1:]) < losses[0] + 0.5, losses
    for rank in run.parameters_per_rank:
        share = rank["local_numel"] / rank["global_numel"]
        assert share == pytest.approx(0.5 if config in SHARDS_PARAMETERS else 1.0, abs=0.01), rank


def test_every_rung_trains_like_ddp(ladder_runs):
    """Every rung starts from the folder's weights (ZeRO-3 loads them into its partitions) and must
    compute the same steps; FSDP2 full shard does so with activation checkpointing on (recomputed
    forward, same numbers)."""
    reference = [row["loss"] for row in ladder_runs("ddp.yaml").summary["losses"]]
    for config in RUNGS[1:]:
        losses = [row["loss"] for row in ladder_runs(config).summary["losses"]]
        assert losses == pytest.approx(reference, abs=1e-4), (config, losses, reference)


def measured(run: Run, point: str) -> list[int]:
    """Per rank: heap bytes in use at `point` minus before the model existed (the probes' memory points)."""
    points = run.memory_points
    if "host_bytes" not in points[0]["before_model"]:
        pytest.fail("no host memory figure: tests/probes/facts.memory_in_use needs glibc >= 2.33 (mallinfo2)")
    return [m[point]["host_bytes"] - m["before_model"]["host_bytes"] for m in points]


@pytest.mark.parametrize("config", RUNGS)
def test_model_state_bytes_match_the_planner(ladder_runs, ladder_model, config):
    summary = ladder_runs(config).summary
    shape = plan.model_shape(model_name_or_path=str(ladder_model))
    predicted = plan.model_state_bytes(config, summary["model"]["parameters"], 2, "fp32", shape=shape)
    at_rest = predicted["at_rest"]["device"]["total"] + predicted["at_rest"]["host"]["total"]
    for value in measured(ladder_runs(config), "after_step"):
        assert value == pytest.approx(at_rest, rel=0.10), (value / 1e6, at_rest / 1e6)
    if not config.startswith("deepspeed"):  # DeepSpeed steps inside backward: no point with gradients held
        at_step = predicted["at_step"]["device"]["total"] + predicted["at_step"]["host"]["total"]
        for value in measured(ladder_runs(config), "after_backward"):
            assert value == pytest.approx(at_step, rel=0.10), (value / 1e6, at_step / 1e6)
