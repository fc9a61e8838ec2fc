"""The toy language the tests train on: a corpus whose structure only a model that uses context
can learn, written once as a .jsonl that the recipes read with --data_files like any user's data."""

from __future__ import annotations

import json
import os
import random
import tempfile
from pathlib import Path

# Bump when the generator changes: the cached files are keyed on it.
SYNTHETIC_VERSION = 1
SYNTHETIC_SEED = 0  # the corpus is part of the tests, not of a run: it ignores --seed


def synthetic_documents(num_documents: int, seed: int = SYNTHETIC_SEED) -> list[str]:
    """A toy language whose structure only a model that uses context can learn.

    A lexicon of 64 made-up words (2-7 letters). Each word has one preferred successor: with
    probability 0.75 the next word is that successor, else a uniformly random word. Sentences of
    4-12 words end with '. ', documents of 3-8 sentences with a newline. So the first letter of a
    word is predictable only from the whole previous word (several bytes back), and the rest of a
    word from its own first letters: a byte-bigram model cannot do either, a transformer can.

    Uses only `random.Random(seed).random()` (Mersenne Twister, specified bit-for-bit by Python)
    and integer arithmetic on it, so the bytes are identical on every Python and platform.
    """
    rng = random.Random(seed)

    def below(n: int) -> int:  # uniform integer in [0, n) from one random() draw
        return int(rng.random() * n)

    letters = "abcdefghijklmnopqrstuvwxyz"
    lexicon: list[str] = []
    while len(lexicon) < 64:
        word = "".join(letters[below(26)] for _ in range(2 + below(6)))
        if word not in lexicon:
            lexicon.append(word)
    successor = [below(64) for _ in range(64)]

    docs = []
    for _ in range(num_documents):
        sentences = []
        word = below(64)
        for _ in range(3 + below(6)):
            words = []
            for _ in range(4 + below(9)):
                words.append(lexicon[word])
                word = successor[word] if rng.random() < 0.75 else below(64)
            sentences.append(" ".join(words) + ".")
        docs.append(" ".join(sentences) + "\n")
    return docs


def corpus_file(num_documents: int = 8000) -> str:
    """The path of a .jsonl of `num_documents` synthetic documents ({"text": ...} per line), written
    on first use into a folder shared by the whole test session (and later ones)."""
    default = Path(tempfile.gettempdir()) / "accelerate_recipes_data"
    folder = Path(os.environ.get("ACCELERATE_RECIPES_TEST_DATA", default))
    path = folder / f"synthetic_v{SYNTHETIC_VERSION}_seed{SYNTHETIC_SEED}_docs{num_documents}.jsonl"
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        with open(tmp, "w") as f:
            for doc in synthetic_documents(num_documents):
                f.write(json.dumps({"text": doc}) + "\n")
        os.replace(tmp, path)
    return str(path)


def save_bos_tokenizer(folder: Path) -> Path:
    """A byte-level BPE tokenizer with BOS and EOS of its own (as Llama 3's and Mistral's have),
    trained with `tokenizers` on 300 toy documents and saved as a Hugging Face tokenizer folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<s>", "</s>", "<pad>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(synthetic_documents(300), trainer)
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                            pad_token="<pad>").save_pretrained(folder)
    return folder


# A chat template with generation markers around what the assistant writes (its content and the
# end of its turn), so that transformers' marker route and the prefix-difference route must agree.
CHAT_TEMPLATE = (
    "{% if bos_token %}{{ bos_token }}{% endif %}{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}<|assistant|>\n{% generation %}{{ message['content'] }}<|end|>"
    "{% endgeneration %}{% else %}<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
CHAT_SPECIALS = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]


def synthetic_conversations(num_conversations: int, seed: int = SYNTHETIC_SEED) -> list[list[dict]]:
    """Multi-turn conversations in the toy language: a system message, then 1-3 exchanges where
    the user gives the start of a toy document and the assistant goes on with its next sentence."""
    rng = random.Random(seed + 1)
    docs = synthetic_documents(num_conversations * 3, seed)
    conversations = []
    for i in range(num_conversations):
        messages = [{"role": "system", "content": "You continue toy text."}]
        for doc in docs[3 * i: 3 * i + 1 + int(rng.random() * 3)]:
            sentences = doc.strip().split(". ")
            messages += [{"role": "user", "content": sentences[0] + "."},
                         {"role": "assistant", "content": sentences[1].rstrip(".") + "."}]
        conversations.append(messages)
    return conversations


def conversations_file(folder: Path, num_conversations: int, name: str = "chat.jsonl", seed: int = 0) -> str:
    path = folder / name
    with open(path, "w") as f:
        for messages in synthetic_conversations(num_conversations, seed):
            f.write(json.dumps({"id": len(messages), "messages": messages}) + "\n")
    return str(path)


def save_chat_tokenizer(folder: Path, template: str | None = CHAT_TEMPLATE) -> Path:
    """A byte-level BPE tokenizer (trained with `tokenizers` on toy documents) with BOS, EOS, the
    chat roles' special tokens and (unless None) CHAT_TEMPLATE, saved as a Hugging Face folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>", "<pad>", *CHAT_SPECIALS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(synthetic_documents(300), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   additional_special_tokens=CHAT_SPECIALS)
    if template is not None:
        fast.chat_template = template
    fast.save_pretrained(folder)
    return folder


# ---- the formats people fine-tune on (tests/test_formats.py) ----

# CHAT_TEMPLATE plus tools: their schemas in a system turn, an assistant's tool calls (JSON, after its
# content if any) inside its generation markers, the tool's results as a turn of their own.
TOOL_CHAT_TEMPLATE = (
    "{% if bos_token %}{{ bos_token }}{% endif %}"
    "{% if tools %}<|system|>\nTools: {{ tools | tojson }}<|end|>{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}<|assistant|>\n{% generation %}"
    "{% if message.content %}{{ message.content }}{% endif %}"
    "{% if message.tool_calls %}{% for call in message.tool_calls %}<call>{{ call.function | tojson }}</call>"
    "{% endfor %}{% endif %}<|end|>{% endgeneration %}"
    "{% else %}<|{{ message['role'] }}|>\n{{ message.content }}<|end|>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")

# Functions whose calls differ in their arguments' names from row to row: datasets reads such
# messages as Json, and a schema merge would add every name to every call.
FUNCTIONS = {
    "get_weather": {"city": "string"},
    "add": {"a": "integer", "b": "integer"},
    "search": {"query": "string", "limit": "integer"},
}


def tool_conversations(num_rows: int, seed: int = SYNTHETIC_SEED) -> list[dict]:
    """Rows of {messages, tools}: a user asks, the assistant calls 1-2 functions (its content null,
    absent or a sentence), the tool answers, the assistant answers; `tools` holds the schemas of
    the functions the row may call."""
    rng = random.Random(seed + 2)
    docs = synthetic_documents(num_rows, seed)
    names = list(FUNCTIONS)
    rows = []
    for i in range(num_rows):
        sentences = docs[i].strip().split(". ")
        offered = [names[(i + k) % 3] for k in range(1 + i % 3)]
        calls = []
        for name in offered[: 1 + int(rng.random() * 2)]:
            words = sentences[-1].split()
            arguments = {arg: (len(words[j % len(words)]) if kind == "integer" else words[j % len(words)])
                         for j, (arg, kind) in enumerate(FUNCTIONS[name].items())}
            calls.append({"type": "function", "function": {"name": name, "arguments": arguments}})
        caller = {"role": "assistant", "tool_calls": calls}
        if i % 3 == 0:
            caller["content"] = None
        elif i % 3 == 1:
            caller["content"] = sentences[0] + "."
        messages = [{"role": "user", "content": sentences[0] + "."}, caller,
                    {"role": "tool", "content": sentences[1 % len(sentences)] + "."},
                    {"role": "assistant", "content": sentences[-1].rstrip(".") + "."}]
        tools = [{"type": "function", "function": {"name": name, "parameters": {
            "type": "object", "properties": {arg: {"type": kind} for arg, kind in FUNCTIONS[name].items()}}}}
            for name in offered]
        rows.append({"messages": messages, "tools": tools})
    return rows


def prompt_completion_rows(num_rows: int, as_messages: bool, seed: int = SYNTHETIC_SEED) -> list[dict]:
    """Rows of {prompt, completion}: the start of a toy document and its next sentence, as text or as
    message lists (a system and a user message; one assistant message)."""
    rows = []
    for messages in synthetic_conversations(num_rows, seed):
        user, assistant = messages[1]["content"], messages[2]["content"]
        if as_messages:
            rows.append({"prompt": messages[:2], "completion": [messages[2]]})
        else:
            rows.append({"prompt": user + " ", "completion": assistant})
    return rows


FORMATS = {  # name -> rows of that format, 60 each
    "messages": lambda: [{"messages": m} for m in synthetic_conversations(60)],
    "tool_calls": lambda: tool_conversations(60),
    "prompt_completion_text": lambda: prompt_completion_rows(60, as_messages=False),
    "prompt_completion_messages": lambda: prompt_completion_rows(60, as_messages=True),
}


def format_file(folder: Path, name: str) -> str:
    path = folder / f"{name}.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in FORMATS[name]()))
    return str(path)
