"""Bad input: one clear line, a non-zero exit, and no model built. In-process through the
recipes' own entry points (config.run_cli; train.py's preemption.run_cli around it), plus one real
`accelerate launch`."""

import json
import os
import time

import pytest

from common import config
from common import model as modeling
from common.export import mark_export
from conftest import DEBUG_ARGS, ROOT, launch, load_recipe
from train_extras.resume import output_dir, preemption


@pytest.fixture
def no_model(monkeypatch, tmp_path):
    """Fail the test if a recipe gets as far as building a model."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets")

    def forbidden(*args, **kwargs):
        raise AssertionError("a model was built despite bad input")

    monkeypatch.setattr(modeling, "build_model", forbidden)


@pytest.fixture(autouse=True)
def release_run_locks():
    """An in-process train.py claims its output folder and keeps the lock until its process ends, as
    a run does (train_extras/resume/output_dir.py): let go after each test, as that end would."""
    yield
    while output_dir._held:
        os.close(output_dir._held.pop())


def bad_inputs(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    blank_docs = tmp_path / "blank.jsonl"
    blank_docs.write_text('{"text": " "}\n')
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("lr: [0.1\n")
    return {
        "unknown option": (["--learning_rate", "1"], "unknown option(s) for {recipe}.py: --learning_rate 1"),
        "unknown preset": (["--preset", "70b"], "unknown preset '70b'"),
        "missing data file": (["--data_files", str(tmp_path / "nope.txt")], "data file not found"),
        "empty data file": (["--data_files", str(empty)], "data file is empty"),
        "empty dataset": (["--data_files", str(blank_docs)], "dataset is empty"),
        "seq_len above positions": (["--preset", "debug", "--seq_len", "4096"], "exceeds the 256 positions"),
        "bad YAML": (["--config", str(bad_yaml)], "bad YAML in"),
    }


@pytest.mark.quick
@pytest.mark.parametrize("recipe", ["train", "bf16_baseline"])
@pytest.mark.parametrize("case", ["unknown option", "unknown preset", "missing data file", "empty data file",
                                  "empty dataset", "seq_len above positions", "bad YAML"])
def test_bad_input_is_one_line(recipe, case, tmp_path, capsys, no_model):
    argv, message = bad_inputs(tmp_path)[case]
    message = message.format(recipe=recipe)
    run_cli = preemption.run_cli if recipe == "train" else config.run_cli  # what each recipe's __main__ calls
    code = run_cli(load_recipe(recipe).main, argv + ["--output_dir", str(tmp_path / "out")])
    captured = capsys.readouterr()
    assert code == 2
    assert captured.out == ""
    assert captured.err.startswith("error: ") and message in captured.err
    assert captured.err.count("\n") == 1, captured.err
    assert not (tmp_path / "out").exists()


@pytest.mark.quick
def test_baseline_has_no_accumulation_option(tmp_path, capsys, no_model):
    """An option of another recipe is an unknown option here, named with this recipe: never ignored."""
    code = config.run_cli(load_recipe("bf16_baseline").main, ["--gradient_accumulation_steps", "4"])
    err = capsys.readouterr().err
    assert code == 2 and err == "error: unknown option(s) for bf16_baseline.py: --gradient_accumulation_steps 4 " \
                                "(see bf16_baseline.py --help)\n", err


def test_bad_input_through_accelerate_launch(tmp_path, hf_home):
    proc = launch("train.py", ["--preset", "huge", "--output_dir", str(tmp_path / "out")], hf_home, check=False)
    assert proc.returncode != 0
    ours = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert ours == ["error: unknown preset 'huge'; choose one of debug, mini, tiny, small, 1b, 8b"]
    # No traceback frame in our code; the launcher's own CalledProcessError traceback is not ours.
    assert f'File "{ROOT / "recipes" / "train.py"}"' not in proc.stderr
    assert 'File "' + str(ROOT / "common") not in proc.stderr
    assert proc.stdout.strip() == ""
    assert not (tmp_path / "out").exists()


def test_too_little_training_data_stops_at_once_instead_of_waiting_for_ever(tmp_path, hf_home):
    """Fewer training blocks than one micro-batch (drop_last: no batch at all) once left train.py's
    loop drawing from an empty loader for ever at full CPU, deaf to SIGTERM. Now it is one line
    before anything trains; the timeout makes a regression fail instead of hanging the suite."""
    small, held_out = tmp_path / "small.txt", tmp_path / "held_out.txt"
    small.write_text("a short training file, " * 20 + "\n")  # 462 tokens with EOS: 7 blocks of 65
    held_out.write_text("held-out text, " * 10 + "\n")
    out = tmp_path / "out"
    start = time.monotonic()
    args = ["--preset", "debug", "--seq_len", "64", "--micro_batch_size", "8", "--data_files", str(small),
            "--eval_data_files", str(held_out), "--output_dir", str(out)]
    proc = launch("train.py", args, hf_home, check=False, timeout=120)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    ours = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert ours == ["error: the training set has 7 blocks of 65 tokens; one micro-batch on each of 1 data-parallel "
                    "rank(s) needs 8 (--micro_batch_size 8 x 1): lower --micro_batch_size or --seq_len, or give more "
                    "data"], proc.stderr[-3000:]
    assert elapsed < 100, elapsed  # the launch and the imports; nothing trained
    assert not (out / "run_summary.json").exists()


# ---- a finished run is not overwritten (train_extras/resume/output_dir.py, check_not_finished) ----
def finished_run(folder, summary: dict | None, export: bool = True):
    """What a finished run leaves, as far as the check reads it: its lock, its record, its export."""
    from common.data import build_tokenizer
    from train_extras.options import TrainConfig

    folder.mkdir(parents=True)
    (folder / ".run.lock").write_text('{"host": "node07", "pid": 4242, "since": 0}')
    (folder / "metrics.jsonl").write_text('{"kind": "train", "step": 1, "loss": 5.5}\n')
    if summary is not None:
        (folder / "run_summary.json").write_text(json.dumps(summary))
    if export:  # what --eval_only can load (config and tokenizer; no model is built in these tests)
        modeling.model_config(TrainConfig(preset="debug"), 259).save_pretrained(folder / "model")
        build_tokenizer(TrainConfig()).save_pretrained(folder / "model")
        mark_as_export(folder / "model")
    return folder


def mark_as_export(folder):
    """The marker every export is written with, listing its files."""
    mark_export(folder)


def contents(folder) -> dict:
    """Every file's bytes, but the lock's: each run that claims the folder writes its own name there."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() if p.is_file() else None
            for p in sorted(folder.rglob("*")) if p.name != ".run.lock"}


@pytest.mark.parametrize("holds, extra", [
    ("run_summary.json, model/", []),
    ("run_summary.json", []),  # --save_model false
    ("model/", []),  # the record lost, the export kept
    ("run_summary.json, model/", ["--resume_from_checkpoint", "auto"]),  # no checkpoint of its own to resume
])
def test_a_finished_run_is_not_overwritten_by_a_new_one(holds, extra, tmp_path, capsys, no_model):
    out = finished_run(tmp_path / "run", {"recipe": "train.py", "eval": []} if "run_summary" in holds else None,
                       export="model/" in holds)
    before = contents(out)
    code = preemption.run_cli(load_recipe("train").main, DEBUG_ARGS + extra + ["--output_dir", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and err == (f"error: {out} holds a finished run ({holds}): pass --overwrite_output_dir to replace "
                                 "it, or choose another --output_dir\n"), err
    assert contents(out) == before


def test_overwrite_output_dir_lets_a_new_run_replace_a_finished_one(tmp_path, no_model):
    out = finished_run(tmp_path / "run", {"recipe": "train.py", "eval": []})
    with pytest.raises(AssertionError, match="a model was built"):  # past every check, on to training
        preemption.run_cli(load_recipe("train").main, DEBUG_ARGS + ["--overwrite_output_dir", "--output_dir", str(out)])


def test_eval_only_may_write_its_record_beside_a_finished_run(tmp_path, no_model):
    out = finished_run(tmp_path / "run", {"recipe": "train.py", "eval": []})
    with pytest.raises(AssertionError, match="a model was built"):  # on to evaluating; eval_summary.json apart
        preemption.run_cli(load_recipe("train").main, DEBUG_ARGS + ["--eval_only", "--model_name_or_path",
                                                                    str(out / "model"), "--output_dir", str(out)])


@pytest.mark.quick
def test_what_counts_as_a_finished_run(tmp_path):
    from train_extras.options import TrainConfig

    def check(folder, resume=None, **options):
        output_dir.check_not_finished(TrainConfig(output_dir=str(folder), **options), resume)

    check(tmp_path / "new")
    check(finished_run(tmp_path / "preempted", {"preempted": {"step": 30}}, export=False))  # its checkpoint goes on
    evaluated = tmp_path / "evaluated"
    evaluated.mkdir()
    (evaluated / "eval_summary.json").write_text("{}")  # --eval_only's record: no run of its own
    check(evaluated)
    done = finished_run(tmp_path / "done", {"recipe": "train.py", "eval": []})
    check(done, done / "checkpoints" / "step_60")  # resuming its own checkpoint continues that run
    check(done, overwrite_output_dir=True)
    with pytest.raises(config.ConfigError, match="holds a finished run"):  # another run's checkpoint: a new run here
        check(done, tmp_path / "elsewhere" / "checkpoints" / "step_60")
    unread = finished_run(tmp_path / "unread", None, export=False)
    (unread / "run_summary.json").write_text('{"recipe": "train.py", "ev')  # not written by a run: not ours to replace
    with pytest.raises(config.ConfigError, match=r"holds a finished run \(run_summary.json\)"):
        check(unread)
