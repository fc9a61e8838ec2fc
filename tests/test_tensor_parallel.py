"""Tensor parallel (2 CPU processes) and 2D FSDP2 x TP (4 CPU processes), through the CPU harness.

Every run starts from the 1-process reference's initial weights (seed 1234, debug preset) with the
same global batch of the same samples, in fp32, so its losses must equal the reference's up to the
order of floating-point sums. Each run is launched once; the tests read its run_summary.json."""

from types import SimpleNamespace

import pytest
import torch
from accelerate.parallelism_config import ParallelismConfig

from common.config import ConfigError, data_parallel_size
from common.model import _split_by_mesh, model_config
from train_extras.parallel import tensor_parallel
from train_extras.resume.checkpoint import check_compatible, verify
from train_extras.options import TrainConfig
from conftest import (CORE_DEBUG_ARGS, DEBUG_ARGS, HARNESS, TRAIN_ARGS, TWO_PROCESS_LAUNCH, Run, check_exact_resume,
                      check_export_reproduces_model, check_loss_goes_down, launch)

TP_LAUNCH = TWO_PROCESS_LAUNCH + ["--parallelism_config_tp_size", "2"]
FSDP_TP_LAUNCH = ["--num_processes", "4", "--num_cpu_threads_per_process", "1", "--mixed_precision", "no",
                  "--parallelism_config_dp_shard_size", "2", "--parallelism_config_tp_size", "2"]
# (recipe, config, launch arguments, recipe arguments). Global batch 8 everywhere, as the 1-process
# reference's: the TP ranks share one batch (train.py: 2 accumulated micro-batches of 4); the 2D run
# has 2 data-parallel groups of 2 accumulated micro-batches of 2.
def accumulate(micro: int, steps: int) -> list[str]:
    return ["--micro_batch_size", str(micro), "--gradient_accumulation_steps", str(steps)]


RUNS = {
    "tensor_parallel.py/tp.yaml": ("tensor_parallel.py", "tp.yaml", TP_LAUNCH, CORE_DEBUG_ARGS),  # no checkpoints
    "train.py/tp.yaml": ("train.py", "tp.yaml", TP_LAUNCH, TRAIN_ARGS + accumulate(4, 2)),
    # 4 processes on 2 cores are slow: 30 steps, saved at 15
    "train.py/fsdp_tp.yaml": ("train.py", "fsdp_tp.yaml", FSDP_TP_LAUNCH,
                              TRAIN_ARGS + accumulate(2, 2) + ["--max_steps", "30", "--save_every", "15",
                                                                "--eval_every", "15"]),
}
# bf16 (autocast around the TP model), short: bf16 is slow on CPUs without bf16 units
BF16_TP_RUN = ("train.py", "tp.yaml", TP_LAUNCH + ["--mixed_precision", "bf16"],
               DEBUG_ARGS + ["--max_steps", "20", "--eval_every", "10"])


def launch_tp(name, args, hf_home, check=True):
    recipe, config, launch_args, _ = BF16_TP_RUN if name == "bf16" else RUNS[name]
    return launch(recipe, args, hf_home, config=config, launch_args=launch_args, check=check,
                  env=HARNESS)


@pytest.fixture(scope="session")
def tp_runs(tmp_path_factory, hf_home):
    runs = {}

    def get(name: str) -> Run:
        if name not in runs:
            out = tmp_path_factory.mktemp(name.replace("/", "__"))
            args = (BF16_TP_RUN if name == "bf16" else RUNS[name])[3]
            runs[name] = Run(out, launch_tp(name, args + ["--output_dir", str(out)], hf_home))
        return runs[name]

    return get


# Which module of a Llama block is split how: (placement, dimension halved by TP).
COLWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROWWISE = ("o_proj", "down_proj")


@pytest.mark.parametrize("name", RUNS)
def test_weights_are_dtensors_sharded_over_the_tp_mesh(name, tp_runs):
    run = tp_runs(name)
    layout = run.final[0]["tensor_parallel_parameters"]
    two_d = "fsdp_tp" in name
    expected_mesh = {"dp_shard": 2, "tp": 2} if two_d else {"tp": 2}
    checked = 0
    for pname, row in layout.items():
        module = pname.split(".")[-2]
        global_shape, local_shape = row["global_shape"], row["local_shape"]
        if module in COLWISE + ROWWISE:
            assert row["mesh"] == expected_mesh, (pname, row)
            tp_dim = 0 if module in COLWISE else 1
            assert row["placements"][-1] == f"S({tp_dim})", (pname, row)  # TP: the inner mesh dimension
            expected = list(global_shape)
            expected[tp_dim] //= 2
            if two_d:
                expected[0] //= 2  # FSDP2 splits the TP shard again along dim 0
            assert local_shape == expected, (pname, row)
            checked += 1
        elif not two_d and name.startswith("train.py"):
            # parallelize_module applies only the model's base_model_tp_plan: the rest stays whole
            assert row["placements"] == [] and local_shape == global_shape, (pname, row)
    assert checked == 2 * len(COLWISE + ROWWISE)  # every projection of both layers of the debug preset
    if name.startswith("tensor_parallel.py"):
        # transformers' tp_plan="auto" also splits the embedding and the LM head over the 259-token vocabulary
        for pname in ("model.embed_tokens.weight", "lm_head.weight"):
            assert layout[pname]["local_shape"] == [130, 64] and layout[pname]["placements"] == ["S(0)"]
    ranks = run.parameters_per_rank
    assert len(ranks) == (4 if two_d else 2)
    assert all(rank["local_numel"] < rank["global_numel"] for rank in ranks)
    # Every element of a TP-sharded matrix lives on exactly one rank; the rest (whole under TP, or
    # split by FSDP2 only in 2D) once per TP rank of a data group.
    numel = lambda shape: torch.Size(shape).numel()  # noqa: E731
    tp_sharded = sum(numel(row["global_shape"]) for row in layout.values() if row["mesh"].get("tp"))
    rest = sum(numel(row["global_shape"]) for row in layout.values() if not row["mesh"].get("tp"))
    assert tp_sharded + rest == ranks[0]["global_numel"]
    assert sum(rank["local_numel"] for rank in ranks) == tp_sharded + 2 * rest


@pytest.mark.parametrize("name", RUNS)
def test_losses_match_one_process_and_go_down(name, tp_runs, train_run):
    run = tp_runs(name)
    reference = [row["loss"] for row in train_run.summary["losses"]]
    losses = [row["loss"] for row in run.summary["losses"]]
    # Steps 1-5 are warm-up steps, whose LR does not depend on --max_steps (the 2D run is shorter).
    assert losses[:5] == pytest.approx(reference[:5], abs=1e-5, rel=0)
    assert reference[4] < reference[0] - 0.2  # the compared steps really moved the model
    same_schedule = len(losses) == len(reference)
    if same_schedule:
        assert losses == pytest.approx(reference, abs=1e-4, rel=0)  # all 60 stay together (measured: 7e-7)
    check_loss_goes_down(run.summary)
    if name.startswith("train.py"):
        # the gradient itself, not only the loss (AdamW would hide a constant factor on the gradient)
        norms = [row["grad_norm"] for row in run.summary["losses"][:5]]
        assert norms == pytest.approx([row["grad_norm"] for row in train_run.summary["losses"][:5]], rel=1e-4)
    # held-out loss: each sample counted once although the TP ranks hold the same rows
    evals = run.summary["eval"] if same_schedule else run.summary["eval"][:1]  # step 0 at least
    reference_evals = train_run.summary["eval"][:len(evals)]
    assert [(row["step"], row["tokens"]) for row in evals] == [(row["step"], row["tokens"]) for row in reference_evals]
    assert [row["loss"] for row in evals] == pytest.approx([row["loss"] for row in reference_evals], abs=1e-5, rel=0)


@pytest.mark.parametrize("name", RUNS)
def test_setup_counts_data_parallel_ranks_only(name, tp_runs):
    setup = tp_runs(name).summary["setup"]
    two_d = "fsdp_tp" in name
    assert setup["world_size"] == (4 if two_d else 2)
    assert (setup["data_parallel_size"], setup["tensor_parallel_size"]) == ((2, 2) if two_d else (1, 2))
    assert setup["global_batch_sequences"] == 8  # as the 1-process reference
    assert setup["distributed_type"] == "MULTI_GPU"


def test_train_py_records_the_strategy_that_ran(tp_runs):
    tp, two_d = tp_runs("train.py/tp.yaml"), tp_runs("train.py/fsdp_tp.yaml")
    mesh = lambda run: (run.summary["setup"]["data_parallel_size"], run.summary["setup"]["tensor_parallel_size"])  # noqa: E731
    assert mesh(tp) == (1, 2) and tp.strategy["engine"] == "LlamaForCausalLM"
    assert mesh(two_d) == (2, 2) and two_d.strategy["engine"] == "fsdp2"
    assert two_d.strategy["reshard_after_forward"] is True
    # one parameter group per mesh: TP-split matrices with decay, the whole LM head with decay,
    # the whole norms and embedding without (fused AdamW refuses mixed groups)
    assert [g["weight_decay"] for g in tp.final[0]["optimizer_groups"]] == [0.1, 0.1, 0.0]
    # the copies TP keeps on every rank (norms, embedding, LM head) stayed bitwise equal
    for run in (tp, two_d):
        assert run.final[0]["tensor_parallel_replica_max_difference"] == 0.0


def test_bf16_under_tensor_parallel(tp_runs):
    """bf16 autocast wraps the TP model's forward; the probe (fp32, wrapper removed) must still
    reproduce the export, and the run must learn."""
    run = tp_runs("bf16")
    assert run.summary["setup"]["mixed_precision"] == "bf16"
    losses = [row["loss"] for row in run.summary["losses"]]
    assert len(losses) == 20 and sum(losses[-5:]) / 5 < losses[0] - 1.0, losses
    check_export_reproduces_model(run)


@pytest.mark.parametrize("name", RUNS)
def test_export_reloads_with_the_same_logits(name, tp_runs):
    check_export_reproduces_model(tp_runs(name))


@pytest.mark.parametrize("name, half", [("train.py/tp.yaml", 30), ("train.py/fsdp_tp.yaml", 15)])
def test_resume_is_exact(name, half, tp_runs, tmp_path, hf_home):
    full = tp_runs(name)
    step_half = full.output_dir / "checkpoints" / f"step_{half}"
    # model and optimizer shards by torch.distributed.checkpoint, one file per rank; RNG per rank
    shards = sorted(p.name for p in (step_half / tensor_parallel.SHARDED_STATE_DIR).glob("*.distcp"))
    world = full.summary["setup"]["world_size"]
    assert len(shards) == world and (step_half / tensor_parallel.SHARDED_STATE_DIR / ".metadata").is_file()
    rng_files = sorted(p.name for p in step_half.glob("random_states_*.pkl"))
    assert rng_files == [f"random_states_{r}.pkl" for r in range(world)]
    args = RUNS[name][3] + ["--resume_from_checkpoint", str(step_half), "--output_dir", str(tmp_path)]
    resumed = Run(tmp_path, launch_tp(name, args, hf_home))
    check_exact_resume(full, resumed, half)
    assert resumed.summary["eval"][-1]["loss"] == full.summary["eval"][-1]["loss"]
    check_export_reproduces_model(resumed)


# ---- in-process: the checks that run before any model is built ----

class StandIn(SimpleNamespace):
    """The attributes of an Accelerator that the checks read."""


def stand_in(tp=2, dp_shard=1, distributed_type="MULTI_GPU", mixed_precision="no"):
    pc = ParallelismConfig(dp_shard_size=dp_shard, tp_size=tp)
    return StandIn(parallelism_config=pc, num_processes=tp * dp_shard, mixed_precision=mixed_precision,
                   distributed_type=SimpleNamespace(value=distributed_type))


@pytest.mark.parametrize("kwargs, options, message", [
    ({"tp": 3}, {}, "tp_size 3 does not divide the model's num_attention_heads (4)"),
    ({"mixed_precision": "fp16"}, {}, "fp16 is not supported with tensor parallelism"),
    ({"distributed_type": "FSDP", "dp_shard": 2}, {}, "tensor parallel configs use distributed_type MULTI_GPU"),
    ({}, {"compile": True}, "--compile is not tested with tensor parallelism"),
])
def test_impossible_tensor_parallel_setups_are_refused(kwargs, options, message):
    cfg = TrainConfig(preset="debug", **options)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        tensor_parallel.check(stand_in(**kwargs), cfg, model_config(cfg, 259), "train.py")
    tensor_parallel.check(stand_in(), TrainConfig(preset="debug"), model_config(TrainConfig(preset="debug"), 259), "x")


def test_a_checkpoint_resumes_only_on_its_own_mesh(tp_runs):
    full = tp_runs("train.py/tp.yaml")
    step_half = full.output_dir / "checkpoints" / "step_30"
    cfg = TrainConfig(**{k: v for k, v in full.summary["setup"]["options"].items()})
    meta = verify(step_half, contents=False)
    check_compatible(step_half, cfg, stand_in(), meta)  # its own mesh: fine
    for other, seen in ((stand_in(tp=2, dp_shard=2), "this run has 2 x 2"),
                        (StandIn(parallelism_config=None, num_processes=2,
                                 distributed_type=SimpleNamespace(value="MULTI_GPU")),
                         "this run has 2 x 1")):
        with pytest.raises(ConfigError, match=f"saved with 1 data-parallel x 2 tensor-parallel ranks; {seen}"):
            check_compatible(step_half, cfg, other, meta)
    assert data_parallel_size(stand_in(tp=2, dp_shard=2)) == 2


def test_optimizer_groups_split_by_mesh_only_when_there_are_dtensors():
    plain = [torch.nn.Parameter(torch.zeros(2)) for _ in range(3)]
    assert _split_by_mesh(plain) == [plain]
    assert _split_by_mesh([]) == [[]]
