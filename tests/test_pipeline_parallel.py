"""Pipeline parallel (recipes/pipeline_parallel.py): 2 and 3 CPU processes over gloo, one stage each.

The 2-stage run takes the 1-process reference's batch of 8 as 4 micro-batches of 2, from the same
initial weights: its losses must equal the reference's up to the order of floating-point sums."""

import pytest
from accelerate.utils import set_seed
from transformers import AutoModelForCausalLM

from common.data import build_datasets, build_loaders, build_tokenizer
from common.export import not_an_export
from common.model import evaluate, model_config
from train_extras.options import TrainConfig
from conftest import CORE_DEBUG_ARGS, Run, check_loss_goes_down, launch_two_processes

PIPELINE_ARGS = CORE_DEBUG_ARGS + ["--micro_batch_size", "2", "--gradient_accumulation_steps", "4"]


@pytest.fixture(scope="session")
def pipeline_run(tmp_path_factory, hf_home):
    out = tmp_path_factory.mktemp("pipeline_2_stages")
    proc = launch_two_processes("pipeline_parallel.py", "ddp.yaml", PIPELINE_ARGS + ["--output_dir", str(out)], hf_home)
    return Run(out, proc)


@pytest.fixture(scope="session")
def three_stage_run(tmp_path_factory, hf_home):
    """A 3-layer model over 3 stages: the middle stage receives and sends (the 2-stage run has none)."""
    folder = tmp_path_factory.mktemp("three_layers")
    config = model_config(TrainConfig(preset="debug"), 259)
    config.num_hidden_layers = 3
    set_seed(1234)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    build_tokenizer(TrainConfig()).save_pretrained(folder)
    out = tmp_path_factory.mktemp("pipeline_3_stages")
    args = PIPELINE_ARGS + ["--model_name_or_path", str(folder), "--max_steps", "30", "--eval_every", "15",
                            "--output_dir", str(out)]
    return Run(out, launch_two_processes("pipeline_parallel.py", "ddp.yaml", args, hf_home,
                                         extra_launch_args=["--num_processes", "3"]))


def test_pipeline_losses_match_one_process(pipeline_run, train_run_unmasked):
    """The pipeline packs without document masks: its reference is train.py's without them."""
    train_run = train_run_unmasked
    reference = [row["loss"] for row in train_run.summary["losses"]]
    losses = [row["loss"] for row in pipeline_run.summary["losses"]]
    assert losses[:5] == pytest.approx(reference[:5], abs=1e-5, rel=0)
    assert losses == pytest.approx(reference, abs=1e-4, rel=0)  # all 60 steps (measured: 9.5e-7)
    check_loss_goes_down(pipeline_run.summary)
    assert [(row["step"], row["tokens"]) for row in pipeline_run.summary["eval"]] == \
        [(row["step"], row["tokens"]) for row in train_run.summary["eval"]]
    assert [row["loss"] for row in pipeline_run.summary["eval"]] == pytest.approx(
        [row["loss"] for row in train_run.summary["eval"]], abs=1e-5, rel=0)


def test_each_stage_holds_its_own_layers(pipeline_run, three_stage_run):
    two = pipeline_run.summary
    assert two["pipeline"] == {"stages": 2, "micro_batches": 4, "layers_per_stage": [[0, 1], [1, 2]]}
    assert three_stage_run.summary["pipeline"]["layers_per_stage"] == [[0, 1], [1, 2], [2, 3]]
    # (every parameter comes from exactly one stage: the export loads the stages' tensors strictly)
    # one batch of 2 x 4 for all the stages, as the 1-process reference's 8
    assert (two["setup"]["global_batch_sequences"], two["setup"]["data_parallel_size"]) == (8, 1)
    assert two["setup"]["distributed_type"] == "MULTI_CPU" and two["setup"]["world_size"] == 2


@pytest.mark.parametrize("run", ["pipeline_run", "three_stage_run"])
def test_pipeline_export_reproduces_the_model_that_came_through_the_stages(run, request, monkeypatch, tmp_path):
    """The export, reloaded by plain transformers in this process, gives the held-out loss the
    stages computed at the last step (same weights, same held-out blocks; the run's real outputs),
    and holds its marker (the pipeline's own export, train_extras/parallel/pipeline.py)."""
    import datasets
    from accelerate import Accelerator

    trained = request.getfixturevalue(run)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path)
    cfg = TrainConfig(**trained.summary["setup"]["options"])
    model = AutoModelForCausalLM.from_pretrained(trained.summary["export"])
    tokenizer = build_tokenizer(TrainConfig(model_name_or_path=trained.summary["export"]))
    _, eval_loader = build_loaders(cfg, *build_datasets(cfg, tokenizer), pin_memory=False)
    held_out = evaluate(model, eval_loader, Accelerator(cpu=True))
    assert held_out["tokens"] == trained.summary["eval"][-1]["tokens"]
    assert held_out["loss"] == pytest.approx(trained.summary["eval"][-1]["loss"], abs=1e-5, rel=0)
    assert not_an_export(trained.summary["export"]) is None  # marked as every export is: a later one may replace it


def test_three_stages_train(three_stage_run):
    losses = [row["loss"] for row in three_stage_run.summary["losses"]]
    assert len(losses) == 30 and sum(losses[-5:]) / 5 < losses[0] - 1.0, losses
    evals = three_stage_run.summary["eval"]
    assert evals[-1]["loss"] < evals[0]["loss"] - 1.0
