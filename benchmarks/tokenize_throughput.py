"""Tokenising throughput of the data path (common/data.py) with 1 and 2 processes (--dataset_num_proc).

    python benchmarks/tokenize_throughput.py             # ~50 MB of text, 3 rounds of 1 vs 2 processes

Writes a ~50 MB .txt (tiny Shakespeare's speeches, shuffled and repeated; one document per
paragraph) into a temporary folder, then tokenises it with `data.tokenize_and_stream`, each run in
a datasets cache of its own (nothing reused), alternating 1 and 2 processes. Tokens/s counts the
tokens in the stream written; the time includes datasets' arrow writing and the stream file.
Tokenizers: the byte tokenizer (the default; a Python tokenizer) and a byte-level BPE trained here
with `tokenizers` (a Rust tokenizer, as pretrained models' are). Writes
benchmarks/results/tokenize-<date>/ (table.md, results.json).
"""

from __future__ import annotations

import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench_utils import ROOT, write_results

sys.path.insert(0, str(ROOT))
TARGET_BYTES = 50 * 2**20
ROUNDS = 3


def write_corpus(path: Path) -> int:
    from common.data import shakespeare_split

    speeches = [s for s in "\n".join(shakespeare_split()).split("\n\n") if s.strip()]
    rng, written = random.Random(0), 0
    with open(path, "w") as f:
        while written < TARGET_BYTES:
            rng.shuffle(speeches)
            for speech in speeches:
                written += f.write(speech + "\n\n")
    return written


def bpe_tokenizer(folder: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from common.data import shakespeare_split

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=4096, special_tokens=["<s>", "</s>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(shakespeare_split(), trainer)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>").save_pretrained(folder)
    return AutoTokenizer.from_pretrained(folder)


def tokenise_once(corpus: Path, tokenizer, num_proc: int, cache: Path) -> tuple[int, float]:
    import datasets

    from common import data
    from train_extras.options import TrainConfig

    datasets.config.HF_DATASETS_CACHE = cache
    datasets.utils.disable_progress_bars()
    cfg = TrainConfig(data_files=[str(corpus)], dataset_num_proc=num_proc if num_proc > 1 else None)
    t0 = time.perf_counter()
    stream = data.tokenize_and_stream(data.load_documents(cfg), tokenizer, "train", cfg, cfg.dataset_num_proc)
    return len(stream), time.perf_counter() - t0


def main():
    from common.data import build_tokenizer
    from train_extras.options import TrainConfig

    work = Path(tempfile.mkdtemp(prefix="tokenize_bench_"))
    corpus = work / "corpus.txt"
    size = write_corpus(corpus)
    tokenizers = {"byte (Python)": build_tokenizer(TrainConfig()), "BPE 4k (Rust)": bpe_tokenizer(work / "bpe")}
    rows, results = [], {"corpus_bytes": size, "runs": []}
    for name, tokenizer in tokenizers.items():
        rates = {1: [], 2: []}
        for round_ in range(ROUNDS):
            for num_proc in (1, 2):
                cache = work / f"cache_{name[:4]}_{round_}_{num_proc}"
                tokens, seconds = tokenise_once(corpus, tokenizer, num_proc, cache)
                rates[num_proc].append(tokens / seconds)
                results["runs"].append({"tokenizer": name, "num_proc": num_proc, "tokens": tokens, "seconds": seconds})
                print(f"{name}, {num_proc} proc: {tokens:,} tokens in {seconds:.1f} s", flush=True)
        one, two = statistics.median(rates[1]), statistics.median(rates[2])
        rows.append([name, f"{one:,.0f}", f"{two:,.0f}", f"{two / one:.2f}"])
    notes = [f"Corpus: {size / 2**20:.1f} MB of tiny Shakespeare's speeches, shuffled and repeated (one document "
             f"per paragraph). Median of {ROUNDS} rounds, 1 and 2 processes alternating; each run tokenises "
             "afresh into a cache of its own."]
    day = time.strftime("%Y-%m-%d")
    write_results(ROOT / "benchmarks" / "results" / f"tokenize-{day}", "Tokenising throughput, 1 vs 2 processes",
                  ["tokenizer", "tokens/s, 1 process", "tokens/s, 2 processes", "ratio"], rows, notes, results)


if __name__ == "__main__":
    main()
