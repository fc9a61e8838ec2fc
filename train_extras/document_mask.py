"""--document_mask auto | true | false: what keeps the documents of a packed block apart in this
model, asked of the model itself at start-up, then given to each training and held-out forward.

A packed block holds the end of one document and the start of the next; data/packing.py gives it
position ids that restart at every document. What keeps documents apart depends on the layer kind:
- attention: the position ids. transformers builds a block-diagonal causal mask from them (SDPA,
  eager) or takes flash-attention's varlen path (one row: several rows go in as one, with their
  cumulative lengths, as for the gated delta rule below). A family whose forward builds its masks without
  them (GPT-OSS and GraniteMoeHybrid in transformers 5.25) gets the masks transformers' own mask
  functions make from them, one per layer type, in the mapping its forward takes ("masks").
- Mamba2 scans and short convolutions: `seq_idx`, each token's document index, which the kernels
  of mamba_ssm and causal_conv1d take to restart their state at a document's first token.
- gated delta rule (Qwen3-Next): flash-linear-attention's cumulative lengths (`cu_seq_lens_q/_k`),
  which index one row: the micro-batch then goes in as one row (each row's positions restart).
In transformers 5.25 those kernels are CUDA-only and the torch paths refuse the inputs ("can't keep
packed sequences apart without causal_conv1d"); Jamba's Mamba scan and MiniMax's lightning
attention take none of them.

The probe: two rows (one for --micro_batch_size 1) of two 8-token documents, then the same rows
with another first document: the second documents' logits must not move (to 1e-4 of their scale,
model_probe), with the position ids alone, then with each set of inputs above the family's layers
may need. Two rows, because a micro-batch has several: flash-attention keeps packed documents apart
from the position ids in a batch of one row only, so there the probe finds the rows given as one,
with cumulative lengths (and a run of one row keeps the position ids alone, as before).
Both forwards have the same shapes, so bf16 or fp16 compute rounds both alike: comparing with the
second document run alone (another shape) moved a Llama's logits by 0.002 under bf16 autocast,
which turned the masks off. `auto` takes the first that holds; if none does, the documents see
each other, exactly as with --document_mask false (no position ids are passed: positions run on
through the block), and the setup block and run_summary.json say why. A half mask (attention apart,
state shared) is not offered: the probe cannot tell which half holds. `true` refuses instead, in one
line; `false` asks nothing. A resumed run keeps the mode its checkpoint trained with.
"""

from __future__ import annotations

import itertools

import torch
from transformers import masking_utils
from transformers.modeling_flash_attention_utils import prepare_fa_kwargs_from_position_ids

from common.config import ConfigError, same_on_every_rank
from common.export import unwrap
from train_extras import model_probe

POSITIONS = "position_ids"
NONE = "none"  # the documents of a block see each other (no position ids passed, as --document_mask false)
ROWS = "rows"  # --packing false: one document per row, nothing to keep apart
# What may keep documents apart besides the position ids: each combination, the fewest inputs first.
EXTRAS = tuple(combo for size in (1, 2, 3)
               for combo in itertools.combinations(("masks", "seq_idx", "cu_seq_lens"), size))
SHOWN = {POSITIONS: "position ids", "masks": "attention masks made from them",
         "cu_seq_lens": "cu_seq_lens, rows as one"}
KERNEL_REFUSAL = "can't keep packed sequences apart"  # transformers' torch paths, given seq_idx or cu_seqlens


def describe(mode: str, why: str | None) -> str:
    """The setup block's line."""
    if mode == ROWS:
        return "one per row (--packing false): none to keep apart"
    if mode == NONE:
        return f"not kept apart ({why}): packed documents see each other"
    return "kept apart (" + " + ".join(SHOWN.get(part, part) for part in mode.split("+")) + ")"


def resolve(model, accelerator, cfg, vocab_size: int, saved: str | None) -> tuple[str, str | None]:
    """(mode, why the documents see each other, or None). `saved`: the mode of the checkpoint this
    run resumes (it continues as it trained). Every rank runs the same probes (a sharded model needs
    them all) and reaches the same answer."""
    if not cfg.packing:
        return ROWS, None
    if cfg.document_mask == "false":
        return NONE, "--document_mask false"
    if saved == NONE:  # true: refused before any work (checkpoint.check_documents), but for --eval_only
        if cfg.document_mask == "true":
            raise ConfigError("--document_mask true: the checkpoint this run resumes trained with packed documents "
                              "that see each other: use --document_mask auto")
        return NONE, "the checkpoint this run resumes trained so"
    inner = unwrap(accelerator, model)
    modes = [saved] if saved else [POSITIONS] + ["+".join((POSITIONS, *extras)) for extras in EXTRAS
                                                 if "masks" not in extras or _mask_kinds(inner.config)]
    # as many rows as a micro-batch has (two stand for several): flash-attention finds packed documents
    # from the position ids in a batch of one row only, and several rows need giving as one (cu_seq_lens)
    rows = 2 if cfg.micro_batch_size > 1 else 1
    ids = model_probe.random_row(vocab_size, 16 * rows, accelerator.device).reshape(rows, 16)
    changed = ids.clone()
    changed[:, :7] = (changed[:, :7] + 1) % vocab_size  # another first document in each row
    positions = torch.cat([torch.arange(8), torch.arange(8)]).repeat(rows, 1).to(accelerator.device)
    failed = {}
    with model_probe.inference(model):
        for mode in modes:  # each through the hooks training would use
            hooks = install(model, accelerator, mode)
            try:
                before, after = (model(input_ids=x, position_ids=positions, use_cache=False).logits[:, 8:]
                                 for x in (ids, changed))
            except (ValueError, TypeError) as err:  # a kernel or a forward that refuses the inputs
                failed[mode] = str(err).split(", which")[0]
                continue
            finally:
                for hook in hooks:
                    hook.remove()
            gap = model_probe.difference(before, after)
            if gap is None:
                return mode, None
            failed[mode] = gap
    why = _why(inner, failed)
    if saved:
        with same_on_every_rank():
            raise ConfigError(f"--document_mask: the checkpoint this run resumes kept packed documents apart by "
                              f"{saved}, which this run cannot ({why}): resume where it can (the same kernels), "
                              "or start afresh")
    if cfg.document_mask == "true":
        with same_on_every_rank():
            raise ConfigError(f"--document_mask true: {why}: use --document_mask auto (documents then see each "
                              "other) or --packing false")
    return NONE, why


def _why(inner, failed: dict) -> str:
    family = type(inner.config.get_text_config()).__name__.removesuffix("Config")
    gaps = [gap for gap in failed.values() if isinstance(gap, float)]
    moved = (f"the second of two packed documents moved by {min(gaps):.2g} when the first changed" if gaps
             else "its forward refuses every input tried")
    kinds = _stateful_kinds(inner.config.get_text_config())
    what = (f"{family}'s {'/'.join(kinds)} layers carry their state from one document into the next" if kinds
            else f"{family} does not keep packed documents apart")
    refusals = sorted({why for why in failed.values() if isinstance(why, str) and KERNEL_REFUSAL in why})
    return "; ".join([f"{what}: {moved}", *refusals])


def _mask_kinds(config) -> list[str]:
    """The layer types of a family whose masks transformers' mask functions make one per type."""
    kinds = list(dict.fromkeys(getattr(config.get_text_config(), "layer_types", None) or ()))
    functions = masking_utils.LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING
    return kinds if kinds and all(callable(functions.get(kind)) for kind in kinds) else []


def _stateful_kinds(config) -> list[str]:
    """Layer types that carry a state along the sequence: those transformers gives a recurrent mask."""
    functions = masking_utils.LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING
    return [kind for kind in dict.fromkeys(getattr(config, "layer_types", None) or ())
            if functions.get(kind) is masking_utils.create_recurrent_attention_mask
            or isinstance(functions.get(kind), dict)]


def forward_inputs(base, positions: torch.Tensor, mode: str) -> dict:
    """The keyword inputs that keep documents apart under `mode`, made from a batch's position ids
    (rows, seq_len) on their device. "cu_seq_lens" wants the rows as one: their position ids come back
    as one row (the caller flattens the input ids alike)."""
    if mode == NONE:
        return {"position_ids": None}
    extras = mode.split("+")[1:]
    if "cu_seq_lens" in extras:
        positions = positions.reshape(1, -1)
    inputs = {"position_ids": positions}
    if "cu_seq_lens" in extras:
        (cu_q, cu_k), (max_q, max_k) = prepare_fa_kwargs_from_position_ids(positions)
        inputs.update(cu_seq_lens_q=cu_q, cu_seq_lens_k=cu_k, max_length_q=int(max_q), max_length_k=int(max_k))
    if "seq_idx" in extras:
        index = masking_utils.find_packed_sequence_indices(positions)  # None: one document per row
        inputs["seq_idx"] = (torch.zeros_like(positions) if index is None else index).to(torch.int32)
    if "masks" in extras:
        config = base.config.get_text_config()
        # the mask functions read only the shape, dtype and device of the embeddings
        embeds = torch.empty(*positions.shape, 0, dtype=base.get_input_embeddings().weight.dtype,
                             device=positions.device)
        functions = masking_utils.LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING
        inputs["attention_mask"] = {kind: functions[kind](config=config, inputs_embeds=embeds, attention_mask=None,
                                                          cache=None, position_ids=positions)
                                    for kind in _mask_kinds(config)}
    return inputs


def install(model, accelerator, mode: str) -> list:
    """Give `mode`'s inputs to every forward of train.py's own (no cache: training, held-out,
    probes), made from the position ids each batch brings, at the model's base (the decoder below the
    head: a head's own use of the attention mask, such as GPT-OSS's router loss, keeps None);
    generate's forwards are left as they are. Returns the hooks' handles (none for position ids
    alone, which the batch brings, nor for one document per row)."""
    if mode in (POSITIONS, ROWS):
        return []
    flattened = []  # the (rows, seq_len) of the forward under way, when its rows go in as one

    def before(base, args, kwargs):
        flattened.clear()
        positions = kwargs.get("position_ids")
        if positions is None or kwargs.get("use_cache") or any(kwargs.get(key) is not None
                                                               for key in ("cache", "past_key_values")):
            return None  # generate's forwards (a cache) keep their own inputs
        kwargs.update(forward_inputs(base, positions, mode))
        if "cu_seq_lens" in mode:  # the heads call their base with keywords (transformers 5)
            flattened.append(kwargs["input_ids"].shape)
            kwargs["input_ids"] = kwargs["input_ids"].reshape(1, -1)
        return args, kwargs

    def after(base, args, kwargs, output):
        if flattened:  # the hidden states back in the batch's rows, for the head and the loss
            output.last_hidden_state = output.last_hidden_state.reshape(*flattened.pop(), -1)
        return output

    base = unwrap(accelerator, model).base_model
    return [base.register_forward_pre_hook(before, with_kwargs=True),
            base.register_forward_hook(after, with_kwargs=True)]
