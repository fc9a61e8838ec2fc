"""Rows -> examples (docs/data.md#conversations): text, or conversations in the shapes people write
them, all made one: a column 'messages' of {role, content} with content a string.

- messages: a list of {role, content} (OpenAI's, transformers' and TRL's shape); other keys of a
  message (tool_calls, name...) are kept for the template.
- OpenAI content parts: content as a list of {"type": "text", "text": ...}. Its text parts are
  joined in order with nothing between, as templates that take parts render them (and as
  transformers reads one text part: the same as the string). A part of another type (an image,
  audio...) is refused: train.py trains text models.
- ShareGPT: `conversations` (or --chat_column) of {from, value}; `from` is mapped to a role (ROLES).

Each conversation keeps its row: its place in the source's files (sources.locate), so an error
about it, here or at render time after the split has shuffled the rows, names its file and line.
"""

from __future__ import annotations

import dataclasses

from common import data
from common.config import ConfigError
from train_extras.data import sources

# ShareGPT's `from` -> the role a chat template expects (FastChat's, axolotl's and LLaMA-Factory's names).
ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
         "tool": "tool", "observation": "tool"}


def shape(feature) -> str | None:
    """'messages' for a list of {role, content}, 'sharegpt' for a list of {from, value}, else None."""
    import datasets

    inner = getattr(feature, "feature", None)
    if not (isinstance(feature, (datasets.List, datasets.LargeList)) and isinstance(inner, dict)):
        return None
    if {"role", "content"} <= set(inner):
        return "messages"
    return "sharegpt" if {"from", "value"} <= set(inner) else None


def find_column(rows, given: str | None, source: str, text_column: str = "text") -> str | None:
    """--chat_column, else (when the rows have no --text_column column: that one is text, as before)
    the first column shaped like conversations, else None (text)."""
    if given is not None:
        if given not in rows.column_names:
            raise ConfigError(f"{source}: no column {given!r} (has {rows.column_names}); set --chat_column")
        if shape(rows.features[given]) is None:
            raise ConfigError(f"{source}: column {given!r} is not a list of {{role, content}} messages nor of "
                              f"ShareGPT {{from, value}} turns ({rows.features[given]})")
        return given
    if text_column in rows.column_names:
        return None
    return next((name for name in rows.column_names if shape(rows.features[name])), None)


class RowError(Exception):
    """A conversation that cannot be read or rendered: (its row, what is wrong). Raised inside a
    `datasets` map (whose fingerprint must not hold the run's options), named by where(row) outside."""


def named(where, err: RowError) -> ConfigError:
    row, message = err.args
    return ConfigError(f"{where(row)}: {message}")


def text_of(content, i: int, row: int) -> str:
    """A message's content as the template sees it: a string, or the text parts joined."""
    if content is None or isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RowError(row, f"message {i}'s content is neither text nor a list of parts ({content!r:.80})")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise RowError(row, f"message {i} has a content part {kind or type(part).__name__!r}: only text parts "
                                '({"type": "text", "text": ...}) can be trained (train.py trains text models)')
        texts.append(part["text"])
    return "".join(texts)


def as_messages(turns: list[dict], form: str, row: int) -> list[dict]:
    """One row's conversation as messages with string contents (ShareGPT's turns mapped to roles)."""
    if form == "sharegpt":
        messages = []
        for i, turn in enumerate(turns):
            if turn["from"] not in ROLES:
                raise RowError(row, f"turn {i} is from {turn['from']!r}: ShareGPT's senders read here are "
                                    f"{', '.join(ROLES)}")
            messages.append({"role": ROLES[turn["from"]], "content": text_of(turn["value"], i, row)})
        return messages
    return [{**message, "content": text_of(message["content"], i, row)} for i, message in enumerate(turns)]


def conversations(rows, column: str, source: str, where):
    """The conversations of `column` as one column 'messages' (empty ones left out) and their rows
    ('row': the place in the source, where(row) -> "chat.jsonl line 7")."""
    form = shape(rows.features[column])

    def read(batch, indices):
        return {"messages": [as_messages(turns, form, row) if turns else turns
                             for row, turns in zip(indices, batch[column])], "row": indices}

    try:
        ds = rows.select_columns([column]).map(read, batched=True, with_indices=True, remove_columns=[column],
                                               desc=f"read {source}")
    except RowError as err:
        raise named(where, err) from None
    ds = ds.filter(lambda batch: [bool(m) for m in batch["messages"]], batched=True)
    if len(ds) == 0:
        raise ConfigError(f"dataset is empty (no conversation with a message): {source}")
    return ds


def load(cfg, held_out: bool = False):
    """(examples, kind) of the source the data options name (tiny Shakespeare when none)."""
    rows, source = data.load_rows(cfg, held_out)
    if rows is None:
        return data.load_documents(cfg, held_out), "text"
    column = find_column(rows, cfg.chat_column, source, cfg.text_column)
    if column is not None:
        return conversations(rows, column, source, lambda row: sources.locate(cfg, held_out, row)), "conversations"
    return data.text_documents(rows, cfg.text_column, source), "text"


@dataclasses.dataclass
class Source:
    """One source's examples, split: text ('text' column) or conversations ('messages', 'row')."""
    train: object
    held_out: object
    kind: str  # "text" or "conversations"
    where: object  # (held_out: bool, row) -> "chat.jsonl line 7"


def load_source(cfg) -> Source:
    docs, kind = load(cfg)
    loaded = {}

    def held_out_docs(cfg, held_out):  # its own held-out files or split: the same kind, or refused
        loaded["docs"], loaded["kind"] = load(cfg, held_out)
        return loaded["docs"]

    split = data.split_documents(cfg, docs, load=held_out_docs)
    if loaded and loaded["kind"] != kind:
        raise ConfigError(f"the training data holds {kind} and the held-out data {loaded['kind']}: give one kind")
    # a held-out part cut from the training rows lies in the training files
    own = bool(cfg.eval_split or cfg.eval_data_files)
    return Source(split["train"], split["test"], kind,
                  lambda held_out, row: sources.locate(cfg, held_out and own, row))
