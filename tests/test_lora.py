"""LoRA in train.py (train_extras/lora.py): adapters on a frozen base, with peft.

In this process, on every family of tests/families.py (dense, MoE, hybrids): which layers get
adapters, that the model is exactly the base at step 0, and that the two exports (the adapter
folder peft loads onto the base, the merged model) give the live model's logits."""

from __future__ import annotations

import re

import pytest
import torch
from peft import PeftModel
from torch import nn
from transformers import AutoModelForCausalLM

from common.config import ConfigError
from common.data import build_tokenizer
from conftest import (CORE_DEBUG_ARGS, SYNTHETIC, TWO_RANK_ARGS, Run, check_exact_resume, launch, launch_two_processes,
                      parse_train)
from families import FAMILIES, VOCAB, save_family
from synthetic import CHAT_TEMPLATE, conversations_file
from tools import plan
from train_extras import lora
from train_extras.options import TrainConfig

IDS = torch.tensor([[1, 40, 77, 5, 200, 13, 99, 2, 64, 31, 8, 150]])


def lora_args(*extra: str) -> list[str]:
    return ["--lora_r", "4", *extra]


@pytest.mark.quick
@pytest.mark.parametrize("family", FAMILIES)
def test_adapters_start_as_the_base_and_both_exports_give_the_trained_logits(family, tmp_path):
    base_dir = save_family(family, tmp_path / "base")
    model = AutoModelForCausalLM.from_pretrained(base_dir)
    with torch.no_grad():
        base_logits = model(IDS).logits
    base = {name: p.detach().clone() for name, p in model.named_parameters()}
    cfg = parse_train(lora_args("--lora_dropout", "0.0"))
    facts = lora.apply(model, cfg)

    # What is adapted: every linear layer named by the targets; never the head or an MoE router.
    adapted = {re.sub(r"(\.base_layer)+", "", name.rsplit(".lora_A", 1)[0]) for name, _ in model.named_parameters()
               if ".lora_A." in name}
    assert facts["adapted_layers"] == len(adapted) > 0
    linear = {name for name, m in model.named_modules()
              if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] in facts["target_modules"]}
    assert linear <= adapted, sorted(linear - adapted)[:5]  # no targeted linear layer left out
    assert not any(name.endswith(("lm_head", ".gate", ".router")) for name in adapted), sorted(adapted)
    experts = [name for name, m in model.named_modules() if name.endswith(".experts")]  # fused: adapted too
    assert all(name in adapted for name in experts) and bool(experts) == bool(facts["target_parameters"]), experts
    assert all(not p.requires_grad for name, p in model.named_parameters() if ".lora_" not in name)
    assert facts["trainable_parameters"] == sum(p.numel() for p in model.parameters() if p.requires_grad) > 0

    with torch.no_grad():  # B starts at zero: the base model, exactly
        assert torch.equal(model(IDS).logits, base_logits)
        for name, p in model.named_parameters():
            if ".lora_B." in name:  # as if trained
                p.copy_(torch.randn_like(p) * 0.05)
        trained = model(IDS).logits
    assert not torch.allclose(trained, base_logits)

    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    weights = lora.base_state(state)
    assert all(torch.equal(weights[name], value) for name, value in base.items())  # the base, as loaded
    lora.writer(tmp_path / "merged", build_tokenizer(TrainConfig()))(tmp_path / "adapter", model, state)

    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), tmp_path / "adapter")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    with torch.no_grad():
        assert (reloaded(IDS).logits - trained).abs().max() < 1e-6
        assert (merged(IDS).logits - trained).abs().max() < 1e-5
    assert merged.config.vocab_size == VOCAB and not any(".lora_" in k for k in merged.state_dict())


@pytest.mark.quick
def test_lora_options_are_checked_in_one_line():
    with pytest.raises(ConfigError, match="add --lora_r"):
        parse_train(["--lora_alpha", "16"])
    with pytest.raises(ConfigError, match="--lora_r must be >= 0"):
        parse_train(["--lora_r", "-1"])
    with pytest.raises(ConfigError, match="Muon"):
        parse_train(lora_args("--optimizer", "muon"))
    assert lora.apply(AutoModelForCausalLM.from_config(FAMILIES["qwen3"][1]()), parse_train([])) is None


# ---- launched: one process, and two through each strategy, from the same pretrained folder ----
# One process: global batch 8 as 2 ranks x 4 (TWO_RANK_ARGS)
LORA = ["--lora_r", "4", "--lr", "1e-2", "--save_every", "30", "--sample_length", "8", "--lora_merge", "true"]
LORA_ARGS = {"cpu.yaml": CORE_DEBUG_ARGS + LORA, **{config: TWO_RANK_ARGS + LORA for config in
                                                   ("ddp.yaml", "fsdp.yaml", "deepspeed_zero3_offload.yaml")}}
STRATEGIES = ["ddp.yaml", "fsdp.yaml", "deepspeed_zero3_offload.yaml"]


@pytest.mark.quick
@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe", "falcon_h1"])
def test_the_planner_counts_the_adapters_alone_as_trained(family, tmp_path, capsys):
    """tools.plan --lora_r: the adapters train.py injects, counted on the meta model, are the only
    parameters with gradients and optimizer states under every rung; the base is stored beside them."""
    folder = save_family(family, tmp_path)
    shape = plan.model_shape(None, str(folder), lora_r=4)
    model = AutoModelForCausalLM.from_pretrained(folder)
    facts = lora.apply(model, parse_train(lora_args()))
    adapters = [p.numel() for name, p in model.named_parameters() if ".lora_" in name]
    assert (shape.lora_params, shape.lora_largest) == (facts["trainable_parameters"], max(adapters))
    assert shape.n_params == sum(p.numel() for p in model.parameters()) - shape.lora_params  # the base's count
    P, A = shape.n_params, shape.lora_params
    for rung in plan.LADDER:
        full = plan.model_state_bytes(rung, P, 2, "bf16", shape)
        adapted = plan.model_state_bytes(rung, P, 2, "bf16", shape, lora_params=A, lora_largest=shape.lora_largest)
        for category in ("grads", "optimizer"):  # every gradient, master copy and moment: the adapters' alone
            mine, theirs = (sum(s["at_step"][loc][category] for loc in ("device", "host")) for s in (adapted, full))
            assert mine == pytest.approx(theirs * A / P, rel=1e-12), (rung.name, category)
    single = plan.model_state_bytes(plan.SINGLE, P, 1, "bf16", shape, lora_params=A)["at_step"]["device"]
    assert (single["params"], single["grads"], single["optimizer"]) == (4 * (P + A), 4 * A, 8 * A)
    assert plan.main(["--model_name_or_path", str(folder), "--lora_r", "4", "--seq_len", "64"]) == 0
    out = capsys.readouterr().out
    assert f"--lora_r 4: {A / 1e6:.1f}M adapter parameters" in out
    assert re.search(r"accelerate launch .* recipes/train.py .* --lora_r 4\n", out), out[-600:]


@pytest.mark.quick
def test_the_planner_refuses_lora_without_a_shape(capsys):
    assert plan.main(["--params", "7e9", "--lora_r", "16"]) == 2
    assert capsys.readouterr().err.startswith("error: --lora_r needs a positive rank and the model's shape")


@pytest.fixture(scope="session")
def lora_runs(tmp_path_factory, hf_home, initial_model):
    """config -> the LoRA run of the debug model saved by `initial_model`, launched once, lazily."""
    runs = {}

    def get(config: str) -> Run:
        if config not in runs:
            out = tmp_path_factory.mktemp(f"lora_{config.split('.')[0]}")
            args = LORA_ARGS[config] + ["--model_name_or_path", str(initial_model), "--output_dir", str(out)]
            proc = (launch("train.py", args, hf_home) if config == "cpu.yaml"
                    else launch_two_processes("train.py", config, args, hf_home))
            runs[config] = Run(out, proc)
        return runs[config]
    return get


def base_weights(folder) -> dict:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def check_lora_run(run: Run, initial_model, base_run: Run) -> None:
    from probes.sitecustomize import PROBE_INPUT_IDS

    summary = run.summary
    facts = summary["model"]["lora"]
    assert facts["r"] == 4 and facts["alpha"] == 8 and facts["trainable_parameters"] == 9344
    # step 0: the base model's own held-out loss (adapters start as the identity)
    assert abs(summary["eval"][0]["loss"] - base_run.summary["eval"][0]["loss"]) < 1e-6
    assert summary["eval"][-1]["loss"] < summary["eval"][0]["loss"] - 0.01  # the adapters learned
    trained = torch.tensor(run.final[0]["probe_logits"])
    ids = torch.tensor([PROBE_INPUT_IDS])
    with torch.no_grad():  # the adapter folder on the untouched base, and the merged model, alone
        base = AutoModelForCausalLM.from_pretrained(initial_model)
        adapted = PeftModel.from_pretrained(base, run.output_dir / "model")(ids).logits[0]
        merged = AutoModelForCausalLM.from_pretrained(run.output_dir / "model_merged")(ids).logits[0]
    assert (adapted - trained).abs().max() < 1e-5
    assert (merged - trained).abs().max() < 1e-5


def test_lora_on_one_process_trains_only_adapters_and_exports_both_folders(lora_runs, initial_model,
                                                                            two_process_runs):
    run = lora_runs("cpu.yaml")
    check_lora_run(run, initial_model, two_process_runs("train.py/fsdp.yaml"))
    # the base weights in the last checkpoint are the pretrained ones, bit for bit
    saved, initial = base_weights(run.output_dir / "checkpoints" / "step_60"), base_weights(initial_model)
    base = lora.base_state(saved)
    assert {k for k in base if k != "lm_head.weight"} == {k for k in initial if k != "lm_head.weight"}
    assert all(torch.equal(base[name], initial[name]) for name in initial if name in base)
    assert any(".lora_B." in k and v.abs().max() > 0 for k, v in saved.items())


@pytest.mark.parametrize("config", STRATEGIES)
def test_lora_under_each_strategy_trains_as_one_process(config, lora_runs, initial_model, two_process_runs):
    run, alone = lora_runs(config), lora_runs("cpu.yaml")
    check_lora_run(run, initial_model, two_process_runs("train.py/fsdp.yaml"))
    for mine, reference in zip(run.summary["losses"], alone.summary["losses"]):
        assert mine["step"] == reference["step"] and abs(mine["loss"] - reference["loss"]) < 1e-4, (mine, reference)


def test_a_lora_run_resumes_exactly(tmp_path, hf_home, lora_runs, initial_model):
    full = lora_runs("cpu.yaml")
    args = LORA_ARGS["cpu.yaml"] + ["--model_name_or_path", str(initial_model), "--output_dir", str(tmp_path),
                        "--resume_from_checkpoint", str(full.output_dir / "checkpoints" / "step_30")]
    check_exact_resume(full, Run(tmp_path, launch("train.py", args, hf_home)), 30)


@pytest.fixture(scope="module")
def lora_mixture_runs(tmp_path_factory, hf_home, initial_model):
    """LoRA on a mixture of conversations (assistant-only loss, packed with document masks) and text,
    as 8 x 1 and as 4 x 2 micro-batches: two one-process launches."""
    folder = tmp_path_factory.mktemp("lora_mixture")
    (folder / "template.jinja").write_text(CHAT_TEMPLATE)
    (folder / "mix.yaml").write_text(
        f"sources:\n  - name: chat\n    data_files: [{conversations_file(folder, 300)}]\n    weight: 0.5\n"
        f"  - name: prose\n    data_files: [{SYNTHETIC}]\n    weight: 0.5\n")
    runs = {}
    for micro, accumulation in ((8, 1), (4, 2)):
        out = folder / f"run_{micro}x{accumulation}"
        args = ["--seq_len", "256", "--overlong", "truncate", "--max_steps", "30", "--warmup_steps", "3",
                "--eval_every", "30", "--log_every", "10", "--save_every", "30", "--sample_length", "0",
                "--lora_r", "4", "--lr", "1e-2", "--data_mixture", str(folder / "mix.yaml"),
                "--chat_template", str(folder / "template.jinja"), "--micro_batch_size", str(micro),
                "--gradient_accumulation_steps", str(accumulation), "--model_name_or_path", str(initial_model),
                "--output_dir", str(out)]
        runs[accumulation] = Run(out, launch("train.py", args, hf_home))
    return runs


def test_lora_on_conversations_and_text_with_accumulation_trains_as_one_batch(lora_mixture_runs, initial_model):
    alone, accumulated = lora_mixture_runs[1], lora_mixture_runs[2]
    data = accumulated.summary["data"]
    assert set(data["mixture"]) == {"chat", "prose"} and data["conversations"]["chat"]["kept"] > 0
    assert set(accumulated.summary["eval"][0]["sources"]) == {"chat", "prose"}  # (chat: assistant tokens only)
    assert accumulated.summary["model"]["lora"] == alone.summary["model"]["lora"]
    assert len(accumulated.summary["losses"]) == len(alone.summary["losses"]) == 30
    for mine, reference in zip(accumulated.summary["losses"], alone.summary["losses"]):  # token-normalised
        assert mine["step"] == reference["step"] and abs(mine["loss"] - reference["loss"]) < 1e-5, (mine, reference)
    evals = accumulated.summary["eval"]
    assert evals[-1]["loss"] < evals[0]["loss"] - 0.01 and evals[0] == alone.summary["eval"][0]
    saved = base_weights(accumulated.output_dir / "checkpoints" / "step_30")
    base, initial = lora.base_state(saved), base_weights(initial_model)
    assert all(torch.equal(base[name], initial[name]) for name in initial if name in base)


def test_the_focused_lora_recipe_trains_adapters_and_exports_both_folders(tmp_path, hf_home, initial_model):
    """recipes/lora.py: the baseline plus peft's get_peft_model; its two exports agree."""
    args = CORE_DEBUG_ARGS + ["--lr", "1e-2", "--max_steps", "20", "--eval_every", "20",
                              "--model_name_or_path", str(initial_model), "--output_dir", str(tmp_path)]
    run = Run(tmp_path, launch("lora.py", args, hf_home))
    evals = run.summary["eval"]
    assert evals[-1]["loss"] < evals[0]["loss"] - 0.01
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(initial_model)
        before = base(IDS).logits
        adapted = PeftModel.from_pretrained(base, tmp_path / "adapter")(IDS).logits
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "model")(IDS).logits
    assert (adapted - merged).abs().max() < 1e-5 and (adapted - before).abs().max() > 1e-3
