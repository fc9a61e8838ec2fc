"""Mixture-of-experts models a user brings (Mixtral, Qwen3-MoE, OLMoE: tiny, random init, made
locally with transformers' own config classes), trained by train.py under 1 process, DDP, FSDP2
and ZeRO-3 with offload (2 CPU processes, fp32), with the router's load-balancing loss in the
objective and the experts' load in metrics.jsonl; and the dense families that need eager attention
(Gemma2, BLOOM), which --attn_implementation auto builds as they are.

DeepSeek-V3 (tests/families.py), whose router returns no load-balancing loss and chooses its experts
with a correction bias, is launched under the same four configs from a saved folder whose bias is
non-zero, as a pretrained one's is; Ernie 4.5-MoE, whose bias is a frozen parameter that
from_pretrained makes trainable, shows in-process what DDP does with a parameter without a gradient.

Each (family, config) is launched once; the tests read its record and its export."""

import contextlib
import json
from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from safetensors import safe_open
from transformers import (AutoConfig, AutoModelForCausalLM, BloomConfig, ByT5Tokenizer, Ernie4_5_MoeConfig,
                          Gemma2Config, MixtralConfig, OlmoeConfig, Qwen3MoeConfig)

import families
from common import data
from common.config import ConfigError
from common.export import export_pretrained
from conftest import (SYNTHETIC, TWO_CPU_PROCESSES, TWO_PROCESS_LAUNCH, Run, check_export_reproduces_model, launch,
                      load_recipe)
from test_seams_moe import expert_counts, load_of
from train_extras import moe
from train_extras.data import assemble
from train_extras.observe.flops import meta_model
from train_extras.options import TrainConfig
from train_extras.parallel.pipeline import check_micro_batches, check_pipeline_layout

VOCAB = 259  # the byte-level tokenizer
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256, tie_word_embeddings=False)
FAMILIES = {
    "mixtral": lambda: MixtralConfig(intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, **SHAPE),
    "qwen3_moe": lambda: Qwen3MoeConfig(intermediate_size=64, moe_intermediate_size=32, num_experts=4,
                                        num_experts_per_tok=2, **SHAPE),
    "olmoe": lambda: OlmoeConfig(intermediate_size=64, num_experts=4, num_experts_per_tok=2, pad_token_id=0,
                                 bos_token_id=1, eos_token_id=1, **SHAPE),
}
EAGER_ONLY = {  # families without an SDPA path in transformers: auto must pick eager for them
    "gemma2": lambda: Gemma2Config(intermediate_size=128, head_dim=16, **SHAPE),
    "bloom": lambda: BloomConfig(vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4),
}
MODEL_CLASS = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM",
               "gemma2": "Gemma2ForCausalLM", "bloom": "BloomForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}
# A pretrained DeepSeek-V3's correction bias is far from its initial zeros (DeepSeek's update rule moved
# it in pre-training); the saved tiny model's gets distinct values, so a bias lost, reset or trained shows.
AUX_FREE, BIAS_NAME = "deepseek_v3", "model.layers.1.mlp.gate.e_score_correction_bias"
CORRECTION_BIAS = torch.tensor([-0.05, -0.02, 0.01, 0.04]).tolist()  # as float32 holds them
CONFIGS = ["cpu.yaml", "ddp.yaml", "fsdp.yaml", "deepspeed_zero3_offload.yaml"]
# Global batch 8 everywhere (1 x 8, 2 x 4): the 2-process runs must match the 1-process one.
ARGS = ["--data_files", SYNTHETIC, "--seq_len", "64", "--max_steps", "12", "--warmup_steps", "2",
        "--eval_every", "12", "--log_every", "1", "--sample_length", "8"]
# fp32 sums in another order (and DeepSpeedCPUAdam, another AdamW) as tests/test_distributed.py's
# PARITY, at its looser 1e-4: the router's softmax and top-k carry the differences on (Mixtral under
# DDP and FSDP2: 1e-6 at step 4, 1.1e-5 at step 5).
PARITY = {"ddp.yaml": 1e-4, "fsdp.yaml": 1e-4, "deepspeed_zero3_offload.yaml": 1e-4}


@pytest.fixture(scope="session")
def moe_models(tmp_path_factory):
    """Each family as a saved Hugging Face folder (random init, seed 0), and the byte tokenizer."""
    folders = {}
    for name, make in {**FAMILIES, **EAGER_ONLY, AUX_FREE: lambda: families.make_config(AUX_FREE)}.items():
        folder = tmp_path_factory.mktemp(f"moe_{name}")
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(make())
        if name == AUX_FREE:
            model.get_buffer(BIAS_NAME).copy_(torch.tensor(CORRECTION_BIAS))
        model.save_pretrained(folder)
        folders[name] = folder
    folders["tokenizer"] = tmp_path_factory.mktemp("moe_byte_tokenizer")
    data.build_tokenizer(TrainConfig()).save_pretrained(folders["tokenizer"])
    return folders


@pytest.fixture(scope="session")
def moe_runs(tmp_path_factory, hf_home, moe_models):
    runs = {}

    def get(family: str, config: str, *extra: str) -> Run:
        key = (family, config, extra)
        if key not in runs:
            out = tmp_path_factory.mktemp(f"moe_{family}__{config}")
            args = ARGS + ["--model_name_or_path", str(moe_models[family]),
                           "--tokenizer_name_or_path", str(moe_models["tokenizer"]), "--output_dir", str(out), *extra]
            if config == "cpu.yaml":
                proc = launch("train.py", args + ["--micro_batch_size", "8"], hf_home)
            else:
                proc = launch("train.py", args + ["--micro_batch_size", "4"], hf_home, config=config,
                              launch_args=TWO_PROCESS_LAUNCH, env=TWO_CPU_PROCESSES[config])
            runs[key] = Run(out, proc)
        return runs[key]

    return get


def metrics_lines(run: Run, kind: str) -> list[dict]:
    lines = [json.loads(line) for line in (run.output_dir / "metrics.jsonl").read_text().splitlines()]
    return [line for line in lines if line["kind"] == kind]


RUNS = [(family, config) for family in FAMILIES for config in CONFIGS]


@pytest.mark.parametrize("family, config", RUNS)
def test_each_moe_family_trains_under_each_strategy(family, config, moe_runs):
    run = moe_runs(family, config)
    summary = run.summary
    assert summary["setup"]["world_size"] == (1 if config == "cpu.yaml" else 2)
    assert summary["setup"]["global_batch_sequences"] == 8
    assert run.final[0]["model_class"] == MODEL_CLASS[family]
    model = summary["model"]  # per token: the non-expert weights and 2 of the 4 experts (test_moe_flops.py)
    assert model["parameters"] > model["active_parameters"] > model["parameters"] / 2, model
    losses = [row["loss"] for row in summary["losses"]]
    assert sum(losses[-3:]) / 3 < losses[0] - 1.0, losses
    assert summary["eval"][-1]["loss"] < summary["eval"][0]["loss"] - 1.0, summary["eval"]
    # the router's loss, per step, apart from the language-model loss; the experts' load per interval
    train_lines = metrics_lines(run, "train")
    assert len(train_lines) == 12 and all(0.5 < line["aux_loss"] < 4.0 for line in train_lines), train_lines
    intervals = metrics_lines(run, "interval")
    assert [line["step"] for line in intervals] == list(range(1, 13))
    for line in intervals:
        load = line["expert_load"]
        assert len(load["cv"]) == 2  # one entry per MoE layer
        assert all(0 <= low <= 0.25 <= high <= 1 for low, high in zip(load["min_share"], load["max_share"])), load
        assert all(cv >= 0 for cv in load["cv"]) and any(cv > 0 for cv in load["cv"])
    assert summary["throughput"][-1]["expert_load"] == intervals[-1]["expert_load"]
    if config != "cpu.yaml":  # the same global batch as 1 process: the same steps
        reference = [row["loss"] for row in moe_runs(family, "cpu.yaml").summary["losses"][:5]]
        assert losses[:5] == pytest.approx(reference, abs=PARITY[config], rel=0)


@pytest.fixture(scope="module")
def packed_train_set(moe_models, tmp_path_factory):
    """The training blocks (with their restarting position ids) the runs drew their micro-batches from."""
    import datasets

    cfg = TrainConfig(data_files=[SYNTHETIC], seq_len=64, tokenizer_name_or_path=str(moe_models["tokenizer"]))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path_factory.mktemp("moe_datasets"))
        return assemble.build(cfg, data.build_tokenizer(cfg)).train


@pytest.mark.parametrize("family, config", [run for run in RUNS if run[1] != "cpu.yaml"])
def test_a_steps_router_loss_and_expert_load_are_every_ranks(family, config, moe_runs, moe_models, packed_train_set):
    """Step 1 on 2 ranks, from the initial weights and each rank's own micro-batch (its sample ids, as
    the probes recorded them): the logged aux_loss is the mean of the 2 ranks' load-balancing losses,
    and the first interval's expert load (--log_every 1: step 1 alone) that of both ranks' routing
    slots summed, which the test finds far from rank 0's alone."""
    run = moe_runs(family, config)
    model = AutoModelForCausalLM.from_pretrained(moe_models[family])
    auxes, counts = [], []
    with torch.no_grad():
        for rank_batches in run.batches:
            rows = [packed_train_set[i] for i in rank_batches[0]]
            out = model(input_ids=torch.stack([r["input_ids"] for r in rows]),
                        position_ids=torch.stack([r["position_ids"] for r in rows]), output_router_logits=True)
            auxes.append(out.aux_loss.item())
            counts.append(expert_counts(out.router_logits))
    assert len(auxes) == 2
    assert metrics_lines(run, "train")[0]["aux_loss"] == pytest.approx(sum(auxes) / 2, rel=1e-6)
    logged, expected = metrics_lines(run, "interval")[0]["expert_load"], load_of(sum(counts))
    for key, values in expected.items():
        assert logged[key] == pytest.approx(values, abs=1e-6), (key, logged, expected)
    rank0 = load_of(counts[0])
    assert max(abs(a - b) for key in rank0 for a, b in zip(rank0[key], expected[key])) > 1e-3


@pytest.mark.parametrize("family, config", RUNS)
def test_each_moe_family_exports_the_trained_model(family, config, moe_runs):
    # The byte tokenizer is read back by its own class: AutoTokenizer takes the class of the folder's
    # model type over the one tokenizer_config.json names (Mixtral's: Llama's, which needs sentencepiece).
    check_export_reproduces_model(moe_runs(family, config), load_tokenizer=ByT5Tokenizer.from_pretrained)


def test_the_logged_router_loss_is_the_familys_own_on_the_same_batch(moe_runs, moe_models):
    """Step 1's aux_loss (1 process, no accumulation) is the family's own load-balancing loss of the
    initial weights on the first batch, rebuilt here from the same data options."""
    run = moe_runs("mixtral", "cpu.yaml")
    cfg = TrainConfig(model_name_or_path=str(moe_models["mixtral"]), data_files=[SYNTHETIC], seq_len=64,
                      tokenizer_name_or_path=str(moe_models["tokenizer"]), micro_batch_size=8, max_steps=12,
                      warmup_steps=2)
    train_set, eval_set = data.build_datasets(cfg, data.build_tokenizer(cfg))
    batch = next(iter(data.build_loaders(cfg, train_set, eval_set, pin_memory=False)[0]))
    model = AutoModelForCausalLM.from_pretrained(moe_models["mixtral"])
    with torch.no_grad():
        out = model(input_ids=batch["input_ids"], output_router_logits=True)
    first = metrics_lines(run, "train")[0]
    assert first["aux_loss"] == pytest.approx(out.aux_loss.item(), rel=1e-6)
    lm_loss = torch.nn.functional.cross_entropy(out.logits.reshape(-1, VOCAB), batch["labels"].reshape(-1))
    assert first["loss"] == pytest.approx(lm_loss.item(), rel=1e-6)  # the language-model loss alone


@pytest.mark.parametrize("family", EAGER_ONLY)
def test_a_family_without_sdpa_trains_with_no_attention_option(family, moe_runs):
    # BLOOM's ALiBi takes no position ids: packed documents cannot be kept apart, which train.py
    # refuses with the document mask on (tests/test_documents.py); it trains with it off
    run = moe_runs(family, "cpu.yaml", *(("--document_mask", "false") if family == "bloom" else ()))
    assert run.final[0]["model_class"] == MODEL_CLASS[family]
    assert "attention        : eager (auto)" in run.proc.stdout
    losses = [row["loss"] for row in run.summary["losses"]]
    assert sum(losses[-3:]) / 3 < losses[0] - 1.0, losses
    assert run.summary["model"]["active_parameters"] == run.summary["model"]["parameters"]
    assert "aux_loss" not in metrics_lines(run, "train")[0]  # dense: no router loss, no expert load
    assert "expert_load" not in metrics_lines(run, "interval")[0]


@pytest.mark.parametrize("config", CONFIGS)
def test_an_aux_loss_free_router_trains_under_each_strategy(config, moe_runs, moe_models):
    """DeepSeek-V3 from a saved folder: no load-balancing loss (the objective is the language-model loss
    alone, no aux_loss logged), the experts' load still recorded, the loss down, the 2-process runs
    on the 1-process losses; every rank routes with the loaded correction bias to the end (FSDP2's
    rank-0 loading and ZeRO-3's partitioned load included), and the export reloads with no key
    missing or unexpected, the trained logits and that same bias."""
    run = moe_runs(AUX_FREE, config)
    summary = run.summary
    assert "Traceback" not in run.proc.stderr, run.proc.stderr[-3000:]
    assert summary["setup"]["world_size"] == (1 if config == "cpu.yaml" else 2)
    assert run.final[0]["model_class"] == MODEL_CLASS[AUX_FREE]
    assert ("experts          : 4, top-2 per token; no router loss (aux-loss-free routing); "
            "e_score_correction_bias kept as loaded, not trained") in run.proc.stdout
    # the default document mask: MLA keeps packed documents apart by their position ids, and says so
    assert summary["setup"]["documents"] == {"mode": "position_ids", "why": None}
    assert "documents        : kept apart (position ids)\n" in run.proc.stdout
    model = summary["model"]
    assert model["router"] == {"experts": 4, "top_k": 2, "loss": False, "coef": 0.0,
                               "fixed": ["e_score_correction_bias"]}
    assert model["frozen"] == []  # a buffer: nothing to freeze
    assert model["ddp_unused_parameters"] == ([] if config == "ddp.yaml" else None)  # the probe ran, found none
    losses = [row["loss"] for row in summary["losses"]]
    assert sum(losses[-3:]) / 3 < losses[0] - 1.0, losses
    assert summary["eval"][-1]["loss"] < summary["eval"][0]["loss"] - 1.0, summary["eval"]
    train_lines = metrics_lines(run, "train")
    assert len(train_lines) == 12 and not any("aux_loss" in line for line in train_lines)
    assert all(len(line["expert_load"]["cv"]) == 1 for line in metrics_lines(run, "interval"))  # 1 sparse layer
    if config != "cpu.yaml":
        reference = [row["loss"] for row in moe_runs(AUX_FREE, "cpu.yaml").summary["losses"][:5]]
        assert losses[:5] == pytest.approx(reference, abs=PARITY[config], rel=0)
    assert [rank["correction_biases"] for rank in run.final] == [{BIAS_NAME: CORRECTION_BIAS}] * len(run.final)
    check_export_reproduces_model(run, load_tokenizer=ByT5Tokenizer.from_pretrained)
    exported, loading = AutoModelForCausalLM.from_pretrained(run.output_dir / "model", output_loading_info=True)
    assert not any(loading.values()), loading  # missing, unexpected, mismatched keys, errors
    assert exported.get_buffer(BIAS_NAME).tolist() == CORRECTION_BIAS


@pytest.mark.quick
def test_the_router_loss_is_read_from_the_family_and_its_option_refused_without_one():
    """Whether a family's forward returns a load-balancing loss, as train.py reads it before the
    model is built, against the forward itself, for every MoE family here and in tests/families.py;
    --router_aux_loss_coef (0 included) for a family without one is one line."""
    configs = {**{name: make() for name, make in FAMILIES.items()},
               **{name: families.make_config(name) for name in families.FAMILIES}}
    ids = torch.randint(3, VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))
    without = []
    for name, config in configs.items():
        route = moe.routing(config)
        if route is None:
            continue
        torch.manual_seed(0)
        with torch.no_grad():
            out = AutoModelForCausalLM.from_config(config)(input_ids=ids, output_router_logits=True)
        assert route["loss"] is (out.aux_loss is not None), name
        if not route["loss"]:
            without.append(name)
            assert route["coef"] == 0.0 and route["fixed"] == ["e_score_correction_bias"], route
            for coef in (0.0, 0.01):
                with pytest.raises(ConfigError) as err:
                    moe.route_for(TrainConfig(router_aux_loss_coef=coef), config)
                family = type(config).__name__.replace("Config", "")
                assert str(err.value) == (f"--router_aux_loss_coef: the {family} model's router has no load-balancing "
                                          "loss (it balances by a correction bias, e_score_correction_bias, which "
                                          "transformers does not update); leave the option out")
            assert moe.route_for(TrainConfig(), config) == route  # the default just trains
    assert sorted(without) == ["deepseek_v3", "glm4_moe"]


@pytest.mark.quick
def test_a_bf16_export_keeps_the_router_in_fp32_as_the_family_does(moe_models, tmp_path):
    """DeepSeek-V3 keeps its router's weight and correction bias in fp32 whatever the dtype it is loaded
    in (_keep_in_fp32_modules_strict); a bf16 export rounding them would change the routing it reloads
    with (the bias 0.01 becomes 0.010009765625). They are written fp32, the rest bf16."""
    model = AutoModelForCausalLM.from_pretrained(moe_models[AUX_FREE])
    tokenizer = data.build_tokenizer(TrainConfig())
    export_pretrained(Accelerator(cpu=True), model, tokenizer, tmp_path / "model", dtype=torch.bfloat16)
    with safe_open(tmp_path / "model" / "model.safetensors", "pt") as f:
        dtypes = {name: f.get_slice(name).get_dtype() for name in f.keys()}
    fp32 = sorted(name for name, dtype in dtypes.items() if dtype == "F32")
    assert fp32 == [BIAS_NAME, "model.layers.1.mlp.gate.weight"], fp32
    assert {dtype for name, dtype in dtypes.items() if name not in fp32} == {"BF16"}
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    assert reloaded.get_buffer(BIAS_NAME).tolist() == CORRECTION_BIAS
    assert torch.equal(reloaded.get_parameter("model.layers.1.mlp.gate.weight"),
                       model.get_parameter("model.layers.1.mlp.gate.weight"))


ERNIE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, moe_intermediate_size=32, moe_k=2, moe_num_experts=4,
             moe_num_shared_experts=1, tie_word_embeddings=False)
ERNIE_BIAS = "model.layers.1.mlp.gate.moe_statics.e_score_correction_bias"


@contextlib.contextmanager
def one_rank_group():
    """A gloo process group of this process alone: DDP's reducer behaves as on N ranks."""
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.quick
def test_what_the_family_builds_frozen_stays_frozen_and_ddp_is_told_of_parameters_without_gradient(tmp_path):
    """Ernie 4.5-MoE builds its router's correction bias as a parameter with requires_grad=False, and
    from_pretrained makes it trainable; it only shifts the top-k choice, so it gets no gradient, and
    DDP stops at the second step with torch's reduction error. train.py freezes it again (the rule
    read on the meta-device model), after which the start-up probe finds nothing and DDP is left as
    it is; left trainable, the probe names it and DDP looks for unused parameters, and trains."""
    from train_extras.parallel import ddp_settings

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(Ernie4_5_MoeConfig(**ERNIE)).save_pretrained(tmp_path)
    meta = meta_model(AutoConfig.from_pretrained(tmp_path))
    route = moe.routing(meta.config, meta)
    assert route["loss"] and route["fixed"] == ["e_score_correction_bias"]
    assert moe.declared_frozen(meta) == {ERNIE_BIAS}
    train = load_recipe("train")

    def objective(model, ids, labels):  # train.py's, as its probe runs it
        loss, aux, _ = train.micro_batch_losses(model, {"input_ids": ids, "labels": labels}, route, None)
        return loss + aux

    def two_steps(model):
        for step in range(2):
            ids = torch.randint(3, VOCAB, (2, 17), generator=torch.Generator().manual_seed(step))
            objective(model, ids[:, :-1], ids[:, 1:]).backward()

    def ddp_launch():
        return SimpleNamespace(distributed_type=DistributedType.MULTI_CPU, device=torch.device("cpu"), ddp_handler=None)

    with one_rank_group():
        thawed = AutoModelForCausalLM.from_pretrained(tmp_path)
        assert thawed.get_parameter(ERNIE_BIAS).requires_grad  # transformers' loading
        with pytest.raises(RuntimeError, match="Expected to have finished reduction in the prior iteration"):
            two_steps(torch.nn.parallel.DistributedDataParallel(thawed))
        thawed, launch_state = AutoModelForCausalLM.from_pretrained(tmp_path), ddp_launch()
        assert ddp_settings.find_unused(thawed, launch_state, objective, VOCAB) == [ERNIE_BIAS]
        assert launch_state.ddp_handler.to_kwargs() == {"find_unused_parameters": True}
        two_steps(torch.nn.parallel.DistributedDataParallel(thawed, **launch_state.ddp_handler.to_kwargs()))

        model, launch_state = AutoModelForCausalLM.from_pretrained(tmp_path), ddp_launch()
        assert moe.keep_frozen(model, moe.declared_frozen(meta)) == [ERNIE_BIAS]
        assert ddp_settings.find_unused(model, launch_state, objective, VOCAB) == []
        assert launch_state.ddp_handler is None
        two_steps(torch.nn.parallel.DistributedDataParallel(model))
    assert ddp_settings.describe([ERNIE_BIAS, ERNIE_BIAS.replace(".1.", ".3.")]) == (
        "find_unused_parameters on: no gradient in the start-up probe for "
        "model.layers.*.mlp.gate.moe_statics.e_score_correction_bias (2)")


@pytest.mark.quick
def test_the_router_option_is_refused_for_a_dense_model(moe_models):
    cfg = TrainConfig(router_aux_loss_coef=0.01)
    dense = AutoConfig.from_pretrained(moe_models["gemma2"])
    with pytest.raises(ConfigError, match="--router_aux_loss_coef: the Gemma2 model has no router"):
        moe.route_for(cfg, dense)
    with pytest.raises(ConfigError, match="--router_aux_loss_coef must be >= 0"):
        TrainConfig(router_aux_loss_coef=-1.0)
    mixtral = AutoConfig.from_pretrained(moe_models["mixtral"])
    assert moe.route_for(TrainConfig(), mixtral) == {"experts": 4, "top_k": 2, "loss": True, "coef": 0.001, "fixed": []}
    assert moe.route_for(cfg, mixtral)["coef"] == 0.01


@pytest.mark.quick
def test_the_pipeline_refuses_moe_and_too_few_micro_batches(moe_models):
    for family in FAMILIES:
        with pytest.raises(ConfigError, match="is a mixture of experts"):
            check_pipeline_layout(AutoConfig.from_pretrained(moe_models[family]), "pipeline_parallel.py")
    with pytest.raises(ConfigError, match=r"^pipeline_parallel.py: 2 stages need at least 2 micro-batches per step; "
                                          r"got --gradient_accumulation_steps 1: raise it to 2 or more$"):
        check_micro_batches(1, 2, "pipeline_parallel.py")
    check_micro_batches(2, 2, "pipeline_parallel.py")


@pytest.mark.quick
def test_expert_load_statistics():
    slots = torch.tensor([[2.0, 2.0, 2.0, 2.0], [8.0, 0.0, 0.0, 0.0]])  # uniform, and all on one expert
    stats = moe.load_stats(slots)
    assert stats["cv"] == pytest.approx([0.0, 3 ** 0.5]) and stats["max_share"] == [0.25, 1.0]
    assert stats["min_share"] == [0.25, 0.0]


MOE_LORA = ("--lora_r", "4", "--lr", "1e-2", "--lora_merge", "true")


@pytest.mark.parametrize("config", CONFIGS)
def test_lora_on_an_moe_adapts_attention_and_experts_under_each_strategy(config, moe_runs, moe_models):
    """LoRA on Qwen3-MoE (train_extras/lora.py): the attention projections and the fused experts
    (peft's mapping of gate/up/down_proj) get adapters, the router none; the 2-process runs train as
    one process; both exports give the trained logits."""
    from peft import PeftModel

    from probes.sitecustomize import PROBE_INPUT_IDS

    run, alone = moe_runs("qwen3_moe", config, *MOE_LORA), moe_runs("qwen3_moe", "cpu.yaml", *MOE_LORA)
    lora = run.summary["model"]["lora"]
    assert lora["target_modules"] == ["k_proj", "o_proj", "q_proj", "v_proj"]
    assert lora["target_parameters"] == ["experts.down_proj", "experts.gate_up_proj"]
    assert run.summary["eval"][-1]["loss"] < run.summary["eval"][0]["loss"] - 0.01
    for mine, reference in zip(run.summary["losses"], alone.summary["losses"]):
        assert abs(mine["loss"] - reference["loss"]) < PARITY.get(config, 0.0) + 1e-12, (mine, reference)
    trained, ids = torch.tensor(run.final[0]["probe_logits"]), torch.tensor([PROBE_INPUT_IDS])
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(moe_models["qwen3_moe"])
        adapted = PeftModel.from_pretrained(base, run.output_dir / "model")(ids).logits[0]
        merged = AutoModelForCausalLM.from_pretrained(run.output_dir / "model_merged")(ids).logits[0]
    assert (adapted - trained).abs().max() < 1e-5 and (merged - trained).abs().max() < 1e-5
