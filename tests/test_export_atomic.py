"""The Hugging Face export is replaced whole (common/export.py, common/files.py): a kill at any moment
of an export over an earlier one leaves `model/` loading, with its tokenizer, as the earlier export or
as the new one, and the next export clears what the kill left. The kills are the probes'
(ACCELERATE_RECIPES_FAULT=export_<phase>, tests/probes/sitecustomize.py): in a small process that
exports a tiny model (tests/scripts/export_over.py), and once in a real train.py export. The export
replaces only an export this project wrote, known by its marker (issue 42), in this process."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from accelerate import Accelerator
from transformers import AutoModelForCausalLM, AutoTokenizer

from common import files
from common.config import ConfigError
from common.data import build_tokenizer
from common.export import MARKER, export_pretrained, not_an_export
from conftest import ROOT, TRAIN_ARGS, launch, launch_env
from probes.sitecustomize import FAULT_EXIT_CODE, PROBE_INPUT_IDS
from test_output_folder import contents, users_model_package
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


# ---- only an export this project wrote is replaced ----
def test_an_export_goes_in_with_its_marker_and_the_next_export_replaces_it(tmp_path, models, tokenizer):
    """The marker is written into the new folder before the swap (a kill leaves the export marked or
    not there), listing every file of it."""
    out = tmp_path / "model"
    export_pretrained(Accelerator(cpu=True), models["old"], tokenizer, out)
    written = ["config.json", "generation_config.json", "model.safetensors", "tokenizer_config.json"]
    assert sorted(os.listdir(out)) == sorted([MARKER, *written])
    assert json.loads((out / MARKER).read_text()) == {"written_by": "accelerate-recipes", "files": written}
    export_pretrained(Accelerator(cpu=True), models["new"], tokenizer, out)
    assert loads_as(out, models, tokenizer) == "new" and not_an_export(out) is None
    assert os.listdir(tmp_path) == ["model"]


def an_unmarked_export(folder):
    export_pretrained(Accelerator(cpu=True), export_over.tiny_model(SEEDS["old"]), build_tokenizer(TrainConfig()),
                      folder / "model")
    (folder / "model" / MARKER).unlink(missing_ok=True)  # (on main before the marker: none to remove)


@pytest.mark.parametrize("make, holds", [
    (users_model_package, "__init__.py, net.py"),  # before: deleted by the export
    (an_unmarked_export, "config.json, generation_config.json, model.safetensors, tokenizer_config.json"),
])
def test_a_folder_not_marked_as_an_export_is_refused_in_one_line_and_kept(make, holds, tmp_path, models,
                                                                          tokenizer):
    """A user's `model/` package, or an export written before the marker existed (refused too:
    move it away)."""
    make(tmp_path)
    before = contents(tmp_path)
    with pytest.raises(ConfigError) as refused:
        export_pretrained(Accelerator(cpu=True), models["new"], tokenizer, tmp_path / "model")
    assert str(refused.value) == (f"{tmp_path / 'model'} (no export marker {MARKER}; holds {holds}): nothing marks it "
                                  "as an export of this project, and the export would replace it; move it away, or "
                                  "choose another --output_dir")
    assert contents(tmp_path) == before  # byte for byte, and nothing written beside it


@pytest.mark.parametrize("leftover", [".model.partial", ".model.old"])
def test_a_leftover_name_that_is_a_link_is_removed_and_never_followed(leftover, tmp_path, models, tokenizer):
    """What a killed export leaves has these names; a link of such a name, to a user's folder: before,
    rmtree refused it with a raw OSError (.model.partial), or the link was renamed to model/ and
    left beside the export (.model.old)."""
    users_model_package(tmp_path / "theirs")
    before = contents(tmp_path / "theirs")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / leftover).symlink_to(tmp_path / "theirs" / "model")
    export_pretrained(Accelerator(cpu=True), models["new"], tokenizer, tmp_path / "run" / "model")
    assert os.listdir(tmp_path / "run") == ["model"]
    assert loads_as(tmp_path / "run" / "model", models, tokenizer) == "new"
    assert contents(tmp_path / "theirs") == before
