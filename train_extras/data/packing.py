"""Tokenised examples -> the rows the loader yields (docs/data.md#packing): packed into rows of
seq_len + 1 tokens with document masks, or one example per row; conversations' and completions'
labels only on their trained tokens (render.py's targets).

Two ways to pack (--packing_strategy; auto: best_fit for conversations, prompt/completion pairs and
mixtures, concatenate for text):
- concatenate: the examples as one token stream cut into blocks. No padding, and an example may
  be split over two blocks (its second part trained without its beginning in view).
- best_fit: best-fit decreasing. Examples longest first, each into the row with the least room
  left that still holds it (a new row when none does); a row's unused end is padding. Every
  example sits whole in one row. Text documents longer than a row are first cut into row-long
  pieces (conversations longer than a row were dropped or truncated by --overlong). The rows are
  a function of the examples' lengths alone: the same on every rank and on resume.

Document masks (--document_mask, auto by default when packing). A packed block holds the end of one
document and the start of the next; without a mask every token attends to every earlier token of
its block, the previous documents' too. Each block carries position ids that restart at each
document (and at the block's start), and the model gets no attention mask and no cache: from those
transformers builds a block-diagonal causal mask for SDPA and eager attention
(masking_utils.find_packed_sequence_indices), so no token sees another document and each document
starts at position 0, as in inference. What else a model's layers need (sequence indices for Mamba
and convolutions, cumulative lengths, masks made from the positions), and whether they can at all,
is asked of the model at start-up (train_extras/document_mask.py). Concatenated, labels are not cut
at a boundary: the last token of a document (its EOS) still predicts the first of the next, as
without a mask. Best fit, they are: each example is trained alone, and the padding is never a label.
"""

from __future__ import annotations

import bisect
from pathlib import Path

import numpy as np
import torch

from common import data
from common.config import ConfigError


def restart_positions(starts: np.ndarray, begin: int, length: int) -> np.ndarray:
    """Positions of the stream's tokens [begin, begin + length): each one's distance from the start of
    its document (`starts`: the sorted offsets where documents begin) or from `begin`, if later."""
    offsets = np.arange(begin, begin + length)
    document_start = starts[np.searchsorted(starts, offsets, side="right") - 1]
    return offsets - np.maximum(document_start, begin)


class DocumentBlocks(data.PackedBlocks):
    """common.data.PackedBlocks' blocks (the same input_ids and labels), plus position ids that
    restart at each document (starts given: --document_mask) and, for conversations, labels -100
    where the next token is not the assistant's (targets: a 0/1 stream beside the tokens)."""

    def __init__(self, stream: np.ndarray, seq_len: int, starts: np.ndarray | None = None,
                 targets: np.ndarray | None = None):
        super().__init__(stream, seq_len)
        self.targets = None if targets is None else data.pack_into_blocks(targets, seq_len + 1)
        self.starts, self.seq_len = starts, seq_len

    def __getitem__(self, index):
        block = torch.from_numpy(self.blocks[index].astype(np.int64))
        labels = block[1:].clone()
        if self.targets is not None:
            labels[torch.from_numpy(self.targets[index][1:] == 0)] = -100
        item = {"input_ids": block[:-1], "labels": labels, "index": index}
        if self.starts is not None:
            begin = index * (self.seq_len + 1)
            item["position_ids"] = torch.from_numpy(restart_positions(self.starts, begin, self.seq_len))
        return item


class DocumentRows(data.PaddedDocuments):
    """One document per row (--packing false), as common.data.PaddedDocuments; for conversations
    the labels are also -100 where the next token is not the assistant's."""

    def __getitem__(self, index):
        item = super().__getitem__(index)
        if "targets" in self.docs.column_names:
            targets = torch.tensor(self.docs[index]["targets"][1: self.seq_len + 1])
            item["labels"][: len(targets)][targets == 0] = -100
        return item


def streams(tokenized, tokenizer):
    """The token stream (common.data's, on disk), the documents' start offsets and, for
    conversations, the 0/1 targets stream beside it (on disk too)."""
    import datasets

    dtype = np.uint16 if len(tokenizer) <= 65536 else np.uint32
    cache = Path(datasets.config.HF_DATASETS_CACHE) / "accelerate_recipes" / "streams"
    stem = cache / tokenized._fingerprint  # the map's fingerprint: (source data, tokenizer, function)
    tokens = data.token_stream(tokenized, stem.with_suffix(f".{np.dtype(dtype).name}"), dtype)
    lengths = np.asarray(tokenized["length"], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]) if len(lengths) else np.zeros(0, np.int64)
    targets = None
    if "targets" in tokenized.column_names:
        targets = data.token_stream(tokenized, stem.with_suffix(".targets.uint8"), np.uint8, column="targets")
    return tokens, starts, targets


def best_fit_decreasing(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """Rows of example indices: examples longest first (ties: in order), each into the open row with
    the least room left that holds it, else into a new row. No example may exceed capacity."""
    rows: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (room left, row), sorted
    for index in np.argsort(-lengths, kind="stable").tolist():
        need = int(lengths[index])
        at = bisect.bisect_left(room, (need, -1))
        if at == len(room):
            rows.append([index])
            bisect.insort(room, (capacity - need, len(rows) - 1))
        else:
            left, row = room.pop(at)
            rows[row].append(index)
            bisect.insort(room, (left - need, row))
    return rows


class FittedRows(torch.utils.data.Dataset):
    """--packing_strategy best_fit: rows of seq_len + 1 tokens, each holding whole examples (the
    token stream's [starts[e], starts[e] + lengths[e])), right-padded with pad_id. Labels: the next
    token where it belongs to the same example (and is a target), else -100; position ids (with
    document masks) restart at each example, and the padding counts from 0 as an example of its own."""

    def __init__(self, stream: np.ndarray, starts: np.ndarray, lengths: np.ndarray, seq_len: int, pad_id: int,
                 targets: np.ndarray | None = None, positions: bool = True):
        self.stream, self.targets, self.seq_len = stream, targets, seq_len
        self.pad_id, self.positions = pad_id, positions
        # text documents longer than a row: cut into row-long pieces first
        pieces = [(int(start + at), int(min(length - at, seq_len + 1)))
                  for start, length in zip(starts.tolist(), lengths.tolist()) for at in range(0, length, seq_len + 1)]
        self.piece_starts = np.array([p[0] for p in pieces], dtype=np.int64)
        self.piece_lengths = np.array([p[1] for p in pieces], dtype=np.int64)
        self.rows = best_fit_decreasing(self.piece_lengths, seq_len + 1)
        self.used = int(self.piece_lengths.sum())  # tokens in the rows; the rest is padding

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, index):
        width = self.seq_len + 1
        tokens = np.full(width, self.pad_id, dtype=np.int64)
        trained = np.zeros(width, dtype=bool)  # a target that may be a label
        first = np.zeros(width, dtype=bool)  # an example's first token: not the previous token's label
        positions = np.zeros(width, dtype=np.int64)
        at = 0
        for piece in self.rows[index]:
            start, length = self.piece_starts[piece], self.piece_lengths[piece]
            tokens[at: at + length] = self.stream[start: start + length]
            trained[at: at + length] = True if self.targets is None else self.targets[start: start + length] == 1
            first[at] = True
            positions[at: at + length] = np.arange(length)
            at += length
        positions[at:] = np.arange(width - at)
        block = torch.from_numpy(tokens)
        labels = block[1:].clone()
        labels[torch.from_numpy(~trained[1:] | first[1:])] = -100
        item = {"input_ids": block[:-1], "labels": labels, "index": index}
        if self.positions:
            item["position_ids"] = torch.from_numpy(positions[:-1])
        return item


def strategy(cfg, kind: str) -> str:
    """--packing_strategy, auto resolved: best_fit for everything but text."""
    if cfg.packing_strategy != "auto":
        return cfg.packing_strategy
    return "concatenate" if kind == "text" else "best_fit"


def as_dataset(tokenized, tokenizer, cfg, kind: str = "text"):
    """DocumentBlocks (concatenated), FittedRows (best fit) or DocumentRows (--packing false) of
    tokenised documents."""
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if not cfg.packing:
        return DocumentRows(tokenized, cfg.seq_len, pad_id)
    tokens, starts, targets = streams(tokenized, tokenizer)
    if strategy(cfg, kind) == "best_fit":
        lengths = np.asarray(tokenized["length"], dtype=np.int64)
        return FittedRows(tokens, starts, lengths, cfg.seq_len, pad_id, targets, cfg.document_mask != "false")
    return DocumentBlocks(tokens, cfg.seq_len, starts if cfg.document_mask != "false" else None, targets)


def totals(dataset, seq_len: int) -> dict:
    """What a training set trains, counted from its arrays (no row is built): its rows, the examples
    in them (None where not known: text concatenated without document masks), the tokens that are
    labels and the share of input positions that are padding. train.py's setup block, its
    run_summary.json and tools/show_data.py print these."""
    width = seq_len + 1
    if isinstance(dataset, FittedRows):
        examples, inputs = len(dataset.piece_lengths), len(dataset) * seq_len
        if dataset.targets is None:  # every token is a label but an example's first
            trained = dataset.used - examples
        else:
            targets = np.asarray(dataset.targets)
            trained = int(targets.sum()) - int(targets[dataset.piece_starts].sum())
        filled = np.array([int(dataset.piece_lengths[row].sum()) for row in dataset.rows], dtype=np.int64)
        padding = int((seq_len - np.minimum(filled, seq_len)).sum())  # a row's last token is an input of none
        return {"strategy": "best_fit", "rows": len(dataset), "examples": examples, "trained_tokens": trained,
                "padding_share": padding / inputs if inputs else 0.0}
    if isinstance(dataset, data.PackedBlocks):  # concatenated: no padding
        rows = len(dataset)
        targets = getattr(dataset, "targets", None)
        trained = rows * seq_len if targets is None else int(np.asarray(targets)[:, 1:].sum())
        starts = getattr(dataset, "starts", None)
        examples = None if starts is None else int((starts < rows * width).sum())
        return {"strategy": "concatenate", "rows": rows, "examples": examples, "trained_tokens": trained,
                "padding_share": 0.0}
    lengths = np.minimum(np.asarray(dataset.docs["length"], dtype=np.int64), width)  # one per row
    if "targets" in dataset.docs.column_names:
        trained = sum(int(np.sum(t[1:width])) for t in dataset.docs["targets"])
    else:
        trained = int((lengths - 1).sum())
    inputs = len(lengths) * seq_len
    return {"strategy": "none", "rows": len(lengths), "examples": len(lengths), "trained_tokens": trained,
            "padding_share": (inputs - int((lengths - 1).sum())) / inputs if inputs else 0.0}


def describe_rows(train, cfg) -> dict:
    """The training set's totals, for the setup block and run_summary.json."""
    return {"rows": totals(train, cfg.seq_len)}


def describe_packing(rows: dict) -> str:
    how = {"best_fit": "best fit", "concatenate": "concatenated", "none": "one example per row (--packing false)"}
    examples = "" if rows["examples"] is None else f"{rows['examples']} examples in "
    return (f"{how[rows['strategy']]}: {examples}{rows['rows']} rows, {rows['trained_tokens']} trained tokens, "
            f"{rows['padding_share']:.1%} padding")


def check_not_empty(cfg, train, held_out: dict) -> None:
    named = [("training", train)] + [(f"held-out ({key})" if key else "held-out", ds) for key, ds in held_out.items()]
    for name, ds in named:
        if len(ds) == 0:
            raise ConfigError(f"the {name} split has fewer than seq_len+1={cfg.seq_len + 1} tokens")
