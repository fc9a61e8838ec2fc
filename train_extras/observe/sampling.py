"""A sample of generated text from the model being trained: read it to judge a run, not only its loss."""

from __future__ import annotations

import torch
from torch import nn
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList

from common.export import unwrap

STOP_CHECK_EVERY = 16  # generated tokens between two calls of sample_text's `stop`


class _StopWhen(StoppingCriteria):
    """Ends the generation when `stop()` (called by every rank at the same token) says so."""

    def __init__(self, stop):
        self.stop, self.tokens, self.stopped = stop, 0, False

    def __call__(self, input_ids, scores, **kwargs) -> torch.Tensor:
        self.tokens += 1
        if not self.stopped and self.tokens % STOP_CHECK_EVERY == 0:
            self.stopped = bool(self.stop())
        return torch.full((input_ids.shape[0],), self.stopped, dtype=torch.bool, device=input_ids.device)


class _TokenizerIdsOnly(LogitsProcessor):
    """Never draws an id the tokenizer cannot decode: a model's embedding is often wider than its
    tokenizer (padded to a multiple of 64 or 128, or a vocabulary made for another tokenizer), and an
    untrained row there can win the draw (a byte tokenizer then fails to decode it)."""

    def __init__(self, size: int):
        self.size = size

    def __call__(self, input_ids, scores):
        scores[:, self.size:] = -float("inf")
        return scores


@torch.no_grad()
def sample_text(accelerator, model: nn.Module, tokenizer, prompt: str, max_new_tokens: int, seed: int,
                temperature: float = 0.8, top_k: int = 200, stop=None) -> str | None:
    """A continuation of `prompt` by the model being trained, through transformers' `generate`
    (temperature and top-k as nanoGPT's sample.py), to read what the model has learned.

    Call on every rank: a sharded model (FSDP2, ZeRO-3, TP) needs all ranks in each forward, and
    with the same seed every rank draws the same tokens. The global RNG is forked, so sampling in
    the middle of a run leaves the training's random stream (and so exact resume) untouched."""
    from accelerate.utils import DistributedType

    unwrapped = unwrap(accelerator, model)
    was_training = unwrapped.training
    unwrapped.eval()
    ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt").input_ids.to(accelerator.device)
    devices = [accelerator.device] if accelerator.device.type == "cuda" else []
    stopping = _StopWhen(stop) if stop is not None else None
    # Eagerly, even under --compile: the shapes change with every generated token, and compiling
    # them cost minutes of recompiles for a few tokens (CPU: the compile test 348 s with it, 106 s without).
    with torch.random.fork_rng(devices=devices), accelerator.autocast(), torch.compiler.set_stance("force_eager"):
        torch.manual_seed(seed)
        out = unwrapped.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=True,
            temperature=temperature, top_k=top_k, use_cache=True,
            remove_invalid_values=True,  # a diverged model (NaN/inf logits) still samples instead of crashing
            eos_token_id=None,  # always max_new_tokens: go on past a document's end (EOS is not printed)
            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
            # ZeRO-3: a rank that stopped early must keep joining the others' parameter gathers
            synced_gpus=accelerator.distributed_type == DistributedType.DEEPSPEED and accelerator.num_processes > 1,
            stopping_criteria=StoppingCriteriaList([stopping] if stopping else []),
            logits_processor=LogitsProcessorList([_TokenizerIdsOnly(len(tokenizer))]),
        )
    unwrapped.train(was_training)
    if stopping is not None and stopping.stopped:
        return None
    return tokenizer.decode(out[0], skip_special_tokens=True)

