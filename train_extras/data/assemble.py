"""train.py's datasets (docs/data.md), the data room's last step: the source the data options name,
or a weighted mixture of sources (--data_mixture), read (formats.py), rendered (render.py) and
packed (packing.py); the setup block's lines about them, what a resume compares, the held-out loss
per source.

A mixture draws training documents from its sources by weight with the run's seed (datasets'
interleave_datasets over the tokenised sources: a fixed order of documents, packed and shuffled
by block as one source is, so resume is exact as it is for one source). The weights are shares of
documents, not of tokens. first_exhausted stops the epoch when a source runs out (no document
repeats); all_exhausted goes on until each has been drawn whole (the smaller ones repeat). A source
drawn more often than it has documents is repeated, one mostly left undrawn is cut short: the
setup block says so with the numbers. Evaluation scores each source's held-out part apart
(eval/<name>/loss) and, as the mixture's loss, all of them together (the token mean over every
source's held-out tokens).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math

import numpy as np
from torch.utils.data import Dataset

from common import model as modeling
from train_extras.data import formats, packing, render, sources

UNDRAWN = 0.5  # a source with less than this share of its documents drawn per epoch gets a notice


@dataclasses.dataclass
class Datasets:
    train: Dataset
    held_out: dict  # {source name: dataset}; one source: {"": dataset}
    kind: str  # "text", "completions", "conversations" or "mixed"
    facts: dict  # conversations' fates, a mixture's shares: the setup block and run_summary.json


def build(cfg, tokenizer, num_proc: int | None = None) -> Datasets:
    """Training and held-out datasets of the data options, or of --data_mixture's sources."""
    template = render.read_template_file(cfg)
    if cfg.data_mixture:
        return build_mixture(cfg, template, tokenizer, num_proc)
    source = formats.load_source(cfg)
    render.apply_template(cfg, template, tokenizer, source.kind)
    train, fates = render.tokenize(source.train, source.kind, tokenizer, cfg, "train", num_proc,
                                   lambda row: source.where(False, row))
    held_out, _ = render.tokenize(source.held_out, source.kind, tokenizer, cfg, "eval", num_proc,
                                  lambda row: source.where(True, row))
    train_set = packing.as_dataset(train, tokenizer, cfg, source.kind)
    datasets = Datasets(train_set, {"": packing.as_dataset(held_out, tokenizer, cfg, source.kind)}, source.kind,
                        {**({source.kind: fates} if fates else {}), **packing.describe_rows(train_set, cfg)})
    packing.check_not_empty(cfg, datasets.train, datasets.held_out)
    return datasets


def build_mixture(cfg, template, tokenizer, num_proc: int | None = None) -> Datasets:
    """The mixture's training set (documents drawn by weight, then packed) and each source's held-out set."""
    import datasets

    spec = sources.read(cfg.data_mixture)
    loaded = [formats.load_source(sources.source_config(cfg, source)) for source in spec["sources"]]
    kinds = [source.kind for source in loaded]
    render.apply_template(cfg, template, tokenizer, "conversations" if "conversations" in kinds else "text")
    kind = kinds[0] if len(set(kinds)) == 1 else "mixed"
    trains, held_out, fates = [], {}, {}
    for i, (source, got) in enumerate(zip(spec["sources"], loaded)):
        name, source_cfg = source["name"], sources.source_config(cfg, source)
        train, train_fates = render.tokenize(got.train, got.kind, tokenizer, source_cfg, f"train {name}", num_proc,
                                             lambda row, got=got: got.where(False, row))
        evaluated, _ = render.tokenize(got.held_out, got.kind, tokenizer, source_cfg, f"eval {name}", num_proc,
                                       lambda row, got=got: got.where(True, row))
        held_out[name] = packing.as_dataset(evaluated, tokenizer, cfg, kind)
        trains.append(train.map(lambda batch, i=i: {"source": [i] * len(batch["length"])}, batched=True,
                                desc=f"mark {name}"))
        if train_fates:
            fates.setdefault(got.kind, {})[name] = train_fates
    if set(kinds) != {"text"}:  # a text source's every token is a target
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
    train_set = packing.as_dataset(mixed.remove_columns("source"), tokenizer, cfg, kind)
    result = Datasets(train_set, held_out, kind, {"mixture": shares, **fates, **packing.describe_rows(train_set, cfg)})
    packing.check_not_empty(cfg, result.train, result.held_out)
    return result


def describe_mixture(shares: dict) -> dict:
    """The setup block's lines: each source's share of the documents drawn, and of what it has; a
    notice for a source repeated (drawn more often than it has documents) or mostly left out (only
    first_exhausted leaves documents out: all_exhausted draws every source whole)."""
    total = sum(s["documents"] for s in shares.values())
    lines = {"mixture": "; ".join(f"{name} {s['share']:.1%} of {total} documents (weight {s['weight']:.1%}; "
                                  f"{s['documents']}/{s['available']} drawn)" for name, s in shares.items())}
    notices = []
    for name, s in shares.items():
        if s["documents"] > s["available"]:
            notices.append(f"{name!r} has {s['available']} training documents and its weight draws {s['documents']} of "
                           f"the epoch's {total}: each is repeated, {s['documents'] / s['available']:.1f} times an "
                           "epoch on average")
        elif s["documents"] < UNDRAWN * s["available"]:
            ran_out = [n for n, x in shares.items() if x["documents"] == x["available"]]
            notices.append(f"{name!r} has {s['available']} training documents and only {s['documents']} are drawn an "
                           f"epoch (first_exhausted ends it when {' or '.join(map(repr, ran_out))} runs out)")
    if notices:
        lines["mixture notice"] = ("; ".join(notices) + ": give the small sources more documents, or change the "
                                   "weights or the stopping_strategy")
    return lines


def describe(facts: dict) -> dict:
    """Lines for the setup block: what happened to the conversations, and a mixture's shares."""
    lines = {}
    for kind in ("conversations", "completions"):
        for name, fates in facts.get(kind, {}).items() if "mixture" in facts else (
                [("", facts[kind])] if kind in facts else []):
            lines[kind + (f" ({name})" if name else "")] = render.describe(fates, kind)
    if "mixture" in facts:
        lines.update(describe_mixture(facts["mixture"]))
    if "rows" in facts:
        lines["packing"] = packing.describe_packing(facts["rows"])
    return lines


def identity(cfg, tokenizer, kind: str) -> dict:
    """Beyond the files (resume/checkpoint.data_identity): the chat template that rendered
    conversations (its SHA-256), what a mixture resolves to and how examples were packed; a resume
    compares them."""
    rendered = kind in ("conversations", "mixed") and isinstance(tokenizer.chat_template, str)
    template = tokenizer.chat_template if rendered else None
    return {"chat_template_sha256": hashlib.sha256(template.encode()).hexdigest() if template else None,
            "mixture": sources.identity(cfg) if cfg.data_mixture else None,
            "packing": packing.strategy(cfg, kind) if cfg.packing else None}


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


def evaluate(model, loaders: dict, accelerator, max_batches: int = 0, stop=None,
             loss=modeling.causal_lm_loss) -> dict | None:
    """common.model.evaluate on each source's held-out loader; the mixture's loss is their token mean.
    One source ({"": loader}): its result as it is. `stop` (train.py: a preemption): True ends the
    eval within STOP_CHECK_EVERY batches, with no result (None): the loss of a part of the held-out
    set is not the held-out loss. `loss`: common.model.evaluate's."""
    scores = {}
    for name, loader in loaders.items():
        batches = _UntilStopped(loader, stop) if stop is not None else loader
        scores[name] = modeling.evaluate(model, batches, accelerator, max_batches, loss)
        if stop is not None and batches.stopped:
            return None
    if list(scores) == [""]:
        return scores[""]
    tokens = sum(r["tokens"] for r in scores.values())
    loss = sum(r["loss"] * r["tokens"] for r in scores.values()) / tokens if tokens else float("nan")
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": tokens, "sources": scores}
