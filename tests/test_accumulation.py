"""accumulate_and_clip.py: token-normalised accumulation and clipping, equal in every strategy;
train.py's handling of non-finite losses."""

import json
import math

import pytest
import torch
from accelerate.utils import set_seed
from safetensors.torch import load_file

from train_extras.options import TrainConfig
from common.data import build_datasets, build_tokenizer
from common.model import build_model, causal_lm_loss
from common.config import ConfigError
from tools import plan
from conftest import SYNTHETIC, TWO_RANK_ARGS, Run, launch, launch_two_processes, load_recipe, parse_train

MAX_GRAD_NORM = 0.05  # below every pre-clip norm of these steps: clipping is active in each


@pytest.fixture(scope="session")
def initial_tiny(tmp_path_factory):
    """Shared initial weights (tiny preset: big enough for DDP to use more than one gradient bucket)."""
    folder = tmp_path_factory.mktemp("initial_tiny")
    set_seed(0)
    build_model(TrainConfig(preset="tiny"), 259).save_pretrained(folder)
    build_tokenizer(TrainConfig()).save_pretrained(folder)
    return folder


def step_args(initial, micro_batch, accum, out):
    # Unpacked rows of uneven length (--packing false; documents are 100-500 bytes), 8 per step. Adam's first
    # update is ~lr * sign(gradient), blind to the gradient's size; with eps = 1 >> |gradient| it
    # is ~lr * gradient, so the updated weights show any difference in the gradients.
    return ["--model_name_or_path", str(initial), "--packing", "false", "--seq_len", "512",
            "--data_files", SYNTHETIC, "--micro_batch_size", str(micro_batch),
            "--gradient_accumulation_steps", str(accum),
            "--max_steps", "3", "--warmup_steps", "0", "--lr_schedule", "constant", "--lr", "1.0",
            "--adam_eps", "1.0", "--weight_decay", "0", "--max_grad_norm", str(MAX_GRAD_NORM),
            "--eval_every", "0", "--log_every", "1", "--output_dir", str(out)]


RUNS = {
    # name: (config or None for 1 process, micro-batch, accumulation)
    "1 process, 8 x 1": (None, 8, 1),
    "1 process, 2 x 4": (None, 2, 4),
    "DDP, 1 x 4 x 2 ranks": ("ddp.yaml", 1, 4),
    "FSDP2, 1 x 4 x 2 ranks": ("fsdp.yaml", 1, 4),
    "ZeRO-3, 1 x 4 x 2 ranks": ("deepspeed_zero3_offload.yaml", 1, 4),
}


@pytest.fixture(scope="session")
def accumulation_runs(tmp_path_factory, hf_home, initial_tiny):
    runs = {}

    def get(name):
        if name not in runs:
            config, micro_batch, accum = RUNS[name]
            out = tmp_path_factory.mktemp("accumulate")
            args = step_args(initial_tiny, micro_batch, accum, out)
            if config is None:
                proc = launch("accumulate_and_clip.py", args, hf_home)
            else:  # (under DDP the probes also count the gradient buckets each micro-step all-reduces)
                proc = launch_two_processes("accumulate_and_clip.py", config, args, hf_home,
                                            env={"ACCELERATE_RECIPES_PROBE_DDP_BUCKETS": "1",
                                                 "ACCELERATE_RECIPES_PROBE_GRADIENT_BYTES": "1"})
            runs[name] = Run(out, proc)
        return runs[name]

    return get


@pytest.mark.parametrize("name", [n for n in RUNS if n != "1 process, 8 x 1"])
def test_accumulated_steps_equal_one_big_batch(name, accumulation_runs):
    reference = accumulation_runs("1 process, 8 x 1")
    run = accumulation_runs(name)
    ref_weights = load_file(reference.output_dir / "model" / "model.safetensors")
    weights = load_file(run.output_dir / "model" / "model.safetensors")
    diff = max((weights[k] - ref_weights[k]).abs().max().item() for k in ref_weights)
    assert diff < 1e-5, diff  # measured: <= 7.5e-9 on 2026-11-30
    for mine, ref in zip(run.summary["losses"], reference.summary["losses"]):
        assert mine["loss"] == pytest.approx(ref["loss"], abs=1e-5)
        assert mine["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)  # the pre-clip norm


@pytest.mark.parametrize("name", ["1 process, 2 x 4", "DDP, 1 x 4 x 2 ranks", "FSDP2, 1 x 4 x 2 ranks"])
def test_clipping_bounds_the_full_gradient_and_logs_the_pre_clip_norm(name, accumulation_runs):
    for row in accumulation_runs(name).summary["losses"]:
        assert row["grad_norm"] > MAX_GRAD_NORM * 10  # clipping was active, and this is the pre-clip norm
        assert row["grad_norm_after_clip"] <= MAX_GRAD_NORM * (1 + 1e-5)
        assert row["grad_norm_after_clip"] == pytest.approx(MAX_GRAD_NORM, rel=1e-4)


def test_deepspeed_clips_at_max_grad_norm_inside_its_step(accumulation_runs):
    """Under DeepSpeed the recipe does not clip: the engine does, at its config's gradient_clipping."""
    for strategy in (rank["strategy"] for rank in accumulation_runs("ZeRO-3, 1 x 4 x 2 ranks").final):
        assert strategy["gradient_clipping"] == strategy["optimizer_clip_grad"] == MAX_GRAD_NORM, strategy


def test_ddp_syncs_only_on_the_last_micro_batch(accumulation_runs):
    run = accumulation_runs("DDP, 1 x 4 x 2 ranks")
    buckets = run.probed("ddp_buckets")[0]  # rank 0: [bucket index, gradient elements] per all-reduce
    assert buckets[:3] == [[], [], []]  # no all-reduce during the 3 non-final micro-steps
    last = buckets[3]
    assert sorted(index for index, _ in last) == list(range(len(last)))  # every bucket, each once
    # ...and together they carry every gradient element exactly once (the tiny preset fits DDP's
    # default bucket, so this is one bucket here)
    assert sum(numel for _, numel in last) == run.parameters_per_rank[0]["global_numel"]


# ---- FSDP2: the gradient held between micro-batches is a shard's, not the whole model's ----
@pytest.fixture(scope="module")
def fsdp_accumulation_runs(tmp_path_factory, hf_home, initial_model):
    """train.py under fsdp.yaml as the pair run "train.py/fsdp.yaml" (2 ranks x 4 sequences), but
    as 2 micro-batches of 2: by default, and (6 steps: the warmup) with --fsdp_sync_each_batch false.
    The probes count each rank's host syncs per step too."""
    runs = {}
    for sync, steps in (("true", []), ("false", ["--max_steps", "6", "--eval_every", "0", "--save_model", "false"])):
        out = tmp_path_factory.mktemp(f"fsdp_accumulation_{sync}")
        args = TWO_RANK_ARGS + ["--save_every", "30", "--sample_length", "8", "--model_name_or_path",
                                str(initial_model), "--micro_batch_size", "2", "--gradient_accumulation_steps", "2",
                                *(["--fsdp_sync_each_batch", "false"] if sync == "false" else []), *steps,
                                "--output_dir", str(out)]
        runs[sync] = Run(out, launch_two_processes("train.py", "fsdp.yaml", args, hf_home,
                                                   env={"ACCELERATE_RECIPES_PROBE_GRADIENT_BYTES": "1",
                                                        "ACCELERATE_RECIPES_PROBE_SYNCS": "1"}))
    return runs


def test_fsdp2_accumulation_holds_a_shard_of_the_gradient_between_micro_batches(fsdp_accumulation_runs,
                                                                                two_process_runs, accumulation_runs):
    sharded, whole = fsdp_accumulation_runs["true"], fsdp_accumulation_runs["false"]
    fp32_gradient = 4 * sharded.parameters_per_rank[0]["global_numel"]  # the whole model's, in bytes
    for rank in sharded.probed("gradient_bytes"):  # after each of the first step's 2 backwards
        assert [r["sync"] for r in rank] == [False, True]
        assert all(r["unsharded_accumulated"] == 0 and 0 < r["grad"] <= fp32_gradient / 2 * 1.01 for r in rank)
    for rank in whole.probed("gradient_bytes"):  # the way before: no sync, every unsharded gradient kept
        assert rank[0] == {"sync": False, "grad": 0, "unsharded_accumulated": fp32_gradient}
    planned = plan.model_state_bytes("fsdp.yaml", fp32_gradient / 4, 2, "fp32", fsdp_whole_gradients=True)
    assert [t["bytes"] for t in planned["terms"] if "kept between micro-batches" in t["name"]] == [fp32_gradient]
    for rank in accumulation_runs("FSDP2, 1 x 4 x 2 ranks").probed("gradient_bytes"):  # the focused recipe too
        assert len(rank) == 4 and all(r["unsharded_accumulated"] == 0 for r in rank)
    # the same losses: as one micro-batch of 4 (the pair run; the sums split in two and reduce-scattered
    # twice: 1.2e-5 apart at most in 60 steps, measured), and as syncing once per step
    reference = two_process_runs("train.py/fsdp.yaml").summary["losses"]
    assert len(sharded.summary["losses"]) == len(reference) == 60
    for mine, ref in zip(sharded.summary["losses"], reference):
        assert mine["step"] == ref["step"] and abs(mine["loss"] - ref["loss"]) < 5e-5, (mine, ref)
    for mine, ref in zip(whole.summary["losses"], sharded.summary["losses"][:6], strict=False):
        assert mine["step"] == ref["step"] and abs(mine["loss"] - ref["loss"]) < 1e-5, (mine, ref)
    assert len(whole.summary["losses"]) == 6


@pytest.mark.quick
def test_fsdp_sync_each_batch_false_outside_fsdp_is_refused(monkeypatch):
    monkeypatch.delenv("ACCELERATE_USE_FSDP", raising=False)  # this process: launched by no FSDP config
    with pytest.raises(ConfigError, match="--fsdp_sync_each_batch false is an FSDP2 setting: this launch is not"):
        load_recipe("train").build_accelerator(parse_train(["--fsdp_sync_each_batch", "false"]))


@pytest.mark.quick
def test_the_workload_can_tell_normalisations_apart(tmp_path, monkeypatch, initial_tiny):
    """The equivalence test has power: on the same 8 uneven rows, the mean of 4 micro-batch means
    gives a gradient far (relative 1e-2 and more) from the token mean the recipe uses."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path)
    cfg = TrainConfig(model_name_or_path=str(initial_tiny), packing=False, seq_len=512, data_files=[SYNTHETIC])
    train, _ = build_datasets(cfg, build_tokenizer(cfg))
    rows = [train[i] for i in range(8)]
    targets = [int((r["labels"] != -100).sum()) for r in rows]
    assert len(set(targets)) > 1  # uneven rows
    model = build_model(cfg, 259)

    def gradient(loss_fn):
        model.zero_grad()
        loss_fn().backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    ids = torch.stack([r["input_ids"] for r in rows])
    labels = torch.stack([r["labels"] for r in rows])
    token_mean = gradient(lambda: causal_lm_loss(model, ids, labels))
    mean_of_means = gradient(lambda: sum(causal_lm_loss(model, ids[i:i + 2], labels[i:i + 2])
                                         for i in range(0, 8, 2)) / 4)
    assert ((token_mean - mean_of_means).norm() / token_mean.norm()).item() > 1e-2


def test_nonfinite_losses_are_skipped_and_counted(tmp_path, hf_home):
    """lr 1e9 blows the weights up after step 1; every later loss is NaN. Each such step is
    skipped (no NaN reaches the weights) and counted."""
    args = ["--preset", "debug", "--seq_len", "64", "--micro_batch_size", "8", "--data_files", SYNTHETIC,
            "--max_steps", "6", "--warmup_steps", "0", "--lr_schedule", "constant", "--lr", "1e9",
            "--eval_every", "0", "--log_every", "1", "--max_nonfinite_steps", "100", "--sample_length", "0",
            "--output_dir", str(tmp_path)]
    summary = Run(tmp_path, launch("train.py", args, hf_home)).summary
    losses = [row["loss"] for row in summary["losses"]]
    assert math.isfinite(losses[0]) and all(math.isnan(x) for x in losses[1:])
    assert summary["skipped_steps"]["nonfinite_loss"] == 5
    weights = load_file(tmp_path / "model" / "model.safetensors")
    assert all(torch.isfinite(w).all() for w in weights.values())


def test_nonfinite_losses_in_a_row_stop_the_run(tmp_path, hf_home):
    args = ["--preset", "debug", "--seq_len", "64", "--micro_batch_size", "8", "--data_files", SYNTHETIC,
            "--max_steps", "30", "--warmup_steps", "0", "--lr_schedule", "constant", "--lr", "1e9",
            "--eval_every", "0", "--output_dir", str(tmp_path / "out")]
    proc = launch("train.py", args, hf_home, check=False)
    assert proc.returncode != 0
    ours = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert ours == ["error: non-finite loss in 3 steps in a row (last: step 4); stopping without a checkpoint or an "
                    "export (lower --lr, check the data, or use bf16 instead of fp16)"]
    # nothing but the run's own record: its lock and the steps that led here
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [".run.lock", "metrics.jsonl"]
    lines = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"] is None) for r in lines] == [(1, False), (2, True), (3, True), (4, True)]



# What a steady step of train.py makes a GPU wait for, per rank (the probes' census, by file): its one
# documented sync (the finite check and the preemption vote, recipes/train.py), and transformers'
# packed-sequence check, once per forward (masking_utils.find_packed_sequence_indices, a `.all()` on
# the position ids: docs/benchmarks.md#host-syncs-per-step). No blocking batch copy.
STEADY_SYNCS = {"recipes/train.py tolist": 1, "transformers/masking_utils.py __bool__": 2}  # 2 micro-batches


def test_a_step_makes_the_gpu_wait_once_and_copies_batches_without_waiting(fsdp_accumulation_runs):
    for run in fsdp_accumulation_runs.values():
        for rank in run.probed("syncs"):
            steps = {r["step"]: {} for r in rank}
            for r in rank:
                for site, count in r["sites"].items():  # "recipes/train.py:533 tolist" -> "recipes/train.py tolist"
                    where, what = site.split(" ", 1)
                    key = f"{where.rsplit(':', 1)[0]} {what}"
                    steps[r["step"]][key] = steps[r["step"]].get(key, 0) + count
            assert sorted(steps) == list(range(1, len(steps) + 1)) and len(steps) in (6, 60)
            assert all(census.get("recipes/train.py tolist") == 1 for census in steps.values()), steps
            assert not [site for census in steps.values() for site in census if "blocking batch copy" in site]
            # the loss line every 10 steps (--log_every) reads the 10 steps' losses at once
            logged = [step for step, census in steps.items() if "observe/run_record.py tolist" in census]
            assert logged == list(range(11, len(steps) + 1, 10))
            steady = {step: census for step, census in steps.items() if step > 1 and step not in logged}
            assert steady and all(census == STEADY_SYNCS for census in steady.values()), steady
