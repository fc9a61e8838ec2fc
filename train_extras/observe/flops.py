"""What the model is, read from its config and its real class on the meta device (no memory):
layers, heads and width under every family's names, the parameters a token multiplies through,
and the training FLOPs per token that MFU is measured against."""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoModelForCausalLM

from common.config import ConfigError


def text_config(config):
    """The language model's part of a config (multimodal configs nest it; a causal LM's is itself)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def dimensions(config) -> dict:
    """Layers, heads and head size (the width over the heads where a family has no head_dim), read
    under the names every family maps them to.

    transformers' `attribute_map` already turns most families' own names into these (GPT-2's
    n_layer, n_embd, n_head). A family whose config lacks one of them is refused with one line."""
    text = text_config(config)
    missing = [k for k in ("num_hidden_layers", "hidden_size", "num_attention_heads") if getattr(text, k, None) is None]
    if missing:
        raise ConfigError(f"{type(text).__name__} has no {', '.join(missing)}: cannot estimate FLOPs per token "
                          "for this model family")
    heads = text.num_attention_heads
    return {"layers": text.num_hidden_layers, "heads": heads,
            "head_dim": getattr(text, "head_dim", None) or text.hidden_size // heads}


def meta_model(config) -> nn.Module:
    """The model class of a config with no memory behind its weights (the meta device): its
    structure and parameter shapes for planning and checks, in milliseconds even for 8B."""
    from accelerate.state import AcceleratorState, is_initialized

    plugin = AcceleratorState().deepspeed_plugin if is_initialized() else None
    if plugin is None:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    # Under ZeRO-3 transformers builds every model inside deepspeed.zero.Init and initialises its
    # weights there, which a meta-device model cannot take: hide DeepSpeed's config from transformers
    # while this one is built, then give it back as accelerate set it.
    from transformers.integrations import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    finally:
        plugin.set_deepspeed_weakref()


def matmul_params(config) -> int:
    """N for FLOPs: every weight a token multiplies through, i.e. all parameters except embedding
    tables (token and learned position embeddings: lookups, no FLOPs), but including the output
    projection (a matmul even when it is tied to the input embedding). Counted from the real model
    class on the meta device, so it holds for any family: gated or plain MLPs, biases, GPT-2's
    Conv1D. Norm gains and biases are included; they are negligible."""
    model = meta_model(config)
    tables = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    n = sum(p.numel() for p in model.parameters() if id(p) not in tables)  # parameters() lists a tied weight once
    output = model.get_output_embeddings()
    if output is not None and id(output.weight) in tables:  # tied: the shared table is also the output matmul
        n += output.weight.numel()
    return n


def flops_per_token(config, seq_len: int) -> float:
    """Training FLOPs per token, PaLM (appendix B) / nanoGPT: 6N + 12 * L * H * Q * T.

    6N: forward (2 FLOPs per multiply-add) plus backward (twice the forward) through the N weights
    of matmul_params(). 12*L*H*Q*T: the attention scores and the weighted sum (QK^T and AV) over
    T positions in L layers with H heads of size Q, forward plus backward, not halved for the
    causal mask (flash/SDPA kernels skip the masked half, so this slightly overstates MFU there)
    nor capped at a sliding window (Mistral-style local attention: overstated for T > window).
    """
    dims = dimensions(config)
    return 6 * matmul_params(config) + 12 * dims["layers"] * dims["heads"] * dims["head_dim"] * seq_len
