"""--optimizer muon: torch.optim.Muon on the hidden matrices, AdamW on everything else, as one optimizer.

Muon replaces each 2-D weight's momentum by its orthogonalised form (Newton-Schulz, torch's own
implementation): every direction of the matrix moves by the same amount, which reaches a loss in
fewer steps than AdamW on the linear maps of the blocks. It is defined for whole matrices only,
so embeddings, the output head, norms, biases and fused 3-D expert tensors stay with AdamW
(--lr, --weight_decay, the betas), and a strategy that shards the matrices (FSDP2, DeepSpeed ZeRO,
tensor parallelism) is refused: each rank would orthogonalise its own slice, another update.

The two optimizers are stepped, scheduled, clipped and checkpointed as one: the LR schedule
scales every group from its own peak (--muon_lr for Muon's, --lr for the rest).
"""

from __future__ import annotations

import torch
from accelerate.utils import DistributedType
from torch import nn

from common import model as modeling
from common.config import ConfigError, tensor_parallel_size


def hidden_matrices(model: nn.Module) -> list[nn.Parameter]:
    """The 2-D trainable weights apart from the token/position embeddings and the output head
    (tied or not): the linear maps of attention, MLP and router."""
    head = model.get_output_embeddings()
    outside = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    outside |= {id(head.weight)} if head is not None else set()
    return [p for p in model.parameters() if p.requires_grad and p.ndim == 2 and id(p) not in outside]


def check_launch(cfg, accelerator) -> None:
    """Refuse, before the model is built, a strategy that hands Muon slices of matrices."""
    if cfg.optimizer != "muon":
        return
    sharded = {DistributedType.FSDP: "FSDP2 shards", DistributedType.DEEPSPEED: "DeepSpeed ZeRO flattens"}
    how = sharded.get(accelerator.distributed_type)
    if how is None and tensor_parallel_size(accelerator) > 1:
        how = "tensor parallelism splits"
    if how:
        raise ConfigError(f"--optimizer muon orthogonalises each whole matrix and {how} them across ranks: use one "
                          "process or ddp.yaml, or --optimizer adamw")


def build_optimizer(model: nn.Module, cfg, device: torch.device) -> torch.optim.Optimizer:
    """AdamW as common/model.py builds it, or Muon on the hidden matrices with AdamW on the rest."""
    if cfg.optimizer == "adamw":
        return modeling.build_optimizer(model, cfg, device)
    hidden = hidden_matrices(model)
    chosen = {id(p) for p in hidden}
    rest = [p for p in model.parameters() if p.requires_grad and id(p) not in chosen]
    muon = torch.optim.Muon(hidden, lr=cfg.muon_lr, weight_decay=cfg.muon_weight_decay, momentum=cfg.muon_momentum,
                            adjust_lr_fn=cfg.muon_adjust_lr)
    return MuonWithAdamW(modeling.build_optimizer(model, cfg, device, params=rest), muon)


def peak_lrs(optimizer, cfg) -> list[float]:
    """Each param group's peak learning rate, as this run's options set it (a resumed run's schedule)."""
    return [cfg.muon_lr if "ns_steps" in group else cfg.lr for group in optimizer.param_groups]


class MuonWithAdamW(torch.optim.Optimizer):
    """Two torch optimizers behind one Optimizer: param_groups (AdamW's first, so the logged lr is
    --lr's schedule) and state are theirs, read on every access (load_state_dict replaces their
    group dicts), and state_dict nests both."""

    def __init__(self, adamw: torch.optim.AdamW, muon: torch.optim.Muon):
        params = [p for part in (adamw, muon) for group in part.param_groups for p in group["params"]]
        super().__init__(params, {})  # the base's hooks and profiling; its own groups go unused
        self.parts = (adamw, muon)

    @property
    def param_groups(self):
        parts = self.__dict__.get("parts")
        return [g for part in parts for g in part.param_groups] if parts else self.__dict__["_base_groups"]

    @param_groups.setter
    def param_groups(self, groups):  # only Optimizer.__init__ sets it
        self.__dict__["_base_groups"] = groups

    @property
    def state(self) -> dict:
        """Both optimizers' states, merged into a new dict: reading it creates nothing (a ChainMap
        would, through AdamW's defaultdict, and AdamW's state_dict would then fail on Muon's keys)."""
        parts = self.__dict__.get("parts")
        return {p: s for part in parts for p, s in part.state.items()} if parts else self.__dict__["_base_state"]

    @state.setter
    def state(self, state):
        self.__dict__["_base_state"] = state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for part in self.parts:
            part.step()
        return loss

    def state_dict(self) -> dict:
        return {"adamw": self.parts[0].state_dict(), "muon": self.parts[1].state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        if set(state_dict) != {"adamw", "muon"}:
            raise ConfigError("this optimizer state is not Muon + AdamW (--optimizer muon): resume with the "
                              "--optimizer it was saved with")
        self.parts[0].load_state_dict(state_dict["adamw"])
        self.parts[1].load_state_dict(state_dict["muon"])
