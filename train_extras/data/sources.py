"""Where train.py's documents come from (docs/data.md): the files, folders, globs or Hub dataset of
the data options (read by common/data.py), where a row of them lies in its file, and a mixture of
such sources (--data_mixture FILE.yaml; docs/data.md#mixtures):

    sources:
      - name: prose                 # optional: default the first file's stem, or the dataset's name
        data_files: [prose.jsonl]   # or dataset_name (+ dataset_config, dataset_split, eval_split)
        weight: 0.8
      - name: chat
        data_files: [chat.jsonl]    # conversations found by their shape (or chat_column)
        eval_data_files: [chat_eval.jsonl]
        weight: 0.2
    stopping_strategy: first_exhausted   # or all_exhausted (datasets' interleave_datasets)

Each source takes the data options of one source (SOURCE_OPTIONS; relative paths from the
working directory, as on the command line) and keeps its own held-out part, cut or given by its
own options. The draw by weight is build.py's (it draws tokenised documents).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
from pathlib import Path

from common import data
from common.config import ConfigError, data_file_list

SOURCE_OPTIONS = ("data_files", "eval_data_files", "dataset_name", "dataset_config", "dataset_split", "eval_split",
                  "txt_documents", "text_column", "chat_column", "eval_fraction")
STOPPING = ("first_exhausted", "all_exhausted")


def read(path: str) -> dict:
    """The mixture file, checked: {"sources": [{name, weight, options}], "stopping_strategy": ...}."""
    import yaml

    try:
        spec = yaml.safe_load(Path(path).read_text())
    except OSError as err:
        raise ConfigError(f"cannot read --data_mixture {path}: {err.strerror}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"--data_mixture {path} is not valid YAML: {str(err).splitlines()[0]}") from None
    where = f"--data_mixture {path}"
    if not isinstance(spec, dict) or not isinstance(spec.get("sources"), list) or not spec["sources"]:
        raise ConfigError(f"{where}: expected a mapping with a non-empty list under 'sources:'")
    unknown = set(spec) - {"sources", "stopping_strategy"}
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {sorted(unknown)} (known: sources, stopping_strategy)")
    stopping = spec.get("stopping_strategy", "first_exhausted")
    if stopping not in STOPPING:
        raise ConfigError(f"{where}: stopping_strategy must be one of {', '.join(STOPPING)}, got {stopping!r}")
    sources = [_source(entry, i, where) for i, entry in enumerate(spec["sources"])]
    names = [s["name"] for s in sources]
    if len(set(names)) != len(names):
        raise ConfigError(f"{where}: source names must differ, got {names} (set 'name:' on each)")
    return {"sources": sources, "stopping_strategy": stopping}


def _source(entry, i: int, where: str) -> dict:
    if not isinstance(entry, dict):
        raise ConfigError(f"{where}: source {i} is not a mapping of options")
    unknown = set(entry) - set(SOURCE_OPTIONS) - {"name", "weight"}
    if unknown:
        raise ConfigError(f"{where}: source {i} has unknown option(s) {sorted(unknown)} (known: name, weight, "
                          f"{', '.join(SOURCE_OPTIONS)})")
    weight = entry.get("weight")
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0 or math.isinf(weight):
        raise ConfigError(f"{where}: source {i} needs a positive 'weight:', got {weight!r}")
    if bool(entry.get("data_files")) == bool(entry.get("dataset_name")):
        raise ConfigError(f"{where}: source {i} needs data_files or dataset_name (one of them)")
    options = {key: entry[key] for key in SOURCE_OPTIONS if key in entry}
    for key in ("data_files", "eval_data_files"):  # one path or a list, as on the command line
        if isinstance(options.get(key), str):
            options[key] = [options[key]]
    name = entry.get("name") or (Path(options["data_files"][0]).stem if "data_files" in options
                                 else str(options["dataset_name"]).rstrip("/").split("/")[-1])
    if not isinstance(name, str) or "/" in name or not name.strip():
        raise ConfigError(f"{where}: source {i}'s name must be a non-empty string without '/', got {name!r}")
    return {"name": name, "weight": float(weight), "options": options}


def source_config(cfg, source: dict):
    """The run's options with this source's data options in place of the run-level ones (which a
    mixture leaves at their defaults), checked as the command line's are (a missing file...)."""
    from common.config import DataOptions

    source_cfg = copy.copy(cfg)
    source_cfg.data_mixture = None
    defaults = {f.name: f.default for f in dataclasses.fields(cfg)}
    for key in SOURCE_OPTIONS:
        setattr(source_cfg, key, source["options"].get(key, defaults[key]))
    try:
        DataOptions.check(source_cfg)
    except ConfigError as err:
        raise ConfigError(f"--data_mixture source {source['name']!r}: {err}") from None
    return source_cfg


def identity(cfg) -> dict:
    """What the mixture resolves to (each source's files as real paths): kept in checkpoints and
    compared on resume, so an edited mixture file is refused as other data is."""
    spec = read(cfg.data_mixture)
    for source in spec["sources"]:
        for key in ("data_files", "eval_data_files"):
            if key in source["options"]:
                source["options"][key] = [os.path.realpath(f) for f in data_file_list(source["options"][key])]
    return spec


def locate(cfg, held_out: bool, row: int) -> str:
    """Where row `row` (0-based, in the order datasets read the source's files) lies, for error
    lines: "chat.jsonl line 7" (JSON Lines: blank lines are no rows), "data.csv row 3" (other
    files: the data rows, from 1), "org/set (train) row 12" (the Hub). Counts rows only when called."""
    import datasets

    given = cfg.eval_data_files if held_out else cfg.data_files
    if not given:
        return f"{cfg.dataset_name} ({cfg.eval_split if held_out else cfg.dataset_split}) row {row + 1}"
    for path in data_file_list(given):
        if path.endswith(".jsonl"):
            with open(path, "rb") as f:
                lines = [number for number, line in enumerate(f, 1) if line.strip()]
            if row < len(lines):
                return f"{path} line {lines[row]}"
            row -= len(lines)
            continue
        builder, kwargs = data.file_builder([path], cfg.txt_documents)
        count = len(datasets.load_dataset(builder, data_files=[path], split="train", **kwargs))
        if row < count:
            return f"{path} row {row + 1}"
        row -= count
    return f"{', '.join(given)} row {row + 1}"
