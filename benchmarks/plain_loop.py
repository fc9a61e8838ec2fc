"""The reference for benchmarks/overhead.py: a plain PyTorch training loop, no accelerate.

Same model, data, batch, optimizer (fused AdamW, decay on matrices), schedule and clipping as
`recipes/train.py` (it builds them with the same common/ functions and options), and the same way
of measuring: tokens/s per log interval, the loss fetched once per interval, the median of the
intervals reported. What it leaves out is exactly what train.py adds: the Accelerator and its
wrappers, token-normalised loss over ranks, the NaN check, the preemption vote, the progress bar.

    OMP_NUM_THREADS=2 python benchmarks/plain_loop.py --preset tiny --max_steps 30 --output_dir /tmp/plain
    OMP_NUM_THREADS=2 python benchmarks/plain_loop.py --bare ...   # forward, backward, AdamW, zero_grad only

--bare: the bare step of the model (no clipping, no schedule), the floor any training loop adds to.
"""

import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere, like the recipes

from common import config, data  # noqa: E402
from common import model as modeling  # noqa: E402
from common.files import write_json  # noqa: E402
from train_extras.data import assemble  # noqa: E402
from train_extras.options import TrainConfig  # noqa: E402


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    bare = "--bare" in argv
    argv = [a for a in argv if a != "--bare"]
    cfg = config.parse(TrainConfig, argv, recipe="plain_loop.py")  # train.py's options: the same command line
    torch.manual_seed(cfg.seed)
    tokenizer = data.build_tokenizer(cfg)
    built = assemble.build(cfg, tokenizer)  # train.py's data: document masks, conversations, mixtures
    train_loader, _ = data.build_loaders(cfg, built.train, built.held_out[next(iter(built.held_out))],
                                         pin_memory=False)
    model = modeling.build_model(cfg, len(tokenizer))
    optimizer = modeling.build_optimizer(model, cfg, torch.device("cpu"))
    scheduler = modeling.build_scheduler(optimizer, cfg)
    tokens_per_step = cfg.micro_batch_size * cfg.seq_len

    model.train()
    batches = iter(train_loader)
    losses, rates, pending = [], [], []
    interval_start, interval_steps = time.perf_counter(), 0
    for step in range(1, cfg.max_steps + 1):
        batch = next(batches)
        loss = modeling.causal_lm_loss(model, batch["input_ids"], batch["labels"], "mean", batch.get("position_ids"))
        loss.backward()
        if not bare:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        optimizer.step()
        if not bare:
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        pending.append(loss.detach())
        interval_steps += 1
        if step % cfg.log_every == 0 or step == cfg.max_steps:
            losses += torch.stack(pending).tolist()
            rates.append(interval_steps * tokens_per_step / (time.perf_counter() - interval_start))
            pending, interval_start, interval_steps = [], time.perf_counter(), 0
    write_json(Path(cfg.output_dir) / "run_summary.json", {
        "recipe": "benchmarks/plain_loop.py" + (" --bare" if bare else ""),
        "threads": torch.get_num_threads(),
        "losses": [{"step": i + 1, "loss": v} for i, v in enumerate(losses)],
        "throughput": [{"tokens_per_s": r} for r in rates],
        "tokens_per_s_median": float(np.median(rates)),
    })
    print(f"plain loop: {cfg.max_steps} steps, median {np.median(rates):,.0f} tokens/s, "
          f"{torch.get_num_threads()} threads", flush=True)


if __name__ == "__main__":
    sys.exit(config.run_cli(main))
