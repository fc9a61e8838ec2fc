"""--loss_chunk_size N: the output head and the cross-entropy computed N tokens at a time.

The plain loss (common/model.py) holds the logits of every token over the whole vocabulary, their
fp32 copy, the log-softmax and, in backward, their gradient: at a 128k vocabulary, seq 2048 and
micro-batch 4 that is gigabytes, the largest activation of a 1B run. Here the head's own forward
(so FSDP2, ZeRO-3 and DDP see the head run inside the model's forward, with its weight gathered)
returns each token's loss instead of its logits, computed chunk by chunk under activation
checkpointing: forward keeps one chunk's logits at a time and saves only the hidden states;
backward recomputes each chunk's logits for its gradient. Same value and gradients as the plain
loss (the head's matmul is done once more per chunk: ~1/3 more head compute).

Evaluation takes the same path (`loss_of`: the held-out loss is the same number, and the logits of
a whole batch never exist there either). Outside a loss call (sampling, export) the head is the
plain head: it returns logits.
"""

from __future__ import annotations

import contextlib
import types

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from common import model as modeling
from common.config import ConfigError, tensor_parallel_size
from train_extras import model_probe


def check_launch(cfg, accelerator) -> None:
    if cfg.loss_chunk_size and tensor_parallel_size(accelerator) > 1:
        raise ConfigError("--loss_chunk_size: tensor parallelism splits the head's logits across ranks: use "
                          "--loss_chunk_size 0")


def install(model: nn.Module, chunk_size: int) -> nn.Module | None:
    """Make the model's output head compute chunked token losses when given targets. Returns the
    head (train.py's loss takes it), or None when --loss_chunk_size is 0."""
    if not chunk_size:
        return None
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        raise ConfigError(f"--loss_chunk_size: the output head of {type(model).__name__} is a "
                          f"{type(head).__name__}, not a linear layer: use --loss_chunk_size 0")
    head.loss_targets, head.loss_chunk_size = None, chunk_size
    head.forward = types.MethodType(_forward, head)
    return head


def _forward(head: nn.Linear, hidden: torch.Tensor) -> torch.Tensor:
    """Logits, or (targets set by `loss_and_output`) each token's cross-entropy, fp32, (batch, seq)."""
    targets = head.loss_targets
    if targets is None:
        return nn.Linear.forward(head, hidden)
    flat, labels = hidden.reshape(-1, hidden.size(-1)), targets.reshape(-1)
    size = head.loss_chunk_size
    losses = [checkpoint(_chunk_losses, flat[i:i + size], head.weight, head.bias, labels[i:i + size],
                         use_reentrant=False) for i in range(0, flat.size(0), size)]
    return torch.cat(losses).view(targets.shape)


def _chunk_losses(hidden, weight, bias, labels):
    logits = nn.functional.linear(hidden, weight, bias)
    return nn.functional.cross_entropy(logits.float(), labels, ignore_index=-100, reduction="none")


@contextlib.contextmanager
def _targets(head: nn.Module, labels: torch.Tensor):
    head.loss_targets = labels
    try:
        yield
    finally:
        head.loss_targets = None


def loss_and_output(model, head, input_ids, labels, reduction: str, position_ids=None, **model_kwargs):
    """(the loss with common/model.py's reductions, the model's output) of one forward: the chunked
    head's token losses when `head` is installed, common/model.py's loss of the logits otherwise."""
    if head is None:
        out = model(input_ids=input_ids, position_ids=position_ids, use_cache=False, **model_kwargs)
        return modeling.token_loss(out.logits, labels, reduction), out
    with _targets(head, labels):
        out = model(input_ids=input_ids, position_ids=position_ids, use_cache=False, **model_kwargs)
    return reduce(out.logits, labels, reduction), out  # the head returned (batch, seq) token losses


def causal_lm_loss(model, head, input_ids, labels, reduction: str = "mean", position_ids=None):
    """common/model.py's causal_lm_loss (same reductions), chunked when `head` is installed."""
    return loss_and_output(model, head, input_ids, labels, reduction, position_ids)[0]


def loss_of(head):
    """common/model.py's causal_lm_loss signature (model, input_ids, labels, reduction, position_ids)
    for its evaluate: chunked when `head` is installed, so an eval never holds the whole logits either."""
    return modeling.causal_lm_loss if head is None else (lambda model, *args: causal_lm_loss(model, head, *args))


def reduce(losses: torch.Tensor, labels: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "none":
        return losses.reshape(-1)
    total = losses.sum()
    return total if reduction == "sum" else total / (labels != -100).sum()


def check_plain_head(model, head, accelerator, vocab_size: int) -> None:
    """The chunked loss skips whatever a model does to its logits after the head (Gemma 2's
    softcapping, Cohere's and Granite's scaling): asked of the model itself on every rank, a
    12-token row's chunked loss must equal the plain loss of its logits. One line otherwise."""
    if head is None:
        return
    ids = model_probe.random_row(vocab_size, 13, accelerator.device)
    with model_probe.inference(model):
        plain = modeling.causal_lm_loss(model, ids[:, :-1], ids[:, 1:], "none")
        chunked = causal_lm_loss(model, head, ids[:, :-1], ids[:, 1:], "none")
    model_probe.refuse_if_apart(plain, chunked, accelerator, model,
                                "--loss_chunk_size: {model} changes its logits after the output head (its loss "
                                "differs by {gap} from the head's own): use --loss_chunk_size 0")
