"""--optimizer muon (train_extras/muon.py) and --loss_chunk_size (train_extras/chunked_loss.py).

In-process: which parameters Muon takes on four model families, one optimizer step against
torch's Muon and AdamW applied by hand, the checkpoint state, the chunked loss's value and
gradients against the plain loss, and its refusal of a model that changes its logits after the head.
Launched (~1.5 min): a Muon run and its exact resume (an AdamW run refuses its checkpoint), the
same run on 2 DDP ranks with the chunked loss, and the one-line refusals under FSDP2 and ZeRO.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from accelerate import Accelerator
from torch.utils._python_dispatch import TorchDispatchMode
from conftest import DEBUG_ARGS, launch, launch_two_processes, parse_train, read_summary
from transformers import (AutoModelForCausalLM, Gemma2Config, GPT2Config, LlamaConfig, MixtralConfig,
                          Qwen2Config)

from common import model as modeling
from common.config import ConfigError
from train_extras import chunked_loss, muon
from train_extras.resume import checkpoint

SMALL = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)
FAMILIES = {
    "llama": LlamaConfig(**SMALL),
    "qwen2_tied": Qwen2Config(**SMALL, tie_word_embeddings=True),
    "gpt2": GPT2Config(vocab_size=300, n_embd=32, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0),
    "mixtral": MixtralConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2),
}


def build(family: str):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(FAMILIES[family]).eval()  # eval: GPT-2's dropout off


def fake_grads(model, seed: int):
    generator = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=generator)


@pytest.mark.quick
@pytest.mark.parametrize("family", FAMILIES)
def test_muon_takes_the_hidden_matrices_only(family):
    model = build(family)
    hidden = {id(p) for p in muon.hidden_matrices(model)}
    names = {name for name, p in model.named_parameters() if id(p) in hidden}
    assert names and all(p.ndim == 2 for p in muon.hidden_matrices(model))
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    assert not hidden & embeddings and id(model.get_output_embeddings().weight) not in hidden
    assert not any("norm" in n or "ln_" in n or n.endswith("bias") for n in names), names
    if family == "mixtral":  # the experts are one 3-D tensor per layer: AdamW's; the router is a matrix
        assert any("gate" in n for n in names)
        assert all(p.ndim == 3 for n, p in model.named_parameters() if "experts" in n)
        assert not any("experts" in n for n in names)


@pytest.mark.quick
@pytest.mark.parametrize("family", ["llama", "qwen2_tied"])
def test_one_step_equals_torch_muon_and_adamw_by_hand(family):
    cfg = parse_train(["--optimizer", "muon", "--muon_lr", "0.05", "--muon_weight_decay", "0.01",
                       "--muon_momentum", "0.9", "--lr", "3e-3"])
    ours, by_hand = build(family), build(family)
    optimizer = muon.build_optimizer(ours, cfg, torch.device("cpu"))
    hidden = muon.hidden_matrices(by_hand)
    torch_muon = torch.optim.Muon(hidden, lr=0.05, weight_decay=0.01, momentum=0.9, adjust_lr_fn="original")
    chosen = {id(p) for p in hidden}
    adamw = modeling.build_optimizer(by_hand, cfg, torch.device("cpu"),
                                     params=[p for p in by_hand.parameters() if id(p) not in chosen])
    for seed in (1, 2):  # two steps: the second uses the momentum and Adam's states
        fake_grads(ours, seed), fake_grads(by_hand, seed)
        optimizer.step(), torch_muon.step(), adamw.step()
    for (name, a), b in zip(ours.named_parameters(), by_hand.parameters(), strict=True):
        assert torch.equal(a, b), name
    moved = [name for (name, a), b in zip(ours.named_parameters(), build(family).parameters()) if not torch.equal(a, b)]
    assert len(moved) == len(list(ours.parameters()))
    # The logged lr is --lr's: AdamW's groups come first; Muon's groups keep their own peak.
    assert optimizer.param_groups[0]["lr"] == 3e-3 and muon.peak_lrs(optimizer, cfg)[-1] == 0.05


@pytest.mark.quick
def test_state_dict_round_trip_and_refusal_of_an_adamw_state():
    cfg = parse_train(["--optimizer", "muon"])
    model = build("llama")
    optimizer = muon.build_optimizer(model, cfg, torch.device("cpu"))
    fake_grads(model, 1)
    optimizer.step()
    saved = copy.deepcopy(optimizer.state_dict())
    assert set(saved) == {"adamw", "muon"}
    assert len(optimizer.state) == len(list(model.parameters()))  # both optimizers' states, read through
    fresh = muon.build_optimizer(build("llama"), cfg, torch.device("cpu"))
    fresh.load_state_dict(saved)
    for a, b in zip(fresh.state.values(), optimizer.state.values(), strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert optimizer.state_dict().keys() == saved.keys()  # reading the state created nothing in it
    # load_state_dict replaces the inner groups' dicts: the wrapper must show the new ones
    assert fresh.param_groups[0] is fresh.parts[0].param_groups[0]
    plain = modeling.build_optimizer(build("llama"), cfg, torch.device("cpu"))
    with pytest.raises(ConfigError, match="not Muon"):
        fresh.load_state_dict(plain.state_dict())


@pytest.mark.quick
def test_muon_options_are_checked():
    with pytest.raises(ConfigError, match="add --optimizer muon"):
        parse_train(["--muon_lr", "0.01"])
    with pytest.raises(ConfigError, match="muon_momentum"):
        parse_train(["--optimizer", "muon", "--muon_momentum", "1.0"])
    with pytest.raises(ConfigError, match="loss_chunk_size"):
        parse_train(["--loss_chunk_size", "-1"])


# ---- the chunked loss ----

@pytest.mark.quick
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("chunk", [7, 64, 1000])  # a ragged last chunk, several, one chunk for all
def test_chunked_loss_equals_the_plain_loss(family, chunk):
    """Value and every parameter's gradient within 1e-6 in fp32 (mean over target tokens)."""
    model = build(family)
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 300, (3, 41), generator=generator)
    labels = ids[:, 1:].clone()
    labels[0, :9] = -100  # ignored targets count nowhere
    plain = modeling.causal_lm_loss(model, ids[:, :-1], labels, "mean")
    plain.backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    head = chunked_loss.install(model, chunk)
    chunked = chunked_loss.causal_lm_loss(model, head, ids[:, :-1], labels, "mean")
    chunked.backward()
    assert abs(plain.item() - chunked.item()) <= 1e-6
    for (name, p), grad in zip(model.named_parameters(), expected, strict=True):
        assert (p.grad - grad).abs().max().item() <= 1e-6, name
    # outside a loss call the head is the plain head (sampling, export, evaluation)
    with torch.no_grad():
        assert model(input_ids=ids).logits.shape == (3, 41, 300)


class WidestLogits(TorchDispatchMode):
    """The most rows of any tensor computed whose last dimension is the vocabulary's (logits)."""
    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.rows = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view:  # (the head's weight transposed is no logits)
            return out
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(tensor, torch.Tensor) and tensor.dim() >= 2 and tensor.shape[-1] == self.vocab:
                self.rows = max(self.rows, tensor.numel() // self.vocab)
        return out


@pytest.mark.quick
@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_evaluation_takes_the_chunked_loss_and_never_holds_a_whole_batch_of_logits(family):
    """--loss_chunk_size also bounds the held-out loss's logits (train.py passes loss_of(head) to the
    evaluation): the same loss, and no tensor of more than one chunk's rows of vocabulary width."""
    model = build(family)
    generator = torch.Generator().manual_seed(5)
    batches = []
    for i in range(3):
        ids = torch.randint(0, 300, (2, 33), generator=generator)
        labels = ids[:, 1:].clone()
        labels[:, :4] = -100
        batches.append({"input_ids": ids[:, :-1], "labels": labels, "index": torch.tensor([2 * i, 2 * i + 1])})
    accelerator = Accelerator(cpu=True)
    with WidestLogits(300) as plain_width:
        plain = modeling.evaluate(model, batches, accelerator)
    head = chunked_loss.install(model, 16)
    with WidestLogits(300) as chunked_width:
        chunked = modeling.evaluate(model, batches, accelerator, loss=chunked_loss.loss_of(head))
    assert chunked["tokens"] == plain["tokens"] == 3 * 2 * 28
    assert abs(chunked["loss"] - plain["loss"]) <= 1e-6
    assert plain_width.rows == 2 * 32 and chunked_width.rows == 16  # a batch's logits; one chunk's
    assert chunked_loss.loss_of(None) is modeling.causal_lm_loss


@pytest.mark.quick
def test_chunked_loss_refuses_a_model_that_changes_its_logits_after_the_head():
    accelerator = Accelerator(cpu=True)
    for family, refused in (("llama", False), ("gemma2_softcap", True)):
        config = FAMILIES.get(family) or Gemma2Config(**SMALL, head_dim=8, final_logit_softcapping=30.0)
        model = AutoModelForCausalLM.from_config(config)
        head = chunked_loss.install(model, 5)
        if refused:
            with pytest.raises(ConfigError, match="changes its logits after the output head"):
                chunked_loss.check_plain_head(model, head, accelerator, 300)
        else:
            chunked_loss.check_plain_head(model, head, accelerator, 300)


# ---- launched ----

MUON_ARGS = [*DEBUG_ARGS, "--optimizer", "muon", "--max_steps", "8", "--warmup_steps", "2", "--eval_every", "4",
             "--log_every", "1", "--sample_length", "0"]


def step_losses(output_dir) -> dict[int, float]:
    rows = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["loss"] for row in rows if row["kind"] == "train"}


@pytest.fixture(scope="module")
def muon_run(tmp_path_factory, hf_home):
    out = tmp_path_factory.mktemp("muon") / "run"
    launch("train.py", [*MUON_ARGS, "--save_every", "4", "--output_dir", str(out)], hf_home)
    return out


def test_muon_trains_and_resumes_exactly(muon_run, tmp_path, hf_home):
    summary = read_summary(muon_run)
    assert summary["setup"]["options"]["optimizer"] == "muon"
    losses = step_losses(muon_run)
    assert losses[8] < losses[1] - 1.0  # it trains (debug preset, 8 steps: 5.7 -> ~3.9)
    resumed = tmp_path / "resumed"
    launch("train.py", [*MUON_ARGS, "--output_dir", str(resumed), "--resume_from_checkpoint",
                        str(muon_run / "checkpoints" / "step_4")], hf_home)
    again = step_losses(resumed)
    assert sorted(again) == [5, 6, 7, 8] and all(again[s] == losses[s] for s in again)  # bitwise
    assert read_summary(resumed)["eval"][-1] == summary["eval"][-1]
    # a checkpoint of Muon is not resumed by AdamW (nor the reverse): refused before any heavy work
    saved = muon_run / "checkpoints" / "step_4"
    meta = json.loads((saved / "checkpoint.json").read_text())
    adamw = parse_train([*DEBUG_ARGS, "--max_steps", "8", "--output_dir", str(tmp_path / "adamw")])
    with pytest.raises(ConfigError, match=r"--optimizer 'muon' \(this run: 'adamw'\)"):
        checkpoint.check_compatible(saved, adamw, Accelerator(cpu=True), meta)


def test_eval_only_on_a_muon_checkpoint_without_the_option_is_one_true_line(muon_run):
    """--eval_only skips the checks of training; the optimizer state still loads (ad106ca: "KeyError:
    'param_groups'" from accelerate's load_state)."""
    saved = muon_run / "checkpoints" / "step_4"
    meta = json.loads((saved / "checkpoint.json").read_text())
    eval_only = parse_train([*DEBUG_ARGS, "--eval_only", "true", "--output_dir", str(muon_run),
                             "--resume_from_checkpoint", str(saved)])
    with pytest.raises(ConfigError, match=r"--optimizer muon, .* \(this run: adamw\): add --optimizer muon"):
        checkpoint.check_compatible(saved, eval_only, Accelerator(cpu=True), meta)
    with_muon = parse_train([*DEBUG_ARGS, "--eval_only", "true", "--optimizer", "muon", "--resume_from_checkpoint",
                             str(saved)])
    assert checkpoint.check_compatible(saved, with_muon, Accelerator(cpu=True), meta) is meta


def test_muon_on_two_ddp_ranks_with_the_chunked_loss_matches_one_process(muon_run, tmp_path, hf_home):
    """Each rank orthogonalises the same all-reduced gradient: the same updates as one process
    with the whole batch (micro-batch 4 on each of 2 ranks = 8), the loss chunked or not."""
    out = tmp_path / "ddp"
    launch_two_processes("train.py", "ddp.yaml", [*MUON_ARGS, "--micro_batch_size", "4", "--loss_chunk_size", "100",
                                                  "--output_dir", str(out)], hf_home)
    one, two = step_losses(muon_run), step_losses(out)
    assert read_summary(out)["setup"]["world_size"] == 2
    assert max(abs(one[s] - two[s]) for s in one) < 2e-4, (one, two)


@pytest.mark.parametrize("config, says", [("fsdp.yaml", "FSDP2 shards"),
                                          ("deepspeed_zero2.yaml", "DeepSpeed ZeRO flattens")])
def test_muon_refuses_a_strategy_that_shards_matrices(config, says, tmp_path, hf_home):
    proc = launch_two_processes("train.py", config, [*MUON_ARGS, "--output_dir", str(tmp_path / "run")], hf_home,
                                check=False)
    assert proc.returncode != 0
    line = next(line for line in proc.stderr.splitlines() if "--optimizer muon" in line)
    assert says in line and "ddp.yaml" in line
    assert not (tmp_path / "run" / "checkpoints").exists()
