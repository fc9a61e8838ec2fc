"""Models: Llama-architecture presets with random init, or any pretrained causal LM; the optimizer
and LR schedule; the loss, and the held-out evaluation.

Presets are shapes only; the vocabulary size comes from the tokenizer (259 for the default
byte-level one), so parameter counts below are with that vocabulary:

    preset  layers  hidden  heads/kv  mlp     positions  params (byte vocab)
    debug   2       64      4/2       176     256        ~0.1M   (tests)
    mini    4       128     4/4       344     1024       ~0.86M  (default: nanoGPT's CPU shape, 3 min on 2 cores)
    tiny    4       256     4/4       704     1024       ~3.3M   (CPU-sized)
    small   12      768     12/12     3072    2048       ~114M   (GPT-2-small-like, ~125M with a 8k vocab)
    1b      16      2048    32/8      8192    4096       ~0.97B  (Llama-3.2-1B shape)
    8b      32      4096    32/8      14336   8192       ~7.0B   (Llama-3-8B shape; 8.0B with its 128k vocab)
"""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, get_scheduler

from common.config import ConfigError

PRESETS: dict[str, dict] = {
    "debug": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=176, max_position_embeddings=256),
    "mini": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                 intermediate_size=344, max_position_embeddings=1024),
    "tiny": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                 intermediate_size=704, max_position_embeddings=1024),
    "small": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=12,
                  intermediate_size=3072, max_position_embeddings=2048),
    "1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=8192, max_position_embeddings=4096, rope_theta=500000.0),
    "8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=14336, max_position_embeddings=8192, rope_theta=500000.0),
}


def custom_code_refused(err: Exception, name: str) -> ConfigError | None:
    """transformers' refusal of a folder's own code (trust_remote_code=False, never its [y/N] prompt),
    as one line naming the option; None for any other error."""
    if "trust_remote_code" not in str(err):
        return None
    return ConfigError(f"{name} ships its own Python code (auto_map in its config), which loading it would run: pass "
                       "--trust_remote_code if you trust whoever wrote it, or use a model transformers has built in")


def ships_code(config) -> bool:
    """A config of a class from the model folder's own code (so loaded with --trust_remote_code):
    building its model runs that code too. A built-in config never builds from a folder's code."""
    return not type(config).__module__.startswith("transformers.")


def model_config(cfg, vocab_size: int | None = None):
    """The transformers config of the model this run trains (no weights are created)."""
    if cfg.model_name_or_path:
        try:
            return AutoConfig.from_pretrained(cfg.model_name_or_path, trust_remote_code=cfg.trust_remote_code)
        except (OSError, ValueError) as err:
            raise custom_code_refused(err, cfg.model_name_or_path) or ConfigError(
                f"cannot load model config from {cfg.model_name_or_path}: {str(err).splitlines()[0]}") from None
    return LlamaConfig(vocab_size=vocab_size or 259, tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
                       rms_norm_eps=1e-5, initializer_range=0.02, **PRESETS[cfg.preset])


def check_seq_len(cfg) -> None:
    """Refuse a context longer than the model's positions (RoPE would extrapolate untrained)."""
    limit = getattr(model_config(cfg), "max_position_embeddings", None)
    if limit is not None and cfg.seq_len > limit:
        name = cfg.model_name_or_path or f"preset {cfg.preset!r}"
        raise ConfigError(f"--seq_len {cfg.seq_len} exceeds the {limit} positions of {name}")


def build_model(cfg, vocab_size: int, dtype: torch.dtype = torch.float32) -> nn.Module:
    """Random-init preset or pretrained weights, in fp32 unless told (mixed precision autocasts the
    compute over fp32 master weights; DeepSpeed keeps its own and trains the module in bf16/fp16)."""
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8:
        # TF32 for fp32 matmuls on Ampere and later: several times faster, inputs rounded to a
        # 10-bit mantissa (fp32 accumulation). Under bf16 autocast most matmuls are bf16 anyway.
        torch.set_float32_matmul_precision("high")
    attention = None if cfg.attn_implementation == "auto" else cfg.attn_implementation  # None: transformers picks
    kwargs = {"attn_implementation": attention, "dtype": dtype}
    try:
        if cfg.model_name_or_path:
            model = AutoModelForCausalLM.from_pretrained(cfg.model_name_or_path,
                                                         trust_remote_code=cfg.trust_remote_code, **kwargs)
        else:
            model = AutoModelForCausalLM.from_config(model_config(cfg, vocab_size), **kwargs)
    except (ValueError, ImportError) as err:  # e.g. an attention kernel this model or machine lacks
        raise custom_code_refused(err, cfg.model_name_or_path) or ConfigError(
            f"cannot build the model: {str(err).splitlines()[0]}") from None
    if model.get_input_embeddings().num_embeddings < vocab_size:
        model.resize_token_embeddings(vocab_size)
    enable_checkpointing(model, cfg.gradient_checkpointing)
    model.config.use_cache = False  # the KV cache is for generation; in training it only costs memory
    return model


# Selective checkpointing keeps these ops' outputs and recomputes every other op of a block in its
# backward: the matmuls and attention hold the FLOPs, the element-wise rest (norms, activations,
# rotary, residual adds, casts) most of the saved bytes for a fraction of the time.
SELECTIVE_SAVED = tuple(getattr(torch.ops.aten, name).default for name in (
    "mm", "addmm", "bmm", "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention", "_flash_attention_forward",
    "_efficient_attention_forward") if hasattr(torch.ops.aten, name))


def _keeps(func, args) -> bool:
    """SELECTIVE_SAVED's ops, less matmuls contracting under 1/8 of their output row, cheap to redo: low-rank
    up-projections (kept, LoRA's made selective hold more than none), long eager attention scores."""
    if func in (torch.ops.aten.mm.default, torch.ops.aten.bmm.default):
        return 8 * args[0].shape[-1] >= args[1].shape[-1]
    if func is torch.ops.aten.addmm.default:
        return 8 * args[1].shape[-1] >= args[2].shape[-1]
    return func in SELECTIVE_SAVED


def _selective_contexts():
    """(forward, recompute) dispatch modes for checkpoint's context_fn: forward keeps what _keeps
    names, the recompute hands it back in order and runs the rest. torch's own selective contexts
    require every recomputed op to have run in forward: ZeRO-3's prefetch breaks that."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten, tree_unflatten

    kept: dict = {}

    def alias(t):  # beneath autograd, detach must go through ADInplaceOrView to share t's version counter
        with torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.ADInplaceOrView, False):
            return t.detach()

    class Keep(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if _keeps(func, args):  # with their versions: an output changed in place later is recomputed
                flat, spec = tree_flatten(out)
                kept.setdefault(func, []).append(([alias(t) if isinstance(t, torch.Tensor) else t for t in flat],
                                                  [getattr(t, "_version", None) for t in flat], spec))
            return out

    class Reuse(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if kept.get(func) and _keeps(func, args):  # shapes alone decide: the same ops as in forward
                flat, versions, spec = kept[func].pop(0)
                if all(getattr(t, "_version", None) == v for t, v in zip(flat, versions)):
                    return tree_unflatten(flat, spec)
            return func(*args, **(kwargs or {}))

    return Keep(), Reuse()


def checkpoint_kwargs(mode: str) -> dict | None:
    """torch.utils.checkpoint's arguments for --gradient_checkpointing `mode` (None: off). Non-reentrant
    checkpointing works with FSDP2 and with inputs that need no grad."""
    if mode == "false":
        return None
    return {"use_reentrant": False, **({"context_fn": _selective_contexts} if mode == "selective" else {})}


def enable_checkpointing(model: nn.Module, mode: str) -> None:
    """Every decoder block through transformers' own checkpointing switch, with checkpoint_kwargs(mode)."""
    kwargs = checkpoint_kwargs(mode)
    if kwargs is None:
        return
    # transformers renamed the method (5.2x deprecates the old name); keep both working.
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def build_optimizer(model: nn.Module, cfg, device: torch.device, params=None) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only. Decay pulls weights towards zero: that regularises
    the linear maps, but on norm gains it fights the learned scale (1.0 is neutral, not 0), biases
    have nothing to regularise, and embedding rows of rare tokens, which get a gradient only when
    the token appears, would be erased between appearances."""
    embedding_params = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay = [], []
    for param in model.parameters() if params is None else params:  # params: a subset (train.py's Muon)
        if not param.requires_grad:
            continue
        # Under ZeRO-3's zero.Init a parameter is an empty 1-D placeholder; its real shape is ds_shape.
        is_matrix = len(getattr(param, "ds_shape", param.shape)) >= 2
        (decay if is_matrix and id(param) not in embedding_params else no_decay).append(param)
    groups = [{"params": params, "weight_decay": weight_decay}
              for group, weight_decay in ((decay, cfg.weight_decay), (no_decay, 0.0))
              for params in _split_by_mesh(group)]
    # Fused AdamW updates all tensors in one kernel instead of a loop of small ones. torch has
    # fused kernels for CUDA and (since 2.4) CPU; on this project's 2-core CPU the optimizer step
    # of the tiny preset takes ~2.5x less time than the default foreach implementation.
    fused = device.type in ("cuda", "cpu")
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps, fused=fused)


def _split_by_mesh(params: list) -> list[list]:
    """One list per device mesh (plain tensors apart): fused AdamW refuses a group mixing DTensors of
    different meshes or with plain tensors, as tensor parallelism has (split matrices, whole norms)."""
    by_mesh = {}
    for param in params:
        by_mesh.setdefault(getattr(param, "device_mesh", None), []).append(param)
    return list(by_mesh.values()) or [params]


def causal_lm_loss(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, reduction: str = "mean",
                   position_ids: torch.Tensor | None = None):
    """Next-token cross-entropy. `labels` are already shifted (block[1:]), so we do not pass them
    to the model (Hugging Face models would shift them again). -100 marks ignored positions.
    Logits are upcast to fp32 for the softmax: bf16 log-probs lose ~3 significant digits. Position ids that
    restart at each packed document (train.py's --document_mask) keep documents apart (transformers' mask)."""
    return token_loss(model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits, labels, reduction)


def token_loss(logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    return nn.functional.cross_entropy(logits.float().reshape(-1, logits.size(-1)), labels.reshape(-1),
                                       ignore_index=-100, reduction=reduction)


def build_scheduler(optimizer, cfg):
    """transformers' schedules in optimizer steps, after a linear warmup to --lr: cosine to
    min_lr_ratio * lr; linear to 0; constant; wsd (flat, then the last decay_fraction of the steps
    decay to min_lr_ratio * lr: a run can be extended or branched from its stable phase)."""
    name, kwargs = {
        "cosine": ("cosine_with_min_lr", {"min_lr_rate": cfg.min_lr_ratio}),
        "linear": ("linear", {}),
        "constant": ("constant_with_warmup", {}),
        "wsd": ("warmup_stable_decay", {"num_decay_steps": max(1, round(cfg.decay_fraction * cfg.max_steps)),
                                        "min_lr_ratio": cfg.min_lr_ratio}),
    }[cfg.lr_schedule]
    return get_scheduler(name, optimizer, num_warmup_steps=cfg.warmup_steps, num_training_steps=cfg.max_steps,
                         scheduler_specific_kwargs=kwargs)


@torch.no_grad()
def evaluate(model, eval_loader, accelerator, max_batches: int = 0, loss=causal_lm_loss) -> dict:
    """Token-weighted mean loss over the held-out blocks, across all ranks, each block counted once:
    (sample index, loss sum, target tokens) per sequence are gathered and summed over distinct
    indices, which drops the rows accelerate repeats to even out the last batch and, under TP, the
    identical rows of a TP group (gather_for_metrics' trimming was measured 1e-3 off there). One
    CPU-GPU sync at the end, none per batch. `loss`: or train.py's chunked loss (no whole logits)."""
    model.eval()
    rows = []
    for i, batch in enumerate(eval_loader):
        if max_batches and i >= max_batches:
            break
        labels, positions = batch["labels"], batch.get("position_ids")
        per_token = loss(model, batch["input_ids"], labels, "none", positions).view(labels.shape)
        per_seq = torch.stack([batch["index"].to(per_token.device).double(), per_token.sum(1).double(),
                               (labels != -100).sum(1).double()], dim=1)
        rows.append(accelerator.gather(per_seq))
    model.train()
    by_index = {row[0]: row[1:] for row in (torch.cat(rows).tolist() if rows else [])}
    loss_sum = sum(loss for loss, _ in by_index.values())
    token_count = int(sum(tokens for _, tokens in by_index.values()))
    loss = loss_sum / token_count if token_count else float("nan")
    return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": token_count}
