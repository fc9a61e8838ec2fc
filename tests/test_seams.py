"""Seams between features: each test here fails on a bug that every single-feature test passes.

In-process, no launch of its own (train_run's step-30 checkpoint is reused, tests/conftest.py):
- a mixture's per-source evaluation scores each source on exactly its own held-out rows (train.py's
  data step; the rows and the losses against blocks and a loss made here by the documented rule);
- the chunked loss (--loss_chunk_size) on a head with a bias (Phi), tied to the embeddings or not:
  value and every gradient, the bias's too, against the plain loss;
- a checkpoint.json saved before the later options existed resumes with their defaults, exactly
  (train.py's main in this process, steps 31-60 against train_run's own losses), and another value
  of such an option is refused as a recorded one is;
- a training resume on other data (other files, or the same file rewritten) is one line, exit code 2,
  before any model is built, the checkpoint untouched;
- an export into a folder holding what a killed export left is the clean export, byte for byte, and
  nothing else is left beside it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, set_seed
from transformers import AutoModelForCausalLM, AutoTokenizer, PhiConfig

from common import model as modeling
from common.config import ConfigError
from common.data import build_tokenizer
from common.export import export_pretrained
from conftest import SYNTHETIC, TRAIN_ARGS, check_resumed_losses, load_recipe, parse_train, read_summary
from probes.sitecustomize import PROBE_INPUT_IDS
from synthetic import synthetic_documents
from train_extras import chunked_loss
from train_extras.data import assemble
from train_extras.options import TrainConfig
from train_extras.resume import checkpoint, output_dir, preemption


pytestmark = pytest.mark.quick  # launches nothing: docs/testing.md#running-the-tests


@pytest.fixture
def in_process(monkeypatch, tmp_path):
    """train.py's code in this process: its own datasets cache; the run's folder lock released and
    the signal handlers put back afterwards, as the end of a run's process would."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets")
    handlers = {sig: signal.getsignal(sig) for sig in preemption.SIGNALS}
    yield
    for sig, handler in handlers.items():
        signal.signal(sig, handler)
    while output_dir._held:
        os.close(output_dir._held.pop())


def jsonl(path: Path, texts: list[str]) -> str:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return str(path)


# ---- 1. a mixture's per-source evaluation ----

MIX_SEQ = 16


def hand_blocks(tokenizer, docs: list[str], seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks of seq_len + 1 tokens, position ids of their first seq_len) by docs/data.md's rule:
    each document [BOS] + text + EOS (the byte tokenizer has no BOS), all concatenated, cut into
    whole blocks; positions restart at each document and at each block."""
    stream, positions = [], []
    for doc in docs:
        ids = tokenizer(doc, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
        stream += ids
        positions += list(range(len(ids)))
    n = len(stream) // (seq_len + 1)
    blocks = torch.tensor(stream[: n * (seq_len + 1)]).view(n, seq_len + 1)
    pos = torch.tensor(positions[: n * (seq_len + 1)]).view(n, seq_len + 1)
    pos = torch.minimum(pos, torch.arange(seq_len + 1))  # a document running on from the block before
    return blocks, pos[:, :-1]


def hand_loss(model, blocks: torch.Tensor, positions: torch.Tensor) -> tuple[float, int]:
    with torch.no_grad():
        logits = model(input_ids=blocks[:, :-1], position_ids=positions, use_cache=False).logits
    losses = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.size(-1)),
                                               blocks[:, 1:].reshape(-1), reduction="none")
    return losses.double().sum().item() / losses.numel(), losses.numel()


def test_a_mixture_scores_each_source_on_its_own_held_out_rows(tmp_path, in_process):
    """Two sources in other toy languages: `given` with a held-out file of its own, `cut` with 10% of
    its documents held out (seed 0, docs/data.md). Through train.py's data step, each source's
    held-out rows are the blocks made here from exactly its held-out documents, and each source's
    eval loss (and the mixture's token mean) is the loss computed here on those blocks."""
    import datasets

    given_train = jsonl(tmp_path / "given.jsonl", synthetic_documents(40, seed=11))
    given_eval_docs = synthetic_documents(6, seed=12)
    given_eval = jsonl(tmp_path / "given_eval.jsonl", given_eval_docs)
    cut_docs = synthetic_documents(60, seed=13)
    cut_file = jsonl(tmp_path / "cut.jsonl", cut_docs)
    spec = tmp_path / "mixture.yaml"
    spec.write_text(f"sources:\n  - name: given\n    data_files: {given_train}\n    eval_data_files: {given_eval}\n"
                    f"    weight: 0.5\n  - name: cut\n    data_files: {cut_file}\n    eval_fraction: 0.1\n"
                    f"    weight: 0.5\n")
    cfg = parse_train(["--preset", "debug", "--seq_len", str(MIX_SEQ), "--micro_batch_size", "4",
                       "--data_mixture", str(spec)])
    tokenizer = build_tokenizer(cfg)
    accelerator = Accelerator(cpu=True)
    prepared = load_recipe("train").prepare_data(cfg, accelerator, tokenizer, SimpleNamespace(tp_layout=None),
                                                 None, None)
    assert list(prepared.eval_loaders) == ["given", "cut"]

    cut = datasets.Dataset.from_dict({"text": cut_docs}).train_test_split(test_size=0.1, seed=0, shuffle=True)
    assert len(cut["test"]) == 6 and not set(cut["test"]["text"]) & set(cut["train"]["text"])
    held_out_docs = {"given": given_eval_docs, "cut": cut["test"]["text"]}
    set_seed(0)
    model = modeling.build_model(cfg, len(tokenizer)).eval()
    result = assemble.evaluate(model, prepared.eval_loaders, accelerator)
    expected_sum = expected_tokens = 0
    for name, docs in held_out_docs.items():
        blocks, positions = hand_blocks(tokenizer, docs, MIX_SEQ)
        rows = [prepared.eval_sets[name][i] for i in range(len(prepared.eval_sets[name]))]
        assert len(rows) == len(blocks) > 1, name
        assert torch.equal(torch.stack([r["input_ids"] for r in rows]), blocks[:, :-1]), name
        assert torch.equal(torch.stack([r["labels"] for r in rows]), blocks[:, 1:]), name
        assert torch.equal(torch.stack([r["position_ids"] for r in rows]), positions), name
        loss, tokens = hand_loss(model, blocks, positions)
        got = result["sources"][name]
        assert got["tokens"] == tokens and got["loss"] == pytest.approx(loss, rel=1e-6, abs=0), (name, got, loss)
        expected_sum, expected_tokens = expected_sum + loss * tokens, expected_tokens + tokens
    assert result["tokens"] == expected_tokens
    assert result["loss"] == pytest.approx(expected_sum / expected_tokens, rel=1e-6, abs=0)


# ---- 2. the chunked loss on a head with a bias, tied or not ----

PHI = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0)


def phi_with_head_bias(tied: bool):
    """transformers' Phi (its LM head has a bias), the bias drawn at random: at its zero init a
    chunked loss that dropped it would still agree."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(PhiConfig(**PHI, tie_word_embeddings=tied)).eval()
    head = model.get_output_embeddings()
    with torch.no_grad():
        head.bias.normal_(0.0, 1.0)
    assert (head.weight is model.get_input_embeddings().weight) == tied
    return model


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("chunk", [7, 1000])  # several chunks with a ragged last one; one chunk for all
def test_the_chunked_loss_on_a_head_with_a_bias_equals_the_plain_loss(tied, chunk):
    """Value and every parameter's gradient (the bias's, the tied table's) within 1e-6 of the plain
    loss's; the start-up check (check_plain_head) lets such a model train."""
    model = phi_with_head_bias(tied)
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 300, (3, 41), generator=generator)
    labels = ids[:, 1:].clone()
    labels[0, :9] = -100
    plain = modeling.causal_lm_loss(model, ids[:, :-1], labels, "mean")
    plain.backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    assert expected["lm_head.bias"].abs().max() > 0
    model.zero_grad()
    head = chunked_loss.install(model, chunk)
    chunked = chunked_loss.causal_lm_loss(model, head, ids[:, :-1], labels, "mean")
    chunked.backward()
    assert abs(plain.item() - chunked.item()) <= 1e-6, (plain.item(), chunked.item())
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        assert (p.grad - expected[name]).abs().max().item() <= 1e-6, name
    chunked_loss.check_plain_head(model, head, Accelerator(cpu=True), 300)  # not refused


# ---- 3. a checkpoint from before the later options ----

# Every option of train.py that came after checkpoint.json began recording the run's options
# (commit 9a26ea5), in the order they came; a checkpoint saved before one of them has no such key.
LATER_OPTIONS = (
    "collective_timeout", "save_on_preemption", "compile", "project_name", "report_to", "run_name",
    "sample_length", "sample_prompt", "sample_at_eval", "attn_implementation", "eval_split", "eval_data_files",
    "txt_documents", "add_bos", "data_timeout", "dataset_num_proc", "eval_only", "export_dtype", "streaming",
    "warmup_ratio", "verify_checkpoint", "overwrite_output_dir", "router_aux_loss_coef", "chat_column",
    "chat_template", "data_mixture", "overlong", "sample_message", "optimizer", "muon_lr", "muon_weight_decay",
    "muon_momentum", "muon_adjust_lr", "loss_chunk_size", "trust_remote_code")
# document_mask came with them but is kept: its absence means "trained without masks" (refused with
# them on: test_resume_changes.py), and train_run trained with them.


def step_30(train_run) -> Path:
    return train_run.output_dir / "checkpoints" / "step_30"


def strip_later_options(meta: dict) -> dict:
    """checkpoint.json as a save before the later options (and issue 32's data record) wrote it."""
    for key in LATER_OPTIONS:
        del meta["config"][key]
    del meta["data"]["chat_template_sha256"], meta["data"]["mixture"]
    return meta


def rewritten(source: Path, target: Path, edit) -> Path:
    """A copy of a checkpoint with checkpoint.json edited by `edit(meta)`, its own checksum made again
    (as a save makes it), so that it verifies as a checkpoint that was saved that way."""
    shutil.copytree(source, target)
    meta = json.loads((target / checkpoint.METADATA).read_text())
    edit(meta)
    meta.pop("metadata_checksum", None)
    meta["metadata_checksum"] = checkpoint.metadata_digest(meta)
    (target / checkpoint.METADATA).write_text(json.dumps(meta, indent=1))
    return target


def run_train_py(argv: list[str]) -> int:
    return preemption.run_cli(load_recipe("train").main, argv)


def test_a_checkpoint_from_before_the_later_options_resumes_with_their_defaults_exactly(
        train_run, hf_home, tmp_path, monkeypatch, in_process):
    """train_run's step-30 checkpoint without the keys of every later option (and its data record
    without the keys of issue 32) resumes in this process, losses of steps 31-60 and the final eval
    bitwise train_run's. (train_run's tokenised data is reused from the session's cache.)"""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", hf_home / "datasets")
    fields = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    assert set(LATER_OPTIONS) <= set(fields)
    assert all(train_run.summary["setup"]["options"][key] == fields[key]
               for key in LATER_OPTIONS if key not in ("sample_length",))  # the defaults it ran with

    legacy = rewritten(step_30(train_run), tmp_path / "step_30", strip_later_options)
    assert not set(LATER_OPTIONS) & set(checkpoint.verify(legacy)["config"])
    out = tmp_path / "resumed"
    code = run_train_py(TRAIN_ARGS + ["--save_on_preemption", "false", "--resume_from_checkpoint", str(legacy),
                                      "--output_dir", str(out)])
    assert code == 0
    resumed = read_summary(out)
    check_resumed_losses(train_run, SimpleNamespace(summary=resumed), 30)
    assert resumed["eval"][-1]["loss"] == train_run.summary["eval"][-1]["loss"]
    assert resumed["resumed_from"]["changed"] == {}


@pytest.mark.parametrize("change, named", [
    (["--overlong", "truncate"], "--overlong 'drop' (this run: 'truncate')"),
    (["--add_bos", "false"], "--add_bos True (this run: False)"),
    (["--txt_documents", "line"], "--txt_documents 'paragraph' (this run: 'line')"),
    (["--chat_column", "messages"], "--chat_column None (this run: 'messages')"),
    (["--optimizer", "muon", "--muon_momentum", "0.9"], "--muon_momentum 0.95 (this run: 0.9)"),
])
def test_a_later_option_a_checkpoint_does_not_record_counts_as_its_default(change, named, train_run):
    """What a checkpoint from before an option was trained with is that option's default (the old
    behaviour; --document_mask and --optimizer: BEFORE_THE_OPTION): resuming it with another value of
    a trained-on option is refused, naming the default, as a recorded one is; with the defaults it
    is accepted. (checkpoint.check_compatible on the stripped checkpoint.json, in-process.)"""
    legacy = strip_later_options(checkpoint.verify(step_30(train_run), contents=False))
    single = SimpleNamespace(distributed_type=DistributedType.NO, num_processes=1)
    with pytest.raises(ConfigError) as refused:
        checkpoint.check_compatible(step_30(train_run), parse_train(TRAIN_ARGS + change), single, legacy)
    assert named in str(refused.value) and "\n" not in str(refused.value), refused.value
    checkpoint.check_compatible(step_30(train_run), parse_train(TRAIN_ARGS), single, legacy)


# ---- 4. a training resume on other data ----

def file_digests(folder: Path) -> dict:
    return {p.relative_to(folder).as_posix(): checkpoint.file_digest(p)
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def no_model(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("a model was built for a resume on other data")

    monkeypatch.setattr(modeling, "build_model", forbidden)


@pytest.mark.parametrize("how", ["other files", "same file rewritten"])
def test_a_training_resume_on_other_data_is_refused_before_any_model_and_leaves_the_checkpoint(
        how, train_run, tmp_path, capsys, in_process, no_model):
    """Other --data_files than the checkpoint's: refused when the checkpoint is checked. The same
    file rewritten with other documents: refused once the data is tokenised (its block count). For
    the second, a copy of step_30 records a file of its own (as a run on it would have), which is then
    rewritten. Either way: one line, exit code 2, no model built, nothing printed on stdout, the
    checkpoint's files bitwise as they were and nothing set aside beside it."""
    saved_blocks = train_run.summary["data"]["train_blocks"]
    if how == "other files":
        resume_from = step_30(train_run)
        data_file = jsonl(tmp_path / "other.jsonl", synthetic_documents(300, seed=5))
        message = (f"{resume_from / 'checkpoint.json'} was trained with --data_files "
                   f"[{os.path.realpath(SYNTHETIC)!r}] (this run: [{os.path.realpath(data_file)!r}]): that would "
                   "train on other data")
    else:
        data_file = str(tmp_path / "data.jsonl")
        shutil.copyfile(SYNTHETIC, data_file)

        def record_own_file(meta):
            meta["config"]["data_files"] = [data_file]
            meta["data"]["data_files"] = [os.path.realpath(data_file)]

        resume_from = rewritten(step_30(train_run), tmp_path / "ckpt" / "step_30", record_own_file)
        jsonl(Path(data_file), synthetic_documents(300, seed=5))  # the same path, other documents
        message = (f"{resume_from / 'checkpoint.json'} was trained on other data: {saved_blocks} training blocks, "
                   "this run has ")
    before = file_digests(resume_from)
    siblings = sorted(os.listdir(resume_from.parent))
    args = [a if a != SYNTHETIC else data_file for a in TRAIN_ARGS]
    code = run_train_py(args + ["--save_on_preemption", "false", "--resume_from_checkpoint", str(resume_from),
                                "--output_dir", str(tmp_path / "out")])
    captured = capsys.readouterr()
    assert code == 2, captured.err[-3000:]
    assert captured.err.startswith("error: ") and captured.err.count("\n") == 1, captured.err[-3000:]
    assert message in captured.err, captured.err
    if how == "same file rewritten":
        now = int(captured.err.split("this run has ")[1].split()[0])
        assert now != saved_blocks
    assert captured.out == ""
    assert file_digests(resume_from) == before
    assert sorted(os.listdir(resume_from.parent)) == siblings
    assert not (tmp_path / "out").exists()  # the folder it made for itself is gone again


# ---- 5. an export over what a killed export left ----

def tokenizer_with_template():
    tokenizer = build_tokenizer(TrainConfig())
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    return tokenizer


def tiny(seed: int):
    set_seed(seed)
    return modeling.build_model(TrainConfig(preset="debug"), 259).eval()


def folder_bytes(folder: Path) -> dict:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


# What common/files.py's replace_dir leaves when an export is killed (tests/test_export_atomic.py
# kills real ones), in a folder whose earlier run's tokenizer had a chat template (chat_template.jinja)
# and is now exported by a run whose tokenizer has none (a new run there with --overwrite_output_dir):
# a stale file taken over from the leftovers would publish a template the new run never had.
def killed_while_writing(folder: Path, old: Path) -> None:
    """model/ the earlier export, .model.partial the killed export half written (its weights cut)."""
    shutil.copytree(old, folder / "model")
    shutil.copytree(old, folder / ".model.partial")
    weights = folder / ".model.partial" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])


def killed_after_the_swap(folder: Path, old: Path) -> None:
    """Swapped: model/ the killed run's export, in place, .model.partial the one before it, not yet removed."""
    shutil.copytree(old, folder / ".model.partial")
    shutil.copytree(old, folder / "model")  # (what model/ holds does not matter to the next export)


def killed_between_two_renames(folder: Path, old: Path) -> None:
    """Where two folders cannot swap in one step (NFS): model/ missing, the earlier export set aside
    as .model.old, the new one whole in .model.partial."""
    shutil.copytree(old, folder / ".model.old")
    shutil.copytree(old, folder / ".model.partial")


@pytest.mark.parametrize("leftovers", [killed_while_writing, killed_after_the_swap, killed_between_two_renames],
                         ids=lambda f: f.__name__)
def test_an_export_over_a_killed_exports_leftovers_is_the_clean_export(leftovers, tmp_path):
    """export_pretrained alone (no recover_dir called first) into a folder holding a killed export's
    leftovers: model/ is byte for byte the export of the same model into an empty folder, it reloads
    with that model's logits and no chat template, and nothing else is left in the folder."""
    accelerator = Accelerator(cpu=True)
    old = export_pretrained(accelerator, tiny(1), tokenizer_with_template(), tmp_path / "old" / "model")
    assert (old / "chat_template.jinja").exists()
    new_model, tokenizer = tiny(2), build_tokenizer(TrainConfig())
    clean = export_pretrained(accelerator, new_model, tokenizer, tmp_path / "clean" / "model")
    folder = tmp_path / "run"
    folder.mkdir()
    leftovers(folder, old)
    assert export_pretrained(accelerator, new_model, tokenizer, folder / "model") == folder / "model"
    assert os.listdir(folder) == ["model"]
    assert folder_bytes(folder / "model") == folder_bytes(clean)
    loaded = AutoModelForCausalLM.from_pretrained(folder / "model")
    assert AutoTokenizer.from_pretrained(folder / "model").chat_template is None
    with torch.no_grad():
        ids = torch.tensor([PROBE_INPUT_IDS])
        assert torch.equal(loaded(ids).logits, new_model(ids).logits)


# ---- 6. the held-out loss x rows with unequal targets (conversations one per row, padding) ----

def test_the_held_out_loss_weights_every_target_token_alike_whatever_its_row_holds():
    """Packed text blocks all have seq_len targets, so a mean of per-row means would pass every run on
    text; rows of conversations one per row (--packing false) or padded rows do not: 1, 3 and 15
    targets here (the prompt and the padding at -100). The held-out loss must be the token mean, the
    cross-entropy summed over every target in the test and divided by their count."""
    set_seed(0)
    model = AutoModelForCausalLM.from_config(PhiConfig(**PHI)).eval()
    input_ids = torch.randint(0, PHI["vocab_size"], (3, 16), generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, PHI["vocab_size"], (3, 16), generator=torch.Generator().manual_seed(2))
    labels[0, :15] = -100  # one answer token
    labels[1, :10], labels[1, 13:] = -100, -100  # three, between a prompt and padding
    labels[2, 0] = -100  # fifteen
    rows = [{"input_ids": input_ids[i], "labels": labels[i], "index": i} for i in range(3)]
    loader = torch.utils.data.DataLoader(rows, batch_size=2)
    result = modeling.evaluate(model, loader, Accelerator(cpu=True))
    with torch.no_grad():
        logits = model(input_ids=input_ids).logits.float()
    per_token = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1),
                                                  ignore_index=-100, reduction="none").view(3, 16)
    targets = (labels != -100).sum(1)
    assert targets.tolist() == [1, 3, 15] and result["tokens"] == 19
    assert result["loss"] == pytest.approx((per_token.sum() / 19).item(), rel=1e-6, abs=0)
    mean_of_means = (per_token.sum(1) / targets).mean().item()
    assert abs(mean_of_means - result["loss"]) > 1e-3  # the two can be told apart on these rows
