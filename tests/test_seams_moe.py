"""Mixture of experts where it meets the other features of train.py: gradient accumulation (the
router's loss in the objective and in the record), the experts' load per log interval, and packed
documents (position ids that restart at each document).

One train.py run in this process (no launch, about a second): a tiny Mixtral (2 layers, hidden 32,
4 experts, top-2, random init, made here), 4 steps of 2 micro-batches of 4 rows of 32 tokens,
intervals of 2 steps, router-loss weight 1, on short documents (one sentence each, ~45 bytes) so
that most rows hold a document boundary. Its learning rate, 1e-30, is far below half an ulp of any
fp32 weight of the model, so no step moves one and every step routes with the initial weights
(checked: the export equals them bit for bit); every figure the run logs is then derived here from
the saved initial model and the same micro-batches, rebuilt from the same options:

    loss      sum(token loss over the step) / the step's target tokens
    aux_loss  the mean over the step's micro-batches of Mixtral's own load-balancing loss
    grad_norm |grad(loss + 1 * aux_loss)|, the objective train_extras/moe.py documents
    load      per interval, from the router logits of that interval's 4 micro-batches alone

(expert_counts and load_of are also tests/test_moe.py's, for its 2-rank runs.)
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, MixtralConfig

from common import data
from conftest import load_recipe, parse_train
from synthetic import synthetic_documents
from train_extras import moe
from train_extras.data import assemble
from train_extras.options import TrainConfig
from train_extras.resume import output_dir as run_folder


pytestmark = pytest.mark.quick  # launches nothing: docs/testing.md#running-the-tests

EXPERTS, TOP_K, COEF = 4, 2, 1.0
STEPS, ACCUMULATION, LOG_EVERY = 4, 2, 2
DATA_OPTIONS = ["--seq_len", "32", "--micro_batch_size", "4", "--gradient_accumulation_steps", str(ACCUMULATION)]
# fp32 sums in another order: the run's pre-clip norm (torch's norm of per-tensor norms, gradients
# summed micro-batch by micro-batch) against the float64 norm of the gradient computed here, measured
# 9e-8 apart relative; the aux term at half or twice its weight, 2.5% or more.
NORM_TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def seam_run(tmp_path_factory):
    """The run's output folder, its options and metrics.jsonl lines; the micro-batches it trained on
    and the initial model, for the expected values."""
    folder = tmp_path_factory.mktemp("moe_seams")
    corpus = folder / "sentences.jsonl"
    sentences = [s.strip() + "." for doc in synthetic_documents(40) for s in doc.split(".") if s.strip()]
    corpus.write_text("".join(json.dumps({"text": s}) + "\n" for s in sentences))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(MixtralConfig(
        vocab_size=259, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, num_local_experts=EXPERTS, num_experts_per_tok=TOP_K, max_position_embeddings=64,
        tie_word_embeddings=False))
    model.save_pretrained(folder / "initial")
    data.build_tokenizer(TrainConfig()).save_pretrained(folder / "tokenizer")
    options = ["--model_name_or_path", str(folder / "initial"), "--tokenizer_name_or_path", str(folder / "tokenizer"),
               "--data_files", str(corpus), *DATA_OPTIONS]
    out = folder / "run"
    args = options + ["--max_steps", str(STEPS), "--log_every", str(LOG_EVERY), "--eval_every", "0",
                      "--sample_length", "0", "--lr", "1e-30", "--lr_schedule", "constant", "--warmup_steps", "0",
                      "--router_aux_loss_coef", str(COEF), "--save_on_preemption", "false", "--output_dir", str(out)]
    import datasets

    held = list(run_folder._held)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(datasets.config, "HF_DATASETS_CACHE", folder / "datasets")
        try:
            load_recipe("train").main(args)
        finally:  # the run's folder lock, which its process would let go of at its end
            for fd in [fd for fd in run_folder._held if fd not in held]:
                run_folder._held.remove(fd)
                os.close(fd)
        cfg = parse_train(options)
        tokenizer = data.build_tokenizer(cfg)
        built = assemble.build(cfg, tokenizer)
        loader = data.build_loaders(cfg, built.train, built.held_out[""], pin_memory=False, data_ranks=1)[0]
        batches = iter(loader)  # epoch 0's order, as train.py draws it
        micro_batches = [next(batches) for _ in range(STEPS * ACCUMULATION)]
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    initial = AutoModelForCausalLM.from_pretrained(folder / "initial")
    before, after = initial.state_dict(), AutoModelForCausalLM.from_pretrained(out / "model").state_dict()
    return {"out": out, "lines": lines, "micro_batches": micro_batches, "model": initial,
            "unmoved": before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before),
            "eos": tokenizer.eos_token_id}


def kind(run, name: str) -> list[dict]:
    return [line for line in run["lines"] if line["kind"] == name]


def forward(model, batch, positions: bool = True):
    """(token-summed LM loss, Mixtral's aux loss, router logits per layer) of one micro-batch."""
    out = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"] if positions else None,
                output_router_logits=True, use_cache=False)
    lm = torch.nn.functional.cross_entropy(out.logits.reshape(-1, out.logits.size(-1)).float(),
                                           batch["labels"].reshape(-1), ignore_index=-100, reduction="sum")
    return lm, out.aux_loss, out.router_logits


def step_batches(run, step: int) -> list[dict]:
    return run["micro_batches"][(step - 1) * ACCUMULATION: step * ACCUMULATION]


def test_the_run_routes_with_its_initial_weights(seam_run):
    """The premise of the expected values below: lr 1e-30 left every weight as it was."""
    assert seam_run["unmoved"]
    summary = json.loads((seam_run["out"] / "run_summary.json").read_text())
    assert summary["setup"]["options"]["router_aux_loss_coef"] == COEF
    assert [line["step"] for line in kind(seam_run, "train")] == list(range(1, STEPS + 1))
    assert [line["step"] for line in kind(seam_run, "interval")] == [2, 4]


def test_a_router_weight_of_0_is_the_runs_not_the_configs(seam_run):
    """--router_aux_loss_coef 0 turns the router loss off: it does not fall back to the config's 0.001."""
    config = seam_run["model"].config
    assert config.router_aux_loss_coef == 0.001
    assert moe.route_for(TrainConfig(router_aux_loss_coef=0.0), config) == {"experts": 4, "top_k": 2, "loss": True,
                                                                            "coef": 0.0, "fixed": []}
    assert moe.route_for(TrainConfig(), config)["coef"] == 0.001


def test_the_router_loss_under_gradient_accumulation(seam_run):
    """Per step of 2 micro-batches: the logged loss is the token mean, the logged aux_loss the mean
    of the 2 micro-batches' own load-balancing losses, and the gradient (its pre-clip norm) that of
    loss + 1 * aux_loss. The same norm with the aux term at half or twice its weight (divided by the
    accumulation once too often, or not at all) is measured here to be far outside the tolerance."""
    model = seam_run["model"]
    for line in kind(seam_run, "train"):
        batches = step_batches(seam_run, line["step"])
        tokens = sum(int((b["labels"] != -100).sum()) for b in batches)
        results = [forward(model, b) for b in batches]
        lm = sum(r[0] for r in results) / tokens
        aux = sum(r[1] for r in results) / ACCUMULATION
        assert line["loss"] == pytest.approx(lm.item(), rel=1e-6)
        assert line["aux_loss"] == pytest.approx(aux.item(), rel=1e-6)
        params = list(model.parameters())
        lm_grad, aux_grad = (torch.cat([g.double().flatten() for g in grads]) for grads in
                             (torch.autograd.grad(term, params, retain_graph=True, materialize_grads=True)
                              for term in (lm, aux)))
        norms = {weight: (lm_grad + weight * aux_grad).norm().item()
                 for weight in (COEF, COEF / ACCUMULATION, COEF * ACCUMULATION)}
        assert line["grad_norm"] == pytest.approx(norms[COEF], rel=NORM_TOLERANCE), (line, norms)
        for wrong in (COEF / ACCUMULATION, COEF * ACCUMULATION):  # the test can tell them apart
            assert abs(norms[wrong] / norms[COEF] - 1) > 100 * NORM_TOLERANCE, norms


def expert_counts(router_logits) -> torch.Tensor:
    """(layers, experts): routing slots each expert got, by the top-k of each token's router logits."""
    return torch.stack([torch.bincount(torch.topk(logits, TOP_K, dim=-1).indices.flatten(), minlength=EXPERTS)
                        for logits in router_logits]).double()


def load_of(counts: torch.Tensor) -> dict:
    """Per layer: coefficient of variation (population std / mean) of the experts' shares, max and min share."""
    shares = counts / counts.sum(dim=1, keepdim=True)
    return {"cv": (shares.std(dim=1, unbiased=False) / shares.mean(dim=1)).tolist(),
            "max_share": shares.max(dim=1).values.tolist(), "min_share": shares.min(dim=1).values.tolist()}


def test_each_interval_logs_the_load_routed_in_that_interval(seam_run):
    """The expert load of each log interval (metrics.jsonl and run_summary.json) is that of the
    micro-batches of its own steps, not of every micro-batch since the start of the run."""
    model = seam_run["model"]
    with torch.no_grad():
        counts = [expert_counts(forward(model, b)[2]) for b in seam_run["micro_batches"]]
    per_interval = LOG_EVERY * ACCUMULATION
    expected = {step: load_of(sum(counts[step * ACCUMULATION - per_interval: step * ACCUMULATION]))
                for step in (2, 4)}
    summary = json.loads((seam_run["out"] / "run_summary.json").read_text())
    logged = {line["step"]: line["expert_load"] for line in kind(seam_run, "interval")}
    assert {row["step"]: row["expert_load"] for row in summary["throughput"]} == logged
    for step, load in expected.items():
        for key, values in load.items():
            assert logged[step][key] == pytest.approx(values, abs=1e-6), (step, key, logged[step], load)
    # the test can tell the second interval's load from the run's load so far
    so_far = load_of(sum(counts))
    assert max(abs(a - b) for key in so_far for a, b in zip(so_far[key], expected[4][key])) > 1e-3


def restarting_positions(input_ids: torch.Tensor, eos) -> torch.Tensor:
    """Each token's position in its document, from the tokens alone: 0 at the row's start and after
    each EOS (the byte tokenizer ends each document with EOS and adds no BOS)."""
    positions = torch.zeros_like(input_ids)
    for t in range(1, input_ids.size(1)):
        positions[:, t] = torch.where(input_ids[:, t - 1] == eos, 0, positions[:, t - 1] + 1)
    return positions


def test_packed_documents_reach_the_moe_model_with_their_own_positions(seam_run):
    """Step 1's loss is that of each packed document run through the model alone (positions from 0,
    nothing before it to attend to), summed over documents: the MoE path gave the model the
    documents' restarting position ids. Without them (the positions of the whole row) the loss is
    measured here to be far off."""
    model, batches = seam_run["model"], step_batches(seam_run, 1)
    eos = seam_run["eos"]
    alone, tokens, rows_with_a_boundary = 0.0, 0, 0
    with torch.no_grad():
        for batch in batches:
            assert torch.equal(batch["position_ids"], restarting_positions(batch["input_ids"], eos))
            for ids, labels, positions in zip(batch["input_ids"], batch["labels"], batch["position_ids"]):
                starts = (positions == 0).nonzero().flatten().tolist() + [len(ids)]
                rows_with_a_boundary += len(starts) > 2
                for begin, end in zip(starts, starts[1:]):
                    logits = model(input_ids=ids[None, begin:end], use_cache=False).logits[0]
                    alone += torch.nn.functional.cross_entropy(logits.float(), labels[begin:end],
                                                               reduction="sum").item()
            tokens += int((batch["labels"] != -100).sum())
        whole_rows = sum(forward(model, b, positions=False)[0].item() for b in batches) / tokens
    assert rows_with_a_boundary >= len(batches) * 3  # most rows hold two documents or more
    line = kind(seam_run, "train")[0]
    # measured 6e-9 apart relative (fp32 sums in another order); the whole rows' positions 8e-4
    assert line["loss"] == pytest.approx(alone / tokens, rel=1e-6)
    assert abs(whole_rows / (alone / tokens) - 1) > 100 * 1e-6
