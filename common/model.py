"""Models: Llama-architecture presets with random init, or any pretrained causal LM; the optimizer;
FLOPs per token.

Presets are shapes only; the vocabulary size comes from the tokenizer (259 for the default
byte-level one), so parameter counts below are with that vocabulary:

    preset  layers  hidden  heads/kv  mlp     positions  params (byte vocab)
    debug   2       64      4/2       176     256        ~0.1M   (tests)
    mini    4       128     4/4       344     1024       ~0.86M  (default: the most Shakespeare a 2-core CPU
                                                                  learns in 3 minutes; nanoGPT's CPU shape)
    tiny    4       256     4/4       704     1024       ~3.3M   (CPU-sized)
    small   12      768     12/12     3072    2048       ~114M   (GPT-2-small-like, ~125M with a 8k vocab)
    1b      16      2048    32/8      8192    4096       ~0.97B  (Llama-3.2-1B shape)
    8b      32      4096    32/8      14336   8192       ~7.0B   (Llama-3-8B shape; 8.0B with its 128k vocab)
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

from common.config import ConfigError, TrainConfig

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


def model_config(cfg: TrainConfig, vocab_size: int | None = None):
    """The transformers config of the model this run trains (no weights are created)."""
    if cfg.model_name_or_path:
        try:
            return AutoConfig.from_pretrained(cfg.model_name_or_path)
        except OSError as err:
            raise ConfigError(f"cannot load model config from {cfg.model_name_or_path}: {str(err).splitlines()[0]}")
    return LlamaConfig(
        vocab_size=vocab_size or 259,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        rms_norm_eps=1e-5,
        initializer_range=0.02,
        **PRESETS[cfg.preset],
    )


def check_seq_len(cfg: TrainConfig) -> None:
    """Refuse a context longer than the model's positions (RoPE would extrapolate untrained)."""
    limit = getattr(model_config(cfg), "max_position_embeddings", None)
    if limit is not None and cfg.seq_len > limit:
        name = cfg.model_name_or_path or f"preset {cfg.preset!r}"
        raise ConfigError(f"--seq_len {cfg.seq_len} exceeds the {limit} positions of {name}")


def build_model(cfg: TrainConfig, vocab_size: int) -> nn.Module:
    """Random-init preset or pretrained weights, in fp32 (mixed precision autocasts the compute)."""
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 8:
        # TF32 for fp32 matmuls on Ampere and later: several times faster, inputs rounded to a
        # 10-bit mantissa (fp32 accumulation). Under bf16 autocast most matmuls are bf16 anyway.
        torch.set_float32_matmul_precision("high")
    if cfg.model_name_or_path:
        model = AutoModelForCausalLM.from_pretrained(
            cfg.model_name_or_path, attn_implementation="sdpa", dtype=torch.float32
        )
        if model.get_input_embeddings().num_embeddings < vocab_size:
            model.resize_token_embeddings(vocab_size)
    else:
        model = AutoModelForCausalLM.from_config(
            model_config(cfg, vocab_size), attn_implementation="sdpa", dtype=torch.float32
        )
    if cfg.gradient_checkpointing:
        # Non-reentrant checkpointing works with FSDP2 and with inputs that need no grad.
        # transformers renamed the method (5.2x deprecates the old name); keep both working.
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    model.config.use_cache = False  # the KV cache is for generation; in training it only costs memory
    if cfg.compile:
        model.compiled_blocks = compile_blocks(model)
    return model


def compile_blocks(model: nn.Module) -> int:
    """Regional compilation: torch.compile each transformer block in place (the classes the model
    names in `_no_split_modules`, e.g. LlamaDecoderLayer). All blocks share one compiled graph, so
    compile time does not grow with depth, and FSDP2's per-block sharding and activation
    checkpointing wrap the same modules. Returns the number of blocks compiled."""
    block_classes = set(getattr(model, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in block_classes]
    if not blocks:
        raise ConfigError(f"--compile: found no transformer blocks ({sorted(block_classes)}) in {type(model).__name__}")
    for block in blocks:
        block.compile()
    return len(blocks)


def build_optimizer(model: nn.Module, cfg: TrainConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only.

    Decay pulls weights towards zero. That regularises the linear maps (the matrices), but on
    norm gains it fights the learned scale (1.0 is their neutral value, not 0), biases are offsets
    with nothing to regularise, and embedding rows of rare tokens get a gradient only when the
    token appears, so decay would erase them between appearances.
    """
    embedding_params = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay = [], []
    for param in model.parameters():
        if not param.requires_grad:
            continue
        # Under ZeRO-3's zero.Init a parameter is an empty 1-D placeholder; its real shape is ds_shape.
        is_matrix = len(getattr(param, "ds_shape", param.shape)) >= 2
        (decay if is_matrix and id(param) not in embedding_params else no_decay).append(param)
    groups = [
        {"params": params, "weight_decay": weight_decay}
        for group, weight_decay in ((decay, cfg.weight_decay), (no_decay, 0.0))
        for params in _split_by_mesh(group)
    ]
    # Fused AdamW updates all tensors in one kernel instead of a loop of small ones. torch has
    # fused kernels for CUDA and (since 2.4) CPU; on this project's 2-core CPU the optimizer step
    # of the tiny preset takes ~2.5x less time than the default foreach implementation.
    fused = device.type in ("cuda", "cpu")
    return torch.optim.AdamW(
        groups, lr=cfg.lr, betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps, fused=fused
    )


def _split_by_mesh(params: list) -> list[list]:
    """One list per device mesh (plain tensors apart): a fused or foreach AdamW refuses a group that
    mixes DTensors with plain tensors or DTensors of different meshes, which tensor parallelism
    produces (sharded matrices, whole norms and embeddings). Without DTensors: the list as it is."""
    by_mesh = {}
    for param in params:
        by_mesh.setdefault(getattr(param, "device_mesh", None), []).append(param)
    return list(by_mesh.values()) or [params]


def text_config(config):
    """The language model's part of a config (multimodal configs nest it; a causal LM's is itself)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def dimensions(config) -> dict:
    """Layers, width, heads and head size under the names every family maps them to.

    transformers' `attribute_map` already turns most families' own names into these (GPT-2's
    n_layer, n_embd, n_head). A family whose config lacks one of them is refused with one line."""
    text = text_config(config)
    missing = [k for k in ("num_hidden_layers", "hidden_size", "num_attention_heads") if getattr(text, k, None) is None]
    if missing:
        raise ConfigError(f"{type(text).__name__} has no {', '.join(missing)}: cannot estimate FLOPs per token "
                          "for this model family")
    heads = text.num_attention_heads
    return {"layers": text.num_hidden_layers, "hidden": text.hidden_size, "heads": heads,
            "kv_heads": getattr(text, "num_key_value_heads", None) or heads,
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


def class_name(model: nn.Module) -> str:
    """The model's own class, also once FSDP2 has swapped it for a FSDP<Class> subclass."""
    return next(c.__name__ for c in type(model).__mro__ if not c.__name__.startswith("FSDP"))


def embeddings_tied(model: nn.Module) -> bool:
    """Whether the LM head multiplies by the input embedding table itself (one shared parameter)."""
    output = model.get_output_embeddings()
    return output is not None and output.weight is model.get_input_embeddings().weight


def causal_lm_loss(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, reduction: str = "mean"):
    """Next-token cross-entropy. `labels` are already shifted (block[1:]), so we do not pass them
    to the model (Hugging Face models would shift them again). -100 marks ignored positions.
    Logits are upcast to fp32 for the softmax: bf16 log-probs lose ~3 significant digits."""
    logits = model(input_ids=input_ids).logits
    return nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.size(-1)), labels.reshape(-1), ignore_index=-100, reduction=reduction
    )


@torch.no_grad()
def sample_text(accelerator, model: nn.Module, tokenizer, prompt: str, max_new_tokens: int, seed: int,
                temperature: float = 0.8, top_k: int = 200) -> str:
    """A continuation of `prompt` by the model being trained, through transformers' `generate`
    (temperature and top-k as nanoGPT's sample.py), to read what the model has learned.

    Call on every rank: a sharded model (FSDP2, ZeRO-3, TP) needs all ranks in each forward, and
    with the same seed every rank draws the same tokens. The global RNG is forked, so sampling in
    the middle of a run leaves the training's random stream (and so exact resume) untouched."""
    from accelerate.utils import DistributedType

    unwrapped = accelerator.unwrap_model(model)
    was_training = unwrapped.training
    unwrapped.eval()
    ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt").input_ids.to(accelerator.device)
    devices = [accelerator.device] if accelerator.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), accelerator.autocast():
        torch.manual_seed(seed)
        out = unwrapped.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=True,
            temperature=temperature, top_k=top_k, use_cache=True,
            remove_invalid_values=True,  # a diverged model (NaN/inf logits) still samples instead of crashing
            eos_token_id=None,  # always max_new_tokens: go on past a document's end (EOS is not printed)
            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
            # ZeRO-3: a rank that stopped early must keep joining the others' parameter gathers
            synced_gpus=accelerator.distributed_type == DistributedType.DEEPSPEED and accelerator.num_processes > 1,
        )
    unwrapped.train(was_training)
    return tokenizer.decode(out[0], skip_special_tokens=True)
