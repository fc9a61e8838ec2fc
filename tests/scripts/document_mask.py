"""Run by tests/test_documents.py under cpu.yaml, ddp.yaml and fsdp.yaml: does a packed block's later
document see the earlier one? train.py's own steps build the Accelerator, the data (with
--document_mask true, then false) and the prepared model; a block holding the end of document A and
the start of B goes through the model as train.py's loss does (input ids and the batch's position
ids, no attention mask, no cache), then again with A's tokens changed. Rank 0 writes the largest
change of B's logits (and of A's, which must change) for each setting into OUT_JSON.

    accelerate launch --config_file C tests/scripts/document_mask.py OUT_JSON <train.py options>
"""

import importlib.util
import json
import sys
from pathlib import Path

import torch
from accelerate.utils import set_seed

from common import data
from common import model as modeling

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("train", ROOT / "recipes" / "train.py")
train = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train)


def boundary_block(dataset) -> tuple[int, int]:
    """(block index, position where B starts): the first block with a document starting well inside it."""
    for index in range(len(dataset)):
        positions = dataset[index]["position_ids"]
        restarts = [i for i in range(8, len(positions) - 8) if positions[i] == 0]
        if restarts:
            return index, restarts[0]
    raise AssertionError("no block holds a document boundary")


def logits(model, batch: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=batch["input_ids"], position_ids=batch.get("position_ids"), use_cache=False).logits


def main():
    out, argv = sys.argv[1], sys.argv[2:]
    cfg, _ = train.configure(argv)
    accelerator = train.build_accelerator(cfg)
    set_seed(cfg.seed)
    tokenizer = data.build_tokenizer(cfg)
    facts = train.model_facts(cfg, accelerator, len(tokenizer))
    model = modeling.build_model(cfg, len(tokenizer))
    model, _ = accelerator.prepare(model, modeling.build_optimizer(model, cfg, accelerator.device))  # FSDP2: both
    model.eval()
    index, start = None, None
    result = {}
    for mask in ("true", "false"):
        cfg.document_mask = mask
        dataset = train.prepare_data(cfg, accelerator, tokenizer, facts, None, None).train_set
        if index is None:
            index, start = boundary_block(dataset)
        item = dataset[index]
        batch = {key: item[key][None].to(accelerator.device) for key in ("input_ids", "position_ids") if key in item}
        changed = dict(batch, input_ids=batch["input_ids"].clone())
        changed["input_ids"][0, : start - 1] = (changed["input_ids"][0, : start - 1] + 7) % len(tokenizer)
        before, after = logits(model, batch), logits(model, changed)
        result["masked" if mask == "true" else "unmasked"] = {
            "has_position_ids": "position_ids" in item, "block": index, "b_starts_at": start,
            "b_max_change": (after[0, start:] - before[0, start:]).abs().max().item(),
            "a_max_change": (after[0, : start - 1] - before[0, : start - 1]).abs().max().item()}
    if accelerator.is_main_process:
        Path(out).write_text(json.dumps(result))
    accelerator.end_training()


if __name__ == "__main__":
    main()
