"""Nothing in a checkpoint folder runs code: every file that accelerate, torch or DeepSpeed would
unpickle on resume is checked here first, before any model is built.

Unpickling runs whatever callable the pickle names (`os.system`, `builtins.exec`...), and several
loaders on the resume path unpickle with no restriction: torch.distributed.checkpoint reads
`.metadata` with `pickle.load` and the non-tensor items of its `.distcp` files with
`torch.load(weights_only=False)` (FSDP2, tensor parallel), DeepSpeed reads its `*.pt` files with
`torch.load(weights_only=False)`. Checksums cannot help: whoever can write the folder can recompute
them. So each pickle is read by `_Scanner`, an unpickler whose every class and function is an inert
stub: it builds nothing and calls nothing, and refuses any global that is not on the allowlist of
that kind of file. torch's zip files (`torch.save`) are opened as zips: the pickle inside
(`<archive>/data.pkl`) is scanned, the tensor bytes beside it are never unpickled. A file that fails
is one line naming it and the global it wanted (`Refused`), and the run stops: a damaged file is
`ConfigError` (the caller may fall back to an older checkpoint, as for a bad checksum).

Files no loader unpickles (safetensors, JSON, DeepSpeed's `latest` and its copied `zero_to_fp32.py`,
which nothing runs) are not read here; tensors inside `.distcp` files are loaded by DCP with
`weights_only=True`.
"""

from __future__ import annotations

import io
import pickle
import re
import tarfile
import zipfile
from pathlib import Path

from common.config import ConfigError

_TORCH_DTYPES = {f"torch.{name}" for name in (
    "float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool", "complex64",
    "complex128", "float8_e4m3fn", "float8_e5m2")}
_TORCH_STORAGES = {f"torch.{kind}Storage" for kind in (
    "Double", "Float", "Half", "BFloat16", "Long", "Int", "Short", "Char", "Byte", "Bool", "ComplexFloat",
    "ComplexDouble", "Untyped")}
# A tensor in a torch.save file: the storage type names its dtype (the bytes are a separate zip
# entry), _rebuild_tensor_v2 views them with a shape and stride, OrderedDict is its (empty) hooks
# dict and what state_dict() returns.
_TENSORS = {"torch._utils._rebuild_tensor_v2", "collections.OrderedDict", *_TORCH_STORAGES}

ALLOWED: dict[str, frozenset[str]] = {
    # optimizer.bin, scheduler.bin, scaler.pt, pytorch_model.bin (accelerate's save_state): state
    # dicts of tensors, numbers and strings; torch.Size for a shape kept in a state.
    "torch state": frozenset(_TENSORS | {"torch.Size"}),
    # random_states_<rank>.pkl: Python's RNG state is a tuple of ints; numpy's is an array
    # (_reconstruct and ndarray/dtype rebuild it; the uint32 dtype class in numpy >= 1.25, both
    # numpy 1 (numpy.core) and 2 (numpy._core) module names) whose bytes _codecs.encode turns from
    # the pickled latin-1 string back into bytes; torch's is a ByteTensor.
    "RNG state": frozenset(_TENSORS | {
        "_codecs.encode", "numpy.ndarray", "numpy.dtype", "numpy.dtypes.UInt32DType",
        "numpy._core.multiarray._reconstruct", "numpy.core.multiarray._reconstruct"}),
    # DeepSpeed's *_model_states.pt and *_optim_states.pt: state dicts of tensors, plus
    # torch.Size (param_shapes), ZeroStageEnum (the stage it was saved with), LossScaler and
    # DynamicLossScaler (the optimizer's loss scale, fp32/bf16 and fp16; restored by their
    # attributes), fragment_address (ZeRO-1/2: where each parameter lies in the flat partition, two
    # ints), torch.Tensor with _rebuild_from_type_v2 and _rebuild_parameter (tensors saved as a
    # Tensor/Parameter object: ZeRO-3's partitions).
    "DeepSpeed state": frozenset(_TENSORS | {
        "torch.Size", "torch.Tensor", "torch._tensor._rebuild_from_type_v2", "torch._utils._rebuild_parameter",
        "torch.nn.parameter.Parameter", "deepspeed.runtime.zero.config.ZeroStageEnum",
        "deepspeed.runtime.fp16.loss_scaler.LossScaler", "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
        "deepspeed.utils.tensor_fragment.fragment_address"}),
    # torch.distributed.checkpoint's .metadata (FSDP2's model and optimizer folders, the tensor-
    # parallel model_optimizer_dcp/): its own dataclasses describing each tensor (dtype, layout via
    # _get_layout, memory format enum, shape as torch.Size, chunks) and where its bytes lie
    # (_StorageInfo); StorageMeta records the folder as a PosixPath.
    "DCP metadata": frozenset(_TORCH_DTYPES | {
        "torch.Size", "torch.serialization._get_layout", "pathlib.PosixPath",
        *(f"torch.distributed.checkpoint.metadata.{name}" for name in (
            "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
            "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")),
        "torch.distributed.checkpoint.filesystem._StorageInfo"}),
    # a non-tensor item inside a .distcp file (an optimizer's param_group settings: lr, betas,
    # flags): plain numbers, strings, tuples; a tensor-valued setting as a tensor.
    "DCP item": frozenset(_TENSORS | {"torch.Size"}),
}


class Refused(ConfigError):
    """A checkpoint file that would run code, or that cannot be checked: the run stops (it is not
    damage, so `--resume_from_checkpoint auto` does not fall back past it)."""


class _Forbidden(Exception):
    def __init__(self, name: str):
        super().__init__(name)
        self.name = name


class _Stub:
    """Stands for every class and function while scanning: takes any arguments and state, does nothing."""

    def __new__(cls, *args, **kwargs):
        return object.__new__(cls)

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return _Stub()

    def __setstate__(self, state):
        pass

    def __setitem__(self, key, value):
        pass

    def append(self, value):
        pass

    def extend(self, values):
        pass


class _Scanner(pickle.Unpickler):
    """Reads a pickle through to its end with every global replaced by _Stub: nothing is built,
    nothing is called. `allowed` None: records the globals instead (to write an allowlist)."""

    def __init__(self, file, allowed: frozenset[str] | None):
        super().__init__(file)
        self.allowed, self.seen = allowed, set()

    def find_class(self, module, name):
        full = f"{module}.{name}"
        if self.allowed is not None and full not in self.allowed:
            raise _Forbidden(full)
        self.seen.add(full)
        return _Stub

    def persistent_load(self, pid):  # torch's storages: their bytes are other zip entries, not read here
        return _Stub()


class _Restricted(pickle.Unpickler):
    """Loads a pickle _Scanner passed, for real, the same allowlist enforced again."""

    def __init__(self, file, allowed: frozenset[str]):
        super().__init__(file)
        self.allowed = allowed

    def find_class(self, module, name):
        if f"{module}.{name}" not in self.allowed:
            raise _Forbidden(f"{module}.{name}")
        return super().find_class(module, name)


def scan(data: bytes, allowed: frozenset[str] | None, where: str, kind: str) -> set[str]:
    """The globals a pickle names, or Refused naming the first one `allowed` lacks; ConfigError
    when it is not a readable pickle. `where` names the file in the messages."""
    scanner = _Scanner(io.BytesIO(data), allowed)
    try:
        scanner.load()
    except _Forbidden as err:
        raise Refused(f"{where} wants {err.name}, which a {kind} file of a checkpoint never needs (allowed: "
                      f"{_short(allowed)}): refused, nothing was loaded; the folder holds a file this project "
                      "did not write (someone changed it): do not resume from it") from None
    except Exception as err:  # noqa: BLE001 - any way a damaged pickle fails to parse
        raise ConfigError(f"{where} is not a readable pickle ({type(err).__name__}: {err})") from None
    return scanner.seen


def _short(allowed) -> str:
    names = sorted(allowed or ())
    return ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")


def _torch_zip(data_or_path, where: str, kind: str, whole: bool = False) -> None:
    """A torch.save file: a zip whose only pickle is <archive>/data.pkl. torch.load unpickles a
    file that is not a zip the old way (and a zip holding constants.pkl as TorchScript): refused.
    whole: read every entry (the zip's CRC-32 finds damage the checksums were not asked to)."""
    source = io.BytesIO(data_or_path) if isinstance(data_or_path, bytes) else data_or_path
    try:
        archive = zipfile.ZipFile(source)
    except (zipfile.BadZipFile, OSError, ValueError):
        if _legacy(source):
            raise Refused(f"{where} is not a torch.save zip file but the old format, which torch would unpickle "
                          "unchecked: refused, nothing was loaded") from None
        raise ConfigError(f"{where} is not a torch.save file (no zip directory at its end)") from None
    with archive:
        names = archive.namelist()
        pickles = [name for name in names if name.endswith(".pkl")]
        if len(pickles) != 1 or not pickles[0].endswith("/data.pkl"):
            raise Refused(f"{where} holds the pickles {pickles or 'none'}, a torch.save file holds data.pkl "
                          "alone: refused, nothing was loaded")
        try:
            if whole:
                for name in names:
                    archive.read(name)
            data = archive.read(pickles[0])
        except (zipfile.BadZipFile, OSError, ValueError, EOFError) as err:
            raise ConfigError(f"{where} cannot be read as a zip ({type(err).__name__}: {err})") from None
    scan(data, ALLOWED[kind], where, kind)


def _legacy(source) -> bool:
    """torch.load's formats before the zip one: a pickle stream (protocol 2+ starts with 0x80) or a tar."""
    if isinstance(source, io.BytesIO):
        return source.getvalue()[:1] == b"\x80" or tarfile.is_tarfile(io.BytesIO(source.getvalue()))
    with open(source, "rb") as f:
        if f.read(1) == b"\x80":
            return True
    return tarfile.is_tarfile(source)


def _dcp_folder(metadata_file: Path) -> None:
    """A torch.distributed.checkpoint folder: its .metadata, then every non-tensor item of its
    .distcp files (DCP loads those with weights_only=False; its tensors with weights_only=True)."""
    data = metadata_file.read_bytes()
    scan(data, ALLOWED["DCP metadata"], str(metadata_file), "DCP metadata")
    try:
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata

        meta = _Restricted(io.BytesIO(data), ALLOWED["DCP metadata"]).load()
        items = [(index, info) for index, info in meta.storage_data.items()
                 if isinstance(meta.state_dict_metadata.get(index.fqn), BytesStorageMetadata)]
    except Exception as err:  # noqa: BLE001 - a metadata object of another shape
        raise ConfigError(f"{metadata_file} is not DCP metadata ({type(err).__name__}: {err})") from None
    folder = metadata_file.parent
    for index, info in items:
        where = f"{folder / str(info.relative_path)} (item {index.fqn})"
        if Path(info.relative_path).name != str(info.relative_path) or getattr(info, "transform_descriptors", None):
            raise Refused(f"{where}: DCP metadata points outside its folder or at transformed bytes, which this "
                          "project never writes: refused, nothing was loaded")
        with open(folder / info.relative_path, "rb") as f:
            f.seek(info.offset)
            blob = f.read(info.length)
        _torch_zip(blob, where, "DCP item")


# (file name pattern, kind); the first that matches. Relative to the checkpoint folder.
KINDS = (
    (r"random_states_\d+\.pkl", "RNG state"),
    (r"custom_checkpoint_\d+\.pkl", None),  # accelerate unpickles these unchecked; train.py registers none
    (r"[^/]+\.(bin|pt)", "torch state"),  # model, optimizer, scheduler, sampler, dataloader, scaler
    (r".+/[^/]+\.pt", "DeepSpeed state"),  # <tag>/(zero_pp_rank_N_)mp_rank_00_{model,optim}_states.pt
    (r"(.+/)?(__\d+)?\.metadata", "DCP metadata"),
)


def check_folder(path: str | Path) -> None:
    """Every file in the checkpoint folder that a loader would unpickle, checked (see the module's
    docstring). Refused or ConfigError, one line naming the file."""
    path = Path(path)
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        name = file.relative_to(path).as_posix()
        kind = next((kind for pattern, kind in KINDS if re.fullmatch(pattern, name)), "")
        if kind is None:
            raise Refused(f"{file}: accelerate would unpickle it unchecked and this project never writes it: "
                          "refused, nothing was loaded")
        if kind == "DCP metadata":
            _dcp_folder(file)
        elif kind:
            _torch_zip(file, str(file), kind, whole=kind == "RNG state")
            if kind == "RNG state":
                _check_rng(file)


def _check_rng(file: Path) -> None:
    """accelerate loads random_states_<rank>.pkl in a try block that logs and skips any failure: a
    damaged one would resume with other random numbers, silently. Loaded here (weights_only, the
    same safe globals as accelerate) and its parts checked, so damage is one line instead."""
    import torch
    from accelerate.utils import load

    try:
        states = load(file)
        parts = (states["random_state"], states["numpy_random_seed"], states["torch_manual_seed"])
        ok = isinstance(parts[0], tuple) and isinstance(parts[1], tuple) and parts[2].dtype == torch.uint8
    except Exception as err:  # noqa: BLE001 - anything accelerate would have skipped
        raise ConfigError(f"{file} does not load ({type(err).__name__}: {err}): the run's random state cannot be "
                          "restored") from None
    if not ok:
        raise ConfigError(f"{file} does not hold the random states accelerate saves")
