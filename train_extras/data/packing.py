"""Tokenised examples -> the rows the loader yields (docs/data.md): packed into blocks of seq_len + 1
tokens with document masks, or one example per row; conversations' labels only on the assistant's
tokens (render.py's targets).

Document masks (--document_mask, auto by default when packing). A packed block holds the end of one
document and the start of the next; without a mask every token attends to every earlier token of
its block, the previous documents' too. Each block carries position ids that restart at each
document (and at the block's start), and the model gets no attention mask and no cache: from those
transformers builds a block-diagonal causal mask for SDPA and eager attention
(masking_utils.find_packed_sequence_indices), so no token sees another document and each document
starts at position 0, as in inference. What else a model's layers need (sequence indices for Mamba
and convolutions, cumulative lengths, masks made from the positions), and whether they can at all,
is asked of the model at start-up (train_extras/document_mask.py). Labels are not cut at a boundary:
the last token of a document (its EOS) still predicts the first of the next, as without a mask.
"""

from __future__ import annotations

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


def as_dataset(tokenized, tokenizer, cfg):
    """DocumentBlocks (packing) or DocumentRows of tokenised documents."""
    if not cfg.packing:
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        return DocumentRows(tokenized, cfg.seq_len, pad_id)
    tokens, starts, targets = streams(tokenized, tokenizer)
    return DocumentBlocks(tokens, cfg.seq_len, starts if cfg.document_mask != "false" else None, targets)


def check_not_empty(cfg, train, held_out: dict) -> None:
    named = [("training", train)] + [(f"held-out ({key})" if key else "held-out", ds) for key, ds in held_out.items()]
    for name, ds in named:
        if len(ds) == 0:
            raise ConfigError(f"the {name} split has fewer than seq_len+1={cfg.seq_len + 1} tokens")
