"""What --document_mask costs: train.py's forward, backward and AdamW step on the same packed blocks,
with position ids that restart at each document (transformers then builds a block-diagonal mask
for SDPA) and without (SDPA's causal path, no mask tensor), timed in one process, interleaved
(STEPS steps of each in turn, ROUNDS rounds, medians), so the shared machine's drifts hit both alike.

    python benchmarks/document_mask.py            # writes benchmarks/results/document-mask-<date>/

The data: tiny Shakespeare's training part, one document per paragraph (a speech: ~190 characters,
so a 256-byte block holds 2-3 of them; the default job reads the whole text as one document, where
the mask changes nothing). Settings: the default job's (mini, 16 x 256) and a longer context
(tiny, 4 x 1024). SDPA, fp32, 2 threads.
"""

import dataclasses
import statistics
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
torch.set_num_threads(2)
from bench_utils import write_results  # noqa: E402

from common import data  # noqa: E402
from common import model as modeling  # noqa: E402
from train_extras.data import assemble  # noqa: E402
from train_extras.options import TrainConfig  # noqa: E402

ROUNDS, STEPS = 12, 3
SETTINGS = [("mini", 16, 256), ("tiny", 4, 1024)]


def time_setting(text_file: str, preset: str, micro_batch: int, seq_len: int) -> dict:
    cfg = TrainConfig(preset=preset, micro_batch_size=micro_batch, seq_len=seq_len, data_files=[text_file],
                      attn_implementation="sdpa", max_steps=100000)
    tokenizer = data.build_tokenizer(cfg)
    masked = assemble.build(cfg, tokenizer).train
    unmasked = assemble.build(dataclasses.replace(cfg, document_mask="false"), tokenizer).train
    torch.manual_seed(0)
    model = modeling.build_model(cfg, len(tokenizer))
    optimizer = modeling.build_optimizer(model, cfg, torch.device("cpu"))
    batches = [list(range(i * micro_batch, (i + 1) * micro_batch)) for i in range(len(masked) // micro_batch)]
    documents_per_block = []

    def step(dataset, indices):
        rows = [dataset[i] for i in indices]
        batch = {key: torch.stack([row[key] for row in rows]) for key in rows[0] if key != "index"}
        loss = modeling.causal_lm_loss(model, batch["input_ids"], batch["labels"], "mean", batch.get("position_ids"))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if "position_ids" in batch:
            documents_per_block.append(((batch["position_ids"] == 0).sum(1).float().mean().item()))

    variants = {"without": unmasked, "with": masked}
    times = {name: [] for name in variants}
    cursor = 0
    for dataset in variants.values():  # warm-up
        step(dataset, batches[0])
    for _ in range(ROUNDS):
        for name, dataset in variants.items():
            t0 = time.perf_counter()
            for k in range(STEPS):
                step(dataset, batches[(cursor + k) % len(batches)])
            times[name].append((time.perf_counter() - t0) / STEPS * 1e3)
        cursor += STEPS  # both variants time the same blocks
    without, with_mask = statistics.median(times["without"]), statistics.median(times["with"])
    return {"preset": preset, "micro_batch": micro_batch, "seq_len": seq_len, "without_ms": without,
            "with_ms": with_mask, "ratio": with_mask / without,
            "documents_per_block": statistics.mean(documents_per_block), "times_ms": times}


def main():
    text = data.shakespeare_split()[0]
    with tempfile.TemporaryDirectory() as folder:
        text_file = str(Path(folder) / "shakespeare_train.txt")  # paragraphs: one speech a document
        Path(text_file).write_text(text)
        results = [time_setting(text_file, *setting) for setting in SETTINGS]
    rows = [[r["preset"], f"{r['micro_batch']} x {r['seq_len']}", f"{r['documents_per_block']:.1f}",
             f"{r['without_ms']:.1f}", f"{r['with_ms']:.1f}", f"{r['ratio']:.3f}"] for r in results]
    notes = [f"Median over {ROUNDS} rounds of {STEPS} steps per variant, interleaved on the same blocks "
             "(forward, backward, fused AdamW; SDPA, fp32, 2 threads). Data: tiny Shakespeare's training "
             "90%, one document per paragraph. `documents/block`: documents starting in a block (its first "
             "token counts as one)."]
    out = Path(__file__).parent / "results" / f"document-mask-{date.today().isoformat()}"
    write_results(out, "Step time with and without --document_mask (CPU, SDPA)",
                         ["preset", "micro-batch x seq_len", "documents/block", "without (ms)", "with (ms)",
                          "ratio"], rows, notes, {"settings": results})


if __name__ == "__main__":
    main()
