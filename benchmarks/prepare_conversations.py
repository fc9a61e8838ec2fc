"""Preparing conversations for training: train.py's data path (train_extras/data/: read, render with
the chat template, the assistant's tokens found) beside TRL's SFTTrainer, one process.

    python benchmarks/prepare_conversations.py                       # 8k and 32k conversations, 2 rounds
    PYTHONPATH=/tmp/trl python benchmarks/prepare_conversations.py   # with TRL, installed by:
    pip install --no-deps --target /tmp/trl trl==1.16.0

The conversations are tiny Shakespeare's speeches: a system message, then 1 to 3 exchanges (a
speech as the user's turn, the next as the assistant's), written as JSONL. The tokenizer is a
byte-level BPE of 4,096 ids trained here on the same text, with chat tokens and a template that
marks the assistant's turns with {% generation %}; "no markers" is the same template without them
(the assistant's tokens are then found from the prefixes' renders). Each measurement runs in a
process of its own with a datasets cache of its own (nothing reused) and counts reading the JSONL
and rendering every conversation into token ids and a trained mask:
- ours: train_extras.data.formats.load + render.tokenize (what assemble.build does before packing);
- TRL: SFTTrainer._prepare_dataset (assistant_only_loss=True, unpacked, untruncated), only with the
  markers (TRL needs them for an assistant-only loss).
Rounds alternate the three; the table holds medians. Writes benchmarks/results/prepare-<date>/.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_utils import ROOT, write_results

sys.path.insert(0, str(ROOT))
SIZES = (8000, 32000)
ROUNDS = 2
TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}<|assistant|>\n{% generation %}{{ message['content'] }}<|end|>"
    "{% endgeneration %}{% else %}<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
SPECIALS = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]


def write_conversations(path: Path, count: int) -> None:
    from common.data import shakespeare_split

    speeches = [s.strip() for s in "\n".join(shakespeare_split()).split("\n\n") if s.strip()]
    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(count):
            at = rng.randrange(len(speeches) - 8)
            messages = [{"role": "system", "content": "You answer in verse."}]
            for k in range(rng.randint(1, 3)):
                messages += [{"role": "user", "content": speeches[at + 2 * k]},
                             {"role": "assistant", "content": speeches[at + 2 * k + 1]}]
            f.write(json.dumps({"messages": messages}) + "\n")


def save_tokenizer(folder: Path, markers: bool) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from common.data import shakespeare_split

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=4096, special_tokens=["<s>", "</s>", "<pad>", *SPECIALS],
                                  show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(shakespeare_split(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   additional_special_tokens=SPECIALS)
    fast.chat_template = TEMPLATE if markers else TEMPLATE.replace("{% generation %}", "").replace(
        "{% endgeneration %}", "")
    fast.save_pretrained(folder)


def measure(kind: str, data: str, tokenizer: str) -> dict:
    """In this process (a fresh one): prepare the conversations, return seconds and counts."""
    import datasets
    from transformers import AutoTokenizer

    datasets.utils.disable_progress_bars()
    tok = AutoTokenizer.from_pretrained(tokenizer)
    t0 = time.perf_counter()
    if kind == "trl":
        import types

        from trl import SFTConfig, SFTTrainer

        rows = datasets.load_dataset("json", data_files=data, split="train")
        args = SFTConfig(output_dir=tempfile.mkdtemp(), max_length=None, assistant_only_loss=True, bf16=False,
                         use_cpu=True, report_to=[], dataset_num_proc=None)
        trainer = types.SimpleNamespace(_tokenizer=tok, completion_only_loss=True, chat_template=None)
        prepared = SFTTrainer._prepare_dataset(trainer, rows, tok, args, packing=False, formatting_func=None,
                                               dataset_name="train")
        tokens = sum(len(ids) for ids in prepared["input_ids"])
        trained = sum(sum(label != -100 for label in labels) for labels in prepared["labels"])
    else:
        from train_extras.data import formats, render
        from train_extras.options import TrainConfig

        cfg = TrainConfig(data_files=[data], seq_len=100000)
        docs, kind_ = formats.load(cfg)
        rendered, _ = render.tokenize(docs, kind_, tok, cfg, "train", None, lambda row: row)
        tokens = sum(rendered["length"])
        trained = sum(sum(t[1:]) for t in rendered["targets"])
    return {"seconds": time.perf_counter() - t0, "tokens": int(tokens), "trained": int(trained)}


def run_one(kind: str, data: Path, tokenizer: Path, cache: Path) -> dict:
    env = {**os.environ, "HF_DATASETS_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, __file__, "--measure", kind, str(data), str(tokenizer)], env=env,
                          capture_output=True, text=True, cwd=ROOT / "benchmarks")
    if proc.returncode != 0:
        raise SystemExit(f"{kind} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    parser.add_argument("--rounds", type=int, default=ROUNDS)
    options = parser.parse_args()
    try:
        import trl
        with_trl = trl.__version__
    except ImportError:
        with_trl = None
    work = Path(tempfile.mkdtemp(prefix="prepare_bench_"))
    save_tokenizer(work / "markers", True)
    save_tokenizer(work / "no_markers", False)
    variants = {"ours, markers": ("ours", "markers"), "ours, no markers": ("ours", "no_markers")}
    if with_trl:
        variants["TRL, markers"] = ("trl", "markers")
    results, rows = {"trl": with_trl, "runs": []}, []
    for size in options.sizes:
        data = work / f"conversations_{size}.jsonl"
        write_conversations(data, size)
        seconds = {name: [] for name in variants}
        for round_ in range(options.rounds):
            for name, (kind, tokenizer) in variants.items():
                got = run_one(kind, data, work / tokenizer, work / f"cache_{size}_{round_}_{kind}_{tokenizer}")
                seconds[name].append(got["seconds"])
                results["runs"].append({"conversations": size, "variant": name, **got})
                print(f"{size} conversations, {name}: {got['seconds']:.1f} s ({got['tokens']:,} tokens, "
                      f"{got['trained']:,} trained)", flush=True)
        median = {name: statistics.median(values) for name, values in seconds.items()}
        rows.append([f"{size:,}", *(f"{median[name]:.1f}" for name in variants),
                     f"{median['ours, no markers'] / median['ours, markers']:.2f}",
                     f"{median['TRL, markers'] / median['ours, markers']:.2f}" if with_trl else "-"])
    headers = ["conversations", *(f"{name} (s)" for name in variants), "no markers / markers",
               "TRL / ours (markers)"]
    notes = [f"Median of {options.rounds} rounds, the variants alternating, each in a fresh process and datasets "
             "cache; one process each. Tiny Shakespeare's speeches as 1-3 exchanges, a 4,096-id BPE trained on them.",
             f"TRL: {with_trl or 'not installed (its columns are left out)'}."]
    day = time.strftime("%Y-%m-%d")
    write_results(ROOT / "benchmarks" / "results" / f"prepare-{day}", "Preparing conversations: ours beside TRL",
                  headers, rows, notes, results)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--measure":
        print(json.dumps(measure(*sys.argv[2:5])))
    else:
        main()
