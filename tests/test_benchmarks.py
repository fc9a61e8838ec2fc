"""The overhead benchmark compares train.py with benchmarks/plain_loop.py; that comparison means
something only if both train the same model on the same batches. Checked here on the debug preset."""

import subprocess
import sys

from conftest import DEBUG_ARGS, ROOT, launch_env, read_summary


def test_the_plain_loop_trains_exactly_what_train_py_trains(tmp_path, hf_home, train_run):
    proc = subprocess.run([sys.executable, "benchmarks/plain_loop.py", *DEBUG_ARGS, "--output_dir", str(tmp_path)],
                          cwd=ROOT, env={**launch_env(hf_home), "OMP_NUM_THREADS": "2"}, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    plain = [row["loss"] for row in read_summary(tmp_path)["losses"]]
    recipe = [row["loss"] for row in train_run.summary["losses"]]
    assert len(plain) == len(recipe) == 60
    # same init, data order, optimizer, schedule and clipping: the same losses up to summation order
    assert max(abs(a - b) for a, b in zip(plain, recipe)) < 1e-5
    assert read_summary(tmp_path)["tokens_per_s_median"] > 0
