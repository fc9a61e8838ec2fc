"""What TRL's SFTTrainer trains on the formats of tests/synthetic.py (FORMATS), written as the fixture
tests/test_formats.py holds train.py's rows to, token for token:

    pip install --no-deps --target /tmp/trl trl==1.16.0
    PYTHONPATH=/tmp/trl python tests/scripts/trl_trained_tokens.py [--out tests/data/trl_trained_tokens.json]

TRL is not a dependency of this project: its output is committed instead. The script runs the
trainer's own data preparation (SFTTrainer._prepare_dataset: chat template, masks, EOS) on each
format's rows, with the tests' tokenizer (tests/synthetic.py save_chat_tokenizer with
TOOL_CHAT_TEMPLATE), unpacked and untruncated: assistant_only_loss=True for conversations (the
template's generation markers), completion_only_loss (TRL's default) for prompt/completion. It
records, per row in file order, the input ids and the labels (-100: not trained), and the tokenizer's
vocabulary and template hashes, which the test checks first (another tokenizer: run this again).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from synthetic import FORMATS, TOOL_CHAT_TEMPLATE, format_file, save_chat_tokenizer  # noqa: E402


def tokenizer_identity(tokenizer) -> dict:
    vocab = json.dumps(sorted(tokenizer.get_vocab().items())).encode()
    return {"vocab_sha256": hashlib.sha256(vocab).hexdigest(),
            "template_sha256": hashlib.sha256(tokenizer.chat_template.encode()).hexdigest()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(ROOT / "tests" / "data" / "trl_trained_tokens.json"))
    out = Path(parser.parse_args().out)
    import datasets
    import trl
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    folder = Path(tempfile.mkdtemp())
    tokenizer = AutoTokenizer.from_pretrained(save_chat_tokenizer(folder / "tokenizer", TOOL_CHAT_TEMPLATE))
    result = {"trl": trl.__version__, **tokenizer_identity(tokenizer), "formats": {}}
    for name in FORMATS:
        rows = datasets.load_dataset("json", data_files=format_file(folder, name), split="train")
        conversation = name in ("messages", "tool_calls")
        args = SFTConfig(output_dir=str(folder / "out"), max_length=None, assistant_only_loss=conversation,
                         bf16=False, use_cpu=True, report_to=[])
        trainer = types.SimpleNamespace(_tokenizer=tokenizer, completion_only_loss=True, chat_template=None)
        prepared = SFTTrainer._prepare_dataset(trainer, rows, tokenizer, args, packing=False, formatting_func=None,
                                               dataset_name=name)
        result["formats"][name] = [[row["input_ids"], row["labels"]] for row in prepared]
        trained = sum(sum(label != -100 for label in row[1]) for row in result["formats"][name])
        print(f"{name}: {len(prepared)} rows, {trained} trained tokens")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
