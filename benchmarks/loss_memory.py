"""Peak memory of the loss: the plain cross-entropy over full fp32 logits (common/model.py) against
--loss_chunk_size (train_extras/chunked_loss.py), at a 32k and a 128k vocabulary, on CPU.

    python benchmarks/loss_memory.py        # writes benchmarks/results/loss-memory-<date>/

Each case runs in a fresh process: a 2-layer Llama (hidden 256) with that vocabulary, fp32, one
micro-batch of 4 x 1024 tokens, forward and backward of train.py's loss; the peak is the process's
peak resident memory (ru_maxrss) minus its resident memory just before the step (model, optimizer-
free, inputs, a warm-up step of 4 x 32 tokens already done), so it is what the step itself adds:
activations, logits and gradients. Step time: median of 3 more steps, same process.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_utils import ROOT, median_seconds, rss_bytes, write_results  # noqa: E402

VOCABS = (32768, 131072)
CHUNKS = (0, 4096, 1024)  # 0: the plain loss; 4096: one chunk for the whole micro-batch (no saving)
BATCH, SEQ, HIDDEN = 4, 1024, 256


def one_case(vocab: int, chunk: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from train_extras import chunked_loss

    torch.set_num_threads(2)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=704, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=SEQ,
                         tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    head = chunked_loss.install(model, chunk)

    def step(tokens: int) -> float:
        ids = torch.randint(0, vocab, (BATCH, tokens + 1))
        loss = chunked_loss.causal_lm_loss(model, head, ids[:, :-1], ids[:, 1:], "sum")
        loss.backward()
        model.zero_grad(set_to_none=False)  # the gradients stay allocated: counted before the step
        return loss.item()

    step(32)
    before = rss_bytes()
    step(SEQ)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    seconds = median_seconds(lambda: step(SEQ))
    return {"vocab": vocab, "chunk": chunk, "step_peak_bytes": peak - before, "step_s": seconds,
            "fp32_logits_bytes": BATCH * SEQ * vocab * 4}


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--case":
        print(json.dumps(one_case(int(sys.argv[2]), int(sys.argv[3]))))
        return
    results = []
    for vocab in VOCABS:
        for chunk in CHUNKS:
            proc = subprocess.run([sys.executable, __file__, "--case", str(vocab), str(chunk)], cwd=ROOT,
                                  capture_output=True, text=True, check=True)
            results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(results[-1], flush=True)
    rows = []
    for r in results:
        plain = next(p for p in results if p["vocab"] == r["vocab"] and p["chunk"] == 0)
        name = "plain (full fp32 logits)" if not r["chunk"] else f"--loss_chunk_size {r['chunk']}"
        rows.append([f"{r['vocab']:,}", name,
                     f"{r['fp32_logits_bytes'] / 1e9:.2f}", f"{r['step_peak_bytes'] / 1e9:.2f}",
                     f"{r['step_peak_bytes'] / plain['step_peak_bytes']:.2f}", f"{r['step_s']:.2f}",
                     f"{r['step_s'] / plain['step_s']:.2f}"])
    out = ROOT / "benchmarks" / "results" / f"loss-memory-{date.today()}"
    write_results(out, "Peak memory of the loss step: plain cross-entropy against --loss_chunk_size (CPU, fp32)",
                  ["vocab", "loss", "one fp32 logits tensor, GB", "step peak, GB", "x plain", "step s", "x plain"],
                  rows, [f"One micro-batch of {BATCH} x {SEQ} tokens through a 2-layer Llama (hidden {HIDDEN}), "
                         "forward + backward of train.py's loss; step peak = the process's peak resident memory "
                         "minus its resident memory before the step (see the script's docstring). Step time: "
                         "median of 3, 2 threads (the head's matmul is done once more in backward when chunked)."],
                  {"cases": results})


if __name__ == "__main__":
    main()
