"""Bring your own model: three non-Llama families, made locally with transformers' own config
classes, trained by train.py under every main strategy (1 process, DDP, FSDP2, ZeRO-3 + offload on
2 CPU processes) and tensor parallel where the family declares a plan.

- GPT-2: tied input/output embeddings, learned positions, Conv1D layers, names of its own
  (n_embd, n_layer, n_inner), no tensor-parallel plan.
- Qwen2: biases on q/k/v, grouped-query attention, a tensor-parallel plan.
- GPT-NeoX: parallel residual, partial rotary, a plain (ungated) MLP.

Each (family, config) is launched once; the tests read its run_summary.json and export."""

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, GPT2Config, GPTNeoXConfig, Qwen2Config

from train_extras.parallel import fsdp_settings, pipeline, tensor_parallel
from common.config import ConfigError
from train_extras.options import TrainConfig
from common.data import build_tokenizer
from train_extras.observe.flops import dimensions, flops_per_token, matmul_params
from conftest import (HARNESS, SYNTHETIC, TWO_CPU_PROCESSES, TWO_PROCESS_LAUNCH, Run, check_export_reproduces_model,
                      launch)

VOCAB = 259  # the byte-level tokenizer
SHAPE = dict(num_hidden_layers=2, num_attention_heads=4, hidden_size=64, max_position_embeddings=256)
FAMILIES = {
    "gpt2": lambda: GPT2Config(vocab_size=VOCAB, n_layer=2, n_head=4, n_embd=64, n_positions=256,
                               bos_token_id=1, eos_token_id=1, tie_word_embeddings=True),
    "qwen2": lambda: Qwen2Config(vocab_size=VOCAB, num_key_value_heads=2, intermediate_size=176,
                                 tie_word_embeddings=False, **SHAPE),
    "gpt_neox": lambda: GPTNeoXConfig(vocab_size=VOCAB, intermediate_size=176, tie_word_embeddings=False, **SHAPE),
}
BLOCK = {"gpt2": "GPT2Block", "qwen2": "Qwen2DecoderLayer", "gpt_neox": "GPTNeoXLayer"}
MODEL_CLASS = {"gpt2": "GPT2LMHeadModel", "qwen2": "Qwen2ForCausalLM", "gpt_neox": "GPTNeoXForCausalLM"}
CONFIGS = ["cpu.yaml", "ddp.yaml", "fsdp.yaml", "deepspeed_zero3_offload.yaml"]
DISTRIBUTED_TYPE = {"cpu.yaml": "NO", "ddp.yaml": "MULTI_CPU", "fsdp.yaml": "FSDP",
                    "deepspeed_zero3_offload.yaml": "DEEPSPEED"}
# Short runs on the synthetic corpus (learnable in a few dozen steps); global batch 8.
ARGS = ["--data_files", SYNTHETIC, "--seq_len", "64", "--max_steps", "24",
        "--warmup_steps", "4", "--eval_every", "24", "--log_every", "8", "--sample_length", "24"]
# Under DeepSpeed another clipping threshold than accelerate's 1.0 for "auto": train.py must hand
# --max_grad_norm to DeepSpeed's config (no other DeepSpeed run of train.py can change its 1.0).
DEEPSPEED_ARGS = ["--max_grad_norm", "0.5"]


@pytest.fixture(scope="session")
def family_models(tmp_path_factory):
    """Each family as a saved Hugging Face folder (random init, seed 0)."""
    folders = {}
    for name, make in FAMILIES.items():
        folder = tmp_path_factory.mktemp(f"family_{name}")
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(make()).save_pretrained(folder)
        folders[name] = folder
    return folders


@pytest.fixture(scope="session")
def byte_tokenizer(tmp_path_factory):
    """The byte tokenizer in a folder of its own (--tokenizer_name_or_path). Saved beside a Qwen2
    config, transformers would load Qwen2's own tokenizer class instead of the one named in
    tokenizer_config.json, without its vocabulary (the recipe refuses that tokenizer: tested below)."""
    folder = tmp_path_factory.mktemp("byte_tokenizer")
    build_tokenizer(TrainConfig()).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def family_runs(tmp_path_factory, hf_home, family_models, byte_tokenizer):
    runs = {}

    def get(family: str, config: str) -> Run:
        if (family, config) not in runs:
            out = tmp_path_factory.mktemp(f"{family}__{config}")
            args = ARGS + ["--model_name_or_path", str(family_models[family]),
                           "--tokenizer_name_or_path", str(byte_tokenizer), "--output_dir", str(out)]
            if config == "cpu.yaml":
                proc = launch("train.py", args + ["--micro_batch_size", "8"], hf_home)
            elif config == "tp.yaml":  # the 2 ranks share each batch: 2 accumulated micro-batches of 4
                proc = launch("train.py", args + ["--micro_batch_size", "4", "--gradient_accumulation_steps", "2"],
                              hf_home, config=config, env=HARNESS,
                              launch_args=TWO_PROCESS_LAUNCH + ["--parallelism_config_tp_size", "2"])
            else:
                args += DEEPSPEED_ARGS if config.startswith("deepspeed") else []
                proc = launch("train.py", args + ["--micro_batch_size", "4"], hf_home, config=config,
                              launch_args=TWO_PROCESS_LAUNCH, env=TWO_CPU_PROCESSES[config])
            runs[family, config] = Run(out, proc)
        return runs[family, config]

    return get


RUNS = [(family, config) for family in FAMILIES for config in CONFIGS]


@pytest.mark.parametrize("family, config", RUNS)
def test_each_family_trains_under_each_strategy(family, config, family_runs):
    run = family_runs(family, config)
    summary = run.summary
    assert summary["setup"]["distributed_type"] == DISTRIBUTED_TYPE[config]
    assert summary["setup"]["world_size"] == (1 if config == "cpu.yaml" else 2)
    assert summary["setup"]["global_batch_sequences"] == 8
    assert run.final[0]["model_class"] == MODEL_CLASS[family]
    losses = [row["loss"] for row in summary["losses"]]
    assert sum(losses[-4:]) / 4 < losses[0] - 1.0, losses
    assert summary["eval"][-1]["loss"] < summary["eval"][0]["loss"] - 1.0, summary["eval"]
    # the sample at the end: the prompt continued by 24 tokens (bytes), every rank in the generate
    sample = summary["samples"][-1]
    assert sample["step"] == 24 and sample["text"].startswith(sample["prompt"])
    assert len(sample["text"]) > len(sample["prompt"])


@pytest.mark.parametrize("family, config", RUNS)
def test_each_family_exports_the_trained_model(family, config, family_runs):
    check_export_reproduces_model(family_runs(family, config))


@pytest.mark.parametrize("family", FAMILIES)
def test_fsdp2_shards_by_the_familys_own_block(family, family_runs):
    """Read from the prepared model: one FSDP2 unit per block of the family's class, plus the root."""
    strategy_facts = family_runs(family, "fsdp.yaml").strategy
    assert strategy_facts["engine"] == "fsdp2"
    units = strategy_facts["shard_units"]
    # accelerate also gives the embedding, final norm and LM head units of their own
    assert units[BLOCK[family]] == 2 and units[MODEL_CLASS[family]] == 1, units
    assert all(count == 1 for name, count in units.items() if name != BLOCK[family]), units


@pytest.mark.parametrize("family", FAMILIES)
def test_deepspeed_clips_at_train_pys_max_grad_norm(family, family_runs):
    """DeepSpeed clips inside its step at its config's gradient_clipping ("auto" is 1.0 by
    accelerate): read from the built engine and its ZeRO optimizer, it is --max_grad_norm, 0.5."""
    run = family_runs(family, "deepspeed_zero3_offload.yaml")
    assert run.summary["setup"]["options"]["max_grad_norm"] == 0.5
    for engine in (rank["strategy"] for rank in run.final):
        assert engine["gradient_clipping"] == engine["optimizer_clip_grad"] == 0.5, engine


@pytest.mark.parametrize("family, config", RUNS)
def test_tied_embeddings_stay_tied(family, config, family_runs):
    """GPT-2 ties its LM head to the input embedding: still one parameter after prepare (FSDP2,
    ZeRO-3), and the export stores the table once and reloads tied; the others stay untied."""
    run = family_runs(family, config)
    tied = family == "gpt2"
    assert all(facts["tied_embeddings"] is tied for facts in run.final)
    model = AutoModelForCausalLM.from_pretrained(run.output_dir / "model")
    assert model.config.tie_word_embeddings is tied
    assert (model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()) is tied
    with safe_open(run.output_dir / "model" / "model.safetensors", "pt") as f:
        stored = set(f.keys())
    # one stored tensor per distinct parameter: a tied table once (GPT-2: wte, no lm_head copy)
    assert len(stored) == len(dict(model.named_parameters())), sorted(stored)
    assert (len(dict(model.named_parameters(remove_duplicate=False))) == len(stored) + 1) is tied


def test_a_family_with_a_tensor_parallel_plan_runs_under_tp(family_runs):
    run = family_runs("qwen2", "tp.yaml")
    summary = run.summary
    assert summary["setup"]["tensor_parallel_size"] == 2 and summary["setup"]["data_parallel_size"] == 1
    layout = run.final[0]["tensor_parallel_parameters"]
    q = layout["model.layers.0.self_attn.q_proj.weight"]
    assert q["mesh"] == {"tp": 2} and q["local_shape"][0] * 2 == q["global_shape"][0]
    losses = [row["loss"] for row in summary["losses"]]
    assert sum(losses[-4:]) / 4 < losses[0] - 1.0, losses
    check_export_reproduces_model(run)


# ---- in-process: what reads a model's config, and the refusals that come before any heavy work ----

@pytest.mark.quick
def test_a_family_without_a_tensor_parallel_plan_is_refused(family_models):
    from test_tensor_parallel import stand_in

    cfg = TrainConfig(model_name_or_path=str(family_models["gpt2"]))
    with pytest.raises(ConfigError, match="the GPT2 model declares no tensor-parallel plan"):
        tensor_parallel.check(stand_in(), cfg, AutoConfig.from_pretrained(family_models["gpt2"]), "train.py")
    qwen = TrainConfig(model_name_or_path=str(family_models["qwen2"]))
    tensor_parallel.check(stand_in(), qwen, AutoConfig.from_pretrained(family_models["qwen2"]), "train.py")


@pytest.mark.quick
def test_the_pipeline_recipe_takes_models_with_a_list_of_blocks_and_refuses_others(family_models):
    """GPT-NeoX (embed_in/embed_out, parallel residual, partial rotary) is cut by its own forward as
    Qwen2 is; GPT-2 keeps its blocks in .h and is refused in one line."""
    for family in ("qwen2", "gpt_neox"):
        pipeline.check_pipeline_layout(AutoConfig.from_pretrained(family_models[family]), "pipeline_parallel.py")
        model = AutoModelForCausalLM.from_pretrained(family_models[family])
        pipeline.check_stages(model, [0, 1, 2], "pipeline_parallel.py")  # the stages give its own logits
    with pytest.raises(ConfigError, match=r"^pipeline_parallel.py splits models whose decoder keeps its blocks in one "
                                          r"list, .layers \(.*\); the GPT2 model is laid out otherwise$"):
        pipeline.check_pipeline_layout(AutoConfig.from_pretrained(family_models["gpt2"]), "pipeline_parallel.py")


@pytest.fixture
def fsdp_launch_env(monkeypatch):
    """What `accelerate launch --config_file accelerate_configs/fsdp.yaml` hands each worker."""
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    monkeypatch.setenv("FSDP_AUTO_WRAP_POLICY", "TRANSFORMER_BASED_WRAP")
    monkeypatch.delenv("FSDP_TRANSFORMER_CLS_TO_WRAP", raising=False)
    return monkeypatch


@pytest.mark.quick
@pytest.mark.parametrize("family", FAMILIES)
def test_fsdp_wraps_the_models_own_blocks_unless_told(family, family_models, fsdp_launch_env):
    config = AutoConfig.from_pretrained(family_models[family])
    assert fsdp_settings.plugin(config).transformer_cls_names_to_wrap == [BLOCK[family]]
    fsdp_launch_env.setenv("FSDP_TRANSFORMER_CLS_TO_WRAP", BLOCK[family])  # a name the user wrote, honoured
    assert fsdp_settings.plugin(config).transformer_cls_names_to_wrap == [BLOCK[family]]


@pytest.mark.quick
def test_a_block_class_the_model_lacks_is_one_line_naming_its_classes(family_models, fsdp_launch_env):
    fsdp_launch_env.setenv("FSDP_TRANSFORMER_CLS_TO_WRAP", "LlamaDecoderLayer")
    with pytest.raises(ConfigError) as err:
        fsdp_settings.plugin(AutoConfig.from_pretrained(family_models["gpt2"]))
    message = str(err.value)
    assert "\n" not in message
    assert "names LlamaDecoderLayer, which the GPT2 model does not contain" in message
    assert "GPT2Block" in message and "GPT2Attention" in message


@pytest.mark.quick
def test_a_tokenizer_that_encodes_nothing_is_refused(family_models, byte_tokenizer, tmp_path):
    import shutil

    mismatched = tmp_path / "qwen2_with_byte_tokenizer"
    shutil.copytree(family_models["qwen2"], mismatched)
    for path in byte_tokenizer.iterdir():
        shutil.copy(path, mismatched)
    with pytest.raises(ConfigError, match="encodes text to no tokens; give a working one with "
                                          "--tokenizer_name_or_path"):
        build_tokenizer(TrainConfig(model_name_or_path=str(mismatched)))


@pytest.mark.quick
def test_no_fsdp_config_names_a_model_class():
    root = Path(__file__).resolve().parents[1] / "accelerate_configs"
    for path in root.glob("*.yaml"):
        values = [line for line in path.read_text().splitlines() if not line.lstrip().startswith("#")]
        assert not any("transformer_layer_cls_to_wrap" in line for line in values), path.name


@pytest.mark.quick
def test_flops_read_each_familys_own_names(family_models):
    """GPT-2 by hand: per block c_attn (h x 3h + 3h), attention c_proj (h x h + h), c_fc (h x 4h + 4h),
    MLP c_proj (4h x h + h), two LayerNorms (2h each): 12h^2 + 13h; then ln_f (2h) and the tied
    output projection (V x h). The embedding tables (wte, wpe) are lookups: no FLOPs."""
    h, layers = 64, 2
    gpt2 = AutoConfig.from_pretrained(family_models["gpt2"])
    assert matmul_params(gpt2) == layers * (12 * h * h + 13 * h) + 2 * h + VOCAB * h
    assert dimensions(gpt2) == {"layers": 2, "heads": 4, "head_dim": 16}  # n_layer, n_head; n_embd 64 / 4 heads
    assert flops_per_token(gpt2, 64) == 6 * matmul_params(gpt2) + 12 * 2 * 4 * 16 * 64
    for family in ("qwen2", "gpt_neox"):
        config = AutoConfig.from_pretrained(family_models[family])
        model = AutoModelForCausalLM.from_config(config)
        lookups = model.get_input_embeddings().weight.numel()
        assert matmul_params(config) == sum(p.numel() for p in model.parameters()) - lookups


@pytest.mark.quick
def test_a_config_without_the_needed_names_is_refused_in_one_line():
    class Odd(GPT2Config):
        attribute_map = {}  # n_layer etc. no longer answer to the common names

    with pytest.raises(ConfigError, match="has no num_hidden_layers, hidden_size, num_attention_heads"):
        dimensions(Odd())


@pytest.mark.quick
@pytest.mark.parametrize("family", FAMILIES)
def test_the_memory_planner_reads_each_family(family, family_models):
    from tools.plan import model_shape

    shape = model_shape(model_name_or_path=str(family_models[family]))
    assert shape.layers == 2 and shape.hidden == 64 and shape.heads == 4
    assert shape.tied is (family == "gpt2")
    assert shape.intermediate == (256 if family == "gpt2" else 176)  # GPT-2: n_inner None = 4 x n_embd
