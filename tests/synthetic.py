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
