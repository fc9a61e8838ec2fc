"""Activations and logits, counted: one transformers decoder block and the LM head run under
saved_tensors_hooks at a probe size, then scaled to the run's tokens. They run under fake tensors
(torch's FakeTensorMode: shapes, dtypes and storages, no arithmetic), so a 405B block costs what a
tiny one does; `fake=False` runs the same code on real CPU tensors (tests hold the two equal)."""

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


def _storage_key(t) -> int:
    """A storage's identity, real or fake (a fake tensor's storage has no data pointer)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    return StorageWeakRef(t.untyped_storage()).cdata


class SavedBytes:
    """Context manager: sums the bytes of the tensors autograd saves for backward, once per storage,
    leaving out parameters and the storages in `exclude`. `.saved`: activations; `.copies`:
    tensors derived from parameters alone (autocast's low-precision weight copies)."""

    def __init__(self, params=(), exclude=()):
        import torch

        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._params = {_storage_key(p) for p in params}
        self._param_ids = {id(p): p.numel() for p in params}
        self._exclude = {_storage_key(t) for t in exclude}
        self._saved, self._copies = {}, {}

    def _pack(self, t):
        storage = t.untyped_storage()
        key = _storage_key(t)
        if key not in self._params and key not in self._exclude:
            (self._copies if _param_copy(t, self._param_ids) else self._saved)[key] = storage.nbytes()
        return t  # keeps the tensor alive, so a storage key cannot be reused during the forward

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


def live_tracker(exclude=(), timeline: bool = False):
    """A dispatch mode that records every storage ops return (weak references) and the peak of the
    bytes still alive: what gradients and temporaries cost while backward runs. Storages of the
    tensors in `exclude` (parameters: an op returning a view of a weight would add it) are left out.
    timeline=True also keeps what was alive after each op (`snapshots`: (weak reference, bytes) pairs)."""
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves
    import torch

    class LiveBytes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.refs, self.peak, self.snapshots, self.timeline = {}, 0, [], timeline
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
            if self.timeline:
                self.snapshots.append(list(self.refs.values()))
            return out

    return LiveBytes()


def backward_transients(tracker, run, weights) -> tuple[tuple[int, float], ...]:
    """Runs `run` (a backward that accumulates into the `weights`' .grad, as a training step's does)
    under `tracker`: after each op, the bytes alive beyond those alive when it started (negative once
    it has freed more of what forward saved than it made), less the weights' gradients made so far
    (model states: the planner counts them, on top), beside the share of those gradients made so
    far. Returns the points no other exceeds on both: (bytes, share)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    base, start, tracker.timeline = tracker.live(), len(tracker.snapshots), True
    with tracker:
        run()
    tracker.timeline = False
    keys = {StorageWeakRef(w.grad.untyped_storage()).cdata for w in weights if w.grad is not None}
    total = sum(w.grad.untyped_storage().nbytes() for w in weights if w.grad is not None) or 1
    points = []
    for snap in tracker.snapshots[start:]:
        grads = sum(n for ref, n in snap if ref.cdata in keys and not ref.expired())
        points.append((sum(n for _, n in snap) - grads - base, grads / total))  # < 0: saved tensors freed
    return frontier(points)


def frontier(points) -> tuple[tuple[int, float], ...]:
    """The (bytes, share) points that no other point exceeds or equals on both: any later sum
    a * bytes + b * share (a, b >= 0) is largest at one of them."""
    kept, most = [], float("-inf")  # bytes may be negative: backward frees what forward saved
    for t, f in sorted(set(points), key=lambda p: (-p[1], -p[0])):
        if t > most:
            kept.append((t, f))
            most = t
    return tuple(kept) or ((0, 0.0),)


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


def _tensors(fake: bool):
    """The probes' tensors: fake (torch's FakeTensorMode, no storage behind them) or real CPU ones."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode() if fake else contextlib.nullcontext()


def _built(make, dtype, fake: bool):
    """A module made by `make()`: inside the fake mode as it is, else built on the meta device and
    materialised with zeros (the values change nothing autograd saves)."""
    import torch

    if fake:  # a fake tensor's dtype cannot be converted in place (.to swaps it): made in `dtype`
        before = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            return make()
        finally:
            torch.set_default_dtype(before)
    with torch.device("meta"):
        module = make()
    return _zeroed(module, dtype)


@functools.lru_cache(maxsize=32)
def probe_block(dims: tuple, regime: str, tokens: int, fake: bool = True) -> dict:
    """Bytes one decoder block keeps for backward at `tokens` tokens (batch 1), counted.

    Returns {saved, copies, rope, checkpointed, selective, backward_extra, tokens, ckpt_tokens, seconds}:
    saved = activations autograd keeps (rotary cos/sin left out: the model shares them between
    blocks, counted once as `rope`); copies = autocast weight copies it keeps; checkpointed = what
    the block keeps under non-reentrant checkpointing (at ckpt_tokens); selective = what it keeps
    under train.py's selective checkpointing (common/model._keeps); backward_curve = the
    bytes of gradients/temporaries on top of the saved ones while the block runs backward, beside the
    share of its weights' gradients made by then (backward_transients); backward_extra = the most of
    those bytes.
    """
    start = time.perf_counter()
    param_dtype, act_dtype, autocast = _regime(regime)
    config = _probe_config(dims)
    with _tensors(fake):
        return _probe_block(config, dims, param_dtype, act_dtype, autocast, tokens, fake, start)


def _probe_block(config, dims, param_dtype, act_dtype, autocast, tokens, fake, start) -> dict:
    import torch
    from torch.utils.checkpoint import checkpoint
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    from common.model import checkpoint_kwargs

    layer = _built(lambda: LlamaDecoderLayer(config, layer_idx=0), param_dtype, fake).train()
    rope = LlamaRotaryEmbedding(config)
    params = list(layer.parameters())
    amp = (lambda: torch.autocast("cpu", dtype=autocast)) if autocast else contextlib.nullcontext

    def run(n, ckpt=None):
        x = torch.zeros(1, n, dims[0], dtype=act_dtype, requires_grad=True)
        position_ids = torch.arange(n)[None]
        cos, sin = rope(x, position_ids)
        fn = lambda h: layer(h, attention_mask=None, position_ids=position_ids, position_embeddings=(cos, sin))  # noqa
        return x, (cos, sin), (lambda h: checkpoint(fn, h, **checkpoint_kwargs(ckpt))) if ckpt else fn

    with torch.enable_grad():
        x, rope_t, fn = run(tokens)
        tracker = live_tracker(params)
        with tracker, SavedBytes(params, exclude=rope_t) as counted, amp():
            out = fn(x)
            out = out[0] if isinstance(out, tuple) else out
        def backward(out=out):  # the output's gradient made inside: a transient of the block's backward
            torch.autograd.backward(out, torch.ones_like(out), inputs=[x] + params)

        # Its forward's own temporaries are left out: they live while fewer activations do, and no gradient.
        curve = backward_transients(tracker, backward, params)
        del out, backward
        ckpt_tokens = min(tokens, CKPT_PROBE_TOKENS)
        xc, _, fnc = run(ckpt_tokens, ckpt="true")
        with SavedBytes(params) as kept, amp():
            outc = fnc(xc)
        del outc
        # Selective: the kept matmul/attention outputs live in the checkpoint's own cache, out of
        # saved_tensors_hooks' sight: what is alive once forward ends, less the block's output
        # (the next block's input), plus the input the checkpoint keeps.
        xs, _, fns = run(tokens, ckpt="selective")
        tracker = live_tracker(params)
        with tracker, amp():
            outs = fns(xs)
            outs = outs[0] if isinstance(outs, tuple) else outs
        selective = tracker.live() - outs.untyped_storage().nbytes() + xs.untyped_storage().nbytes()
        del outs
    return dict(saved=counted.saved, copies=counted.copies, rope=sum(t.untyped_storage().nbytes() for t in rope_t),
                checkpointed=kept.saved, selective=selective, backward_extra=max(t for t, _ in curve),
                backward_curve=curve, tokens=tokens, ckpt_tokens=ckpt_tokens, seconds=time.perf_counter() - start)


@functools.lru_cache(maxsize=32)
def probe_head(dims: tuple, regime: str, tokens: int, fake: bool = True, chunk: int = 0) -> dict:
    """Bytes the embedding lookup, final RMSNorm, lm_head and fp32 cross-entropy of
    common.model.causal_lm_loss keep for backward (the "logits" bucket), counted at `tokens`; with
    `chunk`, train.py's --loss_chunk_size head (train_extras/chunked_loss.py) instead.
    Returns {saved, copies, backward_extra, backward_curve, tokens, seconds}; backward_curve = the
    bytes of the logits' gradients/temporaries on top of the saved ones (forward upcast and backward)
    beside the share of the head's weight gradients made by then (as probe_block's); backward_extra =
    the most of those bytes."""
    from torch import nn
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    start = time.perf_counter()
    param_dtype, _, autocast = _regime(regime)
    hidden, vocab, eps = dims[0], dims[5], dims[6]
    with _tensors(fake):
        embed, norm, head = (_built(make, param_dtype, fake) for make in (
            lambda: nn.Embedding(vocab, hidden), lambda: LlamaRMSNorm(hidden, eps=eps),
            lambda: nn.Linear(hidden, vocab, False)))
        return _probe_head(embed, norm, head, vocab, autocast, tokens, chunk, start)


def _probe_head(embed, norm, head, vocab, autocast, tokens, chunk, start) -> dict:
    import types

    import torch
    from torch import nn

    from train_extras import chunked_loss

    params = [p for m in (embed, norm, head) for p in m.parameters()]
    amp = (lambda: torch.autocast("cpu", dtype=autocast)) if autocast else contextlib.nullcontext
    ids = torch.zeros(1, tokens, dtype=torch.long)
    if chunk:  # the head's forward returns each token's loss, chunk by chunk under checkpointing
        chunked_loss.install(types.SimpleNamespace(get_output_embeddings=lambda: head), chunk)
        head.loss_targets = ids
    with torch.enable_grad():
        tracker = live_tracker(params)
        with tracker, SavedBytes(params) as counted:
            with amp():
                h = embed(ids)
                logits = head(norm(h))
            # causal_lm_loss: logits upcast to fp32 outside autocast (accelerate's
            # convert_outputs_to_fp32 does the same), then cross-entropy; chunked: their mean.
            loss = (logits.float().mean() if chunk else
                    nn.functional.cross_entropy(logits.float().reshape(-1, vocab), ids.reshape(-1)))
            del logits
        # The weights' gradients are model states; what computing them costs beyond them is a
        # transient: autocast's low-precision gradient before its cast, and with chunks each later
        # chunk's fresh gradient, added into the first's.
        # Its forward's temporaries (the logits' fp32 upcast) count on the first side: they live beside
        # every block's activations, as its backward does, and before any gradient.
        forward = tracker.peak - tracker.live()
        curve = frontier(backward_transients(tracker, lambda: torch.autograd.backward(
            loss, inputs=[h, norm.weight, head.weight]), [norm.weight, head.weight]) + ((forward, 0.0),))
    return dict(saved=counted.saved, copies=counted.copies, backward_extra=max(t for t, _ in curve),
                backward_curve=curve, tokens=tokens, seconds=time.perf_counter() - start)


CHECKPOINTING = {False: "none", True: "full", "false": "none", "true": "full", "none": "none", "full": "full",
                 "selective": "selective"}  # the planner's names, and train.py's --gradient_checkpointing values


def activation_bytes(shape: ModelShape, regime: str, seq_len: int, micro_batch_size: int,
                     activation_checkpointing: bool | str = False, loss_chunk_size: int = 0) -> dict:
    """Activation memory per GPU for micro_batch_size x seq_len tokens, from the probes scaled
    linearly (see tools/plan/__init__.py for the O(seq) assumption).
    activation_checkpointing: none | full | selective (or a bool: full or none).

    Returns {activations, blocks, recompute, rope, logits, weight_copies, backward_block, backward_head,
    tokens, moments, probe}:
      activations = blocks + recompute + rope
      blocks: what L blocks keep from forward to backward (their saved tensors; with full
              checkpointing their inputs only; selective: inputs, matmul and attention outputs)
      recompute: with checkpointing, what one block recomputes during its backward (full: all of
              its activations; selective: those it did not keep)
      rope: rotary cos/sin, computed once per forward and shared by the blocks
      logits: what the embedding/final norm/lm_head/cross-entropy keep (fp32 log-probs dominate;
              with loss_chunk_size, the hidden states the chunks recompute from)
      weight_copies: autocast's low-precision weight copies kept for backward (L blocks' + lm_head;
                   one block's + lm_head's with checkpointing)
      backward_block: the most of the gradients and temporaries alive during one block's backward
      backward_head: the same for the head: the logits' gradient (fp32, tokens x vocab, and its cast
                back to the compute dtype) dominates; with loss_chunk_size, one chunk's
      moments: {head, first_block, last_block}: what lives at each moment of backward, {unit (head |
            block), done (the head's gradients, blocks' gradients complete before it), column (where
            its transient goes: logits | activations), activations, logits, curve ((transient bytes,
            share of the unit's weight gradients made), along its backward), weight_copies}; the planner
            adds the gradients that exist at each (tools/plan/advice.backward_moments)
    """
    mode = CHECKPOINTING[activation_checkpointing]
    tokens = micro_batch_size * seq_len
    probe_tokens = min(seq_len, PROBE_TOKENS)
    block = probe_block(shape.dims, regime, probe_tokens)
    per = lambda probe, key, n=None: probe[key] * tokens / (n or probe["tokens"])  # noqa: E731
    if loss_chunk_size:  # kept bytes grow with the tokens, the transient with one chunk only
        head = probe_head(shape.dims, regime, min(tokens, 2 * loss_chunk_size), chunk=loss_chunk_size)
        head_curve = tuple((float(t), f) for t, f in head["backward_curve"])
    else:
        head = probe_head(shape.dims, regime, min(probe_tokens, 64))  # no attention: exactly linear
        head_curve = tuple((t * tokens / head["tokens"], f) for t, f in head["backward_curve"])
    logits, backward_head = per(head, "saved"), max(t for t, _ in head_curve)
    L = shape.layers
    rope = block["rope"] * seq_len / block["tokens"]  # cos/sin: one row per position, shared by the batch
    # Weight copies do not grow with tokens: one per weight, kept until its backward (with
    # checkpointing only the recomputed block's and lm_head's exist at once).
    if mode == "full":
        blocks, recompute = L * per(block, "checkpointed", block["ckpt_tokens"]), per(block, "saved")
    elif mode == "selective":
        blocks, recompute = L * per(block, "selective"), per(block, "saved") - per(block, "selective")
    else:
        blocks, recompute = L * per(block, "saved"), 0.0
    kept_copies = L * block["copies"] if mode == "none" else 0.0  # checkpointing: recomputed, not kept
    copies = max(kept_copies, block["copies"]) + head["copies"]
    block_curve = tuple((t * tokens / block["tokens"], f) for t, f in block["backward_curve"])
    backward_block = max(t for t, _ in block_curve)
    # The moments of backward, in order: the head's, then the first block's (the last in the model,
    # every block's activations still kept), ..., the last block's (block 0: one block's left). What
    # is alive falls linearly from the first block to the last while gradients grow, so the peak of
    # the blocks' moments is at one of the two ends. Each moment's unit (the head, or a block) runs
    # its backward along `curve`: its transient beside the share of its weight gradients made by then;
    # `done`: (the head's gradients, blocks' gradients) complete before it.
    moments = dict(
        head=dict(unit="head", done=(False, 0), column="logits", activations=blocks + rope, logits=logits,
                  curve=head_curve, weight_copies=kept_copies + head["copies"]),
        first_block=dict(unit="block", done=(True, 0), column="activations", activations=blocks + rope + recompute,
                         logits=0.0, curve=block_curve, weight_copies=max(kept_copies, block["copies"])),
        last_block=dict(unit="block", done=(True, L - 1), column="activations",
                        activations=blocks / L + rope + recompute, logits=0.0, curve=block_curve,
                        weight_copies=block["copies"]))
    return dict(activations=blocks + recompute + rope, blocks=blocks, recompute=recompute, rope=rope,
                logits=logits, weight_copies=copies, backward_block=backward_block, backward_head=backward_head,
                tokens=tokens, moments=moments, probe=dict(block=block, head=head))


def regime_of(rung: Rung, precision: str) -> str:
    """Which probe regime a rung runs in: DDP/single autocast fp32 weights; DeepSpeed casts the
    module to bf16/fp16; FSDP2 computes with bf16/fp16 unsharded params (its autocast casts nothing)."""
    if precision == "fp32":
        return "fp32"
    return "autocast" if rung.framework in ("single", "ddp") else "low"


