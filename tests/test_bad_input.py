"""Bad input: one clear line, a non-zero exit, and no model built. In-process through the
recipes' own entry points (config.run_cli; train.py's preemption.run_cli around it), plus one real
`accelerate launch`."""

import pytest

from common import config
from common import model as modeling
from conftest import ROOT, launch, load_recipe
from train_extras import preemption


@pytest.fixture
def no_model(monkeypatch, tmp_path):
    """Fail the test if a recipe gets as far as building a model."""
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets")

    def forbidden(*args, **kwargs):
        raise AssertionError("a model was built despite bad input")

    monkeypatch.setattr(modeling, "build_model", forbidden)


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
