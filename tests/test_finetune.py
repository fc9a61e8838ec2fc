"""Your data, your pretrained model: train.py fine-tuning a local pretrained folder with the shipped
fine-tune config in bf16, its export and --eval_only on it; rank 0 preparing data for longer than
a collective may wait; a streamed run on two ranks and its resume. The in-process parts (documents
of a .txt, held-out splits, BOS, tokenising processes, option errors) are in test_data.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from common.config import parse
from synthetic import corpus_file, save_bos_tokenizer, synthetic_documents
from train_extras.options import TrainConfig
from conftest import DEBUG_ARGS, ROOT, Run, check_export_reproduces_model, launch, launch_two_processes

CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


@pytest.mark.quick
@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_every_shipped_config_loads(path):
    cfg = parse(TrainConfig, ["--config", str(path)], recipe="train.py")
    assert cfg.config == str(path) and cfg.output_dir.startswith("outputs/")


@pytest.mark.quick
def test_the_shipped_configs_are_a_pretraining_and_a_fine_tune():
    pretrain, finetune = (parse(TrainConfig, ["--config", str(ROOT / "configs" / name)], recipe="train.py")
                          for name in ("pretrain_shakespeare.yaml", "finetune.yaml"))
    assert pretrain.model_name_or_path is None and finetune.model_name_or_path == f"{pretrain.output_dir}/model"
    assert finetune.lr <= pretrain.lr / 10 and finetune.warmup_ratio is not None


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A tiny Llama folder with a tokenizer that has BOS and EOS of its own (random init, seed 0)."""
    folder = save_bos_tokenizer(tmp_path_factory.mktemp("pretrained"))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=320, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=176, max_position_embeddings=256,
                         bos_token_id=0, eos_token_id=1, pad_token_id=2, tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def line_files(tmp_path_factory):
    """One document per line, as many users' text comes: training and held-out files."""
    folder = tmp_path_factory.mktemp("lines")
    train, held_out = folder / "train.txt", folder / "held_out.txt"
    docs = synthetic_documents(440)  # each document ends with its newline
    train.write_text("".join(docs[:400]))
    held_out.write_text("".join(docs[400:]))  # more of the same language, unseen
    return train, held_out


def data_args(line_files) -> list[str]:
    return ["--data_files", str(line_files[0]), "--txt_documents", "line", "--eval_data_files", str(line_files[1]),
            "--seq_len", "64", "--micro_batch_size", "8"]


@pytest.fixture(scope="module")
def finetune_run(tmp_path_factory, hf_home, pretrained, line_files):
    """configs/finetune.yaml on the local folder in bf16 (single_gpu.yaml: bf16 autocast on this CPU),
    cut to 30 steps; it also saves a checkpoint at the end."""
    out = tmp_path_factory.mktemp("finetune")
    args = ["--config", str(ROOT / "configs" / "finetune.yaml"), "--model_name_or_path", str(pretrained),
            *data_args(line_files), "--max_steps", "30", "--eval_every", "15", "--log_every", "5",
            "--sample_length", "0", "--save_every", "30", "--output_dir", str(out)]
    return Run(out, launch("train.py", args, hf_home, config="single_gpu.yaml"))


def test_the_fine_tune_config_trains_the_pretrained_folder_on_lines(finetune_run, pretrained, line_files):
    setup = finetune_run.summary["setup"]
    assert setup["mixed_precision"] == "bf16"
    assert setup["documents"] == {"mode": "position_ids", "why": None}  # the probe under bf16 autocast too
    assert setup["options"]["lr"] == 4e-4 and setup["options"]["warmup_steps"] == 2  # 5% of 30 steps, from the file
    assert setup["options"]["model_name_or_path"] == str(pretrained)
    # every line is a document: [BOS] + its tokens + [EOS], packed into blocks of 65
    tokenizer = AutoTokenizer.from_pretrained(pretrained)
    lines = [line for line in line_files[0].read_text().splitlines() if line.strip()]
    assert len(lines) == 400
    tokens = sum(len(tokenizer(line, add_special_tokens=False).input_ids) + 2 for line in lines)
    assert finetune_run.summary["data"]["train_blocks"] == tokens // 65
    evals = [e["loss"] for e in finetune_run.summary["eval"]]
    assert len(evals) == 3 and evals[-1] < evals[0] - 0.05, evals


def test_a_bf16_run_exports_bf16_that_reloads_with_its_logits(finetune_run):
    folder = Path(finetune_run.summary["export"])
    with safe_open(folder / "model.safetensors", "pt") as f:
        dtypes = {f.get_slice(name).get_dtype() for name in f.keys()}
    assert dtypes == {"BF16"}, dtypes  # half the size of the fp32 masters it was trained with
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
    # bf16 parameters whose logits are the trained fp32 masters' within 5% of the largest (measured: 0.37%)
    check_export_reproduces_model(finetune_run)


@pytest.fixture(scope="module")
def eval_only_export(tmp_path_factory, hf_home, finetune_run, line_files):
    out = tmp_path_factory.mktemp("eval_only_export")
    args = ["--eval_only", "--model_name_or_path", finetune_run.summary["export"], *data_args(line_files),
            "--output_dir", str(out)]
    return out, launch("train.py", args, hf_home)


def test_eval_only_evaluates_an_exported_model_and_writes_nothing_else(eval_only_export, finetune_run):
    out, proc = eval_only_export
    record = json.loads((out / "eval_summary.json").read_text())
    assert record["setup"]["mixed_precision"] == "no" and len(record["eval"]) == 1 and not record["losses"]
    loss = record["eval"][0]["loss"]
    assert f"held-out loss {loss:.4f}  perplexity {record['eval'][0]['perplexity']:.2f}" in proc.stdout
    # the bf16 weights in fp32 compute, against the bf16-autocast eval of the fp32 masters (measured 7e-5)
    assert abs(loss - finetune_run.summary["eval"][-1]["loss"]) < 1e-3
    assert sorted(p.name for p in out.iterdir()) == ["eval_summary.json"]


def test_eval_only_evaluates_a_checkpoint_exactly_and_leaves_the_run_alone(tmp_path, hf_home, finetune_run, pretrained,
                                                                         line_files):
    run_dir = finetune_run.output_dir
    before = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")}
    args = ["--eval_only", "--resume_from_checkpoint", str(run_dir / "checkpoints" / "step_30"),
            "--model_name_or_path", str(pretrained), *data_args(line_files), "--output_dir", str(run_dir)]
    proc = launch("train.py", args, hf_home, config="single_gpu.yaml")
    record = json.loads((run_dir / "eval_summary.json").read_text())
    # the same weights, precision and held-out batches as the run's own last eval: the same loss
    assert record["eval"] == [finetune_run.summary["eval"][-1]]
    assert record["resumed_from"]["step"] == 30 and "eval only: " in proc.stdout
    after = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.name != "eval_summary.json"}
    assert after == before  # the run's record, checkpoints and export untouched


SLOW_DATA_ARGS = DEBUG_ARGS + ["--max_steps", "20", "--eval_every", "10", "--collective_timeout", "6"]


def test_rank_0_preparing_data_longer_than_a_collective_may_wait_still_trains(tmp_path, hf_home):
    """Rank 0's data preparation sleeps 12 s; collectives time out after 6 s. The other rank waits
    in the data barrier (--data_timeout) instead, and the run trains."""
    out = tmp_path / "run"
    proc = launch_two_processes("train.py", "ddp.yaml", SLOW_DATA_ARGS + ["--output_dir", str(out)], hf_home,
                                env={"ACCELERATE_RECIPES_SLOW_DATA": "12"})
    run = Run(out, proc)
    assert run.summary["setup"]["world_size"] == 2 and run.summary["setup"]["options"]["collective_timeout"] == 6
    assert [row["step"] for row in run.summary["losses"]] == list(range(1, 21))


def test_the_data_wait_is_bounded_by_data_timeout(tmp_path, hf_home):
    out = tmp_path / "run"
    proc = launch_two_processes("train.py", "ddp.yaml", SLOW_DATA_ARGS + ["--data_timeout", "3", "--output_dir",
                                                                          str(out)],
                                hf_home, check=False, env={"ACCELERATE_RECIPES_SLOW_DATA": "12"})
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    expected = "rank 1 waited in vain for rank 0 to prepare the data (failed, or longer than --data_timeout 3 s)"
    assert lines and expected in lines[0], lines
    assert not (out / "run_summary.json").exists()


STREAM_ARGS = ["--preset", "debug", "--seq_len", "64", "--micro_batch_size", "8", "--streaming",
               "--data_files", corpus_file(600), "--max_steps", "20", "--warmup_steps", "2", "--eval_every", "10",
               "--log_every", "5", "--sample_length", "0", "--save_every", "10"]


@pytest.fixture(scope="module")
def stream_args(tmp_path_factory) -> list[str]:
    held_out = tmp_path_factory.mktemp("stream_held_out") / "held_out.jsonl"
    held_out.write_text("".join(json.dumps({"text": d}) + "\n" for d in synthetic_documents(660)[600:]))
    return STREAM_ARGS + ["--eval_data_files", str(held_out)]


@pytest.fixture(scope="module")
def streamed_run(tmp_path_factory, hf_home, stream_args):
    out = tmp_path_factory.mktemp("streamed")
    return Run(out, launch_two_processes("train.py", "ddp.yaml", stream_args + ["--output_dir", str(out)], hf_home))


def test_a_streamed_run_trains_each_rank_on_its_own_documents(streamed_run):
    summary = streamed_run.summary
    assert summary["setup"]["world_size"] == 2 and summary["data"]["train_blocks"] is None
    rows = [[crc for batch in rank for crc in batch] for rank in streamed_run.probed("stream_rows")]
    assert [len(r) for r in rows] == [20 * 8, 20 * 8]  # 20 micro-batches of 8 blocks each, read once
    assert not set(rows[0]) & set(rows[1])  # no block on both ranks (each rank reads every other document)
    evals = [e["loss"] for e in summary["eval"]]
    assert evals[-1] < evals[0] - 1.0, evals


def test_a_streamed_run_resumes_exactly_by_reading_up_to_its_place(tmp_path, hf_home, streamed_run, stream_args):
    """Resumed with 2 DataLoader workers per rank tokenising the stream (the run had none): the same blocks."""
    out = tmp_path / "resumed"
    args = stream_args + ["--resume_from_checkpoint", str(streamed_run.output_dir / "checkpoints" / "step_10"),
                          "--num_workers", "2", "--output_dir", str(out)]
    resumed = Run(out, launch_two_processes("train.py", "ddp.yaml", args, hf_home))
    full = {row["step"]: row["loss"] for row in streamed_run.summary["losses"]}
    assert {row["step"]: row["loss"] for row in resumed.summary["losses"]} == {s: full[s] for s in range(11, 21)}
    # each rank read its stream again from the start: the same blocks in the same order, the first 10
    # micro-batches skipped, the next 10 trained
    assert resumed.probed("stream_rows") == streamed_run.probed("stream_rows")


def test_a_streamed_checkpoint_resumes_only_as_it_was(streamed_run, stream_args):
    """Other ranks or micro-batch, or other data, would skip to another place: refused before any work.
    Evaluating its weights (--eval_only) needs neither."""
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from common.config import ConfigError
    from train_extras.resume.checkpoint import check_compatible, verify

    step_10 = str(streamed_run.output_dir / "checkpoints" / "step_10")
    ranks = {n: SimpleNamespace(distributed_type=DistributedType.MULTI_CPU, num_processes=n) for n in (1, 2)}
    resume = parse(TrainConfig, stream_args + ["--resume_from_checkpoint", step_10], recipe="train.py")
    meta = verify(step_10, contents=False)
    assert check_compatible(step_10, resume, ranks[2], meta)["step"] == 10  # as it was
    with pytest.raises(ConfigError, match="a streamed run resumes only as it was"):
        check_compatible(step_10, resume, ranks[1], meta)
    other_seed = parse(TrainConfig, stream_args + ["--resume_from_checkpoint", step_10, "--seed", "7"],
                       recipe="train.py")
    with pytest.raises(ConfigError, match="streamed other data: --seed differ"):
        check_compatible(step_10, other_seed, ranks[2], meta)
    evaluate = parse(TrainConfig, stream_args + ["--resume_from_checkpoint", step_10, "--eval_only",
                                                 "--micro_batch_size", "4"], recipe="train.py")
    assert check_compatible(step_10, evaluate, ranks[1], meta)["step"] == 10


def test_eval_only_with_no_checkpoint_to_find_is_one_line(tmp_path, hf_home):
    proc = launch("train.py", DEBUG_ARGS + ["--eval_only", "--resume_from_checkpoint", "auto", "--output_dir",
                                            str(tmp_path / "empty")], hf_home, check=False)
    assert proc.returncode != 0
    assert f"error: --eval_only: no complete checkpoint in {tmp_path / 'empty'}/checkpoints to evaluate" in proc.stderr


@pytest.mark.quick
def test_the_model_is_built_in_fp32_except_under_a_16_bit_deepspeed_engine():
    """fp32 master weights wherever autocast computes over them; DeepSpeed's bf16/fp16 engine casts
    the module itself (and keeps fp32 copies in its optimizer), so it loads in that dtype."""
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from train_extras.parallel.deepspeed_settings import weights_dtype

    for kind in (DistributedType.NO, DistributedType.MULTI_GPU, DistributedType.FSDP, DistributedType.DEEPSPEED):
        for precision, deepspeed_dtype in (("no", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
            expected = deepspeed_dtype if kind == DistributedType.DEEPSPEED else torch.float32
            accelerator = SimpleNamespace(distributed_type=kind, mixed_precision=precision)
            assert weights_dtype(accelerator) == expected, (kind, precision)
