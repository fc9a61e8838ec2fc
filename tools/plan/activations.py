"""Activations and logits, measured on the CPU: one real decoder block and the LM head run under
saved_tensors_hooks at a probe size, then scaled to the run's tokens."""

from __future__ import annotations

import contextlib
import functools
import time

from tools.plan.ladder import CKPT_PROBE_TOKENS, ModelShape, PROBE_TOKENS, Rung


def _param_copy(t, params: dict) -> bool:
    """True if `t` is a copy of a parameter (autocast's bf16 weight, or a view of it): same number
    of elements, reached through single-input autograd nodes (cast, transpose) from the parameter's
    AccumulateGrad. An embedding lookup also has a single parent, but not the weight's size."""
    fn = t.grad_fn
    for _ in range(6):
        if fn is None:
            return False
        if hasattr(fn, "variable"):
            return id(fn.variable) in params and params[id(fn.variable)] == t.numel()
        parents = [f for f, _ in fn.next_functions if f is not None]
        if len(parents) != 1:
            return False
        fn = parents[0]
    return False


class SavedBytes:
    """Context manager: sums the bytes of the tensors autograd saves for backward, once per storage,
    leaving out parameters and the storages in `exclude`. `.saved`: activations; `.copies`:
    tensors derived from parameters alone (autocast's low-precision weight copies)."""

    def __init__(self, params=(), exclude=()):
        import torch

        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._params = {p.untyped_storage().data_ptr() for p in params}
        self._param_ids = {id(p): p.numel() for p in params}
        self._exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self._saved, self._copies = {}, {}

    def _pack(self, t):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in self._params and key not in self._exclude:
            (self._copies if _param_copy(t, self._param_ids) else self._saved)[key] = storage.nbytes()
        return t  # keeps the tensor alive, so data_ptr keys cannot be reused during the forward

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)

    @property
    def saved(self) -> int:
        return sum(self._saved.values())

    @property
    def copies(self) -> int:
        return sum(self._copies.values())


def live_tracker(exclude=()):
    """A dispatch mode that records every storage ops return (weak references) and the peak of the
    bytes still alive: what gradients and temporaries cost while backward runs. Storages of the
    tensors in `exclude` (parameters: an op returning a view of a weight would add it) are left out."""
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves
    import torch

    class LiveBytes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.refs, self.peak = {}, 0
            self.exclude = {StorageWeakRef(t.untyped_storage()).cdata for t in exclude}

        def live(self) -> int:
            self.refs = {k: v for k, v in self.refs.items() if not v[0].expired()}
            return sum(n for _, n in self.refs.values())

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    storage = t.untyped_storage()
                    ref = StorageWeakRef(storage)
                    if ref.cdata in self.exclude:
                        continue
                    if ref.cdata not in self.refs or self.refs[ref.cdata][0].expired():
                        self.refs[ref.cdata] = (ref, storage.nbytes())
            self.peak = max(self.peak, self.live())
            return out

    return LiveBytes()


def _probe_config(dims: tuple):
    from transformers import LlamaConfig

    hidden, intermediate, heads, kv_heads, head_dim, vocab, eps = dims
    config = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, head_dim=head_dim, vocab_size=vocab, rms_norm_eps=eps,
                         num_hidden_layers=1, max_position_embeddings=max(PROBE_TOKENS, 1), attention_bias=False,
                         mlp_bias=False, tie_word_embeddings=False, use_cache=False)
    config._attn_implementation = "sdpa"
    return config


def _regime(regime: str):
    """(parameter dtype, residual-stream dtype, autocast dtype or None) of a regime:
    "fp32"; "autocast" (fp32 weights under bf16 autocast: accelerate's DDP/single);
    "low" (bf16 weights and activations: DeepSpeed's bf16 module, FSDP2's bf16 unsharded params).
    fp16 is probed as bf16: same element size, same ops, and the CPU runs bf16 reliably."""
    import torch

    return {"fp32": (torch.float32, torch.float32, None),
            "autocast": (torch.float32, torch.float32, torch.bfloat16),
            "low": (torch.bfloat16, torch.bfloat16, None)}[regime]


def _zeroed(module, dtype):
    """Materialise a meta-built module on the CPU with zeros (values do not change what autograd
    saves; zeros are instant where random init of a 7B-shaped block takes seconds)."""
    import torch

    module = module.to(dtype).to_empty(device="cpu")
    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            t.zero_()
    return module


@functools.lru_cache(maxsize=32)
def probe_block(dims: tuple, regime: str, tokens: int) -> dict:
    """Bytes one decoder block keeps for backward at `tokens` tokens (batch 1), measured.

    Returns {saved, copies, rope, checkpointed, backward_extra, tokens, ckpt_tokens, seconds}:
    saved = activations autograd keeps (rotary cos/sin left out: the model shares them between
    blocks, counted once as `rope`); copies = autocast weight copies it keeps; checkpointed = what
    the block keeps under non-reentrant checkpointing (at ckpt_tokens); backward_extra = peak bytes
    of gradients/temporaries on top of the saved ones while the block runs backward.
    """
    import torch
    from torch.utils.checkpoint import checkpoint
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    start = time.perf_counter()
    param_dtype, act_dtype, autocast = _regime(regime)
    config = _probe_config(dims)
    with torch.device("meta"):
        layer = LlamaDecoderLayer(config, layer_idx=0)
    layer = _zeroed(layer, param_dtype).train()
    rope = LlamaRotaryEmbedding(config)
    params = list(layer.parameters())
    amp = (lambda: torch.autocast("cpu", dtype=autocast)) if autocast else contextlib.nullcontext

    def run(n, ckpt=False):
        x = torch.zeros(1, n, dims[0], dtype=act_dtype, requires_grad=True)
        position_ids = torch.arange(n)[None]
        cos, sin = rope(x, position_ids)
        fn = lambda h: layer(h, attention_mask=None, position_ids=position_ids, position_embeddings=(cos, sin))  # noqa
        return x, (cos, sin), (lambda h: checkpoint(fn, h, use_reentrant=False)) if ckpt else fn

    with torch.enable_grad():
        x, rope_t, fn = run(tokens)
        tracker = live_tracker(params)
        with tracker, SavedBytes(params, exclude=rope_t) as counted, amp():
            out = fn(x)
            out = out[0] if isinstance(out, tuple) else out
        base = tracker.live()
        with tracker:  # gradients w.r.t. the input only: weight gradients are model states
            torch.autograd.grad(out, x, torch.ones_like(out))
        backward_extra = max(0, tracker.peak - base)
        del out
        ckpt_tokens = min(tokens, CKPT_PROBE_TOKENS)
        xc, _, fnc = run(ckpt_tokens, ckpt=True)
        with SavedBytes(params) as kept, amp():
            outc = fnc(xc)
        del outc
    return dict(saved=counted.saved, copies=counted.copies, rope=sum(t.untyped_storage().nbytes() for t in rope_t),
                checkpointed=kept.saved, backward_extra=backward_extra, tokens=tokens, ckpt_tokens=ckpt_tokens,
                seconds=time.perf_counter() - start)


@functools.lru_cache(maxsize=32)
def probe_head(dims: tuple, regime: str, tokens: int) -> dict:
    """Bytes the embedding lookup, final RMSNorm, lm_head and fp32 cross-entropy of
    common.model.causal_lm_loss keep for backward (the "logits" bucket), measured at `tokens`.
    Returns {saved, copies, backward_extra, tokens, seconds}; backward_extra = peak bytes of the
    logits' gradients/temporaries on top of the saved ones (forward upcast and backward)."""
    import torch
    from torch import nn
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    start = time.perf_counter()
    param_dtype, _, autocast = _regime(regime)
    hidden, vocab, eps = dims[0], dims[5], dims[6]
    with torch.device("meta"):
        embed, norm, head = nn.Embedding(vocab, hidden), LlamaRMSNorm(hidden, eps=eps), nn.Linear(hidden, vocab, False)
    embed, norm, head = (_zeroed(m, param_dtype) for m in (embed, norm, head))
    params = [p for m in (embed, norm, head) for p in m.parameters()]
    amp = (lambda: torch.autocast("cpu", dtype=autocast)) if autocast else contextlib.nullcontext
    ids = torch.zeros(1, tokens, dtype=torch.long)
    with torch.enable_grad():
        tracker = live_tracker(params)
        with tracker, SavedBytes(params) as counted:
            with amp():
                h = embed(ids)
                logits = head(norm(h))
            # causal_lm_loss: logits upcast to fp32 outside autocast (accelerate's
            # convert_outputs_to_fp32 does the same), then cross-entropy.
            loss = nn.functional.cross_entropy(logits.float().reshape(-1, vocab), ids.reshape(-1))
            del logits
        base = tracker.live()
        with tracker:
            torch.autograd.grad(loss, h)
    return dict(saved=counted.saved, copies=counted.copies, backward_extra=max(0, tracker.peak - base),
                tokens=tokens, seconds=time.perf_counter() - start)


def activation_bytes(shape: ModelShape, regime: str, seq_len: int, micro_batch_size: int,
                     activation_checkpointing: bool = False) -> dict:
    """Activation memory per GPU for micro_batch_size x seq_len tokens, from the CPU probes scaled
    linearly (see tools/plan/__init__.py for the O(seq) assumption).

    Returns {activations, blocks, recompute, rope, logits, weight_copies, backward, backward_block,
    backward_head, tokens, probe}:
      activations = blocks + recompute + rope
      blocks: what L blocks keep from forward to backward (their saved tensors; with checkpointing
              their inputs only)
      recompute: with checkpointing, one block's full activations, recomputed during its backward
      rope: rotary cos/sin, computed once per forward and shared by the blocks
      logits: what the embedding/final norm/lm_head/cross-entropy keep (fp32 log-probs dominate)
      weight_copies: autocast's low-precision weight copies kept for backward (L blocks' + lm_head;
                   one block's + lm_head's with checkpointing)
      backward = backward_block + backward_head (both added although they are never alive together)
      backward_block: gradients and temporaries alive during the backward of one block
      backward_head: the same for the head: the logits' gradient (fp32, tokens x vocab, and its cast
                back to the compute dtype) dominates; large for a large vocabulary
    """
    tokens = micro_batch_size * seq_len
    probe_tokens = min(seq_len, PROBE_TOKENS)
    block = probe_block(shape.dims, regime, probe_tokens)
    head = probe_head(shape.dims, regime, min(probe_tokens, 64))  # no attention: exactly linear
    per = lambda probe, key, n=None: probe[key] * tokens / (n or probe["tokens"])  # noqa: E731
    L = shape.layers
    rope = block["rope"] * seq_len / block["tokens"]  # cos/sin: one row per position, shared by the batch
    # Weight copies do not grow with tokens: one per weight, kept until its backward (with
    # checkpointing only the recomputed block's and lm_head's exist at once).
    if activation_checkpointing:
        blocks, recompute = L * per(block, "checkpointed", block["ckpt_tokens"]), per(block, "saved")
        copies = block["copies"] + head["copies"]
    else:
        blocks, recompute = L * per(block, "saved"), 0.0
        copies = L * block["copies"] + head["copies"]
    backward_block, backward_head = per(block, "backward_extra"), per(head, "backward_extra")
    return dict(activations=blocks + recompute + rope, blocks=blocks, recompute=recompute, rope=rope,
                logits=per(head, "saved"), weight_copies=copies, backward=backward_block + backward_head,
                backward_block=backward_block, backward_head=backward_head, tokens=tokens,
                probe=dict(block=block, head=head))


def regime_of(rung: Rung, precision: str) -> str:
    """Which probe regime a rung runs in: DDP/single autocast fp32 weights; DeepSpeed casts the
    module to bf16/fp16; FSDP2 computes with bf16/fp16 unsharded params (its autocast casts nothing)."""
    if precision == "fp32":
        return "fp32"
    return "autocast" if rung.framework in ("single", "ddp") else "low"


