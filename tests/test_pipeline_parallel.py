"""Pipeline parallel (recipes/pipeline_parallel.py): 2 and 3 CPU processes over gloo, one stage each.

The 2-stage run takes the 1-process reference's batch of 8 as 4 micro-batches of 2, from the same
initial weights: its losses must equal the reference's up to the order of floating-point sums.
Granite and Gemma 3 (tests/families.py: their own embedding and logit scaling, sliding/full
layers with their own rotary, soft-capping, tied heads) are trained the same way against train.py;
in-process, the stages of every dense family there give the whole model's logits."""

import pytest
import torch
import transformers
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from common.config import ConfigError
from common.data import build_datasets, build_loaders, build_tokenizer
from common.export import not_an_export
from common.model import evaluate
from train_extras.options import TrainConfig
from train_extras.parallel import pipeline
from conftest import (CORE_DEBUG_ARGS, SYNTHETIC, Run, check_loss_goes_down, launch, launch_two_processes,
                      load_recipe)
from families import FAMILIES, make_config, save_family

PIPELINE_ARGS = CORE_DEBUG_ARGS + ["--micro_batch_size", "2", "--gradient_accumulation_steps", "4"]


@pytest.fixture(scope="session")
def pipeline_run(tmp_path_factory, hf_home):
    out = tmp_path_factory.mktemp("pipeline_2_stages")
    proc = launch_two_processes("pipeline_parallel.py", "ddp.yaml", PIPELINE_ARGS + ["--output_dir", str(out)], hf_home)
    return Run(out, proc)


@pytest.fixture(scope="session")
def byte_tokenizer(tmp_path_factory):
    """The byte tokenizer in a folder of its own: beside a Gemma config transformers would load
    Gemma's tokenizer class (tests/test_model_families.py's byte_tokenizer)."""
    folder = tmp_path_factory.mktemp("pipeline_tokenizer")
    build_tokenizer(TrainConfig()).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def three_stage_run(tmp_path_factory, hf_home, byte_tokenizer):
    """SmolLM3's 4 layers over 3 stages (1, 1, 2; rotary skipped on its 4th layer), tied head: the
    middle stage receives and sends (the 2-stage run has none), and the embedding's copy on the
    first stage and the head's on the last are kept equal across a stage that holds neither."""
    folder = save_family("smollm3", tmp_path_factory.mktemp("smollm3"), seed=1234)
    out = tmp_path_factory.mktemp("pipeline_3_stages")
    args = PIPELINE_ARGS + ["--model_name_or_path", str(folder), "--tokenizer_name_or_path", str(byte_tokenizer),
                            "--max_steps", "30", "--eval_every", "15", "--output_dir", str(out)]
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
    assert three_stage_run.summary["pipeline"]["layers_per_stage"] == [[0, 1], [1, 2], [2, 4]]
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
    tokenizer = build_tokenizer(TrainConfig(tokenizer_name_or_path=trained.summary["export"]))
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


# ---- the family's own function on every stage ----
STAGED = ["qwen3", "smollm3", "olmo3", "gemma3", "granite", "falcon_h1", "lfm2"]  # the dense families
MOE = [name for name in FAMILIES if name not in STAGED]


def chained_logits(model, stages: int, input_ids):
    """The stages of `model` run one after the other in this process, as the ranks run them."""
    layers = model.config.num_hidden_layers
    x = input_ids
    for s in range(stages):
        x = pipeline.PipelineStageModule(model, range(layers * s // stages, layers * (s + 1) // stages),
                                         s == 0, s == stages - 1)(x)
    return x


@pytest.mark.quick
def test_the_stages_compute_each_familys_own_forward():
    """Granite's embedding multiplier and logits scaling, Gemma 3's scaled embedding, sliding/full
    layers with two rotary tables and soft-capped logits, SmolLM3's rotary-free layers, OLMo 3's
    sliding windows, Falcon-H1's Mamba2 heads and multipliers, LFM2's short convolutions: every
    way of cutting each family gives its whole forward's logits (fp32, the same kernels: 0 measured).
    Every weight is held by one stage, a tied one by the first and the last (both export it)."""
    input_ids = torch.randint(0, 259, (2, 40), generator=torch.Generator().manual_seed(0))
    for name in STAGED:
        config = make_config(name)
        pipeline.check_pipeline_layout(config, "pipeline_parallel.py")
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config).eval()
        with torch.no_grad():
            whole = model(input_ids=input_ids).logits
            for stages in range(2, config.num_hidden_layers + 1):
                staged = chained_logits(model, stages, input_ids)
                assert (staged - whole).abs().max().item() <= 1e-5, (name, stages)
        layers = config.num_hidden_layers
        held = [dict(pipeline.PipelineStageModule(model, range(layers * s // 2, layers * (s + 1) // 2), s == 0,
                                                  s == 1).named_parameters()) for s in range(2)]
        tied = {"model.model.embed_tokens.weight", "model.lm_head.weight"} if config.tie_word_embeddings else set()
        assert set(held[0]) & set(held[1]) == {"model.model.embed_tokens.weight"} & tied, name
        assert {id(p) for stage in held for p in stage.values()} == {id(p) for p in model.parameters()}, name
        if tied:  # in both stages' state dicts, under both names: the export compares the copies
            assert all(tied <= set(pipeline.PipelineStageModule(model, range(layers * s // 2, layers * (s + 1) // 2),
                                                                s == 0, s == 1).state_dict()) for s in range(2))
    for name in MOE:  # one line: the router's loss is not carried across the stages
        with pytest.raises(ConfigError, match=r"^pipeline_parallel.py: the \w+ model is a mixture of experts, whose "
                                              r"router loss and expert load this pipeline does not carry"):
            pipeline.check_pipeline_layout(make_config(name), "pipeline_parallel.py")


@pytest.mark.quick
def test_the_start_up_probe_refuses_stages_that_miss_the_models_own_function():
    """Zamba2's shared blocks read the embedding's output at every hybrid layer (a later stage only
    has its own input): the logits differ. Gemma 4's per-layer token embeddings feed every block
    from the token ids, which a later stage does not have: it cannot run. One line each, before
    training; Granite passes."""
    shape = dict(vocab_size=259, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                 intermediate_size=128, pad_token_id=0)
    zamba2 = transformers.Zamba2Config(**{**shape, "num_key_value_heads": 4}, layers_block_type=["mamba", "hybrid"],
                                       mamba_d_state=8, mamba_headdim=16, n_mamba_heads=8, mamba_ngroups=1,
                                       chunk_size=16, hybrid_layer_ids=[1], num_mem_blocks=1)
    gemma4 = transformers.Gemma4TextConfig(**shape, head_dim=16, sliding_window=16,
                                           layer_types=["sliding_attention", "full_attention"])
    torch.manual_seed(0)
    with pytest.raises(ConfigError, match=r"^pipeline_parallel.py: the Zamba2ForCausalLM model's 2 stages do not "
                                          r"compute its own forward \(largest logit difference [0-9.e-]+ > 1e-5 on a "
                                          r"probe batch\); train it with train.py$"):
        pipeline.check_stages(AutoModelForCausalLM.from_config(zamba2), [0, 1, 2], "pipeline_parallel.py")
    with pytest.raises(ConfigError, match=r"^pipeline_parallel.py: the Gemma4ForCausalLM model cannot be cut into 2 "
                                          r"stages \(RuntimeError: its forward calls model.embed_tokens_per_layer on "
                                          r"a stage that does not hold it\); train it with train.py$"):
        pipeline.check_stages(AutoModelForCausalLM.from_config(gemma4), [0, 1, 2], "pipeline_parallel.py")
    pipeline.check_stages(AutoModelForCausalLM.from_config(make_config("granite")), [0, 1, 2], "pipeline_parallel.py")


@pytest.mark.quick
def test_micro_batches_default_to_one_per_stage():
    """0 (the default) is one micro-batch per stage, resolved at start-up (the runs below record 2);
    a negative count is one line."""
    recipe = load_recipe("pipeline_parallel")
    assert recipe.Options().gradient_accumulation_steps == 0
    with pytest.raises(ConfigError, match=r"^--gradient_accumulation_steps must be 0 \(one micro-batch per stage\) "
                                          r"or more, got -1$"):
        recipe.Options(gradient_accumulation_steps=-1)


# Granite and Gemma 3 against train.py on 1 process: global batch 8, micro-batches by default (2 of 4).
FAMILY_ARGS = ["--data_files", SYNTHETIC, "--seq_len", "64", "--max_steps", "12", "--warmup_steps", "2",
               "--eval_every", "6", "--log_every", "4"]


@pytest.fixture(scope="session")
def family_pipeline_runs(tmp_path_factory, hf_home, byte_tokenizer):
    runs = {}

    def get(name: str) -> tuple[Run, Run]:
        if name not in runs:
            folder = save_family(name, tmp_path_factory.mktemp(f"pipeline_{name}"))
            args = FAMILY_ARGS + ["--model_name_or_path", str(folder), "--tokenizer_name_or_path", str(byte_tokenizer)]
            out = tmp_path_factory.mktemp(f"pipeline_{name}_2_stages")
            staged = Run(out, launch_two_processes("pipeline_parallel.py", "ddp.yaml", args + [
                "--micro_batch_size", "4", "--output_dir", str(out)], hf_home))
            out = tmp_path_factory.mktemp(f"pipeline_{name}_reference")
            reference = Run(out, launch("train.py", args + ["--micro_batch_size", "8", "--document_mask", "false",
                                                            "--sample_length", "0", "--output_dir", str(out)], hf_home))
            runs[name] = staged, reference
        return runs[name]

    return get


@pytest.mark.parametrize("name", ["granite", "gemma3"])
def test_family_pipeline_trains_the_models_own_function(name, family_pipeline_runs):
    """Each step's loss and each held-out loss equal train.py's on 1 process (both tied models:
    the head's copy on the last stage and the embedding's on the first take the same steps), and the
    export is tied and holds the weights train.py trained."""
    staged, reference = family_pipeline_runs(name)
    assert staged.summary["pipeline"]["micro_batches"] == 2 and staged.summary["setup"]["global_batch_sequences"] == 8
    # fp32 sums in another order: measured 4.8e-7 (losses) and 6e-8 (weights) for both families
    losses = [row["loss"] for row in staged.summary["losses"]]
    assert losses == pytest.approx([row["loss"] for row in reference.summary["losses"]], abs=1e-5, rel=0)
    assert [row["loss"] for row in staged.summary["eval"]] == pytest.approx(
        [row["loss"] for row in reference.summary["eval"]], abs=1e-5, rel=0)
    # one tensor for the embedding and the head (the copies were equal: the export compares them)
    exports = [safe_open(f"{run.summary['export']}/model.safetensors", "pt") for run in (staged, reference)]
    assert set(exports[0].keys()) == set(exports[1].keys()) and "lm_head.weight" not in exports[0].keys()
    assert AutoModelForCausalLM.from_pretrained(staged.summary["export"]).config.tie_word_embeddings
    gaps = {key: (exports[0].get_tensor(key) - exports[1].get_tensor(key)).abs().max().item()
            for key in exports[0].keys()}
    assert max(gaps.values()) < 1e-5, gaps
