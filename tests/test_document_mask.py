"""--document_mask auto | true | false (train_extras/document_mask.py) on the 2025-2026 families of
tests/families.py, on this machine (CPU, transformers 5.25, none of the CUDA kernels that take
seq_idx or cumulative lengths):

- in-process, per family: the way `auto` keeps its packed documents apart, and that this way really
  does (the second of two packed documents, in a micro-batch of two rows, has the logits it has
  alone), or for a family that cannot, why, and that its forward is then exactly the forward of
  --document_mask false; `true` refuses such a family in one line. The inputs made from a batch's
  position ids (seq_idx, cumulative lengths, the rows as one) by value, and the one-row path's
  logits against position ids alone. The option's values.
- launched: Qwen3-Next (named in issue 43) with the default options under cpu.yaml trains, the
  setup block's line and run_summary.json say its documents see each other and why, the checkpoint
  records it, and a resume with --document_mask true is refused before any work.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from transformers import AutoModelForCausalLM

from common.config import ConfigError
from conftest import SYNTHETIC, Run, launch, parse_train
from families import FAMILIES, VOCAB, make_config, save_family
from train_extras import document_mask
from train_extras.resume import checkpoint

# What auto resolves to here. GPT-OSS's forward builds its masks without the position ids (it gets
# masks made from them); the hybrids' recurrent and convolutional layers cannot restart on a CPU.
KEPT_APART = {"gpt_oss": "position_ids+masks"}
SEE_EACH_OTHER = {  # family -> what the reason names: its stateful layer types, the kernels that refused
    "qwen3_next": ["Qwen3Next's linear_attention layers", "`causal_conv1d_fn` can't keep packed sequences apart "
                   "without `causal_conv1d`", "`chunk_gated_delta_rule` can't keep packed sequences apart without "
                   "`flash-linear-attention`"],
    "jamba": ["Jamba's linear_attention layers"],
    "falcon_h1": ["FalconH1's hybrid layers", "`causal_conv1d_fn`"],
    "granitemoehybrid": ["GraniteMoeHybrid's linear_attention layers", "`causal_conv1d_fn`"],
    "lfm2": ["Lfm2's conv layers", "`causal_conv1d_fn`"],
    "minimax": ["MiniMax's linear_attention layers"],
}


def tiny(family: str):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(make_config(family))


def two_rows(generator_seed: int = 1):
    """Two rows of 24 tokens: documents A (10 tokens) then B (14); C (24) alone. Their position ids."""
    ids = torch.randint(3, VOCAB, (2, 24), generator=torch.Generator().manual_seed(generator_seed))
    positions = torch.stack([torch.cat([torch.arange(10), torch.arange(14)]), torch.arange(24)])
    return ids, positions


@pytest.mark.quick
@pytest.mark.parametrize("family", FAMILIES)
def test_auto_keeps_each_familys_documents_apart_where_it_can_and_says_why_not(family):
    accelerator = Accelerator(cpu=True)
    model = tiny(family)
    mode, why = document_mask.resolve(model, accelerator, parse_train([]), VOCAB, None)
    document_mask.install(model, accelerator, mode)  # as train.py: every forward of its own from here on
    ids, positions = two_rows()
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        if family in SEE_EACH_OTHER:
            assert mode == "none" and all(part in why for part in SEE_EACH_OTHER[family]), why
            assert "carry their state from one document into the next" in why
            # exactly --document_mask false's forward: no position ids, positions run on
            assert torch.equal(packed, model(input_ids=ids, use_cache=False).logits)
            if family == "qwen3_next":  # (the others' probes alike: a second second each)
                with pytest.raises(ConfigError, match=r"^--document_mask true: .* use --document_mask auto"):
                    document_mask.resolve(model, accelerator, parse_train(["--document_mask", "true"]), VOCAB, None)
        else:
            assert (mode, why) == (KEPT_APART.get(family, "position_ids"), None)
            alone = model(input_ids=ids[:1, 10:], position_ids=positions[:1, 10:], use_cache=False).logits
            assert (packed[0, 10:] - alone[0]).abs().max() < 1e-5  # measured <= 3e-7
            whole = model(input_ids=ids[1:], position_ids=positions[1:], use_cache=False).logits
            assert (packed[1] - whole[0]).abs().max() < 1e-5


@pytest.mark.quick
def test_the_inputs_made_from_position_ids_and_the_rows_as_one():
    """seq_idx (each token's document in its row) and flash-style cumulative lengths over the rows as
    one, by value; through the hooks, the one-row forward's logits come back in the batch's rows and
    equal those of the position ids alone (Qwen3 takes and ignores seq_idx and cu_seq_lens on CPU)."""
    _, positions = two_rows()
    inputs = document_mask.forward_inputs(None, positions, "position_ids+seq_idx+cu_seq_lens")
    assert inputs["position_ids"].tolist() == [positions.reshape(-1).tolist()]
    assert inputs["seq_idx"].tolist() == [[0] * 10 + [1] * 14 + [2] * 24] and inputs["seq_idx"].dtype == torch.int32
    assert inputs["cu_seq_lens_q"].tolist() == inputs["cu_seq_lens_k"].tolist() == [0, 10, 24, 48]
    assert inputs["max_length_q"] == inputs["max_length_k"] == 24
    rows = document_mask.forward_inputs(None, positions, "position_ids+seq_idx")
    assert rows["seq_idx"].tolist() == [[0] * 10 + [1] * 14, [0] * 24]
    assert document_mask.forward_inputs(None, positions, "none") == {"position_ids": None}

    accelerator = Accelerator(cpu=True)
    model = tiny("qwen3")
    ids, positions = two_rows()
    with torch.no_grad():
        reference = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        hooks = document_mask.install(model, accelerator, "position_ids+seq_idx+cu_seq_lens")
        as_one = model(input_ids=ids, position_ids=positions, use_cache=False).logits
        for hook in hooks:
            hook.remove()
    assert as_one.shape == reference.shape == (2, 24, VOCAB)
    assert (as_one - reference).abs().max() < 1e-5


@pytest.mark.quick
@pytest.mark.parametrize("family, mode", [("qwen3", "position_ids"), ("gpt_oss", "position_ids+masks"),
                                          ("jamba", "none")])
def test_the_probe_gives_the_same_answer_under_bf16_autocast(family, mode):
    """train.py's bf16 runs probe through accelerate's autocast. The probe's two forwards have the same
    shapes (the row, then the row with another first document), so bf16 rounds both alike; compared
    with the second document run alone (another shape), a Llama's logits moved by 0.002 under bf16
    and `auto` turned the masks off in every bf16 run (caught by test_finetune.py's bf16 fine-tune)."""
    model = tiny(family)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert document_mask.resolve(model, Accelerator(cpu=True), parse_train([]), VOCAB, None)[0] == mode


@pytest.mark.quick
def test_the_option_is_auto_true_or_false(tmp_path):
    assert parse_train([]).document_mask == "auto"
    assert parse_train(["--document_mask", "true"]).document_mask == "true"
    (tmp_path / "c.yaml").write_text("document_mask: false\n")  # YAML's boolean, as the CLI spells it
    assert parse_train(["--config", str(tmp_path / "c.yaml")]).document_mask == "false"
    with pytest.raises(ConfigError, match="document_mask.*invalid choice: 'yes'"):
        parse_train(["--document_mask", "yes"])
    # false asks the model nothing, nor does one document per row
    assert document_mask.resolve(None, None, parse_train(["--document_mask", "false"]), VOCAB, None) == (
        "none", "--document_mask false")
    assert document_mask.resolve(None, None, parse_train(["--packing", "false"]), VOCAB, None) == ("rows", None)
    assert document_mask.describe("rows", None) == "one per row (--packing false): none to keep apart"


# ---- launched: a hybrid with the default options ----

def test_a_hybrid_trains_with_the_default_options_and_says_its_documents_see_each_other(tmp_path, hf_home):
    """Qwen3-Next under cpu.yaml, no --document_mask: it trains (the default used to refuse it),
    one setup line and run_summary.json say why its documents see each other, its checkpoints
    record it, and resuming one with --document_mask true is refused before any work (in-process)."""
    from common.data import build_tokenizer
    from train_extras.options import TrainConfig

    folder = save_family("qwen3_next", tmp_path / "model")
    build_tokenizer(TrainConfig()).save_pretrained(tmp_path / "tokenizer")
    out = tmp_path / "run"
    args = ["--model_name_or_path", str(folder), "--tokenizer_name_or_path", str(tmp_path / "tokenizer"),
            "--data_files", SYNTHETIC, "--seq_len", "64", "--micro_batch_size", "8", "--max_steps", "8",
            "--warmup_steps", "2", "--eval_every", "8", "--eval_batches", "2", "--log_every", "4", "--save_every", "4",
            "--sample_length", "0", "--save_model", "false", "--output_dir", str(out)]
    run = Run(out, launch("train.py", args, hf_home))
    documents = run.summary["setup"]["documents"]
    assert documents["mode"] == "none" and all(part in documents["why"] for part in SEE_EACH_OTHER["qwen3_next"])
    assert f"documents        : not kept apart ({documents['why']}): packed documents see each other\n" \
        in run.proc.stdout
    assert run.summary["setup"]["options"]["document_mask"] == "auto"
    losses = [row["loss"] for row in run.summary["losses"]]
    assert losses[-1] < losses[0] - 0.5, losses
    step_4 = out / "checkpoints" / "step_4"
    meta = json.loads((step_4 / "checkpoint.json").read_text())
    assert meta["documents"] == "none" and checkpoint.saved_documents(meta, parse_train([])) == "none"
    single = SimpleNamespace(distributed_type=DistributedType.NO, num_processes=1)
    checkpoint.check_compatible(step_4, parse_train(args), single, meta)  # auto: continues as it trained
    with pytest.raises(ConfigError, match="was trained with packed documents that see each other: resume with "
                                          "--document_mask auto"):
        checkpoint.check_compatible(step_4, parse_train(args + ["--document_mask", "true"]), single, meta)
