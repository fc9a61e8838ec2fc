"""DDP and parameters that get no gradient.

DDP all-reduces gradients bucket by bucket as backward produces them. A trainable parameter that
gets no gradient leaves its bucket unfinished, and the next step stops every rank with torch's
"Expected to have finished reduction in the prior iteration". `find_unused_parameters=True` makes
DDP walk the autograd graph after every forward to mark such parameters ready: correct, at the cost
of that walk each step. So it is turned on only where needed. Parameters a family builds frozen and
`from_pretrained` made trainable (a router's correction bias: train_extras/moe.py) are frozen again
before this; then one backward of a probe row on the model as built (before DDP wraps it) lists the
trainable parameters that got no gradient. None (every family tested) leaves DDP as it is.
"""

from __future__ import annotations

import re

from accelerate.utils import DistributedDataParallelKwargs

from common.config import tensor_parallel_size
from common.guard import KINDS
from train_extras import model_probe


def find_unused(model, accelerator, objective, vocab_size: int, length: int = 16) -> list[str] | None:
    """Under DDP: the trainable parameters one backward of `objective(model, input_ids, labels)` on a
    probe row leaves without a gradient, and if there are any, find_unused_parameters set for
    `prepare`. None for other strategies (FSDP2 and ZeRO handle a missing gradient themselves).
    Eval mode: no dropout, no random number drawn, so training starts from the same RNG state."""
    if KINDS.get(accelerator.distributed_type) != "ddp" or tensor_parallel_size(accelerator) > 1:
        return None
    model.to(accelerator.device)  # where prepare would put it; the probe runs there
    row = model_probe.random_row(vocab_size, length + 1, accelerator.device)
    was_training = model.training
    model.eval()
    try:
        objective(model, row[:, :-1], row[:, 1:]).backward()
    finally:
        model.train(was_training)
    unused = [name for name, p in model.named_parameters() if p.requires_grad and p.grad is None]
    model.zero_grad(set_to_none=True)
    if unused:
        accelerator.ddp_handler = DistributedDataParallelKwargs(find_unused_parameters=True)
    return unused


def describe(unused: list[str]) -> str:
    """The setup line: which parameters made DDP look for unused ones (layers folded: layers.*)."""
    return f"find_unused_parameters on: no gradient in the start-up probe for {fold(unused)}"


def fold(names) -> str:
    """Parameter names with their layer numbers folded, each with its count: 'model.layers.*.x.bias (26)'."""
    counts = {}
    for name in names:
        key = re.sub(r"\.\d+\.", ".*.", name)
        counts[key] = counts.get(key, 0) + 1
    return ", ".join(f"{key} ({n})" if n > 1 else key for key, n in sorted(counts.items()))
