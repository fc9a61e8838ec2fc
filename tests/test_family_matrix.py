"""The causal-LM families of 2025-2026 (tests/families.py) with train.py's default options:

- in-process, every family: train.py's own pieces (the model built from its folder, the document mask
  `auto` picks and installs, its AdamW) train a few steps on packed micro-batches of the toy
  language; the export (common/export.py) reloads strictly and gives the trained logits.
- launched, a representative subset under cpu.yaml, ddp.yaml, fsdp.yaml and
  deepspeed_zero3_offload.yaml (2 CPU processes): Granite (multipliers, logits scaling, tied head),
  Qwen3-Next (gated DeltaNet + gated attention, MoE) and Jamba (Mamba + attention, MoE). Each trains,
  names its document mask in the setup block and run_summary.json, and exports a model that reloads
  strictly with the trained logits. DeepSeek-V3 (MLA, aux-loss-free router) runs under the same four
  configs in tests/test_moe.py. docs/models.md keeps the family x strategy table.
"""

from __future__ import annotations

import pytest
import torch
from accelerate import Accelerator
from transformers import AutoModelForCausalLM, ByT5Tokenizer

from common.data import build_tokenizer
from common.export import export_pretrained
from common.model import build_model, build_optimizer, causal_lm_loss
from common.config import ConfigError
from conftest import (HARNESS, SYNTHETIC, TWO_CPU_PROCESSES, TWO_PROCESS_LAUNCH, Run, check_export_reproduces_model,
                      launch, parse_train)
from families import FAMILIES, VOCAB, make_config, save_family
from train_extras import document_mask
from train_extras.parallel import tensor_parallel
from train_extras.options import TrainConfig

# What `auto` gives each family on this machine (CPU: none of the CUDA kernels that restart a
# recurrent or convolutional state at a document's start): tests/test_document_mask.py says why.
SEE_EACH_OTHER = {"qwen3_next", "jamba", "falcon_h1", "granitemoehybrid", "lfm2", "minimax"}


def packed_batch(rows: int = 4, length: int = 32, seed: int = 0):
    """Rows of two documents each (split at a different place per row), their position ids restarting at
    the second, and the next-token labels."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (rows, length + 1), generator=generator)
    cuts = torch.randint(6, length - 6, (rows,), generator=generator)
    positions = torch.stack([torch.cat([torch.arange(c), torch.arange(length - c)]) for c in cuts.tolist()])
    return ids[:, :-1], ids[:, 1:], positions


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_trains_in_process_and_its_export_reloads_strictly(family, tmp_path):
    folder = save_family(family, tmp_path / "model")
    cfg = parse_train(["--model_name_or_path", str(folder), "--lr", "1e-2", "--weight_decay", "0"])
    accelerator = Accelerator(cpu=True)
    model = build_model(cfg, VOCAB)
    mode, why = document_mask.resolve(model, accelerator, cfg, VOCAB, None)
    assert (mode == document_mask.NONE) == (family in SEE_EACH_OTHER), (mode, why)
    assert (why is None) == (mode != document_mask.NONE)
    hooks = document_mask.install(model, accelerator, mode)
    optimizer = build_optimizer(model, cfg, torch.device("cpu"))
    ids, labels, positions = packed_batch()
    model.train()
    losses = []
    # one batch, learned by heart: the loss must fall for every family (measured: by 0.87 for Granite,
    # whose multipliers slow it most, to 5.2 for Qwen3-Next in 12 steps)
    for _ in range(12):
        loss = causal_lm_loss(model, ids, labels, position_ids=None if mode == document_mask.NONE else positions)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0] - 0.5, losses
    for hook in hooks:
        hook.remove()
    model.eval()
    probe = torch.tensor([list(range(10, 26))])
    with torch.no_grad():
        trained = model(input_ids=probe).logits
    export = export_pretrained(accelerator, model, build_tokenizer(TrainConfig()), tmp_path / "export")
    reloaded, info = AutoModelForCausalLM.from_pretrained(export, output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched tensor
    with torch.no_grad():
        assert (reloaded(input_ids=probe).logits - trained).abs().max().item() < 1e-5


# ---- launched: a representative subset under each data-parallel strategy ----

LAUNCHED = ["granite", "qwen3_next", "jamba"]
CONFIGS = ["cpu.yaml", "ddp.yaml", "fsdp.yaml", "deepspeed_zero3_offload.yaml"]
DISTRIBUTED_TYPE = {"cpu.yaml": "NO", "ddp.yaml": "MULTI_CPU", "fsdp.yaml": "FSDP",
                    "deepspeed_zero3_offload.yaml": "DEEPSPEED"}
MODEL_CLASS = {"granite": "GraniteForCausalLM", "qwen3_next": "Qwen3NextForCausalLM", "jamba": "JambaForCausalLM"}
# No option but the model, its tokenizer, the data and a short run: global batch 8, in micro-batches of 4
# everywhere (1 process accumulates 2), so the MoE families' router loss, a mean over micro-batches,
# is the same objective under every strategy (1 x 8 against 2 x 4 moved Jamba's losses by 2e-4 at step 2).
ARGS = ["--data_files", SYNTHETIC, "--seq_len", "64", "--max_steps", "24", "--warmup_steps", "2",
        "--eval_every", "24", "--log_every", "4", "--sample_length", "8"]


@pytest.fixture(scope="module")
def matrix_runs(tmp_path_factory, hf_home):
    tokenizer = tmp_path_factory.mktemp("matrix_tokenizer")
    build_tokenizer(TrainConfig()).save_pretrained(tokenizer)
    models, runs = {}, {}

    def get(family: str, config: str) -> Run:
        if family not in models:
            models[family] = save_family(family, tmp_path_factory.mktemp(f"matrix_{family}"))
        if (family, config) not in runs:
            out = tmp_path_factory.mktemp(f"matrix_{family}__{config}")
            args = ARGS + ["--model_name_or_path", str(models[family]), "--tokenizer_name_or_path", str(tokenizer),
                           "--output_dir", str(out)]
            if config == "cpu.yaml":
                proc = launch("train.py", args + ["--micro_batch_size", "4", "--gradient_accumulation_steps", "2"],
                              hf_home)
            elif config == "tp.yaml":  # the 2 ranks share each batch: 2 accumulated micro-batches of 4
                proc = launch("train.py", args + ["--micro_batch_size", "4", "--gradient_accumulation_steps", "2"],
                              hf_home, config=config, env=HARNESS,
                              launch_args=TWO_PROCESS_LAUNCH + ["--parallelism_config_tp_size", "2"])
            else:
                proc = launch("train.py", args + ["--micro_batch_size", "4"], hf_home, config=config,
                              launch_args=TWO_PROCESS_LAUNCH, env=TWO_CPU_PROCESSES[config])
            runs[family, config] = Run(out, proc)
        return runs[family, config]

    return get


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("family", LAUNCHED)
def test_each_family_trains_under_each_strategy_with_the_default_options(family, config, matrix_runs):
    run = matrix_runs(family, config)
    setup = run.summary["setup"]
    assert setup["distributed_type"] == DISTRIBUTED_TYPE[config]
    assert setup["world_size"] == (1 if config == "cpu.yaml" else 2)
    assert setup["global_batch_sequences"] == 8
    assert setup["options"]["document_mask"] == "auto"
    assert run.final[0]["model_class"] == MODEL_CLASS[family]
    # the setup block names the document mask, as run_summary.json records it
    documents = setup["documents"]
    assert (documents["mode"] == document_mask.NONE) == (family in SEE_EACH_OTHER), documents
    assert f"documents        : {document_mask.describe(documents['mode'], documents['why'])}\n" in run.proc.stdout
    losses = [row["loss"] for row in run.summary["losses"]]
    assert losses[-1] < losses[0] - 0.5, losses
    assert run.summary["eval"][-1]["loss"] < run.summary["eval"][0]["loss"] - 0.5, run.summary["eval"]


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("family", LAUNCHED)
def test_each_family_exports_a_model_that_reloads_strictly(family, config, matrix_runs):
    run = matrix_runs(family, config)
    # the byte tokenizer by its own class (AutoTokenizer would take the family's, as in tests/test_moe.py)
    check_export_reproduces_model(run, load_tokenizer=ByT5Tokenizer.from_pretrained)
    _, info = AutoModelForCausalLM.from_pretrained(run.summary["export"], output_loading_info=True)
    assert not any(info.values()), info


@pytest.mark.parametrize("family", LAUNCHED)
def test_the_strategies_train_alike(family, matrix_runs):
    """The same micro-batches: every step's loss and the held-out loss of each 2-process run are the
    1-process run's, to fp32 summation order (within 1e-5)."""
    reference = matrix_runs(family, "cpu.yaml").summary
    for config in CONFIGS[1:]:
        summary = matrix_runs(family, config).summary
        diffs = [abs(a["loss"] - b["loss"]) for a, b in zip(summary["losses"], reference["losses"], strict=True)]
        assert max(diffs) < 1e-5, (config, diffs)
        assert abs(summary["eval"][-1]["loss"] - reference["eval"][-1]["loss"]) < 1e-5, config


# ---- tensor parallel: decided from the config, before the model is built ----

TP_REFUSED = {  # family -> the line's reason
    "qwen3_moe": "is a mixture of experts", "glm4_moe": "is a mixture of experts", "gpt_oss": "is a mixture of experts",
    "qwen3_next": "is a mixture of experts", "jamba": "is a mixture of experts",
    "granitemoehybrid": "is a mixture of experts", "minimax": "is a mixture of experts",
    "deepseek_v3": "tensor-parallel plan uses 'mla_kv_a_proj'",
    "falcon_h1": "tensor-parallel plan splits only embed_tokens",
    "lfm2": "tensor-parallel plan splits only embed_tokens",
}


@pytest.mark.quick
@pytest.mark.parametrize("family", FAMILIES)
def test_tensor_parallel_takes_or_refuses_each_family_from_its_config(family):
    """Read from the config and the model built on the meta device: the dense families whose plan splits
    their layers are taken; a mixture of experts (its plan names dense MLP projections a sparse layer
    lacks: transformers 5.25's Qwen2-MoE used to fail after the build on `mlp.gate_proj`), MLA, and a plan
    that splits only the embedding are one line each."""
    from test_tensor_parallel import stand_in

    config = make_config(family)
    if family not in TP_REFUSED:
        tensor_parallel.check(stand_in(), TrainConfig(), config, "train.py")
        return
    line = rf"^train.py: the \w+ model('s)? {TP_REFUSED[family]}.*[:;] use a data-parallel"
    with pytest.raises(ConfigError, match=line):
        tensor_parallel.check(stand_in(), TrainConfig(), config, "train.py")


def test_granite_under_tensor_parallel_trains_as_one_process(matrix_runs):
    """Granite (its multipliers and logits scaling around the split layers, tied head kept whole) under
    tp.yaml: its weights are split over the 2 ranks, and its losses are the 1-process run's (the same
    micro-batches; fp32 sums in another order) to 1e-5; the export reloads strictly."""
    run, reference = matrix_runs("granite", "tp.yaml"), matrix_runs("granite", "cpu.yaml").summary
    assert run.summary["setup"]["tensor_parallel_size"] == 2 and run.summary["setup"]["data_parallel_size"] == 1
    q = run.final[0]["tensor_parallel_parameters"]["model.layers.0.self_attn.q_proj.weight"]
    assert q["mesh"] == {"tp": 2} and q["local_shape"][0] * 2 == q["global_shape"][0]
    diffs = [abs(a["loss"] - b["loss"]) for a, b in zip(run.summary["losses"], reference["losses"], strict=True)]
    assert max(diffs) < 1e-5, diffs
    check_export_reproduces_model(run, load_tokenizer=ByT5Tokenizer.from_pretrained)
