"""Peak memory of a training step under each activation lever train.py has, measured on CPU beside
the planner's prediction: --gradient_checkpointing false | selective | true, each with the plain
loss and with --loss_chunk_size 1024.

    python benchmarks/checkpointing_memory.py   # writes benchmarks/results/checkpointing-memory-<date>/

Each case runs in a fresh process: an 8-layer Llama (hidden 512, 32k vocabulary) built by
common/model.build_model as train.py builds it, fp32, one micro-batch of 4 x 1024 tokens, forward and
backward of train.py's loss (train_extras/chunked_loss.py), then zero_grad(set_to_none=True) as
train.py's step ends. The step peak is the process's peak resident memory minus its resident memory
just before the step (the model after a warm-up step of 4 x 32 tokens, the inputs): what the step
adds, activations, logits, the gradients and their transients; also the peak of the tensor storages
alive at once during one more step (parameters left out). The planner's figure is tools/plan's
forward/backward peak on one GPU in fp32 for the same shape, tokens and lever, less the parameters
and AdamW's states (this step has no optimizer). Step time: median of 3 more steps, 2 threads.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import tempfile
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_utils import ROOT, median_seconds, rss_bytes, write_results  # noqa: E402

MODES = ("false", "selective", "true")
CHUNKS = (0, 1024)
BATCH, SEQ = 4, 1024
MODEL = dict(vocab_size=32768, hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=8, max_position_embeddings=SEQ, tie_word_embeddings=False)


def one_case(folder: str, mode: str, chunk: int) -> dict:
    import torch

    from common.model import build_model
    from tools.plan import live_tracker
    from train_extras import chunked_loss
    from train_extras.options import TrainConfig

    torch.set_num_threads(2)
    torch.manual_seed(0)
    model = build_model(TrainConfig(model_name_or_path=folder, gradient_checkpointing=mode), MODEL["vocab_size"])
    model.train()
    head = chunked_loss.install(model, chunk)

    def step(tokens: int) -> float:
        ids = torch.randint(0, MODEL["vocab_size"], (BATCH, tokens + 1))
        loss = chunked_loss.causal_lm_loss(model, head, ids[:, :-1], ids[:, 1:])
        loss.backward()
        model.zero_grad(set_to_none=True)
        return loss.item()

    step(32)
    before = rss_bytes()
    loss = step(SEQ)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    seconds = median_seconds(lambda: step(SEQ))
    # The same step once more, every tensor storage tracked: the peak of the bytes alive at once
    # beyond what existed before it (what an allocator must hold at least, without its own slack).
    tracker = live_tracker(list(model.parameters()))
    with tracker:
        step(SEQ)
    return {"mode": mode, "chunk": chunk, "loss": loss, "step_peak_bytes": peak - before,
            "tensor_peak_bytes": tracker.peak, "step_s": seconds}


def main() -> None:
    if len(sys.argv) == 5 and sys.argv[1] == "--case":
        print(json.dumps(one_case(sys.argv[2], sys.argv[3], int(sys.argv[4]))))
        return
    from transformers import LlamaConfig, LlamaForCausalLM

    from tools import plan

    folder = tempfile.mkdtemp(prefix="checkpointing_memory_")
    LlamaForCausalLM(LlamaConfig(**MODEL)).save_pretrained(folder)
    shape = plan.model_shape(None, folder)
    results = []
    for chunk in CHUNKS:
        for mode in MODES:
            proc = subprocess.run([sys.executable, __file__, "--case", folder, mode, str(chunk)], cwd=ROOT,
                                  capture_output=True, text=True, check=True)
            case = json.loads(proc.stdout.strip().splitlines()[-1])
            row = plan.evaluate(shape, plan.Request(gpus=1, precision="fp32", seq_len=SEQ, micro_batch_size=BATCH,
                                                    activation_checkpointing=mode, loss_chunk_size=chunk))[0]
            states = row["states"]["at_step"]["device"]
            case["planned_bytes"] = row["candidates"]["forward_backward"] - states["params"] - states["optimizer"]
            case["planned_moment"] = row["moment"]
            results.append(case)
            print(case, flush=True)
    base = {c: next(r for r in results if r["chunk"] == c and r["mode"] == "false") for c in CHUNKS}
    rows = [[r["mode"], r["chunk"] or "plain", f"{r['step_peak_bytes'] / 1e9:.3f}",
             f"{r['step_peak_bytes'] / base[r['chunk']]['step_peak_bytes']:.2f}", f"{r['tensor_peak_bytes'] / 1e9:.3f}",
             f"{r['planned_bytes'] / 1e9:.3f}", r["planned_moment"],
             f"{r['planned_bytes'] / r['tensor_peak_bytes']:.2f}",
             f"{r['planned_bytes'] / r['step_peak_bytes']:.2f}", f"{r['step_s']:.2f}",
             f"{r['step_s'] / base[r['chunk']]['step_s']:.2f}", f"{r['loss']:.6f}"] for r in results]
    write_results(ROOT / "benchmarks" / "results" / f"checkpointing-memory-{date.today()}",
                  "Peak memory of a step under each activation lever (CPU, fp32), measured and planned",
                  ["--gradient_checkpointing", "--loss_chunk_size", "step peak RSS, GB", "x false",
                   "tensor peak, GB", "planned, GB", "at", "planned / tensors", "planned / RSS", "step s", "x false",
                   "loss"],
                  rows,
                  [f"One micro-batch of {BATCH} x {SEQ} tokens through an 8-layer Llama (hidden 512, vocabulary "
                   "32,768), built by common/model.build_model; step peak = peak resident memory minus resident "
                   "memory before the step (see the script's docstring), which also holds what glibc's heap keeps "
                   "of freed tensors; tensor peak = the most bytes of tensor storages alive at once during the "
                   "same step (tools/plan.live_tracker); planned = tools/plan's forward/backward peak on one GPU in "
                   "fp32 less the parameters and AdamW's states (this step has no optimizer), at the moment "
                   "of backward it names. Step time: median of 3, 2 threads. The loss of the measured "
                   "step is the same in every row of a column of chunking: the levers change memory, not values."],
                  {"cases": results})


if __name__ == "__main__":
    main()
