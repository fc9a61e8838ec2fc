"""What the model is, read from its config and its real class on the meta device (no memory):
layers, heads and width under every family's names, the parameters a token multiplies through
(for a mixture of experts, only the top-k of its routed experts: `active_matmul_params`), each
layer's token mixer (softmax attention and its window, MLA, gated DeltaNet, Mamba, Mamba2, lightning
attention, short convolutions: `mixers`), and the training FLOPs per token that MFU is measured
against (`flops`). Softmax attention follows PaLM's count (appendix B; 6N + 12LHQT for a dense
model): every query against every key of its span, the causal mask ignored, as nanoGPT, Megatron and
torchtitan count it, so that MFU compares with the figures they report."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect

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
    with deepspeed_hidden(), torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, trust_remote_code=ships_code(config))


@contextlib.contextmanager
def deepspeed_hidden():
    """Under ZeRO-3 transformers builds every model inside deepspeed.zero.Init, which partitions and
    initialises its weights there (a collective of every rank): a model built by one process alone,
    or on the meta device, is built with DeepSpeed's config hidden from transformers, given back
    afterwards as accelerate set it."""
    from accelerate.state import AcceleratorState, is_initialized

    plugin = AcceleratorState().deepspeed_plugin if is_initialized() else None
    if plugin is None:
        yield
        return
    from transformers.integrations import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    try:
        yield
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


def matmul_params(config, model: nn.Module | None = None) -> int:
    """Every weight a token may multiply through, i.e. all parameters except embedding tables
    (token and learned position embeddings: lookups, no FLOPs), but including the output
    projection (a matmul even when it is tied to the input embedding). Counted from the real model
    class on the meta device, so it holds for any family: gated or plain MLPs, biases, GPT-2's
    Conv1D. Norm gains and biases are included; they are negligible. For a mixture of experts this
    counts every expert; a token goes through only top_k of them: see active_matmul_params."""
    return _matmul(meta_model(config) if model is None else model)


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


def dense_experts(config, model: nn.Module) -> str | None:
    """The class of a routed-experts module that runs every expert on every token, or None.

    transformers' experts classes (its @use_experts_implementation: eager, grouped_mm, batched_mm;
    also GPT-OSS's and DBRX's own loops, JetMoE's) take the router's choice (top_k_index, expert
    sizes) and send each token through its top-k experts only. An experts module holding the
    (E, ...) weights whose forward takes the hidden states alone cannot know the choice: it runs
    every expert on every token and weights the unchosen by 0 (transformers 5.25: Llama 4's
    Llama4TextExperts, two bmm over all E experts)."""
    _, experts = _read(text_config(config), EXPERT_COUNT_NAMES)
    for name, module in model.named_modules():
        if is_experts(name, module) and any(p.dim() >= 2 and p.shape[0] == experts
                                            for p in module.parameters(recurse=False)):
            inputs = [p for p in inspect.signature(module.forward).parameters.values()
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
            if len(inputs) == 1:
                return type(module).__name__
    return None


@dataclasses.dataclass(frozen=True)
class Mixer:
    """One layer's token mixer and the sizes its FLOPs beyond its weights depend on (its projection
    and convolution weights are in N: 6N counts them)."""

    kind: str  # "attention" (softmax), "mamba", "mamba2", "gated_deltanet", "lightning", "conv"
    heads: int = 0  # attention/DeltaNet/lightning: (value) heads; Mamba2: its heads
    qk: int = 0  # query/key head size (attention, DeltaNet, lightning)
    v: int = 0  # value head size (Mamba2: head_dim, the P of SSD)
    window: int | None = None  # sliding-window attention: the keys a query sees, itself included
    chunk: int | None = None  # chunked attention's chunk; the chunk/block of SSD, DeltaNet, lightning
    state: int = 0  # SSM state size (N)
    groups: int = 0  # Mamba2: groups sharing B and C
    inner: int = 0  # Mamba: channels (d_inner)


# transformers' torch_chunk_gated_delta_rule and fla's chunk_gated_delta_rule both run chunks of 64
DELTANET_CHUNK = 64


def _layer_type(text, i: int) -> str | None:
    types = getattr(text, "layer_types", None)
    return types[i] if types and i < len(types) else None


def _layer_span(text, i: int) -> dict:
    """Layer i's attention span from the config, as transformers masks it: per layer_types, or (a
    family with no layer_types, Mistral) every layer sliding when sliding_window is set."""
    kind = _layer_type(text, i)
    if kind == "sliding_attention" or (getattr(text, "layer_types", None) is None
                                       and getattr(text, "sliding_window", None)
                                       and getattr(text, "use_sliding_window", True)):
        return {"window": text.sliding_window}
    if kind == "chunked_attention":
        return {"chunk": text.attention_chunk_size}
    return {}


def _mixer(module: nn.Module, text, i: int) -> Mixer | None:
    """What module is, read from the attributes transformers' mixers keep, or None (not a mixer)."""
    get = module.__dict__.get  # plain attributes only (never a submodule or a parameter)
    cls = type(module).__name__
    if get("num_v_heads") and get("head_k_dim"):  # Qwen3-Next, Qwen3.5, OLMo-hybrid: gated DeltaNet
        return Mixer("gated_deltanet", heads=get("num_v_heads"), qk=get("head_k_dim"), v=get("head_v_dim"),
                     chunk=DELTANET_CHUNK)
    if cls.endswith("DeltaAttention"):  # Kimi's KDA: the same chunked delta rule, decays per channel
        return Mixer("gated_deltanet", heads=get("num_heads"), qk=get("head_dim"), v=get("head_dim"),
                     chunk=DELTANET_CHUNK)
    if get("ssm_state_size") and get("n_groups"):  # Mamba2: Falcon-H1, GraniteMoeHybrid, Bamba, NemotronH
        return Mixer("mamba2", heads=get("num_heads"), v=get("head_dim"), state=get("ssm_state_size"),
                     groups=get("n_groups"), chunk=get("chunk_size"))
    if get("ssm_state_size"):  # Mamba: Jamba, Mamba, FalconMamba
        return Mixer("mamba", inner=get("intermediate_size"), state=get("ssm_state_size"))
    if cls.endswith("LightningAttention"):  # MiniMax
        return Mixer("lightning", heads=get("num_attention_heads"), qk=get("head_dim"), v=get("head_dim"),
                     chunk=get("block_size"))
    if cls.endswith("ShortConv"):  # LFM2: a depthwise convolution, its weights all its cost
        return Mixer("conv")
    # Softmax attention (MLA: its own q/k (nope + rope) and v head sizes), never in a layer the config
    # calls linear: an attention-named module there is a recurrence this file does not know.
    if cls.endswith("Attention") and _layer_type(text, i) != "linear_attention":
        qk = get("qk_head_dim") or get("head_dim") or dimensions(text)["head_dim"]
        return Mixer("attention", heads=text.num_attention_heads, qk=qk, v=get("v_head_dim") or qk,
                     **_layer_span(text, i))
    return None


def _decoder_layers(model: nn.Module, count: int) -> nn.ModuleList | None:
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    return next((m for m in decoder.modules() if isinstance(m, nn.ModuleList) and len(m) == count), None)


def mixers(config, model: nn.Module | None = None) -> tuple[Mixer, ...]:
    """Every layer's token mixers, read from the model's own modules (a hybrid layer may hold two:
    Falcon-H1's attention and Mamba2). A layer with none that is known here (an MLP-only layer, a
    mixer this file does not know) adds nothing beyond its weights. A model where none is found
    (its layers not a ModuleList of num_hidden_layers) counts full softmax attention in every layer."""
    model = meta_model(config) if model is None else model
    text = text_config(config)
    layers = _decoder_layers(model, getattr(text, "num_hidden_layers", None))
    found = []
    for i, layer in enumerate(layers if layers is not None else []):
        inside = []  # a mixer's own submodules (Kimi's forget gate, a wrapped attention) are its own
        for name, module in layer.named_modules():
            if not any(name.startswith(prefix) for prefix in inside) and (mixer := _mixer(module, text, i)):
                found.append(mixer)
                inside.append(f"{name}.")
    if found:
        return tuple(found)
    dims = dimensions(config)
    return tuple(Mixer("attention", heads=dims["heads"], qk=dims["head_dim"], v=dims["head_dim"],
                       **_layer_span(text, i)) for i in range(dims["layers"]))


def attended_pairs(seq_len: int, window: int | None = None, chunk: int | None = None) -> int:
    """(query, key) pairs a softmax layer is counted for over seq_len positions, as PaLM's 12LHQT counts
    them: every query against min(span, seq_len) keys, the span all seq_len positions, the window
    (sliding) or the chunk (Llama 4's chunked attention), so a span covering the sequence costs a full
    layer."""
    return seq_len * min(window or chunk or seq_len, seq_len)


def sequence_flops(m: Mixer, seq_len: int) -> int:
    """Training FLOPs (3 x forward, as for the weights) a sequence of seq_len tokens spends in m beyond
    its weights: its matmuls, 2 FLOPs a multiply-add; the elementwise work (softmax, decays, gates)
    is not counted, as for attention, except in Mamba's scan, which is all elementwise.

    attention: QK^T and AV over the attended pairs, 2 * heads * (qk + v) each; MLA with its own qk
      and v sizes.
    mamba: the selective scan, token by token as transformers' loop and mamba_ssm's kernel run it:
      per channel and state, dt*A, dt*B, *x, the state's multiply and add, and C's multiply-add: 7
      (A's own d_inner x N entries are in N as well, as every parameter is: 6 more each, a token).
    mamba2: SSD in chunks, as mamba_ssm's mamba_chunk_scan_combined runs it (the chunked form is the
      one any training forward runs): per chunk C*B^T per group, its (C x C) product with x per head,
      the chunk's states, the states' read-out, and the pass of the state from chunk to chunk.
      transformers' torch fallback (no mamba_ssm: the CPU) spends more than this: it repeats B and C
      to every head and passes states between every pair of chunks.
    gated_deltanet: the chunked gated delta rule as transformers' torch_chunk_gated_delta_rule and
      fla's kernel run it (chunks of 64, the last padded): per chunk and head k_beta K^T and Q K^T
      (C x C, computed whole and masked), two unit-triangular solves, the intra-chunk product with
      the new values, and the state's two reads and one write (dk x dv each).
    lightning (MiniMax): per block, Q K^T and its product with V inside the block, Q times the
      (d x d) state and the state's update K^T V, as transformers' loop over blocks runs it.
    conv (LFM2's short convolution): nothing beyond its weights."""
    c, h = m.chunk, m.heads
    if m.kind == "attention":
        return 3 * 2 * h * (m.qk + m.v) * attended_pairs(seq_len, m.window, m.chunk)
    if m.kind == "mamba":
        return 3 * 7 * m.inner * m.state * seq_len
    if m.kind == "mamba2":
        per_chunk = 2 * c * c * m.state * m.groups + h * (2 * c * c * m.v + 4 * c * m.state * m.v + 2 * m.state * m.v)
        return 3 * -(-seq_len // c) * per_chunk
    if m.kind == "gated_deltanet":
        per_chunk = h * (4 * c * c * m.qk + 2 * c * c * m.v + c * (c - 1) * (m.qk + m.v) + 6 * c * m.qk * m.v)
        return 3 * -(-seq_len // c) * per_chunk
    if m.kind == "lightning":
        full, rest = divmod(seq_len, c)
        return 3 * h * (4 * m.qk * (full * c * c + rest * rest) + 4 * m.qk * m.v * seq_len)
    return 0


def describe(found: tuple[Mixer, ...]) -> str:
    """The mixers counted, e.g. '1 softmax attention (sliding window 16), 1 Mamba'."""
    names = {"attention": "softmax attention", "mamba": "Mamba", "mamba2": "Mamba2",
             "gated_deltanet": "gated DeltaNet", "lightning": "lightning attention", "conv": "short conv"}
    counts: dict = {}
    for m in found:
        name = names[m.kind]
        if m.kind == "attention" and (m.window or m.chunk):
            name += f" (sliding window {m.window})" if m.window else f" (chunks of {m.chunk})"
        counts[name] = counts.get(name, 0) + 1
    return ", ".join(f"{n} {name}" for name, n in counts.items())


def per_token(weights: int, found: tuple[Mixer, ...], seq_len: int) -> float:
    """6 FLOPs per weight (forward 2, backward twice that) and the mixers' over the sequence, per token."""
    return 6 * weights + sum(sequence_flops(m, seq_len) for m in found) / seq_len


def flops(config, seq_len: int, model: nn.Module | None = None) -> dict:
    """Training FLOPs per token at seq_len: 6N (forward 2 per weight, backward twice that) through
    the N weights a token multiplies through, plus every layer's mixer by its own formula
    (sequence_flops) averaged over the sequence's tokens.

    {"per_token": what the implementation spends (MFU is measured against it), "active": the same
    from the active weights (a mixture of experts: top-k of its routed ones), "dense_experts": the
    experts class that runs every expert on every token (per_token then counts all of them) or None
    (per_token == active), "counted": what is counted, in words}. Softmax attention by the PaLM
    convention (attended_pairs), so neither the causal mask nor document masks lower it."""
    model = meta_model(config) if model is None else model
    found = mixers(config, model)
    dense = dense_experts(config, model)
    active = per_token(active_matmul_params(config, model), found, seq_len)
    spent = per_token(matmul_params(config, model), found, seq_len) if dense else active
    note = (f"; N counts every expert: {dense} runs each on every token ({active:.3e} by the active experts)"
            if dense else "")
    return {"per_token": spent, "active": active, "dense_experts": dense,
            "counted": f"6N + {describe(found)}{note}"}


def flops_per_token(config, seq_len: int, model: nn.Module | None = None) -> float:
    """The FLOPs per token the model's implementation spends: flops(...)["per_token"]. `model`: the
    config's meta-device model, if the caller has built it already."""
    return flops(config, seq_len, model)["per_token"]
