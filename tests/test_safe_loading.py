"""Nothing from a checkpoint runs code (train_extras/resume/safe_load.py).

Each test plants a payload, a pickle whose __reduce__ runs `builtins.exec` to create a marker file,
into one kind of pickled file of a real checkpoint of one strategy, then recomputes every checksum
the way checkpoint.save does (the files' sizes and xxh3 digests, and checkpoint.json's own), so that
only the new check can catch it: it must be refused in one line naming the file, and the marker must
not appear. The checkpoints: the committed release ones (one process, FSDP2, ZeRO-3 with offload),
and those the session's fixtures write anyway (DDP, fp16's GradScaler; tensor parallel in
tests/test_tensor_parallel.py, beside its fixture).
"""

from __future__ import annotations

import json
import pickle
import shutil
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
import torch

from common.config import ConfigError
from train_extras.resume import checkpoint, safe_load
from conftest import ROOT, launch

RELEASE = ROOT / "tests" / "data" / "release_checkpoints" / "a52d62f"


class Payload:
    """Unpickled, creates `marker`: what an attacker's file would do (run a command)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').close()",)


def release_checkpoint(name: str, into: Path) -> Path:
    """The committed step_3 of a release run, unpacked into a temporary output folder."""
    record = json.loads((RELEASE / name / "release.json").read_text())
    with tarfile.open(RELEASE / name / record["archive"]) as tar:
        tar.extractall(into / "checkpoints", filter="data")
    return into / "checkpoints" / record["checkpoint"]


def copy_checkpoint(step_dir: Path, into: Path) -> Path:
    target = into / "checkpoints" / step_dir.name
    shutil.copytree(step_dir, target)
    return target


def reseal(step_dir: Path) -> None:
    """Every file's size and checksum, and checkpoint.json's own checksum, recomputed as save() does."""
    meta = json.loads((step_dir / checkpoint.METADATA).read_text())
    for name in meta["files"]:
        meta["files"][name] = (step_dir / name).stat().st_size
        meta["checksums"][name] = checkpoint.file_digest(step_dir / name)
    meta.pop("metadata_checksum")
    meta["metadata_checksum"] = checkpoint.metadata_digest(meta)
    (step_dir / checkpoint.METADATA).write_text(json.dumps(meta))


def plant_torch_file(file: Path, marker: Path) -> None:
    """A torch.save zip (optimizer, scheduler, RNG, scaler, DeepSpeed states) whose data.pkl calls exec."""
    torch.save({"state": Payload(marker)}, file)


def plant_raw_pickle(file: Path, marker: Path) -> None:
    """DCP's .metadata, which torch unpickles with plain pickle.load."""
    file.write_bytes(pickle.dumps(Payload(marker)))


def plant_dcp_item(folder: Path, marker: Path) -> None:
    """A non-tensor item of a .distcp file (DCP: torch.load(weights_only=False)): the payload appended
    to the file and the (genuine) metadata pointed at it."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    metadata = pickle.loads((folder / ".metadata").read_bytes())
    index, info = next((index, info) for index, info in metadata.storage_data.items()
                       if isinstance(metadata.state_dict_metadata[index.fqn], BytesStorageMetadata))
    blob = __import__("io").BytesIO()
    torch.save(Payload(marker), blob)
    shard = folder / info.relative_path
    info.offset, info.length = shard.stat().st_size, len(blob.getvalue())
    with open(shard, "ab") as f:
        f.write(blob.getvalue())
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))


def refused(step_dir: Path, file: str, marker: Path, wants: str = "exec") -> str:
    """The check refuses the resealed checkpoint naming `file` (and the global), marker absent."""
    reseal(step_dir)
    with pytest.raises(safe_load.Refused) as err:
        checkpoint.verify(step_dir)
    line = str(err.value)
    assert "\n" not in line and str(step_dir / file) in line and wants in line, line
    with pytest.raises(safe_load.Refused):  # also without the content checksums
        checkpoint.verify(step_dir, contents=False)
    assert not marker.exists()
    return line


# (release checkpoint, file, how to plant): every pickled file kind the committed checkpoints hold
RELEASE_CASES = [
    ("cpu", "optimizer.bin", plant_torch_file),
    ("cpu", "scheduler.bin", plant_torch_file),
    ("cpu", "random_states_0.pkl", plant_torch_file),
    ("fsdp", "pytorch_model_fsdp_0/.metadata", plant_raw_pickle),
    ("fsdp", "optimizer_0/.metadata", plant_raw_pickle),
    ("fsdp", "random_states_1.pkl", plant_torch_file),
    ("deepspeed_zero3_offload", "pytorch_model/zero_pp_rank_0_mp_rank_00_model_states.pt", plant_torch_file),
    ("deepspeed_zero3_offload", "pytorch_model/zero_pp_rank_1_mp_rank_00_optim_states.pt", plant_torch_file),
]


@pytest.mark.quick
@pytest.mark.parametrize("name, file, plant", RELEASE_CASES, ids=[f"{n}:{f}" for n, f, _ in RELEASE_CASES])
def test_a_payload_in_a_release_checkpoint_is_refused(name, file, plant, tmp_path):
    step_dir = release_checkpoint(name, tmp_path / "run")
    checkpoint.verify(step_dir)  # the clean checkpoint passes
    marker = tmp_path / "marker"
    plant(step_dir / file, marker)
    refused(step_dir, file, marker)


@pytest.mark.quick
def test_a_payload_in_a_dcp_item_is_refused(tmp_path):
    step_dir = release_checkpoint("fsdp", tmp_path / "run")
    marker = tmp_path / "marker"
    plant_dcp_item(step_dir / "optimizer_0", marker)
    line = refused(step_dir, "optimizer_0/__", marker)
    assert "(item optimizer.param_groups." in line


@pytest.mark.quick
def test_files_torch_would_unpickle_unchecked_are_refused(tmp_path):
    """The old (non-zip) torch.save format and accelerate's custom_checkpoint_N.pkl are loaded with no
    allowlist at all: refused whatever they hold."""
    step_dir = release_checkpoint("cpu", tmp_path / "run")
    marker = tmp_path / "marker"
    plant_raw_pickle(step_dir / "scheduler.bin", marker)
    assert "not a torch.save zip file" in refused(step_dir, "scheduler.bin", marker, wants="unchecked")
    step_dir = release_checkpoint("cpu", tmp_path / "run2")
    (step_dir / "custom_checkpoint_0.pkl").write_bytes(pickle.dumps(Payload(marker)))
    refused(step_dir, "custom_checkpoint_0.pkl", marker, wants="unchecked")


@pytest.mark.parametrize("pair, file", [("train.py/ddp.yaml", "random_states_1.pkl"),
                                        ("train.py/ddp.yaml", "optimizer.bin")])
def test_a_payload_in_a_ddp_checkpoint_is_refused(pair, file, two_process_runs, tmp_path):
    step_dir = copy_checkpoint(two_process_runs(pair).output_dir / "checkpoints" / "step_30", tmp_path / "run")
    checkpoint.verify(step_dir)
    marker = tmp_path / "marker"
    plant_torch_file(step_dir / file, marker)
    refused(step_dir, file, marker)


def test_a_payload_in_the_grad_scaler_is_refused(fp16_train_run, tmp_path):
    step_dir = copy_checkpoint(fp16_train_run.output_dir / "checkpoints" / "step_20", tmp_path / "run")
    checkpoint.verify(step_dir)
    marker = tmp_path / "marker"
    plant_torch_file(step_dir / "scaler.pt", marker)
    refused(step_dir, "scaler.pt", marker)


@pytest.mark.quick
def test_a_damaged_rng_file_is_one_line_also_unverified(tmp_path):
    """accelerate logs and skips a random_states file it cannot load: here it is one line, with the
    content checksums off too (a file damaged inside a tensor's bytes: the zip's CRC-32 finds it)."""
    step_dir = release_checkpoint("cpu", tmp_path / "run")
    rng = step_dir / "random_states_0.pkl"
    with zipfile.ZipFile(rng) as archive:  # a byte in the middle of the largest tensor's bytes
        entry = max(archive.infolist(), key=lambda info: info.file_size)
    data = bytearray(rng.read_bytes())
    data[entry.header_offset + 30 + len(entry.filename) + len(entry.extra) + entry.file_size // 2] ^= 0xFF
    rng.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match=f"checkpoint {step_dir} is damaged: {rng}") as err:
        checkpoint.verify(step_dir, contents=False)
    assert not isinstance(err.value, safe_load.Refused) and "\n" not in str(err.value)
    rng.write_bytes(b"")  # empty, its size recorded as such (a save that wrote nothing)
    reseal(step_dir)
    with pytest.raises(ConfigError, match=f"{rng} is not a torch.save file") as err:
        checkpoint.verify(step_dir, contents=False)
    assert not isinstance(err.value, safe_load.Refused)


@pytest.mark.quick
def test_auto_does_not_fall_back_past_a_refused_checkpoint(tmp_path):
    """A damaged checkpoint is set aside and an older one resumed; a refused one stops the run (someone
    wrote into the folder: a person must look), and nothing is moved."""
    from accelerate import Accelerator

    from conftest import parse_train

    out = tmp_path / "run"
    older = release_checkpoint("cpu", out)
    newer = copy_checkpoint(older, tmp_path / "newer")
    newer = newer.rename(out / "checkpoints" / "step_4")
    marker = tmp_path / "marker"
    plant_torch_file(newer / "optimizer.bin", marker)
    reseal(newer)
    cfg = parse_train(["--output_dir", str(out), "--resume_from_checkpoint", "auto"])
    with pytest.raises(safe_load.Refused, match="optimizer.bin wants __builtin__.exec"):
        checkpoint.resume_point(cfg, Accelerator(cpu=True))
    assert newer.is_dir() and not marker.exists()


def test_a_resume_with_a_payload_runs_nothing(tmp_path, hf_home):
    """End to end, FSDP2 on 2 processes: the resume stops before any model is built, one line naming
    the file, non-zero exit, no marker (on ad106ca both ranks ran the payload, then trained on).
    (ZeRO-3's launch costs ~90 s here; its files are refused in-process above, by the same verify.)"""
    name, file = "fsdp", "pytorch_model_fsdp_0/.metadata"
    out = tmp_path / "run"
    step_dir = release_checkpoint(name, out)
    marker = tmp_path / "marker"
    (plant_raw_pickle if file.endswith(".metadata") else plant_torch_file)(step_dir / file, marker)
    reseal(step_dir)
    record = json.loads((RELEASE / name / "release.json").read_text())
    proc = launch("train.py", record["args"] + ["--output_dir", str(out), "--resume_from_checkpoint", "auto"],
                  hf_home, config=record["config"], launch_args=record["launch_args"], env=record["env"], check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode != 0 and len(errors) == 1, proc.stderr[-3000:]
    assert f"{step_dir / file} wants " in errors[0] and "exec" in errors[0]
    assert not marker.exists() and not (out / "run_summary.json").exists()


# ---- a model folder's own code (--trust_remote_code) ----

CUSTOM_CODE = '''import pathlib

pathlib.Path({marker!r}).touch()  # the folder's code ran

from transformers import LlamaConfig, LlamaForCausalLM


class MarkerConfig(LlamaConfig):
    model_type = "marker_llama"


class MarkerModel(LlamaForCausalLM):
    config_class = MarkerConfig
'''


def custom_code_folder(folder: Path, marker: Path) -> Path:
    """A model folder whose config names classes of its own Python file (auto_map)."""
    folder.mkdir()
    (folder / "custom.py").write_text(CUSTOM_CODE.format(marker=str(marker)))
    (folder / "config.json").write_text(json.dumps({
        "model_type": "marker_llama", "auto_map": {"AutoConfig": "custom.MarkerConfig",
                                                   "AutoModelForCausalLM": "custom.MarkerModel"},
        "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
        "intermediate_size": 32, "vocab_size": 259, "max_position_embeddings": 64}))
    return folder


@pytest.mark.quick
def test_a_folder_with_its_own_code_needs_trust_remote_code(tmp_path, monkeypatch):
    """Without the option: one line naming it, no [y/N] prompt (stdin closed: the prompt would be an
    EOFError), the folder's code never imported. With it: the config and the model class load."""
    from common import model as modeling
    from conftest import load_recipe, parse_train
    from train_extras.observe import flops

    marker = tmp_path / "marker"
    folder = custom_code_folder(tmp_path / "custom_model", marker)
    monkeypatch.setattr("sys.stdin", __import__("io").StringIO(""))
    # transformers copies trusted folder code into its modules cache and puts it on sys.path:
    # the test's own, not the user's ~/.cache/huggingface/modules
    monkeypatch.setattr("transformers.dynamic_module_utils.HF_MODULES_CACHE", str(tmp_path / "modules"))
    monkeypatch.setattr("sys.path", list(sys.path))
    cfg = parse_train(["--model_name_or_path", str(folder)])
    generate = load_recipe("generate")
    for refused_here in (lambda: modeling.model_config(cfg), lambda: modeling.check_seq_len(cfg),
                         lambda: generate.check_causal_lm(str(folder))):
        with pytest.raises(ConfigError, match=f"^{folder} ships its own Python code .* pass --trust_remote_code"):
            refused_here()
    assert not marker.exists()
    cfg = parse_train(["--model_name_or_path", str(folder), "--trust_remote_code", "true"])
    config = modeling.model_config(cfg)
    assert type(config).__name__ == "MarkerConfig" and marker.exists()
    assert type(flops.meta_model(config)).__name__ == "MarkerModel"
    generate.check_causal_lm(str(folder), trust_remote_code=True)
