"""Data (docs/data.md): --data_files (.txt split by --txt_documents; .json/.jsonl, .csv, .parquet), --dataset_name
(Hub or local folder), else tiny Shakespeare (common/corpus/). Held out: --eval_split / --eval_data_files,
else Shakespeare's last 10% (nanoGPT's split) or a fixed 2% of the documents.
Each document is tokenised as [BOS] + text + EOS (cached by `datasets`), all concatenated into one token
stream on disk (a uint16/uint32 memmap); block i is stream[i*(T+1) : (i+1)*(T+1)]: inputs its first T tokens,
labels its last T; nothing padded, the last partial block dropped. The order depends on (seed, epoch) only.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from common.config import BUILDERS, ConfigError, data_file_list, data_parallel_size, same_on_every_rank
from common.model import custom_code_refused
from common.files import write_atomic

SHAKESPEARE = Path(__file__).parent / "corpus" / "tinyshakespeare.txt"  # provenance: corpus/README.md
SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
SHAKESPEARE_EVAL_FRACTION = 0.1  # nanoGPT's shakespeare_char: train on the first 90%, validate on the rest
DEFAULT_EVAL_FRACTION = 0.02  # other sources: documents held out at random (fixed seed)
SPLIT_SEED = 0  # the held-out documents are fixed, so eval numbers compare across runs


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
        tokenizer = AutoTokenizer.from_pretrained(name, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as err:
        raise custom_code_refused(err, name) or ConfigError(
            f"cannot load tokenizer from {name}: {str(err).splitlines()[0]}") from None
    if tokenizer.eos_token_id is None:
        raise ConfigError(f"tokenizer {name} has no EOS token to separate packed documents")
    if not tokenizer("The text", add_special_tokens=False).input_ids:
        # e.g. transformers picks the model type's own tokenizer class over the one the folder's
        # tokenizer_config.json names, and that class finds none of its vocabulary files
        raise ConfigError(f"the tokenizer loaded from {name} ({type(tokenizer).__name__}, {len(tokenizer)} tokens) "
                          "encodes text to no tokens; give a working one with --tokenizer_name_or_path")
    return tokenizer


def load_rows(cfg, held_out: bool = False):
    """(rows as `datasets` reads them, a name for messages), or (None, None): tiny Shakespeare (held_out:
    --eval_split / --eval_data_files). Local files hide datasets' bars (they would bury an error line)."""
    import datasets

    was_disabled = datasets.utils.are_progress_bars_disabled()
    if cfg.dataset_name is None:
        datasets.utils.disable_progress_bars()
    given = (cfg.eval_data_files, cfg.eval_split) if held_out else (cfg.data_files, cfg.dataset_split)
    try:
        return _load_rows(cfg, *given)
    finally:
        if not was_disabled:
            datasets.utils.enable_progress_bars()


def load_documents(cfg, held_out: bool = False):
    """The raw text as a `datasets.Dataset` with one column, 'text' (see load_rows)."""
    import datasets
    ds, source = load_rows(cfg, held_out)
    if ds is None:
        return datasets.Dataset.from_dict({"text": list(shakespeare_split(cfg.eval_fraction))})
    return text_documents(ds, cfg.text_column, source)


def file_builder(files: list[str], txt_documents: str) -> tuple[str, dict]:
    """datasets' builder for local files of one format (config.data_file_list) and its options."""
    builder = BUILDERS[Path(files[0]).suffix.lower()]
    return builder, {"sample_by": {"file": "document"}.get(txt_documents, txt_documents)} if builder == "text" else {}


def _load_rows(cfg, given, split):
    import datasets

    if given:  # files, folders, globs: as the user gave them in messages
        files, source = data_file_list(given), ", ".join(given)
        builder, kwargs = file_builder(files, cfg.txt_documents)
        try:
            return datasets.load_dataset(builder, data_files=files, split="train", **kwargs), source
        except datasets.exceptions.DatasetGenerationError as err:
            raise ConfigError(f"cannot read {source}: {err.__cause__ or err}") from None
    if cfg.dataset_name:
        try:
            ds = datasets.load_dataset(cfg.dataset_name, cfg.dataset_config, split=split)
        except Exception as err:  # offline, unknown name or split, bad config: all user-facing
            raise ConfigError(f"cannot load dataset {cfg.dataset_name}: {str(err).splitlines()[0]}") from None
        return ds, f"{cfg.dataset_name} ({split})"
    return None, None


def text_documents(ds, column: str, source: str):
    if len(ds) > 0:  # the non-blank texts of `column`, as one column 'text'
        if column not in ds.column_names:
            raise ConfigError(f"{source}: no column {column!r} (has {ds.column_names}); set --text_column")
        if getattr(ds.features[column], "dtype", None) not in ("string", "large_string"):  # numbers, lists...
            raise ConfigError(f"{source}: column {column!r} holds {ds.features[column]}, not text: set --text_column")
        ds = ds.select_columns([column]).rename_columns({column: "text"})
        ds = ds.filter(lambda batch: [bool(t and t.strip()) for t in batch["text"]], batched=True)
    if len(ds) == 0:
        raise ConfigError(f"dataset is empty (no non-blank documents): {source}")
    return ds


def pack_into_blocks(stream: np.ndarray, block_len: int) -> np.ndarray:
    """View a 1-D token stream as [num_blocks, block_len]; the final partial block is dropped."""
    num_blocks = len(stream) // block_len
    return stream[: num_blocks * block_len].reshape(num_blocks, block_len)


def token_stream(tokenized, path: Path, dtype, column: str = "input_ids") -> np.ndarray:
    """Concatenate a column of the tokenised documents into one memmapped array on disk (written once)."""
    if not path.exists():
        total = int(sum(tokenized["length"]))

        def write(tmp):
            out = np.memmap(tmp, dtype=dtype, mode="w+", shape=(total,))
            offset = 0
            for batch in tokenized.iter(batch_size=1024):
                for ids in batch[column]:
                    out[offset : offset + len(ids)] = ids
                    offset += len(ids)
            out.flush()
            del out

        write_atomic(path, write)
    return np.memmap(path, dtype=dtype, mode="r")


def document_bounds(tokenizer, add_bos: bool = True) -> tuple[list[int], list[int]]:
    """The ids before and after each document: [BOS] (if it has one that is not EOS, as GPT-2's is) and [EOS]."""
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    return ([bos] if add_bos and bos is not None and bos != eos else []), [eos]


def tokenize_documents(docs, tokenizer, name: str, cfg, num_proc: int | None = None):
    """Token ids of every document, between its bounds (cached by `datasets`), in num_proc processes (None: one)."""
    head, tail = document_bounds(tokenizer, cfg.add_bos)

    def tokenize(batch):
        ids = [head + x + tail for x in tokenizer(batch["text"], add_special_tokens=False)["input_ids"]]
        return {"input_ids": ids, "length": [len(x) for x in ids]}

    return docs.map(tokenize, batched=True, remove_columns=docs.column_names, desc=f"tokenise {name}",
                    num_proc=num_proc)


def tokenize_and_stream(docs, tokenizer, name: str, cfg, num_proc: int | None = None) -> np.ndarray:
    """Tokenise documents (in `num_proc` processes) and return their token stream (written once to disk)."""
    import datasets

    tokenized = tokenize_documents(docs, tokenizer, name, cfg, num_proc)
    dtype = np.uint16 if len(tokenizer) <= 65536 else np.uint32  # 2 bytes per token when ids fit
    # The map's fingerprint identifies (source data, tokenizer, function): reuse the stream file.
    cache = Path(datasets.config.HF_DATASETS_CACHE) / "accelerate_recipes" / "streams"
    return token_stream(tokenized, cache / f"{tokenized._fingerprint}.{np.dtype(dtype).name}", dtype)


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


def split_documents(cfg, docs, load=load_documents) -> dict:
    """{"train": docs, "test": held-out docs}: a fixed set of whole documents, or load(cfg, held_out=True)."""
    if not cfg.data_files and not cfg.dataset_name:  # Shakespeare: its first 90% and the held-out rest
        return {"train": docs.select([0]), "test": docs.select([1])}
    if cfg.eval_split or cfg.eval_data_files:
        return {"train": docs, "test": load(cfg, held_out=True)}
    if len(docs) < 2:
        raise ConfigError("need at least 2 documents to hold some out for eval (or give a held-out set)")
    return docs.train_test_split(test_size=cfg.eval_fraction or DEFAULT_EVAL_FRACTION, seed=SPLIT_SEED, shuffle=True)


def build_datasets(cfg, tokenizer, num_proc: int | None = None):
    """Train and held-out datasets (PackedBlocks, or PaddedDocuments with --packing false) of
    split_documents. num_proc: processes that tokenise (None: this one)."""
    split = split_documents(cfg, load_documents(cfg))
    if not cfg.packing:
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        return tuple(PaddedDocuments(tokenize_documents(split[part], tokenizer, name, cfg, num_proc), cfg.seq_len,
                                     pad_id) for part, name in (("train", "train"), ("test", "eval")))
    train = PackedBlocks(tokenize_and_stream(split["train"], tokenizer, "train", cfg, num_proc), cfg.seq_len)
    held_out = PackedBlocks(tokenize_and_stream(split["test"], tokenizer, "eval", cfg, num_proc), cfg.seq_len)
    for name, ds in (("training", train), ("held-out", held_out)):
        if len(ds) == 0:
            raise ConfigError(f"the {name} split has fewer than seq_len+1={cfg.seq_len + 1} tokens")
    return train, held_out


class EpochShuffleSampler(Sampler[int]):
    """A permutation from (seed, epoch) alone (numpy's PCG64: the same on every platform), never
    from the global RNG, which accelerate's `load_state` restores to after the epoch's draw (a
    sampler drawing from it repeats and skips samples after a resume). Resuming at (epoch, batch)
    is then `set_epoch(epoch)` plus skipping `batch` batches."""

    def __init__(self, num_samples: int, seed: int):
        self.num_samples, self.seed, self.epoch = num_samples, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self):
        return self.num_samples

    def __iter__(self):
        order = np.random.default_rng([self.seed, self.epoch]).permutation(self.num_samples)
        return iter(order.tolist())


def build_loaders(cfg, train: PackedBlocks, held_out: PackedBlocks, pin_memory: bool, data_ranks: int | None = None,
                  trains: bool = True):
    """data_ranks: the ranks that accelerate's prepare splits the training loader over (default: the
    Accelerator's data-parallel ranks; 1 for a loader not prepared). Each must get a micro-batch,
    unless trains=False: a run that only evaluates (train.py's --eval_only) reads no training batch."""
    from accelerate.state import AcceleratorState, is_initialized

    ranks = data_ranks or (data_parallel_size(AcceleratorState()) if is_initialized() else 1)
    # drop_last: no batch in any epoch, a loop waiting for one for ever
    if trains and len(train) < cfg.micro_batch_size * ranks:
        packed = isinstance(train, PackedBlocks)
        with same_on_every_rank():
            raise ConfigError(
                f"the training set has {len(train)} " + (f"blocks of {cfg.seq_len + 1} tokens" if packed else
                "documents") + f"; one micro-batch on each of {ranks} data-parallel rank(s) needs "
                f"{cfg.micro_batch_size * ranks} (--micro_batch_size {cfg.micro_batch_size} x {ranks}): lower "
                f"--micro_batch_size{' or --seq_len' if packed else ''}, or give more data")
    # drop_last: every optimizer step sees the same number of tokens
    train_loader = DataLoader(train, batch_size=cfg.micro_batch_size, sampler=EpochShuffleSampler(len(train), cfg.seed),
                              drop_last=True, num_workers=cfg.num_workers, pin_memory=pin_memory)
    eval_loader = DataLoader(held_out, batch_size=cfg.micro_batch_size, shuffle=False, pin_memory=pin_memory)
    return train_loader, eval_loader
