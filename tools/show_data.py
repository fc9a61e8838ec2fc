"""`python -m tools.show_data`: what train.py trains on, row by row, before any training.

    python -m tools.show_data --data_files chat.jsonl --tokenizer_name_or_path my_tokenizer --seq_len 2048
    python -m tools.show_data --data_files chat.jsonl ... --rows all --out rows.jsonl

It takes train.py's data and tokenizer options (any other train.py option is accepted and ignored,
so a run's command line can be pasted as it is), builds the training set through train.py's own
code (train_extras/data/, common/data.py's loader and its seeded order) and prints the first rows
the loader hands the model (a 1-process run's, epoch 0): the text with the trained tokens marked
(green on a terminal, [[in brackets]] when piped), where each example starts, the padding; then the
totals (examples kept, dropped, truncated; rows; trained tokens; padding share), which the setup
block and run_summary.json of a run on the same options print too.

--out FILE writes those rows as JSON lines, as the model gets them: input_ids and labels of equal
length (labels[t]: the token trained to follow input_ids[t], or -100), and position_ids where a row
packs several examples with document masks.
"""

from __future__ import annotations

import json
import sys

from common import data
from common.config import ConfigError, parse
from train_extras.data import assemble
from train_extras.options import TrainConfig

USAGE = "python -m tools.show_data [train.py's data options] [--rows N|all] [--out FILE]"
GREEN, RESET = "\033[32m", "\033[0m"


def own_options(argv: list[str]) -> tuple[int | None, str | None, list[str]]:
    """(--rows: a count, None for all; --out; the rest, train.py's options)."""
    rows, out, rest = 3, None, []
    args = iter(argv)
    for arg in args:
        if arg in ("--rows", "--out"):
            value = next(args, None)
            if value is None:
                raise ConfigError(f"{arg} needs a value ({USAGE})")
            if arg == "--out":
                out = value
            elif value == "all":
                rows = None
            elif value.isdigit() and int(value) > 0:
                rows = int(value)
            else:
                raise ConfigError(f"--rows takes a positive count or 'all', got {value!r}")
        else:
            rest.append(arg)
    return rows, out, rest


def loader_rows(cfg, train, held_out, limit: int | None):
    """The training loader's rows in order (1 process, epoch 0), as dicts of lists: the model's inputs."""
    loader, _ = data.build_loaders(cfg, train, held_out, pin_memory=False, data_ranks=1)
    loader.sampler.set_epoch(0)
    count = 0
    for batch in loader:
        for i in range(len(batch["input_ids"])):
            if limit is not None and count >= limit:
                return
            yield {key: batch[key][i].tolist() for key in ("input_ids", "labels", "position_ids") if key in batch}
            count += 1


def spans(row: dict, pad_id: int) -> list[tuple[int, int, bool]]:
    """The row's tokens (its inputs and the last label) as (start, end, trained) runs, cut at example
    starts too; the trailing padding as one run marked by start -1."""
    tokens = row["input_ids"] + [row["labels"][-1] if row["labels"][-1] != -100 else pad_id]
    trained = [False] + [label != -100 for label in row["labels"]]
    starts = {t for t, p in enumerate(row.get("position_ids", [])) if p == 0}
    end = len(tokens)
    while end > 0 and tokens[end - 1] == pad_id and not trained[end - 1]:
        end -= 1
    runs, begin = [], 0
    for t in range(1, end + 1):
        if t == end or trained[t] != trained[begin] or t in starts:
            runs.append((begin, t, trained[begin]))
            begin = t
    if end < len(tokens):
        runs.append((-1, len(tokens) - end, False))
    return runs


def show_row(number: int, row: dict, tokenizer, colour: bool, concatenated: bool) -> str:
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    tokens = row["input_ids"] + [row["labels"][-1] if row["labels"][-1] != -100 else pad_id]
    starts = {t for t, p in enumerate(row.get("position_ids", [])) if p == 0}
    runs = spans(row, pad_id)
    padding = runs[-1][1] if runs and runs[-1][0] == -1 else 0
    examples = len([t for t in starts if t < len(tokens) - padding]) or 1
    trained = sum(label != -100 for label in row["labels"])
    lines = [f"--- row {number}: {examples} example(s), {trained} trained tokens, {padding} padding ---"]
    text = []
    for begin, end, on in runs:
        if begin == -1:
            text.append(f"\n<padding: {end} tokens>")
            continue
        if begin in starts:  # concatenated, a block's first token may continue an example
            text.append("\n<block start>\n" if begin == 0 and concatenated else f"\n<example at token {begin}>\n")
        piece = tokenizer.decode(tokens[begin:end], skip_special_tokens=False)
        text.append((f"{GREEN}{piece}{RESET}" if colour else f"[[{piece}]]") if on else piece)
    lines.append("".join(text).lstrip("\n"))
    return "\n".join(lines)


def describe_totals(built) -> list[str]:
    """The lines train.py's setup block prints about the data (assemble.describe)."""
    return [f"{key:<17}: {value}" for key, value in assemble.describe(built.facts).items()]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        limit, out, rest = own_options(argv)
        cfg = parse(TrainConfig, rest, recipe="python -m tools.show_data")
        if cfg.streaming:
            raise ConfigError("--streaming: the rows are made while training; show them without --streaming")
        tokenizer = data.build_tokenizer(cfg)
        built = assemble.build(cfg, tokenizer, num_proc=cfg.dataset_num_proc)
        held_out = next(iter(built.held_out.values()))
        rows = list(loader_rows(cfg, built.train, held_out, limit))
    except (ConfigError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    colour = sys.stdout.isatty()
    for number, row in enumerate(rows[:3] if out else rows):  # with --out, the file holds them all
        print(show_row(number, row, tokenizer, colour, built.facts["rows"]["strategy"] == "concatenate"))
    print("\n".join(describe_totals(built)))
    if out:
        with open(out, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        print(f"wrote {len(rows)} rows to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
