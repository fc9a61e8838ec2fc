"""Pipeline parallelism for recipes/pipeline_parallel.py: a Llama-layout model cut into consecutive
stages, one per rank, driven by torch's 1F1B schedule (torch.distributed.pipelining), with the
whole-model gradient clip, held-out loss and export that a split model needs."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from common.config import ConfigError


def check_pipeline_layout(model_config, recipe: str) -> None:
    """The stages below cut a Llama-layout model (model.embed_tokens, .layers, .rotary_emb, .norm:
    Llama, Qwen2, Mistral...); refuse any other layout before the model is built."""
    from train_extras.observe.flops import meta_model

    from train_extras.moe import routing

    family = type(model_config).__name__.replace("Config", "")
    if routing(model_config) is not None:
        raise ConfigError(f"{recipe}: the {family} model is a mixture of experts, whose router loss and expert load "
                          "this pipeline does not carry across its stages; train it with train.py (DDP, FSDP2 or "
                          "DeepSpeed configs)")
    inner = getattr(meta_model(model_config), "model", None)
    missing = [name for name in ("embed_tokens", "layers", "rotary_emb", "norm") if not hasattr(inner, name)]
    if missing:
        raise ConfigError(f"{recipe} splits Llama-layout models (model.embed_tokens, .layers, .rotary_emb, .norm: "
                          f"Llama, Qwen2, Mistral...); the {family} model is laid out otherwise")


def check_micro_batches(micro_batches: int, stages: int, recipe: str) -> None:
    """1F1B needs at least one micro-batch in flight per stage (torch raises a ValueError otherwise)."""
    if micro_batches < stages:
        raise ConfigError(f"{recipe}: {stages} stages need at least {stages} micro-batches per step; got "
                          f"--gradient_accumulation_steps {micro_batches}: raise it to {stages} or more")


class PipelineStageModule(nn.Module):
    """Consecutive decoder layers of a Llama-style causal LM, plus the embedding on the first stage
    and the final norm and LM head on the last. It aliases the full model's modules (no copy)."""

    def __init__(self, model: nn.Module, layers: range, first: bool, last: bool):
        super().__init__()
        inner = model.model
        self.embed_tokens = inner.embed_tokens if first else None
        self.layers = nn.ModuleList(inner.layers[i] for i in layers)
        self.rotary_emb = inner.rotary_emb  # a buffer-only module: the position encodings
        self.norm = inner.norm if last else None
        self.lm_head = model.lm_head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(x) if self.embed_tokens is not None else x
        positions = torch.arange(hidden.shape[1], device=hidden.device)[None]
        position_embeddings = self.rotary_emb(hidden, positions)
        for layer in self.layers:
            # attention_mask None: the SDPA kernel applies the causal mask itself (is_causal)
            out = layer(hidden, attention_mask=None, position_ids=positions, position_embeddings=position_embeddings)
            hidden = out[0] if isinstance(out, tuple) else out
        if self.lm_head is not None:
            hidden = self.lm_head(self.norm(hidden))
        return hidden


class Pipeline:
    """This rank's stage of a pipeline over every rank, driven by torch's 1F1B schedule.

    Each optimizer step's batch is cut into `micro_batches` micro-batches; stage s runs the forward
    of micro-batch m as soon as stage s-1 sends its activations (point-to-point), and 1F1B starts
    the backward of the oldest micro-batch as soon as it can, so a stage keeps at most `stages`
    micro-batches' activations. Gradients add up over the micro-batches; every rank calls every method."""

    def __init__(self, model: nn.Module, accelerator, micro_batches: int):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        self.accelerator, self.micro_batches = accelerator, micro_batches
        self.rank, self.stages = accelerator.process_index, accelerator.num_processes
        self.first, self.last = self.rank == 0, self.rank == self.stages - 1
        layers = len(model.model.layers)
        bounds = [layers * s // self.stages for s in range(self.stages + 1)]  # blocks per stage differ by <= 1
        self.module = PipelineStageModule(model, range(bounds[self.rank], bounds[self.rank + 1]), self.first, self.last)
        self.layer_range = (bounds[self.rank], bounds[self.rank + 1])
        # the full model's name of each of this stage's tensors, for the export
        full_names = {id(t): name for name, t in model.state_dict(keep_vars=True).items()}
        self.full_names = {name: full_names[id(t)] for name, t in self.module.state_dict(keep_vars=True).items()}
        self.full_model = model if accelerator.is_main_process else None  # rank 0 assembles the export
        self.module.to(accelerator.device)
        if accelerator.mixed_precision == "bf16":
            self.module.forward = torch.autocast(accelerator.device.type, dtype=torch.bfloat16)(self.module.forward)
        self.stage = PipelineStage(self.module, self.rank, self.stages, accelerator.device)
        # Each micro-batch's loss is its token sum over the step's token count: the losses add up to
        # the step's token mean, and so do the gradients (no extra 1/micro_batches scaling).
        self.schedule = Schedule1F1B(self.stage, n_microbatches=micro_batches, loss_fn=self._loss, scale_grads=False)
        self._step_tokens = None

    def _loss(self, logits, labels):
        return nn.functional.cross_entropy(logits.float().reshape(-1, logits.size(-1)), labels.reshape(-1),
                                           ignore_index=-100, reduction="sum") / self._step_tokens

    def _run(self, input_ids, labels, train: bool):
        """One pass over a whole batch; returns its token-mean loss on every rank."""
        device = self.accelerator.device
        input_ids, labels = input_ids.to(device), labels.to(device)
        self._step_tokens = (labels != -100).sum().clamp(min=1)  # every rank has the whole batch
        losses, run = [], self.schedule.step if train else self.schedule.eval
        if self.first and self.last:
            run(input_ids, target=labels, losses=losses)
        elif self.first:
            run(input_ids)
        elif self.last:
            run(target=labels, losses=losses)
        else:
            run()
        loss = torch.stack(losses).sum().detach() if self.last else torch.zeros((), device=device)
        loss = self.accelerator.reduce(loss, "sum")  # the last stage's value, on every rank
        return loss

    def train_step(self, input_ids, labels) -> torch.Tensor:
        return self._run(input_ids, labels, train=True)

    @torch.no_grad()
    def evaluate(self, eval_loader, max_batches: int = 0) -> dict:
        """Token-weighted held-out loss. Not common/model.py's evaluate: the schedule yields one loss
        per batch, not per sequence, and every rank holds the whole batch (no gather). A short last
        batch is padded with ignored rows (labels -100) to the schedule's batch size, which the
        stages' buffers are sized for."""
        import math

        self.module.eval()
        loss_sum, tokens = torch.zeros((), dtype=torch.float64, device=self.accelerator.device), 0
        for i, batch in enumerate(eval_loader):
            if max_batches and i >= max_batches:
                break
            input_ids, labels = batch["input_ids"], batch["labels"]
            size = eval_loader.batch_size
            if len(input_ids) < size:
                missing = size - len(input_ids)
                input_ids = torch.cat([input_ids, input_ids[:1].expand(missing, -1)])
                labels = torch.cat([labels, torch.full((missing, labels.shape[1]), -100, dtype=labels.dtype)])
            batch_tokens = int((labels != -100).sum())  # on the host: labels are not on the device yet
            loss_sum += self._run(input_ids, labels, train=False).double() * batch_tokens
            tokens += batch_tokens
        self.module.train()
        loss = loss_sum.item() / tokens  # one CPU-GPU sync, at the end
        return {"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens": tokens}

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip on the norm of the whole model's gradient: each stage's squared norm, summed over stages."""
        params = [p for p in self.module.parameters() if p.grad is not None]
        local = torch.nn.utils.get_total_norm([p.grad for p in params]) if params else torch.zeros(())
        total = self.accelerator.reduce(local.to(self.accelerator.device) ** 2, "sum").sqrt()
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return total

    def full_state_dict(self) -> dict | None:
        """Every stage's weights, gathered on rank 0 under the full model's names (None elsewhere)."""
        from accelerate.utils import gather_object

        mine = {self.full_names[name]: t.detach().cpu() for name, t in self.module.state_dict().items()}
        parts = gather_object([mine])
        if not self.accelerator.is_main_process:
            return None
        state = {}
        for part in parts:
            state.update(part)
        return state

    def export(self, tokenizer, out_dir) -> Path:
        """A Hugging Face folder of the whole trained model in the run's precision (as
        common.export's), written by rank 0."""
        from common.export import PRECISION_DTYPES, check_replaceable, mark_export
        from common.files import partial_dir, recover_dir, replace_dir

        out_dir = Path(out_dir)
        check_replaceable(out_dir)  # every rank, before the gather: what is there is an export, or nothing
        state = self.full_state_dict()
        if self.accelerator.is_main_process:  # written whole beside out_dir, then swapped in (as common.export's)
            recover_dir(out_dir)
            self.full_model.load_state_dict(state)  # strict: every tensor comes from some stage
            dtype = PRECISION_DTYPES.get(self.accelerator.mixed_precision, torch.float32)
            self.full_model.to(dtype).save_pretrained(partial_dir(out_dir))
            tokenizer.save_pretrained(partial_dir(out_dir))
            mark_export(partial_dir(out_dir))
            replace_dir(out_dir)
        self.accelerator.wait_for_everyone()
        return out_dir
