"""Checkpoints of earlier releases: every later version resumes each exactly, or refuses it in one line.

tests/data/release_checkpoints/<commit>/<name>/ holds a checkpoint that recipes/train.py of that
commit wrote (step_3.tar.xz: the step_3 folder byte for byte) and release.json: the launch that
wrote it (accelerate config, launch options, environment, train.py's options) and the per-step
losses of that same run, which never stopped (the folder's README.md says how they were made;
tests/scripts/make_release_checkpoints.py makes a new release's set). Each is unpacked into a
temporary output folder (tests/data is never written; the run's lock and new checkpoints go to the
copy) and resumed there by this checkout with the same launch plus `--resume_from_checkpoint auto`:
one launch per checkpoint, against the recorded reference (no uninterrupted run is launched).

The runs start from the release's own tiny model (`--model_name_or_path` relative to the repository
root, where the tests launch) and train on the default corpus, tiny Shakespeare from common/corpus/,
which a checkpoint records as no data files at all: both resolve the same in any clone.

The recorded losses are bits of one toolchain on one kind of CPU. Measured for a52d62f's set (torch
2.13, made with AVX512 kernels): the resumes give them bitwise with torch's AVX512 and AVX2 kernels
(ATEN_CPU_CAPABILITY), MKL limited to SSE4.2, 1 or 2 threads per process; with the scalar kernels
(ATEN_CPU_CAPABILITY=default, as a CPU without AVX2 gets) FSDP2's and ZeRO-3's step-4 loss moves by
one float32 ulp (4.8e-7). A toolchain that moves them fails here with both versions named.
"""

from __future__ import annotations

import hashlib
import json
import tarfile
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator

from common.config import ConfigError
from train_extras.resume import checkpoint
from conftest import ROOT, launch, parse_train, read_summary

RELEASE_ROOT = ROOT / "tests" / "data" / "release_checkpoints"
RELEASES = sorted(path.parent for path in RELEASE_ROOT.glob("*/*/release.json"))
# A version that stops reading one of them lists it here, "<commit>/<name>": the one line it prints
# instead ({checkpoint}: the unpacked step folder), with a non-zero exit and nothing trained. Empty:
# every release checkpoint resumes exactly.
REFUSED: dict[str, str] = {}


def release_id(folder: Path) -> str:
    return f"{folder.parent.name}/{folder.name}"


def digests(root: Path) -> dict:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def unpack(folder: Path, record: dict, output_dir: Path) -> Path:
    """The release's checkpoint as <output_dir>/checkpoints/step_N, as the run that wrote it left it."""
    checkpoints = output_dir / "checkpoints"
    checkpoints.mkdir(parents=True)
    with tarfile.open(folder / record["archive"]) as tar:
        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}  # Python >= 3.10.12
        tar.extractall(checkpoints, **safe)
    return checkpoints / record["checkpoint"]


@pytest.mark.quick
def test_the_first_release_is_there():
    assert {"a52d62f/cpu", "a52d62f/fsdp", "a52d62f/deepspeed_zero3_offload"} <= set(map(release_id, RELEASES))


@pytest.mark.parametrize("folder", RELEASES, ids=release_id)
def test_a_release_checkpoint_resumes_exactly_or_is_refused_in_one_line(folder, tmp_path, hf_home):
    record = json.loads((folder / "release.json").read_text())
    before = digests(folder.parent)
    out = tmp_path / "run"
    step_dir = unpack(folder, record, out)
    proc = launch("train.py", record["args"] + ["--output_dir", str(out), "--resume_from_checkpoint", "auto"],
                  hf_home, config=record["config"], launch_args=record["launch_args"], env=record["env"], check=False)
    assert digests(folder.parent) == before  # the release's files (its model included) are only read
    if release_id(folder) in REFUSED:
        errors = {line for line in proc.stderr.splitlines() if line.startswith("error: ")}
        refusal = REFUSED[release_id(folder)].format(checkpoint=step_dir)
        assert proc.returncode != 0 and errors == {refusal}, proc.stderr[-3000:]
        assert not (out / "run_summary.json").exists()
        return
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    summary = read_summary(out)
    resumed_from = summary["resumed_from"]
    assert (resumed_from["path"], resumed_from["step"], resumed_from["changed"]) == (str(step_dir), record["step"], {})
    expected = {int(step): loss for step, loss in record["losses"].items() if int(step) > record["step"]}
    resumed = {row["step"]: row["loss"] for row in summary["losses"]}
    # bitwise the losses the run that never stopped had at these steps (on which machines: above)
    made = record["made"]
    assert resumed == expected, (f"recorded with torch {made['torch']} ({made['torch_cpu_capability']}), this is "
                                 f"torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()})")


@pytest.mark.quick
def test_an_option_the_checkpoint_does_not_record_takes_its_default(tmp_path):
    """A checkpoint written before an option existed lacks it in checkpoint.json: it was trained as
    the option's default says (or as BEFORE_THE_OPTION says, where the default is not what the
    older code did), and is checked and reported against that, never skipped. Here --packing and
    --eval_batches stand for options added after a52d62f: removed from its recorded options."""
    folder = RELEASE_ROOT / "a52d62f" / "cpu"
    record = json.loads((folder / "release.json").read_text())
    step_dir = unpack(folder, record, tmp_path / "run")
    meta = checkpoint.verify(step_dir)
    older = {**meta, "config": {k: v for k, v in meta["config"].items() if k not in ("packing", "eval_batches")}}
    as_made = parse_train(record["args"])
    assert checkpoint.saved_options(older, as_made)["packing"] is True  # the option's default
    assert checkpoint.saved_options(older, as_made)["eval_batches"] == 0
    accelerator = Accelerator(cpu=True)
    assert checkpoint.check_compatible(step_dir, as_made, accelerator, older) is older
    with pytest.raises(ConfigError, match=r"--packing True \(this run: False\)"):  # not skipped as unknown
        checkpoint.check_compatible(step_dir, parse_train(record["args"] + ["--packing", "false"]), accelerator, older)
    assert checkpoint.resume_changes(older, parse_train(record["args"] + ["--eval_batches", "5"])) == \
        {"eval_batches": [0, 5]}
    # and an option whose default is not what older code did takes BEFORE_THE_OPTION's value
    no_mask = {**meta, "config": {k: v for k, v in meta["config"].items() if k != "document_mask"}}
    assert checkpoint.saved_options(no_mask, as_made)["document_mask"] is False
