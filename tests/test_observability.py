"""What a run lets you see: per-interval metrics, trackers (read back from their own files),
secrets kept out of them, and --compile against eager."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sqlite3
from types import SimpleNamespace

import pytest
import torch
from accelerate.utils import DistributedType

from train_extras.observe import metrics, tracking
from train_extras.observe.run_record import RunRecord
from train_extras.resume import checkpoint
from common.config import ConfigError
from conftest import DEBUG_ARGS, SYNTHETIC, Run, check_export_reproduces_model, launch, parse_train

# Secret-looking values in four options and two environment variables; none may reach a file of the
# run or its output.
SECRETS = {
    "run_name": "hf_RunNameSecretRunNameSecret42",
    "url_password": "pa55w0rd-in-url",
    "url_token": "querytoken1234567",
    "prompt_token": "ghp_PromptSecretPromptSecret0123456789",
    "path_token": "sk-PathSecretPathSecret0123456789",
    "env_hf_token": "hf_EnvironmentTokenEnvironment77",
    "env_wandb_key": "0123456789abcdef0123456789abcdef01234567",
}


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory, hf_home):
    out = tmp_path_factory.mktemp("tracked")
    trackio_dir = tmp_path_factory.mktemp("trackio")
    data = out / f"data-{SECRETS['path_token']}" / "corpus.jsonl"  # a data file in a folder named by a token
    data.parent.mkdir()
    shutil.copy(SYNTHETIC, data)
    args = DEBUG_ARGS + [
        "--max_steps", "20", "--eval_every", "10", "--save_every", "10", "--output_dir", str(out / "run"),
        "--report_to", "tensorboard", "wandb", "trackio",
        "--run_name", f"exp-{SECRETS['run_name']}", "--data_files", str(data),
        "--sample_prompt", f"key {SECRETS['prompt_token']}:",  # its samples print and record the prompt
        # unused without --dataset_name, so the run still trains on the embedded data
        "--dataset_config", f"https://user:{SECRETS['url_password']}@example.com/data?token={SECRETS['url_token']}",
    ]
    env = {"WANDB_MODE": "offline", "TRACKIO_DIR": str(trackio_dir),
           "HF_TOKEN": SECRETS["env_hf_token"], "WANDB_API_KEY": SECRETS["env_wandb_key"]}
    run = Run(out / "run", launch("train.py", args, hf_home, env=env))
    run.trackio_db = trackio_dir / "accelerate-recipes.db"
    run.args = args
    return run


def tensorboard_scalars(folder) -> dict:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}


def test_tensorboard_holds_loss_lr_throughput_and_mfu(tracked_run):
    scalars = tensorboard_scalars(tracked_run.output_dir / "accelerate-recipes")
    summary = tracked_run.summary
    for row in summary["losses"]:  # every step, the same numbers as run_summary.json
        assert scalars["train/loss"][row["step"]] == pytest.approx(row["loss"], rel=1e-6)
        assert scalars["train/lr"][row["step"]] == pytest.approx(row["lr"], rel=1e-6)
        assert scalars["train/grad_norm"][row["step"]] == pytest.approx(row["grad_norm"], rel=1e-6)
    for interval in summary["throughput"]:
        step = interval["step"]
        assert scalars["perf/tokens_per_s"][step] == pytest.approx(interval["tokens_per_s"], rel=1e-5)
        assert scalars["perf/mfu"][step] == pytest.approx(interval["mfu"], rel=1e-5)
        assert 0 < interval["mfu"] < 1
    assert set(scalars["eval/loss"]) == {0, 10, 20}


def test_trackio_database_holds_loss_lr_throughput_and_mfu(tracked_run):
    with sqlite3.connect(tracked_run.trackio_db) as db:
        rows = [(step, json.loads(blob)) for step, blob in db.execute("select step, metrics from metrics")]
        run_names = {name for (name,) in db.execute("select run_name from metrics")}
    logged = {}
    for step, values in rows:
        logged.setdefault(step, {}).update(values)
    summary = tracked_run.summary
    assert [logged[row["step"]]["train/loss"] for row in summary["losses"]] == \
        pytest.approx([row["loss"] for row in summary["losses"]], rel=1e-6)
    assert logged[10]["train/lr"] == pytest.approx(summary["losses"][9]["lr"])
    assert logged[10]["perf/tokens_per_s"] > 0 and 0 < logged[10]["perf/mfu"] < 1
    assert run_names == {"exp-[redacted]"}  # the name reached trackio, redacted


def test_no_file_of_the_run_holds_a_secret(tracked_run):
    """Every file the run wrote (trackers, checkpoints, the export, its records), and its output."""
    files = [p for p in tracked_run.output_dir.rglob("*") if p.is_file()]
    files += [p for p in tracked_run.trackio_db.parent.rglob("*") if p.is_file()]
    names = {p.name for p in files}
    assert "hparams.yml" in names and any(n.startswith("events.out.tfevents") for n in names)  # tensorboard
    assert any(n.endswith(".wandb") for n in names) and "debug.log" in names  # wandb, offline
    assert "accelerate-recipes.db" in names  # trackio
    assert {"checkpoint.json", "run_summary.json", "metrics.jsonl", "config.json"} <= names  # saved, exported
    wandb_run = next(p for p in files if p.name.endswith(".wandb")).read_bytes()
    assert b"train/loss" in wandb_run  # the reader below would see a logged value: the search is not blind
    for file in files:
        content = file.read_bytes()
        for what, secret in SECRETS.items():
            assert secret.encode() not in content, f"{what} found in {file}"
    for what, secret in SECRETS.items():
        assert secret not in tracked_run.proc.stdout + tracked_run.proc.stderr, f"{what} printed"
    hparams = (tracked_run.output_dir / "accelerate-recipes").rglob("hparams.yml")
    assert "dataset_config: https://user:[redacted]@example.com/data?token=[redacted]" in next(hparams).read_text()
    # what the record says instead, and the warning about the command line
    meta = json.loads((tracked_run.output_dir / "checkpoints" / "step_20" / "checkpoint.json").read_text())
    assert meta["config"]["run_name"] == "exp-[redacted]"
    assert meta["data"]["data_files"] == [str(tracked_run.output_dir.parent / "data-[redacted]" / "corpus.jsonl")]
    assert tracked_run.summary["samples"][0]["prompt"] == "key [redacted]:"
    assert "warning: --run_name, --data_files, --sample_prompt, --dataset_config on the command line holds a " \
           "secret-looking value" in tracked_run.proc.stderr


def test_a_run_whose_options_hold_secrets_resumes_as_the_same_run(tracked_run):
    """checkpoint.json keeps the options redacted; a resume compares this run's in the same form: not
    refused (its data files hold a token), and no option reported as changed."""
    meta = json.loads((tracked_run.output_dir / "checkpoints" / "step_20" / "checkpoint.json").read_text())
    cfg = parse_train(tracked_run.args + ["--resume_from_checkpoint", "auto"])
    accelerator = SimpleNamespace(distributed_type=DistributedType.NO, num_processes=1, parallelism_config=None)
    assert checkpoint.check_compatible(tracked_run.output_dir / "checkpoints" / "step_20", cfg, accelerator,
                                       meta) is meta
    assert checkpoint.resume_changes(meta, cfg) == {}
    # a checkpoint saved before options were redacted holds them as they were: the same run too
    data_files = [str(tracked_run.output_dir.parent / f"data-{SECRETS['path_token']}" / "corpus.jsonl")]
    legacy = {**meta, "config": dataclasses.asdict(cfg), "data": {**meta["data"], "data_files": data_files}}
    assert checkpoint.check_compatible(tracked_run.output_dir / "checkpoints" / "step_20", cfg, accelerator,
                                       legacy) is legacy
    other = parse_train(tracked_run.args[:-1] + ["https://user:x@example.com/other-data"])
    with pytest.raises(ConfigError, match="--dataset_config 'https://user:\\[redacted\\]@example.com/data"):
        checkpoint.check_compatible(tracked_run.output_dir / "checkpoints" / "step_20", other, accelerator, meta)


@pytest.mark.quick
def test_redaction_rules(monkeypatch):
    env = {"HF_TOKEN": "hf_abcdefghijklmnopqrstuvwx", "MY_DB_PASSWORD": "correct-horse", "PATH": "/usr/bin:/bin",
           "SHORT_TOKEN": "abc"}
    for name in [name for name in os.environ if tracking.SECRET_NAME.search(name)]:  # the environment is env alone
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    secrets = tracking.secret_env_values()
    assert secrets == ["hf_abcdefghijklmnopqrstuvwx", "correct-horse"]  # PATH is not a secret; "abc" too short
    config = {
        "api_key": "anything at all", "hub_token": None, "lr": 3e-3,
        "paths": ["/data/correct-horse/x.txt", "s3://bucket/key"],
        "nested": {"url": "https://me:hunter22@host/x?sig=XYZ&page=2", "note": "uses ghp_AbCdEfGhIjKlMnOpQrStUvWx"},
    }
    assert tracking.redact(config, secrets) == {
        "api_key": "[redacted]", "hub_token": None, "lr": 3e-3,
        "paths": ["/data/[redacted]/x.txt", "s3://bucket/key"],
        "nested": {"url": "https://me:[redacted]@host/x?sig=[redacted]&page=2", "note": "uses [redacted]"},
    }
    assert tracking.flatten({"a": {"b": 1, "c": None}, "d": [1, 2]}) == {"a/b": 1, "a/c": "None", "d": "[1, 2]"}
    holes = {  # each once reached a tracker unchanged
        "https://x.org/f?api_key=abc123def&page=1": "https://x.org/f?api_key=[redacted]&page=1",
        "s3://b/o?X-Amz-Signature=ab12cd&X-Amz-Credential=AKIDXY": "s3://b/o?X-Amz-Signature=[redacted]&X-Amz-Credential=[redacted]",
        "redis://:hunter22@cache:6379": "redis://:[redacted]@cache:6379",
        "Authorization: Bearer abcdefgh12345678": "Authorization: Bearer [redacted]",
        "key " + "ABCDEF0123456789ABCDEF0123456789ABCDEF01": "key [redacted]",
    }
    for raw, clean in holes.items():
        assert tracking.redact_text(raw, []) == clean
    from pathlib import Path

    assert tracking.redact({"credentials": {"user": "me", "pw": "x"}, "out": Path("/runs/correct-horse")}, secrets) == \
        {"credentials": "[redacted]", "out": "/runs/[redacted]"}
    # a tokenizer is not a token
    assert tracking.redact({"tokenizer_name_or_path": "gpt2"}, []) == {"tokenizer_name_or_path": "gpt2"}


# Each credential shape, as issued (made-up values of the real format), inside an option's text.
TOKENS = {
    "Hugging Face": "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",
    "OpenAI": "sk-proj-A1b2C3d4E5f6G7h8I9j0K1l2M3n4O5p6Q7r8S9t0",
    "OpenAI, older": "sk-Zx9Yw8Vu7Ts6Rq5Po4Nm3Lk2Jh1GfEdCbAz0Yx9Wv8Ut7",
    "Anthropic": "sk-ant-api03-AbCdEf_GhIjKl-MnOpQrStUvWxYz0123456789",
    "GitHub classic": "ghp_Ab1Cd2Ef3Gh4Ij5Kl6Mn7Op8Qr9St0Uv1Wx2",
    "GitHub OAuth": "gho_Ab1Cd2Ef3Gh4Ij5Kl6Mn7Op8Qr9St0Uv1Wx2",
    "GitHub fine-grained": "github_pat_11ABCDEFG0abcdefghijkl_MnOpQrStUvWxYz0123456789AbCdEfGhIjKlMnOpQrStUvWx",
    "Slack bot": "xoxb-1234567890-1234567890123-AbCdEfGhIjKlMnOpQrStUvWx",
    "Slack user": "xoxp-1234567890-1234567890-1234567890123-0123456789abcdef0123456789abcdef",
    "Slack app": "xapp-1-A0123BCDEFG-1234567890123-abcdef0123456789",
    "AWS access key id": "AKIAIOSFODNN7EXAMPLE",
    "wandb": "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b",
}
# Text of a token's length or alphabet that is not one, as it appears in options and in checkpoint.json.
NEAR_MISSES = [
    "hf_finetunedsummarizationmodel", "/data/hf_datasets_cache/train.jsonl", "mask-experiment-with-long-name-v2",
    "sk-learn-baseline-comparison", "task-AbCdEfGhIjKlMnOpQrStUv", "ghp_lowercaseonlywordsinaname",
    "outputs/run-2026-12-05/checkpoints/step_20", "the token embeddings", "max_tokens=512 design=3",
    "HuggingFaceTB/SmolLM2-135M", "/hub/models--gpt2/snapshots/607a30d783dfa663caf39e06633721c8d4cfcd7e/config.json",
    "a" * 64, "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b9f86d081884c7d659a2feaa0",  # sha256 digests
    "0f3c9a7d2b1e4f6a8c0d2e4f6a8b0c1d", "c0ffee1234567890",  # xxh3-128 and xxh3-64 digests
]


@pytest.mark.quick
@pytest.mark.parametrize("shape", TOKENS)
def test_every_token_shape_is_redacted_wherever_it_stands(shape):
    token = TOKENS[shape]
    for text in (token, f"exp-{token}", f"/runs/{token}/x.txt", f"key: {token}.", f"a={token}&b=1"):
        assert token not in tracking.redact_text(text, []), text
    assert tracking.redact_text(f"exp-{token} (v2)", []) == "exp-[redacted] (v2)"  # the token, no more
    assert tracking.redact({"run_name": f"exp-{token}"}, []) == {"run_name": "exp-[redacted]"}


@pytest.mark.quick
def test_words_paths_and_digests_of_a_tokens_shape_are_kept():
    for text in NEAR_MISSES:
        assert tracking.redact_text(text, []) == text
    # checkpoint.json as the save writes it: its checksums and a chat template's digest pass unchanged
    meta = {"step": 20, "tokens_seen": 10240, "checksum": "xxh3_128",
            "checksums": {"model.safetensors": "0f3c9a7d2b1e4f6a8c0d2e4f6a8b0c1d", "optimizer.bin": "1" * 32},
            "data": {"chat_template_sha256": "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b9f86d081884c7d659a2feaa0",
                     "train_blocks": 1234}, "metadata_checksum": "e3b0c44298fc1c149afbf4c8996fb924"}
    assert tracking.redact_strings(meta, []) == meta
    assert tracking.redact_strings({f"eval/{TOKENS['wandb']}/loss": 1.5, "tokens": [1, "hf_x"]}, []) == \
        {"eval/[redacted]/loss": 1.5, "tokens": [1, "hf_x"]}  # keys too; no value dropped for its key's name


@pytest.mark.quick
def test_a_secret_on_the_command_line_is_warned_about_by_option(capsys):
    argv = ["--preset", "debug", "--run_name", f"exp-{TOKENS['Hugging Face']}", "--data_files", "a.txt",
            f"/d/{TOKENS['wandb']}.txt", f"--sample_prompt={TOKENS['GitHub classic']}"]
    assert tracking.warn_command_line(argv, main_process=True) == ["--run_name", "--data_files", "--sample_prompt"]
    err = capsys.readouterr().err
    assert "warning: --run_name, --data_files, --sample_prompt on the command line holds" in err
    assert "pass secrets through the environment" in err and "[redacted]" not in err
    assert tracking.warn_command_line(["--run_name", "exp-1", "--preset", "debug"], main_process=True) == []
    assert tracking.warn_command_line(argv, main_process=False) and not capsys.readouterr().err  # rank 0 alone


@pytest.mark.quick
def test_printed_lines_are_redacted_whole(monkeypatch):
    """The recipe's stdout and stderr and the libraries' logging handlers on them."""
    import io
    import logging
    import sys

    out, err = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    handler = logging.StreamHandler()  # holds sys.stderr as it was: as transformers' handler does
    logging.getLogger("some.library").addHandler(handler)
    try:
        tracking.redact_printed_lines()
        print(f"resumed from /runs/{TOKENS['Hugging Face']}/checkpoints/step_20", flush=True)
        logging.getLogger("some.library").warning("loading %s", TOKENS["OpenAI"])
        sys.stderr.write(f"error: no file /d/{TOKENS['AWS access key id']}\n")
        seen = []  # a library that patches write to capture the console (wandb's) sees the redacted text
        patched = sys.stdout.write
        sys.stdout.write = lambda text: (seen.append(text), patched(text))[1]
        sys.stdout.write(TOKENS["GitHub classic"])
    finally:
        logging.getLogger("some.library").removeHandler(handler)
    assert out.getvalue() == "resumed from /runs/[redacted]/checkpoints/step_20\n[redacted]"
    assert seen == ["[redacted]"]
    assert err.getvalue() == "loading [redacted]\nerror: no file /d/[redacted]\n"


@pytest.mark.quick
def test_an_unknown_tracker_is_bad_input():
    with pytest.raises(ConfigError, match="unknown tracker 'mlflow'"):
        parse_train(["--report_to", "mlflow"])


def test_every_interval_records_throughput_mfu_memory_and_eta(train_run):
    summary = train_run.summary
    peak = summary["peak_flops_per_device"]
    assert peak["tflops"] > 0 and peak["source"].startswith("measured float32")
    steps = [row["step"] for row in summary["throughput"]]
    assert steps == [10, 20, 30, 40, 50, 60]
    for interval in summary["throughput"]:
        assert interval["tokens_per_s_per_device"] == interval["tokens_per_s"]  # one process
        assert interval["step_time_s"] == pytest.approx(8 * 64 / interval["tokens_per_s"])  # 8 x 64 tokens a step
        assert interval["mfu"] == pytest.approx(interval["model_tflops_per_device"] / peak["tflops"])
        assert interval["memory_per_rank"][0]["cpu_max_rss_bytes"] > 50e6
    assert summary["throughput"][-1]["eta_s"] == 0
    assert summary["throughput"][0]["eta_s"] > 0
    assert 0 < summary["mfu_median"] < 1
    model = summary["model"]  # MFU's figure, what it counts, and the one from the active weights (dense: equal)
    assert model["flops_counted"] == "6N + 2 softmax attention"
    assert model["flops_per_token_active"] == model["flops_per_token"]
    for interval in summary["throughput"]:
        assert interval["model_tflops_per_device"] == pytest.approx(
            interval["tokens_per_s_per_device"] * model["flops_per_token"] / 1e12)


@pytest.mark.quick
def test_interval_arithmetic():
    stats = metrics.interval_stats(steps=10, seconds=2.0, tokens_per_step=1000, world_size=2, flops_per_token=1e9,
                                   peak_tflops_per_device=10.0, steps_left=50, step_times=[0.3, 0.2, 0.25])
    assert stats["tokens_per_s"] == 5000 and stats["tokens_per_s_per_device"] == 2500
    assert stats["step_time_s"] == 0.2 and stats["model_tflops_per_device"] == 2.5
    assert stats["mfu"] == 0.25 and stats["eta_s"] == 50 * 0.25  # median step time


# Names as torch.cuda.get_device_name reports them, with the part and the dense bf16 / tf32 peaks.
GPU_NAMES = [
    ("NVIDIA A100-SXM4-40GB", "A100", 312.0, 156.0), ("NVIDIA A100-SXM4-80GB", "A100", 312.0, 156.0),
    ("NVIDIA A100-PCIE-40GB", "A100", 312.0, 156.0), ("NVIDIA A100 80GB PCIe", "A100", 312.0, 156.0),
    ("NVIDIA H100 80GB HBM3", "H100 SXM", 989.5, 494.5), ("NVIDIA H100 PCIe", "H100 PCIe", 756.5, 378.0),
    ("NVIDIA H100 NVL", "H100 NVL", 835.5, 417.5), ("NVIDIA H200", "H200 SXM", 989.5, 494.5),
    ("NVIDIA H200 NVL", "H200 NVL", 835.5, 417.5), ("NVIDIA B200", "B200", 2250.0, 1125.0),
    ("NVIDIA L40S", "L40S", 362.05, 183.0), ("NVIDIA L4", "L4", 121.0, 60.0), ("NVIDIA A10", "A10", 125.0, 62.5),
    ("AMD Instinct MI300X", "MI300X", 1307.4, 163.4), ("AMD Instinct MI300X VF", "MI300X", 1307.4, 163.4),
]


@pytest.mark.quick
@pytest.mark.parametrize("name, part, bf16, tf32", GPU_NAMES)
def test_the_mfu_peak_is_the_exact_parts(name, part, bf16, tf32):
    assert metrics.gpu_peak(name, "bf16") == (bf16, part)
    assert metrics.gpu_peak(name, "fp16") == (bf16, part)  # the same dense rate on every part listed
    assert metrics.gpu_peak(name, "no") == (tf32, part)  # fp32 runs: TF32 matmuls are on (NVIDIA)


@pytest.mark.quick
@pytest.mark.parametrize("name", ["NVIDIA A10G", "NVIDIA H100", "NVIDIA H800", "NVIDIA GeForce RTX 4090",
                                  "NVIDIA L40", "Tesla V100-SXM2-16GB", "AMD Instinct MI250X"])
def test_an_unknown_part_gets_no_mfu_and_says_why(name):
    tflops, why = metrics.gpu_peak(name, "bf16")
    assert tflops is None and name in why and "no datasheet peak" in why


@pytest.mark.quick
def test_measuring_the_cpu_ceiling_leaves_the_global_rng_alone():
    """It runs after set_seed and before the model is built: drawing from the global RNG would
    change every initial weight (it did once: the pinned first-step loss caught it)."""
    before = torch.get_rng_state()
    assert metrics.measure_matmul_tflops(torch.device("cpu"), torch.float32, size=128, seconds=0.01)[0] > 0
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.quick
def test_the_cpu_ceiling_shrinks_its_matmul_when_one_is_longer_than_a_burst_but_not_below_512():
    """fp16 on a CPU without fp16 units ran one 1024 matmul in 2.1 s (the start-up measurement took
    15 s): the size halves, from the best of three timings of a 256 matmul, until one fits in a
    burst, down to 512: a loaded CPU once shrank it to 128, whose rate is far below the ceiling, and
    the run reported MFU 242.9%."""
    tflops, size = metrics.measure_matmul_tflops(torch.device("cpu"), torch.float16, seconds=1e-6, bursts=1)
    assert size == metrics.MIN_MATMUL == 512 and tflops > 0


@pytest.mark.quick
def test_mfu_is_never_above_100_percent_a_peak_below_the_achieved_rate_is_dropped(tmp_path, capsys):
    stats = metrics.interval_stats(steps=10, seconds=1.0, tokens_per_step=1000, world_size=1, flops_per_token=1e9,
                                   peak_tflops_per_device=4.0, steps_left=0, step_times=[0.1])
    assert stats["model_tflops_per_device"] == 10.0 and stats["mfu"] is None  # 250% of that peak: unknown
    cfg = parse_train(["--max_steps", "2", "--warmup_steps", "0", "--log_every", "1", "--output_dir", str(tmp_path)])
    accelerator = SimpleNamespace(is_main_process=True, num_processes=1, process_index=0,
                                  device=torch.device("cpu"), log=lambda *args, **kwargs: None)
    peak = {"tflops": 1e-9, "source": "measured float32 128x128 matmul, 2 threads"}  # far below any real rate
    record = RunRecord(accelerator, cfg, {}, peak=peak, data={}, tokens_per_step=512, flops_per_token=1e6)
    with record.training(0):
        record.step(1, 1e-3, torch.tensor(2.0), torch.tensor(1.0), None)
        record.interval(1)
        record.step(2, 1e-3, torch.tensor(2.0), torch.tensor(1.0), None)
        record.interval(2)
    assert [t["mfu"] for t in record.summary["throughput"]] == [None, None]
    assert record.summary["peak_flops_per_device"]["exceeded"]["step"] == 1
    err = capsys.readouterr().err
    assert err.count("warning: step 1: ") == 1 and "MFU is unknown for this run" in err


def test_compile_gives_the_eager_losses(tmp_path, hf_home, train_run):
    """Regional torch.compile (inductor on CPU) against the eager train_run, same options. Fused kernels
    round differently, and the differences compound as the weights move apart: measured 2026-12-05
    (torch 2.13, transformers 5.25, AVX512), steps 1-17 within 4.8e-7, then growing to 1.6e-5 (step
    57; an earlier machine kept all 60 within 4.8e-7); the final held-out loss within 3.9e-8. So the
    first steps (the same function, before the drift) and the final eval are held tight, every step
    within 5e-5."""
    args = DEBUG_ARGS + ["--compile", "--output_dir", str(tmp_path / "run")]
    cache = tmp_path / "inductor_cache"
    compiled = Run(tmp_path / "run", launch("train.py", args, hf_home, env={"TORCHINDUCTOR_CACHE_DIR": str(cache)}))
    # accelerate's regional compilation: each of the debug preset's 2 decoder layers (and the rest apart)
    assert compiled.summary["model"]["compiled_regions"]["LlamaDecoderLayer"] == 2, compiled.summary["model"]
    assert any(p.suffix == ".py" for p in cache.rglob("*"))  # inductor generated kernels: it really compiled
    eager = {row["step"]: row["loss"] for row in train_run.summary["losses"]}
    assert len(compiled.summary["losses"]) == len(eager) == 60
    for row in compiled.summary["losses"]:
        assert abs(row["loss"] - eager[row["step"]]) <= (1e-6 if row["step"] <= 17 else 5e-5), row
    assert abs(compiled.summary["eval"][-1]["loss"] - train_run.summary["eval"][-1]["loss"]) <= 1e-6
    # compiled in place: the parameter names are the model's own, and the export loads as trained
    check_export_reproduces_model(compiled)


@pytest.mark.quick
def test_a_sample_from_a_compiled_model_runs_eagerly():
    """Under --compile the sample compiles nothing: generation changes its shapes with every token,
    and its recompiles cost minutes (train_extras/observe/sampling.py). Dynamo's own counter of the
    frames it captured stays where it was; the model's training forward does compile (the counter
    moves), so the counter can tell."""
    from accelerate import Accelerator
    from accelerate.utils import compile_regions_fsdp2
    from torch._dynamo.utils import counters

    from common.data import build_tokenizer
    from common.model import build_model
    from train_extras.observe.sampling import sample_text
    from train_extras.options import TrainConfig

    torch._dynamo.reset()
    accelerator = Accelerator(cpu=True)
    tokenizer = build_tokenizer(TrainConfig())
    torch.manual_seed(0)
    model = build_model(TrainConfig(preset="debug"), len(tokenizer))
    compile_regions_fsdp2(model, backend="eager")  # dynamo captures as under inductor, without its codegen
    before = counters["stats"]["calls_captured"]
    text = sample_text(accelerator, model, tokenizer, "\n", max_new_tokens=4, seed=0)
    assert counters["stats"]["calls_captured"] == before and isinstance(text, str)
    model(input_ids=torch.tensor([[5, 6, 7, 8]]))  # the compiled regions outside the sample: compiled
    assert counters["stats"]["calls_captured"] > before


@pytest.mark.quick
def test_a_sample_from_a_model_wider_than_its_tokenizer_draws_only_ids_it_can_decode():
    """An embedding wider than the tokenizer (padded, or made for another one): its untrained rows
    must not be drawn. A random debug model with 131,072 rows and the 259-id byte tokenizer drew them
    first (the top 200 of 131,072 random logits), and the byte tokenizer's decode then raised at the
    end of the run, before the export (found by scripts/gpu_check.py's 128k-vocabulary rows)."""
    from accelerate import Accelerator

    from common.data import build_tokenizer
    from common.model import build_model
    from train_extras.observe.sampling import sample_text
    from train_extras.options import TrainConfig

    tokenizer = build_tokenizer(TrainConfig())
    torch.manual_seed(0)
    model = build_model(TrainConfig(preset="debug"), 131072)
    text = sample_text(Accelerator(cpu=True), model, tokenizer, "\n", max_new_tokens=16, seed=0)
    assert text.startswith("\n") and len(text) > 1  # before: ValueError, bytes must be in range(0, 256)
