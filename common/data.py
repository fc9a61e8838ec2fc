"""Data: tokenised with `datasets.map` (cached on disk), packed into blocks of seq_len + 1 tokens,
served by a loader whose order depends on (seed, epoch) only. Sources: --data_files (.txt: one
document per blank-line-separated paragraph; .json/.jsonl: --text_column), --dataset_name (Hub or
local dataset folder), else tiny Shakespeare, shipped in common/corpus/ (no download).

Held out: the last 10% of tiny Shakespeare's characters (nanoGPT's split, so losses compare), or
a fixed random 2% of the documents of any other source (--eval_fraction changes either).

Packing: every document is tokenised without special tokens and followed by EOS; the documents
are concatenated into one token stream on disk (a uint16/uint32 memmap, nanoGPT-style), and block i
is stream[i*(T+1) : (i+1)*(T+1)]: inputs are its first T tokens, labels its last T. Nothing is
duplicated or padded; only the final partial block (< T+1 tokens) is dropped.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from common.config import ConfigError
from common.files import write_atomic

SHAKESPEARE = Path(__file__).parent / "corpus" / "tinyshakespeare.txt"  # provenance: corpus/README.md
SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
SHAKESPEARE_EVAL_FRACTION = 0.1  # nanoGPT's shakespeare_char: train on the first 90%, validate on the rest
DEFAULT_EVAL_FRACTION = 0.02  # other sources: documents held out at random (fixed seed)
SPLIT_SEED = 0  # the held-out documents are fixed, so eval numbers compare across runs


def _cache_root() -> Path:
    import datasets
    return Path(datasets.config.HF_DATASETS_CACHE) / "accelerate_recipes"


def shakespeare_split(eval_fraction: float | None = None) -> tuple[str, str]:
    """Tiny Shakespeare as it is (blank lines between speeches kept: a model learns to write them),
    cut by characters into the first (1 - eval_fraction) for training and the rest held out."""
    raw = SHAKESPEARE.read_bytes()
    if hashlib.sha256(raw).hexdigest() != SHAKESPEARE_SHA256:  # a damaged or edited copy: results would not compare
        raise ConfigError(f"{SHAKESPEARE} is not the shipped tiny Shakespeare (sha256 differs; see corpus/README.md)")
    text = raw.decode("ascii")
    cut = int(len(text) * (1 - (eval_fraction or SHAKESPEARE_EVAL_FRACTION)))
    return text[:cut], text[cut:]


def build_tokenizer(cfg):
    """The run's tokenizer: --tokenizer_name_or_path, else the pretrained model's, else bytes."""
    from transformers import AutoTokenizer, ByT5Tokenizer

    name = cfg.tokenizer_name_or_path or cfg.model_name_or_path
    if name is None:
        # 256 byte values + pad/eos/unk = 259 ids; needs no vocabulary file and no download.
        return ByT5Tokenizer(extra_ids=0)
    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as err:
        raise ConfigError(f"cannot load tokenizer from {name}: {str(err).splitlines()[0]}") from None
    if tokenizer.eos_token_id is None:
        raise ConfigError(f"tokenizer {name} has no EOS token to separate packed documents")
    if not tokenizer("The text", add_special_tokens=False).input_ids:
        # e.g. transformers picks the model type's own tokenizer class over the one the folder's
        # tokenizer_config.json names, and that class finds none of its vocabulary files
        raise ConfigError(f"the tokenizer loaded from {name} ({type(tokenizer).__name__}, {len(tokenizer)} tokens) "
                          "encodes text to no tokens; give a working one with --tokenizer_name_or_path")
    return tokenizer


def load_documents(cfg):
    """The raw text as a `datasets.Dataset` with one column, 'text'. Local files load at once:
    datasets' progress bars are hidden then (they would bury a one-line error); Hub downloads keep them."""
    import datasets

    was_disabled = datasets.utils.are_progress_bars_disabled()
    if cfg.dataset_name is None:
        datasets.utils.disable_progress_bars()
    try:
        return _load_documents(cfg)
    finally:
        if not was_disabled:
            datasets.utils.enable_progress_bars()


def _load_documents(cfg):
    import datasets

    if cfg.data_files:
        suffixes = {Path(f).suffix.lower() for f in cfg.data_files}
        if suffixes <= {".txt", ".text"}:
            builder, kwargs = "text", {"sample_by": "paragraph"}
        elif suffixes <= {".json", ".jsonl"}:
            builder, kwargs = "json", {}
        else:
            raise ConfigError(f"--data_files must all be .txt or all .json/.jsonl, got {sorted(suffixes)}")
        try:
            ds = datasets.load_dataset(builder, data_files=cfg.data_files, split="train", **kwargs)
        except datasets.exceptions.DatasetGenerationError as err:
            raise ConfigError(f"cannot read {cfg.data_files}: {err.__cause__ or err}") from None
        source = ", ".join(cfg.data_files)
    elif cfg.dataset_name:
        try:
            ds = datasets.load_dataset(cfg.dataset_name, cfg.dataset_config, split=cfg.dataset_split)
        except Exception as err:  # offline, unknown name, bad config: all user-facing
            raise ConfigError(f"cannot load dataset {cfg.dataset_name}: {str(err).splitlines()[0]}") from None
        source = cfg.dataset_name
    else:
        return datasets.Dataset.from_dict({"text": list(shakespeare_split(cfg.eval_fraction))})

    if len(ds) > 0 and cfg.text_column not in ds.column_names:
        raise ConfigError(f"{source}: no column {cfg.text_column!r} (columns: {ds.column_names}); set --text_column")
    if len(ds) > 0:
        ds = ds.select_columns([cfg.text_column])
        if cfg.text_column != "text":
            ds = ds.rename_column(cfg.text_column, "text")
        ds = ds.filter(lambda batch: [bool(t and t.strip()) for t in batch["text"]], batched=True)
    if len(ds) == 0:
        raise ConfigError(f"dataset is empty (no non-blank documents): {source}")
    return ds


def pack_into_blocks(stream: np.ndarray, block_len: int) -> np.ndarray:
    """View a 1-D token stream as [num_blocks, block_len]; the final partial block is dropped."""
    num_blocks = len(stream) // block_len
    return stream[: num_blocks * block_len].reshape(num_blocks, block_len)


def _token_stream(tokenized, path: Path, dtype) -> np.ndarray:
    """Concatenate the tokenised documents into one memmapped array on disk (written once)."""
    if not path.exists():
        total = int(sum(tokenized["length"]))

        def write(tmp):
            out = np.memmap(tmp, dtype=dtype, mode="w+", shape=(total,))
            offset = 0
            for batch in tokenized.iter(batch_size=1024):
                for ids in batch["input_ids"]:
                    out[offset : offset + len(ids)] = ids
                    offset += len(ids)
            out.flush()
            del out

        write_atomic(path, write)
    return np.memmap(path, dtype=dtype, mode="r")


def tokenize_documents(docs, tokenizer, name: str):
    """Token ids of every document, each followed by EOS (cached by `datasets`)."""
    eos = tokenizer.eos_token_id

    def tokenize(batch):
        ids = tokenizer(batch["text"], add_special_tokens=False)["input_ids"]
        ids = [x + [eos] for x in ids]
        return {"input_ids": ids, "length": [len(x) for x in ids]}

    return docs.map(tokenize, batched=True, remove_columns=docs.column_names, desc=f"tokenise {name}")


def tokenize_and_stream(docs, tokenizer, name: str) -> np.ndarray:
    """Tokenise documents and return their EOS-separated token stream (written once to disk)."""
    tokenized = tokenize_documents(docs, tokenizer, name)
    dtype = np.uint16 if len(tokenizer) <= 65536 else np.uint32  # 2 bytes per token when ids fit
    # The map's fingerprint identifies (source data, tokenizer, function): reuse the stream file.
    path = _cache_root() / "streams" / f"{tokenized._fingerprint}.{np.dtype(dtype).name}"
    return _token_stream(tokenized, path, dtype)


class PackedBlocks(Dataset):
    """Fixed-length training examples cut from a token stream: input_ids = block[:-1], labels = block[1:]."""

    def __init__(self, stream: np.ndarray, seq_len: int):
        self.blocks = pack_into_blocks(stream, seq_len + 1)

    def __len__(self):
        return len(self.blocks)

    def __getitem__(self, index):
        block = torch.from_numpy(self.blocks[index].astype(np.int64))
        return {"input_ids": block[:-1], "labels": block[1:], "index": index}


class PaddedDocuments(Dataset):
    """One document per row (--packing false): inputs = doc[:T], labels = doc[1:T+1], right-padded
    to T with the pad id and -100 in the labels, so rows carry different numbers of target tokens.
    Right padding needs no attention mask in a causal model: no real token attends to a later pad."""

    def __init__(self, tokenized, seq_len: int, pad_id: int):
        self.docs, self.seq_len, self.pad_id = tokenized, seq_len, pad_id

    def __len__(self):
        return len(self.docs)

    def __getitem__(self, index):
        ids = torch.tensor(self.docs[index]["input_ids"][: self.seq_len + 1], dtype=torch.int64)
        input_ids = torch.full((self.seq_len,), self.pad_id, dtype=torch.int64)
        labels = torch.full((self.seq_len,), -100, dtype=torch.int64)
        input_ids[: len(ids) - 1] = ids[:-1]
        labels[: len(ids) - 1] = ids[1:]
        return {"input_ids": input_ids, "labels": labels, "index": index}


def build_datasets(cfg, tokenizer):
    """Train and held-out datasets (PackedBlocks, or PaddedDocuments with --packing false); the
    held-out part is a fixed set of whole documents."""
    docs = load_documents(cfg)
    if len(docs) < 2:
        raise ConfigError("need at least 2 documents to hold some out for eval")
    if not cfg.data_files and not cfg.dataset_name:  # Shakespeare: its first 90% and the held-out rest
        split = {"train": docs.select([0]), "test": docs.select([1])}
    else:
        split = docs.train_test_split(test_size=cfg.eval_fraction or DEFAULT_EVAL_FRACTION, seed=SPLIT_SEED,
                                      shuffle=True)
    if not cfg.packing:
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        return tuple(PaddedDocuments(tokenize_documents(split[part], tokenizer, name), cfg.seq_len, pad_id)
                     for part, name in (("train", "train"), ("test", "eval")))
    train = PackedBlocks(tokenize_and_stream(split["train"], tokenizer, "train"), cfg.seq_len)
    held_out = PackedBlocks(tokenize_and_stream(split["test"], tokenizer, "eval"), cfg.seq_len)
    for name, ds in (("training", train), ("held-out", held_out)):
        if len(ds) == 0:
            raise ConfigError(f"the {name} split has fewer than seq_len+1={cfg.seq_len + 1} tokens")
    return train, held_out


class EpochShuffleSampler(Sampler[int]):
    """A permutation that depends on (seed, epoch) alone, never on the global RNG.

    accelerate's `load_state` restores the global RNG to its value at save time, i.e. after the
    epoch's permutation was drawn; a sampler that draws from it repeats and skips samples after a
    resume. Seeding from (seed, epoch) makes the order a pure function, so resuming at (epoch,
    batch) is `set_epoch(epoch)` plus skipping `batch` batches. numpy's PCG64 gives the same
    permutation on every platform.
    """

    def __init__(self, num_samples: int, seed: int):
        self.num_samples, self.seed, self.epoch = num_samples, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self):
        return self.num_samples

    def __iter__(self):
        order = np.random.default_rng([self.seed, self.epoch]).permutation(self.num_samples)
        return iter(order.tolist())


def build_loaders(cfg, train: PackedBlocks, held_out: PackedBlocks, pin_memory: bool):
    # drop_last: every optimizer step sees the same number of tokens
    train_loader = DataLoader(train, batch_size=cfg.micro_batch_size, sampler=EpochShuffleSampler(len(train), cfg.seed),
                              drop_last=True, num_workers=cfg.num_workers, pin_memory=pin_memory)
    eval_loader = DataLoader(held_out, batch_size=cfg.micro_batch_size, shuffle=False, pin_memory=pin_memory)
    return train_loader, eval_loader
