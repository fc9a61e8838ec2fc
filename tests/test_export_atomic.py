"""The Hugging Face export is replaced whole (common/export.py, common/files.py): a kill at any moment
of an export over an earlier one leaves `model/` loading, with its tokenizer, as the earlier export or
as the new one, and the next export clears what the kill left. The kills are the probes'
(ACCELERATE_RECIPES_FAULT=export_<phase>, tests/probes/sitecustomize.py): in a small process that
exports a tiny model (tests/scripts/export_over.py), and once in a real train.py export."""

import importlib.util
import os
import shutil
import subprocess
import sys

import pytest
import torch
from accelerate import Accelerator
from transformers import AutoModelForCausalLM, AutoTokenizer

from common import files
from common.data import build_tokenizer
from common.export import export_pretrained
from conftest import ROOT, TRAIN_ARGS, launch, launch_env
from probes.sitecustomize import FAULT_EXIT_CODE, PROBE_INPUT_IDS
from train_extras.options import TrainConfig

SCRIPT = ROOT / "tests" / "scripts" / "export_over.py"
_spec = importlib.util.spec_from_file_location("export_over", SCRIPT)
export_over = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(export_over)  # its tiny_model(seed): the models the script exports
SEEDS = {"old": 1, "new": 2}

# case -> (--two_renames, what model/ holds once the kill has hit: None = missing, what the output folder holds)
CASES = {
    "export_mid_weights": (False, "old", [".model.partial", "model"]),
    "export_after_weights": (False, "old", [".model.partial", "model"]),
    "export_after_tokenizer": (False, "old", [".model.partial", "model"]),
    "export_before_swap": (False, "old", [".model.partial", "model"]),
    "export_after_swap": (False, "new", [".model.partial", "model"]),  # .model.partial: the old export now
    "export_removing_old": (False, "new", [".model.partial", "model"]),
    # a file system that cannot swap two folders in one step (NFS): two renames, model/ missing between them
    "two renames, export_set_aside": (True, None, [".model.old", ".model.partial"]),
    "two renames, export_removing_old": (True, "new", [".model.partial", "model"]),
}


@pytest.fixture(scope="module")
def models():
    return {name: export_over.tiny_model(seed).eval() for name, seed in SEEDS.items()}


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer(TrainConfig())


def logits_of(model) -> torch.Tensor:
    with torch.no_grad():
        return model.float()(torch.tensor([PROBE_INPUT_IDS])).logits[0]


def loads_as(folder, models, tokenizer) -> str:
    """Which of the two models the folder is, as plain transformers loads it, tokenizer included."""
    loaded = AutoModelForCausalLM.from_pretrained(folder)
    assert AutoTokenizer.from_pretrained(folder)("ROMEO: o").input_ids == tokenizer("ROMEO: o").input_ids
    logits = logits_of(loaded)
    same = [name for name, model in models.items() if torch.allclose(logits, logits_of(model), atol=1e-6)]
    assert len(same) == 1, f"{folder} is neither export"
    return same[0]


@pytest.fixture(scope="module")
def killed_exports(tmp_path_factory, hf_home, models, tokenizer):
    """Per case: a copy of the old export, and the process that exported the new model over it, killed.
    All at once (each process spends its ~6 s importing torch and transformers)."""
    root = tmp_path_factory.mktemp("killed_exports")
    template = root / "template"
    export_pretrained(Accelerator(cpu=True), models["old"], tokenizer, template / "model")
    started = {}
    for i, (case, (two_renames, _, _)) in enumerate(CASES.items()):
        folder = root / f"case{i}"
        shutil.copytree(template, folder)
        env = {**launch_env(hf_home), "ACCELERATE_RECIPES_FAULT": case.split(", ")[-1]}
        cmd = [sys.executable, str(SCRIPT), str(folder / "model"), str(SEEDS["new"])] + ["--two_renames"] * two_renames
        started[case] = folder, subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    results = {}
    for case, (folder, proc) in started.items():
        _, err = proc.communicate(timeout=300)
        results[case] = folder, proc.returncode, err
    return results


@pytest.mark.parametrize("case", CASES)
def test_a_kill_at_any_moment_of_an_export_leaves_the_old_or_the_new_one_whole(case, killed_exports, models,
                                                                                  tokenizer):
    folder, code, err = killed_exports[case]
    _, holds, names = CASES[case]
    phase = case.split(", ")[-1]
    assert code == FAULT_EXIT_CODE and f"stops dead at {phase}\n" in err, err[-3000:]
    assert sorted(os.listdir(folder)) == names
    if holds is None:  # between the two renames: the old export whole beside the missing model/
        assert loads_as(folder / ".model.old", models, tokenizer) == "old"
    else:
        assert loads_as(folder / "model", models, tokenizer) == holds

    # The next export first undoes what the kill left (the old export back in place, the leftovers
    # gone: a killed export's stray files never accumulate) ...
    files.recover_dir(folder / "model")
    assert os.listdir(folder) == ["model"]
    assert loads_as(folder / "model", models, tokenizer) == (holds or "old")
    # ... and then replaces it whole.
    assert export_pretrained(Accelerator(cpu=True), models["new"], tokenizer, folder / "model") == folder / "model"
    assert os.listdir(folder) == ["model"]
    assert loads_as(folder / "model", models, tokenizer) == "new"


def test_a_kill_during_train_py_s_export_over_a_finished_run_leaves_that_run_s_export(tmp_path, hf_home, train_run):
    """The real export, launched: a copy of train_run's folder (60 steps, an fp32 export, step_60 saved)
    resumed at its last step, so nothing trains and the run exports again, this time in bf16; killed
    half-way through writing the weights. (Resuming its own checkpoint, the run may replace the folder's
    finished run without --overwrite_output_dir.)"""
    out = tmp_path / "run"
    shutil.copytree(train_run.output_dir, out)
    summary = (out / "run_summary.json").read_bytes()
    args = TRAIN_ARGS + ["--export_dtype", "bfloat16", "--resume_from_checkpoint", "auto", "--output_dir", str(out)]
    proc = launch("train.py", args, hf_home, check=False, env={"ACCELERATE_RECIPES_FAULT": "export_mid_weights"})
    assert proc.returncode != 0 and "stops dead at export_mid_weights\n" in proc.stderr, proc.stderr[-3000:]
    assert f"resumed from {out / 'checkpoints' / 'step_60'} at step 60" in proc.stdout

    model = AutoModelForCausalLM.from_pretrained(out / "model")
    AutoTokenizer.from_pretrained(out / "model")
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # the first export, not the bf16 one
    trained = torch.tensor(train_run.final[0]["probe_logits"])
    assert (logits_of(model) - trained).abs().max().item() < 1e-5
    assert (out / "run_summary.json").read_bytes() == summary  # the run's record as it was
    half = out / ".model.partial" / "model.safetensors"  # the new weights, cut half-way, beside it
    assert 0 < half.stat().st_size < (out / "model" / "model.safetensors").stat().st_size
