"""A mixture of sources for train.py (--data_mixture FILE.yaml; docs/data.md#mixtures).

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
own options. Training documents are drawn from the sources by weight with the run's seed
(datasets' interleave_datasets over the tokenised sources: a fixed order of documents, packed and
shuffled by block as one source is, so resume is exact as it is for one source). The weights are
shares of documents, not of tokens. first_exhausted stops the epoch when a source runs out (no
document repeats); all_exhausted goes on until each has been drawn whole (the smaller ones repeat).
Evaluation scores each source's held-out part apart (eval/<name>/loss) and, as the mixture's
loss, all of them together (the token mean over every source's held-out tokens).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
from pathlib import Path

import numpy as np

from common import model as modeling
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


def build(cfg, tokenizer, num_proc: int | None = None):
    """The mixture's training set (documents drawn by weight, then packed) and each source's held-out set."""
    import datasets

    from train_extras import documents

    spec = read(cfg.data_mixture)
    trains, held_out, kinds, fates = [], {}, [], {}
    for i, source in enumerate(spec["sources"]):
        name, source_cfg = source["name"], source_config(cfg, source)
        loaded = documents.load_source(source_cfg)
        train, train_fates = documents.tokenize(loaded.train, loaded.kind, tokenizer, source_cfg, f"train {name}",
                                                num_proc)
        evaluated, _ = documents.tokenize(loaded.held_out, loaded.kind, tokenizer, source_cfg, f"eval {name}",
                                          num_proc)
        held_out[name] = documents.as_dataset(evaluated, tokenizer, cfg)
        trains.append(train.map(lambda batch, i=i: {"source": [i] * len(batch["length"])}, batched=True,
                                desc=f"mark {name}"))
        kinds.append(loaded.kind)
        if train_fates:
            fates[name] = train_fates
    if "conversations" in kinds:  # a text source's every token is a target
        trains = [ds if "targets" in ds.column_names else
                  ds.map(lambda batch: {"targets": [[1] * n for n in batch["length"]]}, batched=True, desc="targets")
                  for ds in trains]
    features = trains[0].features
    trains = [ds if ds.features == features else ds.cast(features) for ds in trains]
    weights = np.array([s["weight"] for s in spec["sources"]])
    mixed = datasets.interleave_datasets(trains, probabilities=(weights / weights.sum()).tolist(), seed=cfg.seed,
                                         stopping_strategy=spec["stopping_strategy"])
    drawn = np.bincount(np.asarray(mixed["source"], dtype=np.int64), minlength=len(trains))
    shares = {s["name"]: {"weight": s["weight"] / weights.sum(), "documents": int(n), "available": len(ds),
                          "share": int(n) / max(int(drawn.sum()), 1)}
              for s, n, ds in zip(spec["sources"], drawn, trains)}
    kind = kinds[0] if len(set(kinds)) == 1 else "mixed"
    result = documents.Datasets(documents.as_dataset(mixed.remove_columns("source"), tokenizer, cfg), held_out, kind,
                                {"mixture": shares, **({"conversations": fates} if fates else {})})
    documents.check_not_empty(cfg, result.train, result.held_out)
    return result


def describe(shares: dict) -> str:
    """The setup block's line: each source's share of the documents drawn, and of what it has."""
    return "; ".join(f"{name} {s['share']:.1%} of {sum(x['documents'] for x in shares.values())} documents "
                     f"(weight {s['weight']:.1%}; {s['documents']}/{s['available']} drawn)"
                     for name, s in shares.items())


STOP_CHECK_EVERY = 4  # held-out batches between two calls of evaluate's `stop`


class _UntilStopped:
    """A held-out loader that ends early once `stop()`, asked by every rank at the same batch (every
    STOP_CHECK_EVERY; on several processes a sync of its own), says so."""

    def __init__(self, loader, stop):
        self.loader, self.stop, self.stopped = loader, stop, False

    def __iter__(self):
        for i, batch in enumerate(self.loader):
            if i % STOP_CHECK_EVERY == 0 and self.stop():
                self.stopped = True
                return
            yield batch


def evaluate(model, loaders: dict, accelerator, max_batches: int = 0, stop=None) -> dict | None:
    """common.model.evaluate on each source's held-out loader; the mixture's loss is their token mean.
    One source ({"": loader}): its result as it is. `stop` (train.py: a preemption): True ends the
    eval within STOP_CHECK_EVERY batches, with no result (None): the loss of a part of the held-out
    set is not the held-out loss."""
    sources = {}
    for name, loader in loaders.items():
        batches = _UntilStopped(loader, stop) if stop is not None else loader
        sources[name] = modeling.evaluate(model, batches, accelerator, max_batches)
        if stop is not None and batches.stopped:
            return None
    if list(sources) == [""]:
        return sources[""]
    tokens = sum(r["tokens"] for r in sources.values())
    loss = sum(r["loss"] * r["tokens"] for r in sources.values()) / tokens if tokens else float("nan")
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": tokens, "sources": sources}
