"""Mixture-of-experts models in train.py: the router's load-balancing loss in the objective and the
experts' load in the run's record.

A sparse MoE layer sends each token to the top-k of its E experts by a learned router. Trained on
the language-model loss alone the router is trained blind: it can collapse onto a few experts,
which then see most tokens while the others learn nothing. Most MoE families in transformers ship
a load-balancing loss for this (Switch Transformer's: E * sum_e f_e * P_e over layers, f_e the
share of routing slots expert e gets, P_e its mean router probability; 1 when the load is
uniform), returned as `aux_loss` when the forward is asked for `output_router_logits`. The
objective becomes

    sum(per-token loss over the step) / step target tokens + coef * mean(aux_loss over micro-batches and ranks)

with coef = --router_aux_loss_coef (default: the model config's own router_aux_loss_coef; 0 turns
it off). The aux term is a mean per micro-batch, so accumulation and the world size leave its share
as it is (accelerator.backward divides by the accumulation steps and gradient averaging by the
data-parallel ranks: exactly the mean). The held-out eval reports the language-model loss alone.

Routers without that loss (DeepSeek-V3, GLM-4-MoE and the other "aux-loss-free" families, whose
modeling file has no load_balancing_loss_func) balance by a correction bias instead: a per-expert
offset added to the scores for choosing the top-k only (e_score_correction_bias, a buffer; Ernie
4.5-MoE's and Laguna's are parameters built with requires_grad=False). DeepSeek-V3's paper nudges
it after each step by the load it saw; transformers 5.25 implements no such update (nor a loss),
so the bias stays as loaded, never trained: the objective is the language-model loss alone and
--router_aux_loss_coef is refused for such a family. `from_pretrained` makes every loaded parameter
trainable, a requires_grad=False one too (its _load_parameter_into_model): `keep_frozen` puts
back what the family's own constructor froze, read on the meta-device model.

Expert load: per layer, the share of routing slots (tokens x top_k) each expert got since the last
log interval, summed over ranks; the run records its coefficient of variation and its max and min
share per layer (uniform: cv 0, every share 1/E).
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from common.config import ConfigError
from train_extras import chunked_loss
from train_extras.observe.flops import is_experts, meta_model, routed_experts, text_config


def routing(model_config, model: nn.Module | None = None) -> dict | None:
    """{"experts": E, "top_k": k, "loss": whether the family's forward returns a load-balancing
    loss, "coef": the config's aux coefficient (0 without such a loss), "fixed": the router's tensors
    the family never trains (its correction bias)} of an MoE family (its experts found on the
    meta-device model, as the FLOPs count finds them), else None."""
    model = meta_model(model_config) if model is None else model
    experts = routed_experts(model_config, model)
    if experts is None:
        return None
    # transformers' families that return aux_loss all compute it with their modeling file's own
    # load_balancing_loss_func; the aux-loss-free ones (DeepSeek-V3, GLM-4-MoE...) have none
    loss = hasattr(sys.modules[type(model).__module__], "load_balancing_loss_func")
    coef = float(getattr(text_config(model_config), "router_aux_loss_coef", 0.0) or 0.0) if loss else 0.0
    return {"experts": experts["experts"], "top_k": experts["top_k"], "loss": loss, "coef": coef,
            "fixed": router_fixed(model)}


def route_for(cfg, model_config, model: nn.Module | None = None) -> dict | None:
    """This run's routing: the model's experts and top-k, and the router loss's weight
    (--router_aux_loss_coef, else the config's own); None for a dense model. The option is refused
    for a dense model and for a router without a loss (there is nothing for it to weigh)."""
    route = routing(model_config, model)
    family = type(text_config(model_config)).__name__.replace("Config", "")
    if route is None and cfg.router_aux_loss_coef is not None:
        raise ConfigError(f"--router_aux_loss_coef: the {family} model has no router (not a mixture-of-experts model)")
    if route is not None and cfg.router_aux_loss_coef is not None:
        if not route["loss"]:
            how = (f" (it balances by a correction bias, {', '.join(route['fixed'])}, which transformers does "
                   "not update)") if route["fixed"] else ""
            raise ConfigError(f"--router_aux_loss_coef: the {family} model's router has no load-balancing "
                              f"loss{how}; leave the option out")
        route["coef"] = cfg.router_aux_loss_coef
    return route


def describe(route: dict) -> str:
    """The setup block's line on the experts and how their load is balanced."""
    line = f"{route['experts']}, top-{route['top_k']} per token; "
    if route["loss"]:
        line += f"router loss weight {route['coef']:g}"
    else:
        line += "no router loss (aux-loss-free routing)"
    if route["fixed"]:
        line += f"; {', '.join(route['fixed'])} kept as loaded, not trained"
    return line


def router_fixed(model: nn.Module) -> list[str]:
    """Names (leaf) of what the sparse blocks hold that the family never trains: buffers (DeepSeek-V3's
    e_score_correction_bias) and parameters its constructor froze (Ernie 4.5-MoE's)."""
    classes = sparse_block_classes(model)
    blocks = [m for m in model.modules() if type(m) in classes]
    names = {name.rsplit(".", 1)[-1] for block in blocks for name, _ in block.named_buffers()}
    names |= {name.rsplit(".", 1)[-1] for block in blocks for name, p in block.named_parameters()
              if not p.requires_grad}
    return sorted(names)


def declared_frozen(meta: nn.Module) -> set[str]:
    """The parameters the family's constructor builds with requires_grad=False (a router's
    correction bias), read on the meta-device model (any family, MoE or not)."""
    return {name for name, p in meta.named_parameters() if not p.requires_grad}


def keep_frozen(model: nn.Module, names: set[str]) -> list[str]:
    """Freeze again what `from_pretrained` made trainable against its family's rule; their names."""
    thawed = [name for name, p in model.named_parameters() if name in names and p.requires_grad]
    for name in thawed:
        model.get_parameter(name).requires_grad_(False)
    return thawed


def losses(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, route: dict,
           position_ids: torch.Tensor | None = None, loss_head: nn.Module | None = None):
    """(token-summed language-model loss, the family's load-balancing loss (None for a router
    without one), routing slots per layer and expert as a (layers, E) tensor) of one micro-batch;
    nothing leaves the device. `loss_head`: --loss_chunk_size's head (train_extras/chunked_loss.py),
    which returns token losses."""
    loss, out = chunked_loss.loss_and_output(model, loss_head, input_ids, labels, "sum", position_ids,
                                             output_router_logits=True)
    return loss, out.aux_loss if route["loss"] else None, expert_slots(out.router_logits, route)


def expert_slots(router_logits, route: dict) -> torch.Tensor:
    """(layers, E): how many routing slots each expert got, by the router's own top-k (on its
    softmax: the same experts as the family's forward picks). histc, not bincount: no host sync."""
    counts = []
    for logits in router_logits:
        chosen = torch.topk(logits.float(), route["top_k"], dim=-1).indices
        counts.append(torch.histc(chosen.reshape(-1).float(), bins=route["experts"], min=0, max=route["experts"]))
    return torch.stack(counts)


def load_stats(slots: torch.Tensor) -> dict:
    """Per layer: coefficient of variation, max and min share of the routing slots (a host list)."""
    shares = slots / slots.sum(dim=1, keepdim=True).clamp(min=1)
    mean = shares.mean(dim=1, keepdim=True)
    cv = (shares - mean).pow(2).mean(dim=1).sqrt() / mean.squeeze(1).clamp(min=1e-12)
    cv, high, low = torch.stack([cv, shares.max(dim=1).values, shares.min(dim=1).values]).tolist()
    return {"cv": cv, "max_share": high, "min_share": low}


def sparse_block_classes(model: nn.Module) -> list[type]:
    """The classes of the model's sparse MoE blocks: the modules holding the routed experts (found as
    the FLOPs count finds them)."""
    return sorted({type(m) for m in model.modules()
                   if any(is_experts(name, child) for name, child in m.named_children())},
                  key=lambda c: c.__name__)
