"""HSDP (accelerate_configs/multi_node_hsdp.yaml): accelerate's FSDP2 on its 2-D mesh, 2 replicas x
2 shards, as 4 CPU processes over gloo through the CPU harness. One launcher stands for the two
machines (several launchers joining one rendezvous: tests/test_multinode.py); the mesh, the
sharding and the data split are the same.

Global batch 8 as the 1-process reference (conftest's train_run, same seed and data): 4 ranks x 2
accumulated micro-batches of 1 (accumulation pauses both the reduce-scatter and the all-reduce
across replicas). fp32, so the losses must equal the reference's up to the order of sums. Launched
once, plus one resume from its step-5 checkpoint: about 42 s of launches on 2 cores (measured)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from accelerate.parallelism_config import ParallelismConfig
from torch.distributed.checkpoint import FileSystemReader

from common.config import ConfigError
from common.model import model_config
from tools import plan
from train_extras.parallel import tensor_parallel
from train_extras.options import TrainConfig
from conftest import HARNESS, TRAIN_ARGS, Run, check_exact_resume, check_export_reproduces_model, launch

HSDP_LAUNCH = ["--num_machines", "1", "--num_processes", "4", "--main_process_port", "0",
               "--num_cpu_threads_per_process", "1", "--mixed_precision", "no",
               "--parallelism_config_dp_replicate_size", "2", "--parallelism_config_dp_shard_size", "2"]
HSDP_ARGS = TRAIN_ARGS + ["--micro_batch_size", "1", "--gradient_accumulation_steps", "2", "--max_steps", "10",
                          "--save_every", "5", "--eval_every", "5"]
HALF = 5


def launch_hsdp(args, hf_home):
    return launch("train.py", args, hf_home, config="multi_node_hsdp.yaml", launch_args=HSDP_LAUNCH, env=HARNESS)


@pytest.fixture(scope="session")
def hsdp_run(tmp_path_factory, hf_home):
    out = tmp_path_factory.mktemp("hsdp")
    return Run(out, launch_hsdp(HSDP_ARGS + ["--output_dir", str(out)], hf_home))


def test_setup_is_hsdp_with_every_rank_data_parallel(hsdp_run):
    setup = hsdp_run.summary["setup"]
    assert (setup["distributed_type"], setup["world_size"], setup["data_parallel_size"]) == ("FSDP", 4, 4)
    assert setup["global_batch_sequences"] == 8
    assert "mesh             : dp_replicate 2 x dp_shard 2 (HSDP: 2 copies, each sharded over 2 ranks)" in (
        hsdp_run.proc.stdout)
    assert hsdp_run.strategy["engine"] == "fsdp2" and hsdp_run.strategy["reshard_after_forward"] is True


def test_parameters_are_sharded_in_half_within_a_replica(hsdp_run):
    """Every parameter a DTensor on the (dp_replicate, dp_shard) mesh, placed (Replicate(), Shard(0)):
    rank 0 and 1 (one replica) hold the two halves of dim 0, ranks 2 and 3 the same two halves."""
    layout = hsdp_run.final[0]["hsdp_parameters"]
    assert len(layout) == 21  # every parameter of the debug preset
    for name, row in layout.items():
        assert row["mesh"] == {"dp_replicate": 2, "dp_shard_cp": 2}, (name, row)
        assert row["placements"] == ["R", "S(0)"], (name, row)
        rows = row["global_shape"][0]
        assert row["local_shape"] == [(rows + 1) // 2, *row["global_shape"][1:]], (name, row)  # rank 0: first half
    ranks = hsdp_run.parameters_per_rank
    local = [rank["local_numel"] for rank in ranks]
    assert local[0] + local[1] == ranks[0]["global_numel"] and local[:2] == local[2:], local
    # the replicas' copies stayed bitwise equal: each updates its shard from the all-reduced gradient
    assert hsdp_run.final[0]["hsdp_replica_max_difference"] == 0.0
    # the sharded checkpoint (DCP metadata): each parameter stored as its two row halves
    metadata = FileSystemReader(str(hsdp_run.output_dir / "checkpoints" / f"step_{HALF}" / "pytorch_model_fsdp_0"))
    for name, meta in metadata.read_metadata().state_dict_metadata.items():
        rows = meta.size[0]
        assert [(c.offsets[0], c.sizes[0]) for c in meta.chunks] == [(0, (rows + 1) // 2), ((rows + 1) // 2,
                                                                                            rows // 2)], name


def test_the_planners_hsdp_rung_shards_as_the_run_does(hsdp_run):
    """The planner's HSDP rung (tools/plan) for 2 machines of 2 GPUs: the fp32 parameter shards it
    counts per GPU are what each rank holds (FSDP2 pads a shard by at most a row)."""
    states = plan.model_state_bytes("hsdp", hsdp_run.summary["model"]["parameters"], 4, "fp32", gpus_per_node=2)
    shards = next(t["bytes"] for t in states["terms"] if t["name"] == "fp32 parameter shards (DTensor)")
    for rank in hsdp_run.parameters_per_rank:
        assert 4 * rank["local_numel"] == pytest.approx(shards, rel=0.01), rank


def test_every_rank_gets_its_own_batch(hsdp_run, train_run):
    """All 4 ranks are data-parallel: per optimizer step their 8 samples are distinct and are the
    reference's batch of that step."""
    reference = train_run.batches[0]
    ranks = hsdp_run.batches  # per rank, 2 micro-batches of 1 per step
    assert len(ranks) == 4 and all(len(batches) == 2 * 10 for batches in ranks)
    for step in range(10):
        ids = [i for batches in ranks for batch in batches[2 * step:2 * step + 2] for i in batch]
        assert len(set(ids)) == 8 and sorted(ids) == sorted(reference[step]), step


def test_losses_match_one_process(hsdp_run, train_run):
    reference, run = train_run.summary, hsdp_run.summary
    # Steps 1-5 are warm-up steps, whose LR does not depend on --max_steps (this run is shorter).
    losses = [row["loss"] for row in run["losses"][:5]]
    assert losses == pytest.approx([row["loss"] for row in reference["losses"][:5]], abs=1e-5, rel=0)
    assert reference["losses"][4]["loss"] < reference["losses"][0]["loss"] - 0.2  # the steps moved the model
    norms = [row["grad_norm"] for row in run["losses"][:5]]
    assert norms == pytest.approx([row["grad_norm"] for row in reference["losses"][:5]], rel=1e-4)
    assert run["eval"][0]["tokens"] == reference["eval"][0]["tokens"]  # each held-out sample once
    assert run["eval"][0]["loss"] == pytest.approx(reference["eval"][0]["loss"], abs=1e-5, rel=0)


def test_export_reloads_with_the_same_logits(hsdp_run):
    check_export_reproduces_model(hsdp_run)


def test_resume_is_exact(hsdp_run, tmp_path, hf_home):
    step_half = hsdp_run.output_dir / "checkpoints" / f"step_{HALF}"
    assert sorted(p.name for p in step_half.glob("random_states_*.pkl")) == [f"random_states_{r}.pkl" for r in range(4)]
    args = HSDP_ARGS + ["--resume_from_checkpoint", str(step_half), "--output_dir", str(tmp_path)]
    resumed = Run(tmp_path, launch_hsdp(args, hf_home))
    check_exact_resume(hsdp_run, resumed, HALF)
    assert resumed.summary["eval"][-1] == hsdp_run.summary["eval"][-1]
    check_export_reproduces_model(resumed)


# ---- in-process: what train.py checks before any model is built ----

def launched(distributed_type: str) -> SimpleNamespace:
    """The attributes of an Accelerator that tensor_parallel.check and describe_mesh read: a 2 x 2 data mesh."""
    return SimpleNamespace(parallelism_config=ParallelismConfig(dp_replicate_size=2, dp_shard_size=2), num_processes=4,
                           mixed_precision="no", distributed_type=SimpleNamespace(value=distributed_type))


@pytest.mark.quick
def test_a_sharding_mesh_that_accelerate_would_run_as_ddp_is_refused():
    """dp_shard_size > 1 without TP shards only under distributed_type FSDP: a MULTI_GPU config with
    it gets the whole model wrapped in DDP (seen on CPU: prepare() built DistributedDataParallel)."""
    cfg = TrainConfig(preset="debug")
    with pytest.raises(ConfigError, match=r"dp_shard_size 2 asks for sharding, but accelerate runs MULTI_GPU, which "
                                          "replicates the model: use distributed_type FSDP"):
        tensor_parallel.check(launched("MULTI_GPU"), cfg, model_config(cfg, 259), "train.py")
    tensor_parallel.check(launched("FSDP"), cfg, model_config(cfg, 259), "train.py")  # HSDP: accepted
    assert tensor_parallel.describe_mesh(launched("FSDP")) == {
        "mesh": "dp_replicate 2 x dp_shard 2 (HSDP: 2 copies, each sharded over 2 ranks)"}
    no_mesh = SimpleNamespace(parallelism_config=None, distributed_type=SimpleNamespace(value="FSDP"))
    assert tensor_parallel.describe_mesh(no_mesh) == {}
    tensor_parallel.check(no_mesh, cfg, model_config(cfg, 259), "train.py")
