"""The formats people fine-tune on (issue 48), against what TRL's SFTTrainer trains on the same rows
with the same tokenizer: plain conversations, tool calls (arguments whose names differ from row to
row, read by `datasets` as Json), prompt/completion as text and as messages. TRL's side is the
committed fixture tests/data/trl_trained_tokens.json (tests/scripts/trl_trained_tokens.py made it).

In-process: each format one example per row (--packing false) and packed by best fit (the
default), token for token; --last_turn_only, --completion_only_loss false, the refusals. Launched:
train.py on tool calls under cpu.yaml and ddp.yaml, and on prompt/completion text, resumed exactly."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from common.config import ConfigError
from common.data import build_tokenizer
from conftest import ROOT, SYNTHETIC, Run, check_exact_resume, launch, launch_two_processes, parse_train
from synthetic import FORMATS, FUNCTIONS, TOOL_CHAT_TEMPLATE, format_file, save_chat_tokenizer
from train_extras.data import assemble, render

FIXTURE = ROOT / "tests" / "data" / "trl_trained_tokens.json"
SEQ = 768  # every row of FORMATS fits whole (the longest: 640 tokens)


@pytest.fixture(scope="module")
def trl():
    return json.loads(FIXTURE.read_text())


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("formats")
    save_chat_tokenizer(folder / "tokenizer", TOOL_CHAT_TEMPLATE)
    return {"tokenizer": str(folder / "tokenizer"), **{name: format_file(folder, name) for name in FORMATS}}


def build(files, name: str, *extra: str):
    """train.py's datasets of one format, all of its rows trained (the held-out set: the same file)."""
    cfg = parse_train(["--tokenizer_name_or_path", files["tokenizer"], "--data_files", files[name],
                       "--eval_data_files", files[name], "--seq_len", str(SEQ), *extra])
    tokenizer = build_tokenizer(cfg)
    return tokenizer, assemble.build(cfg, tokenizer)


def shifted(labels: list[int]) -> list[int]:
    """TRL's labels (labels[t]: input_ids[t] itself, the model shifts them) as ours (labels[t]: the
    token trained to follow input_ids[t])."""
    return labels[1:] + [-100]


def check_rows(built, rows: list, pad: int) -> None:
    """One example per row (--packing false): each row is TRL's row, in order."""
    assert len(built.train) == len(rows)
    for index, (ids, labels) in enumerate(rows):
        item, n = built.train[index], len(ids) - 1  # the last token is only a label
        assert item["input_ids"][:n].tolist() == ids[:n] and set(item["input_ids"][n:].tolist()) <= {pad}, index
        assert item["labels"].tolist() == shifted(labels)[:n] + [-100] * (SEQ - n), index


def check_packed(built, rows: list, pad: int) -> None:
    """Best fit: every example whole in one row (found by its position ids), each TRL's row once."""
    pool = {}
    for ids, labels in rows:
        pool.setdefault(tuple(ids), []).append(shifted(labels))
    for index in range(len(built.train)):
        item = built.train[index]
        positions, ids, labels = item["position_ids"].tolist(), item["input_ids"].tolist(), item["labels"].tolist()
        starts = [t for t, p in enumerate(positions) if p == 0] + [SEQ]
        for a, b in zip(starts, starts[1:]):
            if set(ids[a:b]) == {pad}:
                assert set(labels[a:b]) == {-100}
                continue
            # a row's last example may end on the block's last token, which is only a label
            key = next(k for k in (tuple(ids[a:b]), tuple(ids[a:b] + [labels[b - 1]])) if pool.get(k))
            assert pool[key].pop()[: b - a] == labels[a:b], index
    assert not any(pool.values())


def tokenizer_identity(tokenizer) -> dict:
    import importlib.util

    spec = importlib.util.spec_from_file_location("trl_trained_tokens", ROOT / "tests/scripts/trl_trained_tokens.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.tokenizer_identity(tokenizer)


@pytest.mark.quick
def test_the_fixture_was_made_with_this_tokenizer(trl, files):
    tokenizer = build_tokenizer(parse_train(["--tokenizer_name_or_path", files["tokenizer"]]))
    assert tokenizer_identity(tokenizer) == {k: trl[k] for k in ("vocab_sha256", "template_sha256")}, \
        "the tests' tokenizer changed: run tests/scripts/trl_trained_tokens.py again"
    assert {name: len(rows) for name, rows in trl["formats"].items()} == dict.fromkeys(FORMATS, 60)


KINDS = {"messages": "conversations", "tool_calls": "conversations", "prompt_completion_text": "completions",
         "prompt_completion_messages": "conversations"}


@pytest.mark.quick
@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("packing", ["rows", "best_fit"])
def test_each_format_trains_exactly_the_tokens_trl_trains(trl, files, name, packing):
    tokenizer, built = build(files, name, *(["--packing", "false"] if packing == "rows" else []))
    assert built.kind == KINDS[name]
    assert built.facts[KINDS[name]] == {"kept": 60, "truncated": 0, "dropped_overlong": 0,
                                        "dropped_no_assistant_token": 0}
    (check_rows if packing == "rows" else check_packed)(built, trl["formats"][name], tokenizer.pad_token_id)


@pytest.mark.quick
def test_tool_calls_are_rendered_as_written(files):
    """No argument or schema property another row has is added to a row (datasets reads the
    messages as Json); the template gets the row's tools."""
    tokenizer, built = build(files, "tool_calls", "--packing", "false")
    rows = FORMATS["tool_calls"]()
    for index in range(12):
        expected = tokenizer.apply_chat_template(rows[index]["messages"], tools=rows[index]["tools"], tokenize=False)
        n = int((built.train[index]["input_ids"] != tokenizer.pad_token_id).sum())
        text = tokenizer.decode(built.train[index]["input_ids"][:n].tolist() + [built.train[index]["labels"][n - 1]])
        assert text == expected
        for call in rows[index]["messages"][1]["tool_calls"]:  # each call's arguments, and only its own
            assert f"<call>{json.dumps(call['function'])}</call>" in text
        assert "null" not in text


@pytest.mark.quick
def test_last_turn_only_and_the_whole_text_of_a_completion(trl, files):
    """--last_turn_only trains TRL's tokens of the last assistant turn only; --completion_only_loss
    false trains every token of a prompt/completion pair (the first is never a label)."""
    tokenizer, built = build(files, "messages", "--packing", "false", "--last_turn_only", "true")
    rows = [(ids, render.last_turn(labels_as_mask)) for ids, labels_as_mask in
            ((ids, [int(label != -100) for label in labels]) for ids, labels in trl["formats"]["messages"])]
    check_rows(built, [(ids, [t if m else -100 for t, m in zip(ids, mask)]) for ids, mask in rows],
               tokenizer.pad_token_id)
    multi_turn = sum(sum(label != -100 for label in labels) > sum(mask) for (_, labels), (_, mask)
                     in zip(trl["formats"]["messages"], rows))
    assert multi_turn > 20  # most conversations had an earlier turn left untrained
    tokenizer, built = build(files, "prompt_completion_text", "--packing", "false", "--completion_only_loss", "false")
    for index, (ids, _) in enumerate(trl["formats"]["prompt_completion_text"]):
        assert built.train[index]["labels"][: len(ids) - 1].tolist() == ids[1:]


@pytest.mark.quick
def test_a_prompt_completion_pair_of_mixed_kinds_and_a_template_for_completions_are_one_line(files, tmp_path):
    rows = FORMATS["prompt_completion_messages"]()
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps({"prompt": r["prompt"][1]["content"], "completion": r["completion"]}) + "\n"
                            for r in rows))
    with pytest.raises(ConfigError, match="must both hold text or both lists of messages"):
        build({**files, "mixed": str(path)}, "mixed")
    template = tmp_path / "t.jinja"
    template.write_text(TOOL_CHAT_TEMPLATE)
    with pytest.raises(ConfigError, match="renders conversations, and the data holds text only"):
        build(files, "prompt_completion_text", "--chat_template", str(template))


# ---- launched: every format in one mixture, under cpu.yaml and ddp.yaml (2 processes), resumed ----

RUN_ARGS = ["--seq_len", str(SEQ), "--micro_batch_size", "2", "--max_steps", "24",
            "--warmup_steps", "2", "--lr", "3e-3", "--eval_every", "12", "--log_every", "4", "--save_every", "12",
            "--sample_length", "8"]


@pytest.fixture(scope="module")
def format_runs(tmp_path_factory, hf_home, files):
    """train.py on a mixture of the four formats (equal weights, packed by best fit): one process;
    two DDP ranks, 24 steps and again resumed at step 12."""
    folder = tmp_path_factory.mktemp("format_runs")
    torch.manual_seed(0)  # a small Llama with room for the longest row (the debug preset has 256 positions)
    AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=len(AutoTokenizer.from_pretrained(files["tokenizer"])), hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
        tie_word_embeddings=True)).save_pretrained(folder / "model")
    spec = folder / "formats.yaml"
    spec.write_text("sources:\n" + "".join(f"  - name: {name}\n    data_files: [{files[name]}]\n    weight: 1\n"
                                           for name in FORMATS) + "stopping_strategy: all_exhausted\n")
    args = RUN_ARGS + ["--model_name_or_path", str(folder / "model"), "--tokenizer_name_or_path", files["tokenizer"],
                       "--data_mixture", str(spec)]
    runs = {"cpu": Run(folder / "cpu", launch("train.py", args + ["--output_dir", str(folder / "cpu")], hf_home))}
    for name, extra in (("ddp", []), ("ddp_resumed", ["--resume_from_checkpoint",
                                                      str(folder / "ddp" / "checkpoints" / "step_12")])):
        runs[name] = Run(folder / name, launch_two_processes("train.py", "ddp.yaml", args + extra + [
            "--output_dir", str(folder / name)], hf_home))
    return runs


@pytest.mark.parametrize("run", ["cpu", "ddp"])
def test_train_py_learns_every_format_packed_whole(format_runs, run):
    summary = format_runs[run].summary
    data = summary["data"]
    assert data["kind"] == "mixed" and set(data["mixture"]) == set(FORMATS)
    assert set(data["conversations"]) == {"messages", "tool_calls", "prompt_completion_messages"}
    assert set(data["completions"]) == {"prompt_completion_text"}
    for name, fates in (*data["conversations"].items(), *data["completions"].items()):
        assert sum(fates.values()) == fates["kept"] > 50, (name, fates)  # all of those not held out
    assert data["rows"]["strategy"] == "best_fit" and data["rows"]["padding_share"] < 0.05, data["rows"]
    stdout = format_runs[run].proc.stdout
    assert "packing          : best fit: " in stdout and "prompt/completion pairs" in stdout
    first, last = summary["eval"][0]["sources"], summary["eval"][-1]["sources"]
    for name in FORMATS:
        assert last[name]["loss"] < first[name]["loss"] - 0.5, (name, first[name], last[name])


def test_a_ddp_run_on_every_format_resumes_exactly(format_runs):
    check_exact_resume(format_runs["ddp"], format_runs["ddp_resumed"], 12)


@pytest.mark.quick
def test_keys_a_schema_merge_added_are_removed_again(files, tmp_path):
    """Parquet (a Hub dataset's usual form) stores one struct per column: every tool call holds every
    argument name any call has, None where it has none. Rendered without them: as the JSONL is."""
    import datasets

    rows = FORMATS["tool_calls"]()
    arguments = {name: datasets.Value("int64" if kind == "integer" else "string")
                 for schema in FUNCTIONS.values() for name, kind in schema.items()}
    call = {"type": datasets.Value("string"), "function": {"name": datasets.Value("string"), "arguments": arguments}}
    message = {"role": datasets.Value("string"), "content": datasets.Value("string"),
               "tool_calls": datasets.List(call)}
    merged = datasets.Dataset.from_list([{"messages": row["messages"]} for row in rows],
                                        features=datasets.Features({"messages": datasets.List(message)}))
    assert merged[0]["messages"][1]["tool_calls"][0]["function"]["arguments"] == {
        "city": rows[0]["messages"][1]["tool_calls"][0]["function"]["arguments"]["city"], "a": None, "b": None,
        "query": None, "limit": None}  # what the merge did
    merged.to_parquet(tmp_path / "merged.parquet")
    (tmp_path / "plain.jsonl").write_text("".join(json.dumps({"messages": row["messages"]}) + "\n" for row in rows))
    built = {name: build({**files, name: str(tmp_path / name)}, name, "--packing", "false")[1]
             for name in ("merged.parquet", "plain.jsonl")}
    a, b = built["merged.parquet"].train, built["plain.jsonl"].train
    assert len(a) == len(b) == 60
    assert all(torch.equal(a[i]["input_ids"], b[i]["input_ids"]) and torch.equal(a[i]["labels"], b[i]["labels"])
               for i in range(60))


# ---- tools/show_data.py: what a run trains on, shown before it runs ----

def test_show_data_shows_the_rows_train_py_trains_on_in_its_order(format_runs, files, tmp_path):
    """The rows `python -m tools.show_data` writes (same options as the 1-process run) are, one by
    one and in order, the rows train.py's loader gave the model (the run's probes: the sample ids of
    each micro-batch); its totals are the run's setup lines."""
    import subprocess
    import sys

    run = format_runs["cpu"]
    options = run.summary["setup"]["options"]
    argv = ["--tokenizer_name_or_path", files["tokenizer"], "--data_mixture", options["data_mixture"],
            "--seq_len", str(SEQ), "--micro_batch_size", "2", "--model_name_or_path", options["model_name_or_path"]]
    out = tmp_path / "rows.jsonl"
    proc = subprocess.run([sys.executable, "-m", "tools.show_data", *argv, "--rows", "48", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    cfg = parse_train(argv)
    tokenizer = build_tokenizer(cfg)
    train = assemble.build(cfg, tokenizer).train
    consumed = [index for batch in run.batches[0] for index in batch]  # 24 steps x 2 rows
    assert len(rows) == len(consumed) == 48
    for row, index in zip(rows, consumed):
        expected = train[index]
        assert row == {key: expected[key].tolist() for key in ("input_ids", "labels", "position_ids")}, index
        assert len(row["input_ids"]) == len(row["labels"]) == len(row["position_ids"]) == SEQ
    setup_lines = [line for line in proc.stdout.splitlines() if line.split(":")[0].strip() in
                   ("packing", "conversations (tool_calls)", "completions (prompt_completion_text)")]
    assert len(setup_lines) == 3 and all(line in run.proc.stdout for line in setup_lines), setup_lines
    assert "[[" in proc.stdout and "<example at token 0>" in proc.stdout and "<padding: " in proc.stdout


def test_show_data_refuses_bad_input_in_one_line(files, tmp_path):
    import subprocess
    import sys

    for argv, message in ((["--rows", "0"], "--rows takes a positive count or 'all', got '0'"),
                          (["--data_files", str(tmp_path / "missing.jsonl")], "missing.jsonl"),
                          (["--streaming", "true", "--data_files", files["messages"], "--eval_data_files",
                            files["messages"]], "--streaming: the rows are made while training")):
        proc = subprocess.run([sys.executable, "-m", "tools.show_data", *argv], cwd=ROOT, capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr
        assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


@pytest.mark.quick
def test_show_data_marks_the_trained_tokens_example_starts_and_padding(files, capsys, tmp_path):
    """In-process, piped (brackets): each conversation's assistant turns in [[...]], each example's
    start, the row's padding; --rows all writes every row of the training set."""
    from tools import show_data

    argv = ["--tokenizer_name_or_path", files["tokenizer"], "--data_files", files["messages"], "--seq_len", "256"]
    assert show_data.main(argv + ["--rows", "2"]) == 0
    shown = capsys.readouterr().out
    assert shown.count("--- row ") == 2 and shown.count("<example at token 0>") == 2
    assert "<|assistant|>\n[[" in shown and "<|end|>]]" in shown and "[[<|user|>" not in shown
    totals = shown.splitlines()[-2:]
    assert totals[0].startswith("conversations    : 58 conversations")
    assert totals[1].startswith("packing          : best fit")
    assert show_data.main(argv + ["--rows", "all", "--out", str(tmp_path / "rows.jsonl")]) == 0
    rows = [json.loads(line) for line in (tmp_path / "rows.jsonl").read_text().splitlines()]
    cfg = parse_train(argv)
    rows_per_epoch = len(assemble.build(cfg, build_tokenizer(cfg)).train) // 16 * 16  # the loader drops the rest
    assert len(rows) == rows_per_epoch == 16
    assert show_data.own_options(["--rows", "all", "--seq_len", "8"]) == (None, None, ["--seq_len", "8"])


@pytest.mark.quick
def test_a_resume_that_would_pack_otherwise_is_refused(tmp_path):
    """A checkpoint records how its examples were packed; one from before best fit (no record)
    packed by concatenation. Resuming with the other packing is one line naming the option."""
    from train_extras.resume import checkpoint

    identity = {"train_blocks": 5, "chat_template_sha256": None, "mixture": None}
    before_best_fit = {"data": identity}
    checkpoint.check_same_data(tmp_path, before_best_fit, {**identity, "packing": "concatenate"})
    checkpoint.check_same_data(tmp_path, {"data": {**identity, "packing": "best_fit"}},
                               {**identity, "packing": "best_fit"})
    with pytest.raises(ConfigError, match="packed its examples by concatenate, and this run packs them by best_fit: "
                                          "resume with --packing_strategy concatenate"):
        checkpoint.check_same_data(tmp_path, before_best_fit, {**identity, "packing": "best_fit"})


def test_a_mixture_of_text_and_completions_samples_a_continuation(tmp_path, hf_home, files):
    """Text and prompt/completion pairs, no conversation (the byte tokenizer, which has no chat
    template): trains, and the end-of-run sample continues --sample_prompt as for text."""
    spec = tmp_path / "mixture.yaml"
    spec.write_text(f"sources:\n  - name: prose\n    data_files: [{SYNTHETIC}]\n    weight: 1\n"
                    f"  - name: pairs\n    data_files: [{files['prompt_completion_text']}]\n    weight: 1\n")
    run = Run(tmp_path / "out", launch("train.py", ["--preset", "debug", "--seq_len", "128", "--micro_batch_size", "4",
                                                    "--max_steps", "4", "--data_mixture", str(spec), "--sample_length",
                                                    "8", "--output_dir", str(tmp_path / "out")], hf_home))
    data = run.summary["data"]
    assert data["kind"] == "mixed" and "conversations" not in data and set(data["completions"]) == {"pairs"}
    assert run.summary["samples"][-1]["prompt"] == run.summary["setup"]["options"]["sample_prompt"]


@pytest.mark.quick
@pytest.mark.parametrize("name", ["messages", "prompt_completion_text"])
@pytest.mark.parametrize("packing", [[], ["--packing_strategy", "concatenate"], ["--packing", "false"]])
def test_the_totals_count_what_the_rows_hold(files, name, packing):
    """packing.totals (the setup block's, run_summary.json's and show_data's) against every row built:
    the trained tokens are the labels that are not -100, the padding the pad inputs past the end."""
    from train_extras.data import packing as packing_module

    tokenizer, built = build(files, name, *packing)
    rows = [built.train[i] for i in range(len(built.train))]
    totals = built.facts["rows"]
    assert totals == packing_module.totals(built.train, SEQ)
    assert totals["rows"] == len(rows)
    assert totals["trained_tokens"] == sum(int((row["labels"] != -100).sum()) for row in rows)
    if totals["strategy"] == "concatenate":
        assert totals["padding_share"] == 0.0
    else:
        padding = sum(int((row["input_ids"] == tokenizer.pad_token_id).sum()) for row in rows)
        assert totals["padding_share"] == padding / (len(rows) * SEQ)
