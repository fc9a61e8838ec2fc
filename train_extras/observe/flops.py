"""What the model is, read from its config and its real class on the meta device (no memory):
layers, heads and width under every family's names, the parameters a token multiplies through
(for a mixture of experts, only the top-k of its routed experts: `active_matmul_params`), and the
training FLOPs per token that MFU is measured against."""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoModelForCausalLM

from common.config import ConfigError
from common.model import ships_code


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
            return AutoModelForCausalLM.from_config(config, trust_remote_code=ships_code(config))
    # Under ZeRO-3 transformers builds every model inside deepspeed.zero.Init and initialises its
    # weights there, which a meta-device model cannot take: hide DeepSpeed's config from transformers
    # while this one is built, then give it back as accelerate set it.
    from transformers.integrations import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, trust_remote_code=ships_code(config))
    finally:
        plugin.set_deepspeed_weakref()


def _tables(model: nn.Module) -> set:
    return {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}


def _matmul(model: nn.Module) -> int:
    tables = _tables(model)
    n = sum(p.numel() for p in model.parameters() if id(p) not in tables)  # parameters() lists a tied weight once
    output = model.get_output_embeddings()
    if output is not None and id(output.weight) in tables:  # tied: the shared table is also the output matmul
        n += output.weight.numel()
    return n


def matmul_params(config) -> int:
    """Every weight a token may multiply through, i.e. all parameters except embedding tables
    (token and learned position embeddings: lookups, no FLOPs), but including the output
    projection (a matmul even when it is tied to the input embedding). Counted from the real model
    class on the meta device, so it holds for any family: gated or plain MLPs, biases, GPT-2's
    Conv1D. Norm gains and biases are included; they are negligible. For a mixture of experts this
    counts every expert; a token goes through only top_k of them: see active_matmul_params."""
    return _matmul(meta_model(config))


# Where transformers' MoE configs keep the number of routed experts and the experts per token (most
# families map theirs to the first name through `attribute_map`: Qwen's num_experts, DeepSeek's
# n_routed_experts, HunYuan's moe_topk, ERNIE's moe_k ...). DBRX keeps both in its `ffn_config`.
EXPERT_COUNT_NAMES = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
TOP_K_NAMES = ("num_experts_per_tok", "moe_topk", "moe_k", "moe_top_k")
ROUTER_NAMES = ("gate", "router")  # a router inside an experts module (JetMoE's attention experts)


def _read(text, names):
    """The first of `names` set on the text config or on one of its sub-configs (DBRX's ffn_config)."""
    subs = [v for v in vars(text).values() if hasattr(v, "to_dict") and hasattr(v, "attribute_map")]
    for holder in (text, *subs):
        for name in names:
            value = getattr(holder, name, None)
            if isinstance(value, (list, tuple)) and len(set(value)) == 1:  # per layer, all alike (HunYuan)
                value = value[0]
            if value is not None:
                return name, value
    return None, None


def is_experts(name: str, module: nn.Module) -> bool:
    """A module that holds routed experts: named `experts` (Mixtral, Qwen-MoE, OLMoE, DeepSeek, DBRX...)
    or of a class named ...Experts (JetMoE's ParallelExperts); never a shared expert (run in full)."""
    leaf = name.rsplit(".", 1)[-1]  # by name: GraniteMoeShared's routed experts are a GraniteMoeSharedExperts
    return "shared" not in leaf.lower() and (leaf == "experts" or type(module).__name__.endswith("Experts"))


def routed_experts(config, model: nn.Module | None = None) -> dict | None:
    """The routed experts of a mixture-of-experts model, or None for a dense one (no experts module
    in the model: also a MoE family built dense, e.g. Doge without is_moe).

    Returns {"experts": E, "top_k": k, "params": P, "inactive": P - P * k / E}: P sums the parameters of
    the experts modules with a leading expert dimension E (the fused 3-D gate_up_proj (E, 2I, H) /
    down_proj (E, H, I) of transformers 5, their biases (E, ...)), or a 2-D leading dimension that is a
    multiple of E (DBRX's flattened (E * I, H)); a router inside an experts module runs for every token
    and stays out, as do an experts module's other parameters (JetMoE's output bias; LongCat-Flash's
    gate_up_proj, sized for its routed + zero experts: counted in full, so overstated). A layer that is
    dense (Qwen-MoE's mlp_only_layers / decoder_sparse_step, DeepSeek's first_k_dense_replace, Jamba's
    expert period) has no experts module and is not counted here. An MoE model whose config does not
    say E and k, or whose experts have no dimension E, is refused with one line (ConfigError)."""
    model = meta_model(config) if model is None else model
    modules = dict(model.named_modules())
    candidates = {}  # id -> parameter, under an experts module and not under a router
    for name, p in model.named_parameters():
        parts = name.split(".")
        for i in range(1, len(parts)):
            if is_experts(".".join(parts[:i]), modules[".".join(parts[:i])]):
                if not any(part in ROUTER_NAMES or part.endswith(ROUTER_NAMES) for part in parts[i:-1]):
                    candidates[id(p)] = p
                break
    if not candidates:
        return None
    text = text_config(config)
    family = type(text).__name__
    e_name, experts = _read(text, EXPERT_COUNT_NAMES)
    k_name, top_k = _read(text, TOP_K_NAMES)
    if not isinstance(experts, int) or not isinstance(top_k, int) or not 0 < top_k <= experts:
        raise ConfigError(f"{family} is a mixture of experts but its config gives no single expert count and top-k "
                          f"({e_name or '/'.join(EXPERT_COUNT_NAMES[:3])}={experts!r}, "
                          f"{k_name or TOP_K_NAMES[0]}={top_k!r}): cannot count the FLOPs per token")
    routed = [p for p in candidates.values()
              if p.dim() >= 2 and (p.shape[0] == experts or (p.dim() == 2 and p.shape[0] % experts == 0))]
    if not routed:
        raise ConfigError(f"{family}: no parameter of its experts modules has the {experts} experts of "
                          f"{e_name} as its first dimension: cannot count the FLOPs per token")
    params = sum(p.numel() for p in routed)
    active = sum(p.numel() // experts * top_k for p in routed)  # exact: E divides each one's first dimension
    return {"experts": experts, "top_k": top_k, "params": params, "inactive": params - active}


def active_matmul_params(config, model: nn.Module | None = None) -> int:
    """N for FLOPs: the weights one token multiplies through. matmul_params less the routed experts
    a token does not visit: with top_k of E experts, (1 - top_k / E) of their weights. The routers
    (E x H), shared experts (Qwen2-MoE's shared_expert and its gate, DeepSeek's shared_experts) and
    dense layers count in full. Equal to matmul_params for a dense model."""
    model = meta_model(config) if model is None else model
    moe = routed_experts(config, model)
    return _matmul(model) - (moe["inactive"] if moe else 0)


def parameter_counts(config, model: nn.Module | None = None) -> dict:
    """{"total": every parameter (embeddings included, tied weights once: as metrics.count_parameters
    counts the built model), "active": the parameters one token uses (total less the routed experts it
    does not visit; equal to total for a dense model)}. Memory goes with total, compute with active."""
    model = meta_model(config) if model is None else model
    total = sum(p.numel() for p in model.parameters())
    moe = routed_experts(config, model)
    return {"total": total, "active": total - (moe["inactive"] if moe else 0)}


def flops_per_token(config, seq_len: int, model: nn.Module | None = None) -> float:
    """Training FLOPs per token, PaLM (appendix B) / nanoGPT: 6N + 12 * L * H * Q * T.

    6N: forward (2 FLOPs per multiply-add) plus backward (twice the forward) through the N weights
    of active_matmul_params() (a mixture of experts: its top-k routed experts, not all of them).
    12*L*H*Q*T: the attention scores and the weighted sum (QK^T and AV) over T positions in L
    layers with H heads of size Q, forward plus backward, not halved for the causal mask
    (flash/SDPA kernels skip the masked half, so this slightly overstates MFU there) nor capped at
    a sliding window (Mistral-style local attention: overstated for T > window). `model`: the
    config's meta-device model, if the caller has built it already.
    """
    dims = dimensions(config)
    return 6 * active_matmul_params(config, model) + 12 * dims["layers"] * dims["heads"] * dims["head_dim"] * seq_len
