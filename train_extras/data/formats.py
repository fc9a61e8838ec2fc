"""Rows -> examples (docs/data.md: Conversations, Tool calls, Prompt/completion): text;
prompt/completion pairs as text; or conversations in the shapes people write them, all made one: a
column 'example' holding, as JSON text, a list of {role, content} with content a string (and the
row's tool schemas, if any).

- messages: a list of {role, content} (OpenAI's, transformers' and TRL's shape); other keys of a
  message (tool_calls, name...) are kept for the template.
- OpenAI content parts: content as a list of {"type": "text", "text": ...}. Its text parts are
  joined in order with nothing between, as templates that take parts render them (and as
  transformers reads one text part: the same as the string). A part of another type (an image,
  audio...) is refused: train.py trains text models.
- ShareGPT: `conversations` (or --chat_column) of {from, value}; `from` is mapped to a role (ROLES).
- Tool calls: assistant messages with `tool_calls`, `tool` messages with the results, and a `tools`
  column of function schemas handed to the template. `datasets` reads messages whose keys differ
  from one to the next as its `Json` feature (each as written): recognised as messages too.
- prompt/completion: a `prompt` and a `completion` column, both text (kind "completions": the loss
  on the completion) or both message lists (a conversation whose prompt is its first messages).

Each row is rendered as written: messages are kept as JSON text from here on, so no table schema
adds keys to them. Where `datasets` did merge keys (a struct column: every message gets every key
any message has, every tool call's arguments every argument name), the None values it filled in
are removed again, at any depth (a null written in such a file is removed with them).

Each conversation keeps its row: its place in the source's files (sources.locate), so an error
about it, here or at render time after the split has shuffled the rows, names its file and line.
"""

from __future__ import annotations

import dataclasses
import json

from common import data
from common.config import ConfigError
from train_extras.data import sources

# ShareGPT's `from` -> the role a chat template expects (FastChat's, axolotl's and LLaMA-Factory's names).
ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
         "tool": "tool", "observation": "tool"}


def shape(feature) -> str | None:
    """'messages' for a list of {role, content}, 'sharegpt' for a list of {from, value}, 'json' for a
    list of datasets' Json values (messages or turns, told apart per row), else None."""
    import datasets

    inner = getattr(feature, "feature", None)
    if isinstance(feature, datasets.Json):  # a whole column of Json values: read per row
        return "json"
    if not isinstance(feature, (datasets.List, datasets.LargeList)):
        return None
    if isinstance(inner, datasets.Json):
        return "json"
    if not isinstance(inner, dict):
        return None
    if {"role", "content"} <= set(inner):
        return "messages"
    return "sharegpt" if {"from", "value"} <= set(inner) else None


def holds_turns(rows, column: str) -> bool:
    """A column's shape is a conversation's, for a Json list: its first non-empty row's first item."""
    form = shape(rows.features[column])
    if form != "json":
        return form is not None
    first = next((turns for turns in rows.select_columns([column]).select(range(min(len(rows), 100)))[column]
                  if turns), None)
    return isinstance(first, list) and isinstance(first[0], dict) and bool({"role", "from"} & set(first[0]))


PROMPT, COMPLETION, TOOLS = "prompt", "completion", "tools"


def find_column(rows, given: str | None, source: str, text_column: str = "text") -> str | None:
    """--chat_column, else (when the rows have no --text_column column: that one is text, as before)
    the first column shaped like conversations (not a prompt/completion pair's, nor `tools`), else None."""
    if given is not None:
        if given not in rows.column_names:
            raise ConfigError(f"{source}: no column {given!r} (has {rows.column_names}); set --chat_column")
        if not holds_turns(rows, given):
            raise ConfigError(f"{source}: column {given!r} is not a list of {{role, content}} messages nor of "
                              f"ShareGPT {{from, value}} turns ({rows.features[given]})")
        return given
    if text_column in rows.column_names:
        return None
    return next((name for name in rows.column_names
                 if name not in (PROMPT, COMPLETION, TOOLS) and holds_turns(rows, name)), None)


def prompt_completion(rows, cfg, source: str) -> str | None:
    """'text' or 'messages' when the rows are prompt/completion pairs (and no other column was asked
    for), else None; a pair of mixed kinds is refused."""
    if cfg.chat_column or cfg.text_column in rows.column_names or not {PROMPT, COMPLETION} <= set(rows.column_names):
        return None
    kinds = []
    for name in (PROMPT, COMPLETION):
        feature = rows.features[name]
        kinds.append("text" if getattr(feature, "dtype", None) in ("string", "large_string") else
                     "messages" if holds_turns(rows, name) else None)
    if kinds[0] != kinds[1] or kinds[0] is None:
        raise ConfigError(f"{source}: the {PROMPT!r} and {COMPLETION!r} columns must both hold text or both lists of "
                          f"messages (they hold {rows.features[PROMPT]} and {rows.features[COMPLETION]})")
    return kinds[0]


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
    if form == "json":
        form = "sharegpt" if "from" in turns[0] and "role" not in turns[0] else "messages"
    if form == "sharegpt":
        messages = []
        for i, turn in enumerate(turns):
            if turn["from"] not in ROLES:
                raise RowError(row, f"turn {i} is from {turn['from']!r}: ShareGPT's senders read here are "
                                    f"{', '.join(ROLES)}")
            messages.append({"role": ROLES[turn["from"]], "content": text_of(turn["value"], i, row)})
        return messages
    for i, message in enumerate(turns):
        if not isinstance(message, dict) or "role" not in message:
            raise RowError(row, f"message {i} has no 'role' ({message!r:.80})")
    return [{**message, "content": text_of(message["content"], i, row)} if "content" in message else message
            for i, message in enumerate(turns)]


def without_filled_nones(value):
    """A value from a struct column without the None values datasets' schema filled in, at any depth."""
    if isinstance(value, dict):
        return {key: without_filled_nones(item) for key, item in value.items() if item is not None}
    if isinstance(value, list):
        return [without_filled_nones(item) for item in value]
    return value


def conversations(rows, column: str, source: str, where, prompt_column: str | None = None):
    """The conversations of `column` (prompt/completion: prompt_column's messages, then column's) as
    one column 'example': JSON text of {"messages": [...], "tools": [...] or absent, "prompt_turns":
    the number of prompt messages, if any}; empty ones left out; 'row': the place in the source,
    where(row) -> "chat.jsonl line 7"."""
    columns = [c for c in (prompt_column, column) if c] + ([TOOLS] if TOOLS in rows.column_names else [])
    struct = {c: shape(rows.features[c]) != "json" for c in columns}

    def turns_of(batch, name, i, row):
        turns = batch[name][i] or []
        if not isinstance(turns, list):
            raise RowError(row, f"column {name!r} holds {type(turns).__name__}, not a list of messages")
        turns = without_filled_nones(turns) if struct[name] else turns
        return as_messages(turns, shape(rows.features[name]), row) if turns else []

    def read(batch, indices):
        out = []
        for i, row in enumerate(indices):
            messages = turns_of(batch, column, i, row)
            example = {"messages": messages}
            if prompt_column:
                prompt = turns_of(batch, prompt_column, i, row)
                example = {"messages": prompt + messages, "prompt_turns": len(prompt)} if prompt and messages else {}
            tools = batch[TOOLS][i] if TOOLS in batch else None
            tools = json.loads(tools) if isinstance(tools, str) else tools  # schemas written as JSON text
            if tools and example:
                example["tools"] = without_filled_nones(tools) if struct[TOOLS] else tools
            out.append(json.dumps(example) if example.get("messages") else "")
        return {"example": out, "row": indices}

    try:
        ds = rows.select_columns(columns).map(read, batched=True, with_indices=True, remove_columns=columns,
                                              desc=f"read {source}")
    except RowError as err:
        raise named(where, err) from None
    ds = ds.filter(lambda batch: [bool(m) for m in batch["example"]], batched=True)
    if len(ds) == 0:
        raise ConfigError(f"dataset is empty (no conversation with a message): {source}")
    return ds


def completions(rows, source: str):
    """prompt/completion pairs of text: columns 'prompt', 'completion' (rows with an empty completion
    left out) and 'row'."""
    ds = rows.select_columns([PROMPT, COMPLETION]).map(lambda batch, indices: {"row": indices}, batched=True,
                                                        with_indices=True, desc=f"read {source}")
    ds = ds.filter(lambda batch: [bool(c) for c in batch[COMPLETION]], batched=True)
    if len(ds) == 0:
        raise ConfigError(f"dataset is empty (no row with a completion): {source}")
    return ds


def load(cfg, held_out: bool = False):
    """(examples, kind) of the source the data options name (tiny Shakespeare when none): kind
    "text", "completions" (prompt/completion text) or "conversations"."""
    rows, source = data.load_rows(cfg, held_out)
    if rows is None:
        return data.load_documents(cfg, held_out), "text"
    where = lambda row: sources.locate(cfg, held_out, row)  # noqa: E731
    pair = prompt_completion(rows, cfg, source)
    if pair == "text":
        return completions(rows, source), "completions"
    if pair == "messages":
        return conversations(rows, COMPLETION, source, where, prompt_column=PROMPT), "conversations"
    column = find_column(rows, cfg.chat_column, source, cfg.text_column)
    if column is not None:
        return conversations(rows, column, source, where), "conversations"
    return data.text_documents(rows, cfg.text_column, source), "text"


@dataclasses.dataclass
class Source:
    """One source's examples, split: text ('text' column), completions ('prompt', 'completion',
    'row') or conversations ('example': JSON text, 'row')."""
    train: object
    held_out: object
    kind: str  # "text", "completions" or "conversations"
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
