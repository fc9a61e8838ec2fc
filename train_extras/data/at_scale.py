"""Data at scale for train.py: rank 0 prepares the data under a wait of its own (--data_timeout),
and --streaming reads a corpus as it trains instead of tokenising it all first.

Waiting for rank 0. While rank 0 tokenises a corpus on first use, the other ranks wait for it. In
the default process group that wait is a collective bounded by --collective_timeout (meant to catch
a dead rank within minutes), so a corpus that takes longer to tokenise killed the job before it
trained. The wait here is a barrier in a gloo group of its own whose timeout is --data_timeout.

Streaming (docs/data.md#data-at-scale). Each rank reads its own part of the source (`datasets`'
streaming and `split_dataset_by_node`: whole shards per rank when their number divides by the world
size, else every world_size-th document), shuffled in a buffer (seed + epoch), tokenises it as it
goes and packs it into blocks of seq_len + 1 tokens as the packed datasets do. A pass over a rank's
part is an epoch; the next pass reshuffles. Resume is exact: a rank's position is the number of
micro-batches it consumed, and a resumed run reads its stream again from the start and skips as
many (it costs the reading and tokenising of everything seen so far, and needs the same data, world
size and micro-batch, which the checkpoint check enforces).
"""

from __future__ import annotations

import contextlib
import ipaddress
import itertools
import os
import socket
from datetime import timedelta

import numpy as np
import torch
from accelerate.utils import send_to_device
from torch.utils.data import DataLoader, IterableDataset

from common import data
from common.config import ConfigError, TrainingError, data_file_list, one_line, same_on_every_rank
from train_extras.data import packing

SHUFFLE_BUFFER = 10_000  # documents; datasets' default is 1000


@contextlib.contextmanager
def main_process_first(accelerator, timeout_s: int):
    """accelerate's main_process_first, with the ranks' wait bounded by `timeout_s` instead of the
    default group's collective timeout: rank 0 runs the block first, the others after it."""
    if accelerator.num_processes == 1:
        yield
        return
    check_gloo_address()
    group = torch.distributed.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))

    def wait(for_whom: str):
        try:
            torch.distributed.barrier(group=group)
        except RuntimeError as err:  # gloo's timeout, or a peer that failed meanwhile
            raise TrainingError(f"rank {accelerator.process_index} waited in vain for {for_whom} (failed, or "
                                f"longer than --data_timeout {timeout_s} s): {one_line(err, 160)}") from None

    if not accelerator.is_main_process:
        wait("rank 0 to prepare the data")  # rank 0 tokenises and caches; the others then read its cache
    yield
    if accelerator.is_main_process:
        wait("the other ranks")
    torch.distributed.destroy_process_group(group)


def check_gloo_address() -> None:
    """gloo binds the address this machine's hostname resolves to, unless GLOO_SOCKET_IFNAME names an
    interface. Many images resolve the hostname to 127.0.1.1 (Debian's /etc/hosts): on a job across
    machines the others could not reach it, and the first barrier would wait out its timeout. One
    line instead. (All machines on one host, MASTER_ADDR a loopback address, need nothing.)"""
    world, local = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0)
    if os.environ.get("GLOO_SOCKET_IFNAME") or not local or world <= local:
        return
    try:
        hostname = socket.gethostname()
        own, master = (ipaddress.ip_address(socket.gethostbyname(name))
                       for name in (hostname, os.environ.get("MASTER_ADDR", "127.0.0.1")))
    except (OSError, ValueError):
        return  # unresolvable: gloo's own error says more
    if own.is_loopback and not master.is_loopback:
        raise ConfigError(f"this machine's hostname {hostname} resolves to {own}, a loopback address: gloo would bind "
                          f"it, and the other machines of this {world}-process job could not reach it; set "
                          "GLOO_SOCKET_IFNAME (and NCCL_SOCKET_IFNAME) to the network interface, e.g. eth0 "
                          "(docs/clusters.md)")


def held_out_set(cfg, tokenizer):
    """The held-out blocks of a streamed run: its own split or files, tokenised up front (they are
    small), as train.py's other held-out sets (packing.DocumentBlocks: masked with --document_mask)."""
    docs = data.load_documents(cfg, held_out=True)
    return packing.as_dataset(data.tokenize_documents(docs, tokenizer, "eval", cfg, cfg.dataset_num_proc),
                                tokenizer, cfg)


class StreamedBlocks(IterableDataset):
    """This rank's blocks of seq_len + 1 tokens, packed from its part of the streamed source. Each
    carries an index like the packed datasets' (rank + world_size * blocks made so far in the pass),
    unique across ranks; nothing in training reads it."""

    def __init__(self, cfg, tokenizer, rank: int, world_size: int):
        self.cfg, self.tokenizer, self.rank, self.world_size, self.epoch = cfg, tokenizer, rank, world_size, 0
        self.head, self.tail = data.document_bounds(tokenizer, cfg.add_bos)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def documents(self):
        import datasets
        from datasets.distributed import split_dataset_by_node

        cfg = self.cfg
        try:
            if cfg.data_files:  # folders and globs as the files they name, sorted
                files = data_file_list(cfg.data_files)
                builder, kwargs = data.file_builder(files, cfg.txt_documents)
                ds = datasets.load_dataset(builder, data_files=files, split="train", streaming=True, **kwargs)
            else:
                ds = datasets.load_dataset(cfg.dataset_name, cfg.dataset_config, split=cfg.dataset_split,
                                           streaming=True)
        except Exception as err:  # an unknown dataset, split or file format: the user's to fix
            source = cfg.data_files or cfg.dataset_name
            raise ConfigError(f"cannot stream {source}: {str(err).splitlines()[0]}") from None
        ds = split_dataset_by_node(ds, rank=self.rank, world_size=self.world_size)
        ds = ds.shuffle(seed=cfg.seed, buffer_size=SHUFFLE_BUFFER)
        ds.set_epoch(self.epoch)
        # In batches, not `for row in ds`: inside a DataLoader worker that would split the stream by worker
        # itself (by shards: a one-file corpus would go to worker 0 alone); tokenized() takes its share.
        for batch in ds.iter(batch_size=256):
            if cfg.text_column not in batch:
                raise ConfigError(f"streamed rows have no column {cfg.text_column!r} (columns: {sorted(batch)}); "
                                  "set --text_column")
            for text in batch[cfg.text_column]:
                if text is not None and not isinstance(text, str):
                    raise ConfigError(f"{', '.join(cfg.data_files or [cfg.dataset_name])}: column "
                                      f"{cfg.text_column!r} holds {type(text).__name__} values, not text: set "
                                      "--text_column")
                if isinstance(text, str) and text.strip():  # empty and null texts: no documents, as unstreamed
                    yield text

    def tokenized(self, share: int = 0, shares: int = 1):
        """Documents share, share + shares, ... of the stream, tokenised with their BOS/EOS."""
        for i, text in enumerate(self.documents()):
            if i % shares == share:
                yield self.head + self.tokenizer(text, add_special_tokens=False)["input_ids"] + self.tail

    def tokenized_in_workers(self):
        """The stream's documents tokenised, in stream order: alone, here; with --num_workers N, by N
        DataLoader workers, each reading the stream and tokenising every N-th document. The loader
        hands their documents back in turn (worker 0's first, worker 1's first, ...), which is stream
        order: the blocks are the same whatever N (a checkpoint resumes under any), only faster."""
        if not self.cfg.num_workers:
            yield from self.tokenized()
            return
        loader = DataLoader(_WorkerShare(self), batch_size=None, num_workers=self.cfg.num_workers)
        for ids in loader:
            if isinstance(ids, str):  # a worker's ConfigError, as its one line (not the loader's wrapped traceback)
                raise ConfigError(ids)
            yield ids.tolist()

    def __iter__(self):
        block_len, pending, starts, made = self.cfg.seq_len + 1, [], [], 0  # starts: of documents, in pending
        for ids in self.tokenized_in_workers():
            starts.append(len(pending))
            pending.extend(ids)
            while len(pending) >= block_len:
                block = torch.from_numpy(np.asarray(pending[:block_len], dtype=np.int64))
                item = {"input_ids": block[:-1], "labels": block[1:], "index": self.rank + self.world_size * made}
                if self.cfg.document_mask != "false":  # as packing.DocumentBlocks: positions restart at each document
                    positions = packing.restart_positions(np.asarray(starts, dtype=np.int64), 0, block_len - 1)
                    item["position_ids"] = torch.from_numpy(positions)
                del pending[:block_len]
                starts = [0] + [start - block_len for start in starts if start > block_len]
                yield item
                made += 1


class _WorkerShare(IterableDataset):
    """In DataLoader worker w of N: the tokenised documents w, w + N, ... of a StreamedBlocks' stream
    (as int64 arrays; a ConfigError as its message, for the main process to raise)."""

    def __init__(self, blocks: StreamedBlocks):
        self.blocks = blocks

    def __iter__(self):
        worker = torch.utils.data.get_worker_info()
        try:
            for ids in self.blocks.tokenized(worker.id, worker.num_workers):
                yield np.asarray(ids, dtype=np.int64)
        except ConfigError as err:
            yield str(err)


def streamed_loaders(cfg, train: StreamedBlocks, held_out, pin_memory: bool):
    train_loader = DataLoader(train, batch_size=cfg.micro_batch_size, drop_last=True, pin_memory=pin_memory)
    eval_loader = DataLoader(held_out, batch_size=cfg.micro_batch_size, shuffle=False, pin_memory=pin_memory)
    return train_loader, eval_loader


def streamed_batches(accelerator, loader, skip: int = 0):
    """Micro-batches on the device across passes, after skipping the first `skip` (a resumed run).
    At the first batch the ranks agree that each has one: a rank whose part holds no full
    micro-batch stops every rank with the same line, not itself alone while the others wait for
    it in the step's all-reduce (up to --collective_timeout). A pass gives as many blocks as the
    first (the same tokens, reshuffled), so no later pass comes up empty."""
    epoch, first = 0, True
    while True:
        loader.dataset.set_epoch(epoch)
        batches = iter(loader)
        head = next(batches, None)
        if first:
            first, have = False, accelerator.gather(torch.tensor([int(head is not None)], device=accelerator.device))
            empty = [str(rank) for rank, has in enumerate(have.tolist()) if not has]
            if empty:
                with same_on_every_rank():
                    raise ConfigError(
                        f"the part of the stream of rank(s) {', '.join(empty)} (of {len(have)}) holds no full "
                        f"micro-batch of {loader.batch_size} blocks of {loader.dataset.cfg.seq_len + 1} tokens: lower "
                        "--micro_batch_size or --seq_len, use fewer processes, or give more data")
        if head is None:  # not after a first pass that had one; and a loop must not spin
            raise TrainingError(f"pass {epoch} over rank {accelerator.process_index}'s part of the stream: no batch")
        for batch in itertools.chain([head], batches):
            if skip:
                skip -= 1
                continue
            yield send_to_device(batch, accelerator.device, non_blocking=True)  # from pinned memory
        epoch += 1
