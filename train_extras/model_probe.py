"""Start-up checks that ask the model itself, on one tiny seeded row, whether an option holds for it.

Reading a model's class or config cannot tell whether it keeps packed documents apart or changes its
logits after the head; one forward of a dozen tokens can, for any family, before training starts.
Every rank runs the probe (a sharded model needs them all) on the same row, so all agree.
"""

from __future__ import annotations

import contextlib

import torch

from common.config import ConfigError, same_on_every_rank
from common.export import unwrap


def random_row(vocab_size: int, length: int, device) -> torch.Tensor:
    """(1, length) token ids, the same on every rank and every run."""
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab_size, (1, length), generator=generator).to(device)


@contextlib.contextmanager
def inference(model):
    """Eval mode (no dropout) and no autograd for the probe; the model's mode restored after."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


def difference(reference: torch.Tensor, probed: torch.Tensor) -> float | None:
    """The largest difference of `probed` from `reference` when it passes 1e-4 of the reference's
    scale (at least 1: float32 round-off of logits is ~1e-6 of it), else None."""
    gap = (probed.float() - reference.float()).abs().max().item()
    return gap if gap > 1e-4 * max(reference.float().abs().max().item(), 1.0) else None


def refuse_if_apart(reference: torch.Tensor, probed: torch.Tensor, accelerator, model, message: str) -> None:
    """One ConfigError line on every rank when `probed` is not `reference` to 1e-4 of its scale.
    `message` may use {model} (the model's class) and {gap} (the largest difference)."""
    gap = difference(reference, probed)
    if gap is None:
        return
    with same_on_every_rank():
        raise ConfigError(message.format(model=type(unwrap(accelerator, model)).__name__, gap=f"{gap:.2g}"))
