"""Examples -> token ids and a trained mask (docs/data.md: Conversations, Tool calls,
Prompt/completion): text between its bounds (common/data.py); prompt/completion text; or
conversations (formats.py's messages, with their tool schemas) rendered by the tokenizer's chat
template with the loss on the assistant's tokens only.

Which tokens are the assistant's: where the template marks them ({% generation %} ... {% endgeneration %},
read by transformers' return_assistant_tokens_mask), else by rendering the conversation's prefixes
and taking the differences: the tokens of messages[:i+1] past those of messages[:i] with the
generation prompt are assistant message i's (its content and the template's end-of-turn after it).
A template whose prefix renders are not prefixes of the whole render cannot be read this way: that
is one error line. A conversation longer than seq_len + 1 tokens is dropped or truncated
(--overlong); one left with no assistant token trains nothing and is dropped; both are counted.

prompt/completion: the loss is on what follows the prompt: for text, the completion and an EOS
(added when the completion does not end with it), everything with --completion_only_loss false;
for messages, every token after the prompt's render with its generation prompt. Where the prompt's
tokens are not a prefix of the whole (a merge across the boundary), the loss starts where they part.
--last_turn_only keeps the loss on the last assistant turn alone (the earlier ones stay as context).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jinja2
import numpy as np

from common import data
from common.config import ConfigError, one_line
from train_extras.data import formats

GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")
# What happened to each conversation, counted in the setup block and run_summary.json.
KEPT, TRUNCATED, DROPPED_OVERLONG, DROPPED_NO_ASSISTANT = range(4)
FATES = ("kept", "truncated", "dropped_overlong", "dropped_no_assistant_token")


def read_template_file(cfg) -> str | None:
    """--chat_template FILE's text, checked: a template that does not parse is one error line here,
    before any data is read."""
    if not cfg.chat_template:
        return None
    from transformers.utils.chat_template_utils import _compile_jinja_template  # as apply_chat_template does

    text = Path(cfg.chat_template).read_text()
    try:
        _compile_jinja_template(text)
    except jinja2.TemplateSyntaxError as err:
        raise ConfigError(f"--chat_template {cfg.chat_template} is not a Jinja template: line {err.lineno}: "
                          f"{err.message}") from None
    return text


def apply_template(cfg, template: str | None, tokenizer, kind: str) -> None:
    """The template file replaces (or supplies) the tokenizer's, and the export keeps it: only when
    the data holds conversations. On text it would render nothing and still ship with the model."""
    if template is None:
        return
    if kind in ("text", "completions"):
        raise ConfigError(f"--chat_template {cfg.chat_template} renders conversations, and the data holds text only "
                          "(no column of messages or ShareGPT turns was found): drop --chat_template, or name "
                          "the conversations' column with --chat_column")
    tokenizer.chat_template = template


def check_template(tokenizer, source: str) -> None:
    if not tokenizer.chat_template:
        raise ConfigError(f"{source} holds conversations, and the tokenizer has no chat template to render them: "
                          "give one with --chat_template FILE (a Jinja template)")


def by_markers(tokenizer, messages: list[dict], tools=None) -> tuple[list[int], list[int]]:
    """(token ids, 1 on the assistant's tokens) from the template's generation markers."""
    out = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, return_dict=True,
                                        return_assistant_tokens_mask=True)
    return list(out["input_ids"]), list(out["assistant_masks"])


def encode(tokenizer, messages: list[dict], tools=None, generation_prompt: bool = False) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=generation_prompt)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


NOT_PREFIXES = ("the chat template renders a conversation's first messages as something that does not begin its "
                "whole render, so the assistant's tokens cannot be found from the prefixes: give a template with "
                "{% generation %} markers (--chat_template FILE)")


def by_prefixes(tokenizer, messages: list[dict], tools=None) -> tuple[list[int], list[int]]:
    """(token ids, 1 on the assistant's tokens) from the differences of the prefixes' renders: the
    text of messages[:i+1] past that of messages[:i] with the generation prompt is assistant message
    i's. The renders are compared as text and only the whole is tokenised: an assistant span is the
    tokens that start inside it (a fast tokenizer's offsets, as transformers reads the generation
    markers). Where a span's edge falls inside a token (or a tokenizer has no offsets), each prefix
    is tokenised apart instead and must tokenise as the start of the whole."""
    turns = [i for i, message in enumerate(messages) if message["role"] == "assistant"]
    wholes = tokenizer.apply_chat_template([messages] + [messages[: i + 1] for i in turns], tools=tools,
                                           tokenize=False)
    befores = tokenizer.apply_chat_template([messages[:i] for i in turns], tools=tools, tokenize=False,
                                            add_generation_prompt=True) if turns else []
    whole, throughs = wholes[0], wholes[1:]
    if not all(through.startswith(before) and whole.startswith(through) for before, through in zip(befores, throughs)):
        raise ConfigError(NOT_PREFIXES)
    if tokenizer.is_fast:
        encoded = tokenizer(whole, add_special_tokens=False, return_offsets_mapping=True)
        ids = encoded["input_ids"]
        token_at = {len(whole): len(ids)}
        for k, (start, end) in reversed(list(enumerate(encoded["offset_mapping"]))):
            if end > start:
                token_at[start] = k
        edges = [(len(before), len(through)) for before, through in zip(befores, throughs)]
        if all(a in token_at and b in token_at for a, b in edges):
            mask = [0] * len(ids)
            for a, b in edges:
                mask[token_at[a]: token_at[b]] = [1] * (token_at[b] - token_at[a])
            return list(ids), mask
    encoded = tokenizer([whole] + throughs + befores, add_special_tokens=False)["input_ids"]
    ids, throughs, befores = encoded[0], encoded[1: len(wholes)], encoded[len(wholes):]
    mask = [0] * len(ids)
    for before, through in zip(befores, throughs):
        if through[: len(before)] != before or ids[: len(through)] != through:
            raise ConfigError(NOT_PREFIXES)
        mask[len(before): len(through)] = [1] * (len(through) - len(before))
    return ids, mask


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def after_prompt(tokenizer, messages: list[dict], prompt_turns: int, tools=None) -> tuple[list[int], list[int]]:
    """(token ids, 1 after the prompt): a prompt/completion conversation, the prompt its first messages."""
    ids = encode(tokenizer, messages, tools)
    start = common_prefix(encode(tokenizer, messages[:prompt_turns], tools, True), ids)
    return ids, [0] * start + [1] * (len(ids) - start)


def last_turn(mask: list[int]) -> list[int]:
    """The mask with only its last run of 1s (the last assistant turn) left."""
    end = len(mask)
    while end and not mask[end - 1]:
        end -= 1
    start = end
    while start and mask[start - 1]:
        start -= 1
    return [0] * start + mask[start:end] + [0] * (len(mask) - end)


def completion_tokens(tokenizer, prompt: str, completion: str, completion_only: bool) -> tuple[list[int], list[int]]:
    """(token ids, 1 on the completion's tokens and its EOS; all 1 unless completion_only): a
    prompt/completion pair of text, tokenised as the tokenizer does by itself (its own BOS, if any)."""
    eos = tokenizer.eos_token or ""
    ids = tokenizer(prompt + completion + ("" if completion.endswith(eos) else eos))["input_ids"]
    start = common_prefix(tokenizer(prompt)["input_ids"], ids) if completion_only else 0
    return ids, [0] * start + [1] * (len(ids) - start)


def tokenize(docs, kind: str, tokenizer, cfg, name: str, num_proc: int | None, where):
    """(tokenised examples: input_ids, length and, for conversations and completions, targets;
    their fates). where(row): the place of a row in its files, for an error line."""
    if kind == "text":
        return data.tokenize_documents(docs, tokenizer, name, cfg, num_proc), None
    if kind == "conversations":
        check_template(tokenizer, name)
    markers = tokenizer.is_fast and GENERATION_MARKER.search(tokenizer.chat_template or "") is not None
    read = by_markers if markers else by_prefixes
    limit, truncate = cfg.seq_len + 1, cfg.overlong == "truncate"

    def tokens_of(batch, i):
        if kind == "completions":
            return completion_tokens(tokenizer, batch["prompt"][i], batch["completion"][i], cfg.completion_only_loss)
        example = json.loads(batch["example"][i])
        messages, tools = example["messages"], example.get("tools")
        try:
            if "prompt_turns" in example:
                return after_prompt(tokenizer, messages, example["prompt_turns"], tools)
            return read(tokenizer, messages, tools)
        except jinja2.TemplateError as err:  # e.g. the template's raise_exception("roles must alternate")
            raise formats.RowError(batch["row"][i], f"the chat template cannot render this conversation: "
                                                    f"{one_line(err, 200)}") from None

    def render(batch):
        out = {"input_ids": [], "targets": [], "length": [], "fate": []}
        for i in range(len(batch["row"])):
            ids, mask = tokens_of(batch, i)
            if cfg.last_turn_only and kind == "conversations":
                mask = last_turn(mask)
            fate = KEPT
            if len(ids) > limit:
                fate = TRUNCATED if truncate else DROPPED_OVERLONG
                ids, mask = ids[:limit], mask[:limit]
            if fate != DROPPED_OVERLONG and not any(mask[1:]):  # the first token is never a label
                fate = DROPPED_NO_ASSISTANT
            for key, value in zip(out, (ids, mask, len(ids), fate)):
                out[key].append(value)
        return out

    try:
        rendered = docs.map(render, batched=True, remove_columns=docs.column_names, num_proc=num_proc,
                            desc=f"render {name} {kind}")
    except formats.RowError as err:
        raise formats.named(where, err) from None
    fates = np.bincount(np.asarray(rendered["fate"], dtype=np.int64), minlength=len(FATES))
    kept = rendered.filter(lambda batch: [f in (KEPT, TRUNCATED) for f in batch["fate"]], batched=True)
    counts = dict(zip(FATES, fates.tolist()))
    if len(kept) == 0:
        raise ConfigError(f"no {name} example is left: {describe(counts)}; raise --seq_len or use --overlong "
                          "truncate")
    return kept.remove_columns("fate"), counts


def describe(fates: dict, kind: str = "conversations") -> str:
    """The setup block's line: how many conversations (or prompt/completion pairs: kind
    "completions"), and what was dropped or truncated."""
    total = sum(fates.values())
    parts = [f"{fates[key]} {key.replace('_', ' ')}" for key in FATES[1:] if fates[key]]
    noun = "conversations" if kind == "conversations" else "prompt/completion pairs"
    return f"{total} {noun}" + (f" ({', '.join(parts)})" if parts else "")


def sample_prompt(tokenizer, message: str) -> str:
    """The end-of-run sample of a run on conversations: the model's answer to a fixed user message."""
    return tokenizer.apply_chat_template([{"role": "user", "content": message}], tokenize=False,
                                         add_generation_prompt=True)
