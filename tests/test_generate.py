"""recipes/generate.py, run as a user runs it (`python recipes/generate.py ...`, one subprocess each):
samples from the model that train_run trains and exports, and bad input as one `error:` line."""

import json
import subprocess
import sys

import pytest
from conftest import REACHED_RECIPES, ROOT, launch_env
from transformers import AutoTokenizer

PROMPT = "ROMEO:"


def generate(args: list[str], hf_home, check: bool = True) -> subprocess.CompletedProcess:
    cmd = [sys.executable, str(ROOT / "recipes" / "generate.py"), *args]
    REACHED_RECIPES.add(ROOT / "recipes" / "generate.py")
    # One thread: for a model this small it is the fastest, and on a busy 2-core machine threads
    # that spin-wait for each other made sampling 3x slower (measured: 16 s -> 5 s).
    env = {**launch_env(hf_home), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def check_headers(stdout: str, count: int) -> None:
    for i in range(1, count + 1):
        assert f"---------- sample {i} ----------" in stdout, stdout
    assert f"---------- sample {count + 1} ----------" not in stdout


def test_same_seed_same_text_and_exact_length(train_run, hf_home, tmp_path):
    model = train_run.output_dir / "model"
    n = 40
    # --stop_at_eos false: every sample is exactly n new tokens, EOS or not
    args = ["--model", str(model), "--prompt", PROMPT, "--num_samples", "2", "--max_new_tokens", str(n),
            "--temperature", "1.0", "--stop_at_eos", "false"]
    first = generate(args + ["--seed", "1", "--output_file", str(tmp_path / "first.json")], hf_home)
    again = generate(args + ["--seed", "1", "--output_file", str(tmp_path / "again.json")], hf_home)
    other = generate(args + ["--seed", "2"], hf_home)

    check_headers(first.stdout, 2)
    assert again.stdout == first.stdout  # same seed, same text
    assert other.stdout != first.stdout  # 2 x 40 draws over 259 ids: a collision is out of the question

    written = json.loads((tmp_path / "first.json").read_text())
    assert written["samples"] == json.loads((tmp_path / "again.json").read_text())["samples"]
    assert written["settings"]["seed"] == 1 and written["settings"]["max_new_tokens"] == n
    assert written["new_tokens"] == [n, n]
    tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
    for text in written["samples"]:
        assert text.startswith(PROMPT) and text in first.stdout
        # decoding skips special tokens (an EOS the model wrote): at most n tokens come back
        assert 0 < len(tokenizer(text[len(PROMPT):], add_special_tokens=False).input_ids) <= n


def test_greedy_gives_identical_samples(train_run, hf_home, tmp_path):
    out = tmp_path / "greedy.json"
    proc = generate(["--model", str(train_run.output_dir / "model"), "--prompt", PROMPT, "--num_samples", "2",
                     "--max_new_tokens", "30", "--temperature", "0", "--output_file", str(out)], hf_home)
    check_headers(proc.stdout, 2)
    written = json.loads(out.read_text())
    assert written["samples"][0] == written["samples"][1]
    # stopping at EOS (the default) can only make a sample shorter
    assert all(0 < count <= 30 for count in written["new_tokens"]), written["new_tokens"]


def bad_inputs(tmp_path, model) -> dict:
    """case -> (arguments, what the error line must say). `model` is a real (random-init) folder,
    so that the cases that name it fail on their own fault."""
    (tmp_path / "empty").mkdir()
    return {
        "missing folder": (["--model", str(tmp_path / "nope"), "--prompt", PROMPT], "model folder not found"),
        "not a model": (["--model", str(tmp_path / "empty"), "--prompt", PROMPT], "no config.json"),
        "empty prompt": (["--model", str(model), "--prompt", ""], "--prompt is empty"),
        "unknown token": (["--model", str(model), "--prompt", "a<unk>"], "cannot encode"),
        "no new tokens": (["--model", str(model), "--prompt", PROMPT, "--max_new_tokens", "0"],
                          "--max_new_tokens must be positive"),
        "negative temperature": (["--model", str(model), "--prompt", PROMPT, "--temperature", "-1"],
                                 "--temperature must be >= 0"),
        "unknown option": (["--model", str(model), "--prompt", PROMPT, "--max_tokens", "5"],
                           "unknown option(s): --max_tokens 5"),
    }


@pytest.mark.quick
@pytest.mark.parametrize("case", ["missing folder", "not a model", "empty prompt", "unknown token", "no new tokens",
                                  "negative temperature", "unknown option"])
def test_bad_input_is_one_error_line(case, tmp_path, hf_home, initial_model):
    args, message = bad_inputs(tmp_path, initial_model)[case]
    proc = generate(args, hf_home, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stdout == ""
    assert "Traceback" not in proc.stderr
    last = [line for line in proc.stderr.splitlines() if line.strip()][-1]
    assert last.startswith("error: ") and message in last, proc.stderr
    assert "Loading weights" not in proc.stderr  # refused before the weights were read
