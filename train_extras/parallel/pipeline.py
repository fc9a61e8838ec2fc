"""Pipeline parallelism for recipes/pipeline_parallel.py: a causal LM cut into consecutive stages of
its blocks, one per rank, each running the family's own forward over its blocks, driven by torch's
1F1B schedule (torch.distributed.pipelining), with the tied weights, whole-model gradient clip,
held-out loss and export that a split model needs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from common.config import ConfigError, one_line, opt, same_on_every_rank


def check_pipeline_layout(model_config, recipe: str) -> None:
    """The stages below cut a model whose decoder keeps its blocks in one list, `.layers` (Llama,
    Qwen3, Gemma 3, Granite, Falcon-H1, LFM2, GPT-NeoX...); refuse any other layout, and mixtures of
    experts, before the model is built."""
    from train_extras.observe.flops import meta_model

    from train_extras.moe import routing

    family = type(model_config).__name__.replace("Config", "")
    if routing(model_config) is not None:
        raise ConfigError(f"{recipe}: the {family} model is a mixture of experts, whose router loss and expert load "
                          "this pipeline does not carry across its stages; train it with train.py (DDP, FSDP2 or "
                          "DeepSpeed configs)")
    layers = getattr(meta_model(model_config).base_model, "layers", None)
    if not isinstance(layers, nn.ModuleList) or len(layers) != model_config.num_hidden_layers:
        raise ConfigError(f"{recipe} splits models whose decoder keeps its blocks in one list, .layers (Llama, Qwen3, "
                          f"Gemma 3, GPT-NeoX...); the {family} model is laid out otherwise")


@dataclass
class MicroBatchOptions:
    """pipeline_parallel.py's --gradient_accumulation_steps: micro-batches per step, by default as
    many as 1F1B needs (train.py's accumulation option defaults to 1, which no pipeline runs)."""
    gradient_accumulation_steps: int = opt(0, "Micro-batches per step; 0: one per stage, the fewest 1F1B runs.")

    def check(self):
        if self.gradient_accumulation_steps < 0:
            raise ConfigError(f"--gradient_accumulation_steps must be 0 (one micro-batch per stage) or more, "
                              f"got {self.gradient_accumulation_steps}")


def check_micro_batches(micro_batches: int, stages: int, recipe: str) -> None:
    """1F1B needs at least one micro-batch in flight per stage (torch raises a ValueError otherwise)."""
    if micro_batches < stages:
        raise ConfigError(f"{recipe}: {stages} stages need at least {stages} micro-batches per step; got "
                          f"--gradient_accumulation_steps {micro_batches}: raise it to {stages} or more")


def stage_bounds(layers: int, stages: int) -> list[int]:
    """Stage s holds blocks bounds[s] to bounds[s + 1] - 1; blocks per stage differ by at most 1."""
    return [layers * s // stages for s in range(stages + 1)]


class _StageEnd(Exception):
    """Raised by the first block after a stage's own: it carries the hidden state the stage hands on."""

    def __init__(self, hidden: torch.Tensor):
        super().__init__()
        self.hidden = hidden


def _hidden_states(*args, **kwargs) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]


def _stop(*args, **kwargs):
    raise _StageEnd(_hidden_states(*args, **kwargs))


def _held_elsewhere(name: str):
    def forward(*args, **kwargs):
        raise RuntimeError(f"its forward calls {name} on a stage that does not hold it")
    return forward


def _copy(module: nn.Module, forward=None) -> nn.Module:
    """A new object of the module's class with its attributes and children (forward=None), or hollow:
    its parameters, buffers and children read as None and `forward` runs instead of its own. The
    family's forward still reads what it asks of a block (LFM2's `is_attention_layer`, Jamba's
    isinstance), and a hollow block holds no memory."""
    copy = object.__new__(type(module))
    nn.Module.__init__(copy)  # hooks and the like of its own
    own = set(vars(copy))
    copy.__dict__.update({key: value for key, value in vars(module).items() if key not in own})
    for slots in ("_parameters", "_buffers", "_modules"):
        held = getattr(module, slots)
        getattr(copy, slots).update(held if forward is None else dict.fromkeys(held))
    if forward is not None:
        copy.forward = forward
    return copy


def stage_parameters(model: nn.Module, layers: range, first: bool, last: bool) -> set[int]:
    """ids of the parameters a stage holds: its blocks', the input embedding (and what holds it) on
    the first stage and every other weight outside the blocks (final norm, LM head) on the last. A
    tied head is one tensor with the embedding: the first and the last stage both hold it."""
    inner, embedding = model.base_model, model.get_input_embeddings()
    held = {id(p) for i in layers for p in inner.layers[i].parameters()}
    for parent in (model, inner):
        for child in parent.children():
            if child is not inner and child is not inner.layers and \
                    (first if embedding in child.modules() else last):
                held |= {id(p) for p in child.parameters()}
    return held


def stage_model(model: nn.Module, layers: range, first: bool, last: bool) -> nn.Module:
    """A copy of `model` (a transformers causal LM) that runs the family's own forward, with its own
    embedding scaling, masks (sliding windows), rotary per layer type, logit scaling and soft-capping,
    over the blocks in `layers` only: a block before them passes its input on (the stage's input
    replaces it at the first block, PipelineStageModule), the block after them ends the forward.
    The modules outside the blocks that hold no weight of this stage are hollow."""
    inner, held = model.base_model, stage_parameters(model, layers, first, last)
    stage, body = _copy(model), _copy(inner)
    stage._modules[model.base_model_prefix] = body
    body._modules["layers"] = nn.ModuleList(
        block if i in layers else _copy(block, _hidden_states if i < layers.start else _stop)
        for i, block in enumerate(inner.layers))
    for parent, copy, prefix in ((model, stage, ""), (inner, body, f"{model.base_model_prefix}.")):
        for name, child in parent.named_children():
            if child is not inner and child is not inner.layers and \
                    not all(id(p) in held for p in child.parameters()):
                copy._modules[name] = _copy(child, _held_elsewhere(prefix + name))
    return stage


class PipelineStageModule(nn.Module):
    """One stage of a causal LM: token ids (first stage) or the previous stage's hidden states in,
    hidden states (or the logits, last stage) out, computed by the family's own forward
    (stage_model). It shares the full model's blocks and weights (no copy of a tensor)."""

    def __init__(self, model: nn.Module, layers: range, first: bool, last: bool):
        super().__init__()
        self.model = stage_model(model, layers, first, last)
        self.first, self.start = first, layers.start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            return self._run(input_ids=x)

        def enter(block, args, kwargs):  # the family's embedding and scaling of inputs_embeds are dropped here
            return ((x, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": x})

        # inputs_embeds: x gives the masks and rotary their shape, dtype and device; the hook (only
        # for this call) feeds x itself to the first block of the stage.
        entry = self.model.base_model.layers[self.start].register_forward_pre_hook(enter, with_kwargs=True)
        try:
            return self._run(inputs_embeds=x)
        finally:
            entry.remove()

    def _run(self, **inputs) -> torch.Tensor:
        try:
            return self.model(**inputs, use_cache=False).logits
        except _StageEnd as end:
            return end.hidden


@same_on_every_rank()  # every rank runs the same probe on the same full model
def check_stages(model: nn.Module, bounds: list[int], recipe: str) -> None:
    """The stages, run one after the other on one tiny seeded batch, must give the whole model's
    logits to 1e-5, else one line before training: a family whose forward does something between or
    around its blocks that the stages miss would otherwise train another function, silently."""
    from train_extras.model_probe import inference, random_row

    stages = len(bounds) - 1
    # 2 rows of 32 tokens: longer than the tiny test models' sliding windows (16)
    batch = random_row(model.get_input_embeddings().num_embeddings, 64, next(model.parameters()).device).reshape(2, 32)
    family = type(model).__name__
    with inference(model):
        whole = model(input_ids=batch, use_cache=False).logits
        x = batch
        try:
            for s in range(stages):
                x = PipelineStageModule(model, range(bounds[s], bounds[s + 1]), s == 0, s == stages - 1)(x)
        except Exception as err:  # noqa: BLE001 - whatever the family does, one line
            raise ConfigError(f"{recipe}: the {family} model cannot be cut into {stages} stages "
                              f"({one_line(err)}); train it with train.py") from None
    gap = (x.float() - whole.float()).abs().max().item() if x.shape == whole.shape else float("inf")
    if not gap <= 1e-5:
        raise ConfigError(f"{recipe}: the {family} model's {stages} stages do not compute its own forward (largest "
                          f"logit difference {gap:.2g} > 1e-5 on a probe batch); train it with train.py")


class Pipeline:
    """This rank's stage of a pipeline over every rank, driven by torch's 1F1B schedule.

    Each optimizer step's batch is cut into `micro_batches` micro-batches; stage s runs the forward
    of micro-batch m as soon as stage s-1 sends its activations (point-to-point), and 1F1B starts
    the backward of the oldest micro-batch as soon as it can, so a stage keeps at most `stages`
    micro-batches' activations. Gradients add up over the micro-batches; every rank calls every method."""

    def __init__(self, model: nn.Module, accelerator, micro_batches: int, recipe: str):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        self.accelerator, self.micro_batches = accelerator, micro_batches
        self.rank, self.stages = accelerator.process_index, accelerator.num_processes
        self.first, self.last = self.rank == 0, self.rank == self.stages - 1
        bounds = stage_bounds(len(model.base_model.layers), self.stages)
        check_stages(model, bounds, recipe)
        self.layer_range = (bounds[self.rank], bounds[self.rank + 1])
        self.module = PipelineStageModule(model, range(*self.layer_range), self.first, self.last)
        # A weight several stages hold (a tied head: the embedding on the first, the head on the
        # last) is a copy on each: its gradients are summed over them before every step, so the
        # copies take the same steps and stay equal; the clip's norm counts it once.
        held = [stage_parameters(model, range(bounds[s], bounds[s + 1]), s == 0, s == self.stages - 1)
                for s in range(self.stages)]
        self.shared, self.counted_elsewhere = [], set()
        for param in model.parameters():  # the same order on every rank: each makes every group alike
            holders = [s for s in range(self.stages) if id(param) in held[s]]
            if len(holders) > 1:
                group = dist.new_group(holders)
                if self.rank in holders:
                    self.shared.append((param, group))
                    if self.rank != holders[0]:
                        self.counted_elsewhere.add(id(param))
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
        loss = self._run(input_ids, labels, train=True)
        for param, group in self.shared:  # a tied weight's copies: the gradient of the whole model
            dist.all_reduce(param.grad, group=group)
        return loss

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
        mine = [p.grad for p in params if id(p) not in self.counted_elsewhere]  # a shared weight once
        local = torch.nn.utils.get_total_norm(mine) if mine else torch.zeros(())
        total = self.accelerator.reduce(local.to(self.accelerator.device) ** 2, "sum").sqrt()
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return total

    def full_state_dict(self) -> dict | None:
        """Every stage's weights, gathered on rank 0 under the full model's names (None elsewhere)."""
        from accelerate.utils import gather_object

        # the stage's names are the full model's under "model." (PipelineStageModule.model)
        mine = {name.removeprefix("model."): t.detach().cpu() for name, t in self.module.state_dict().items()}
        parts = gather_object([mine])
        if not self.accelerator.is_main_process:
            return None
        state = {}
        for part in parts:
            for name, tensor in part.items():
                if name in state and not torch.equal(state[name], tensor):  # a tied weight's copies
                    raise RuntimeError(f"the pipeline stages' copies of {name} differ")
                state[name] = tensor
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
