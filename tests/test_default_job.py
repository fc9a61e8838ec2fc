"""The quickstart's job: `accelerate launch recipes/train.py` with no config file trains on tiny
Shakespeare with every core the process may use, and ends with its held-out loss and a sample.

The full default job (720 steps, 3.5 minutes) is measured for the README, not run here: this
launches the same command cut to 200 steps, and checks the parts that need no launch in-process."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common import data
from train_extras.parallel import cpu_threads
from train_extras.options import TrainConfig
from conftest import ACCELERATE, ROOT, Run, launch_env


@pytest.fixture(scope="session")
def quickstart_run(tmp_path_factory, hf_home):
    """The README's first command, without a config file (accelerate's defaults), cut short."""
    out = tmp_path_factory.mktemp("quickstart")
    env = launch_env(hf_home)
    env.pop("OMP_NUM_THREADS", None)  # as on a fresh machine
    cmd = [ACCELERATE, "launch", str(ROOT / "recipes" / "train.py"), "--max_steps", "200", "--eval_every", "200",
           "--sample_length", "40", "--output_dir", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return Run(out, proc)


def test_the_default_job_trains_on_tiny_shakespeare(quickstart_run):
    summary = quickstart_run.summary
    assert summary["setup"]["options"]["data_files"] is None and summary["setup"]["options"]["dataset_name"] is None
    assert summary["setup"]["options"]["preset"] == "mini"
    # the first 90% of 1,115,394 characters, + EOS, in blocks of 257: nanoGPT's split
    assert summary["data"]["train_blocks"] == (1_003_854 + 1) // 257
    assert summary["data"]["eval_blocks"] == (111_540 + 1) // 257


def test_the_default_job_uses_every_core(quickstart_run):
    """accelerate starts the process with OMP_NUM_THREADS=1; the recipe takes the cores it may use."""
    assert quickstart_run.summary["setup"]["cpu_threads"] == len(os.sched_getaffinity(0))


def test_the_default_job_learns_more_than_bigrams(quickstart_run):
    """200 of the 720 steps already bring the held-out loss below the bigram entropy of the held-out
    text (the best any model that sees only the previous character could do)."""
    summary = quickstart_run.summary
    assert summary["eval"][-1]["step"] == 200
    assert summary["eval"][-1]["loss"] < summary["data"]["eval_bigram_entropy"] - 0.1, (
        summary["eval"], summary["data"])


def test_the_default_job_ends_with_its_loss_and_a_sample(quickstart_run):
    out = quickstart_run.proc.stdout
    sample = quickstart_run.summary["samples"][-1]
    assert sample["step"] == 200 and sample["prompt"] == "\n"
    assert f"step 200: sample (40 tokens from '\\n'):\n{sample['text']}\n" in out
    # no DeepSpeed in a job that does not use it: its import printed "[WARNING] ... Setting accelerator
    # to CPU" before the sample. (transformers' save_pretrained still imports it at the export, through
    # accelerate's extract_model_from_parallel whenever deepspeed is installed: not ours to change.)
    assert "Setting accelerator to CPU" not in out[:out.index("step 200: sample")]
    text = sample["text"]  # characters of the text it learned: letters, spaces, newlines, punctuation
    assert len(text) >= 20 and sum(c.isascii() and (c.isprintable() or c == "\n") for c in text) >= 0.9 * len(text)
    assert out.rstrip().splitlines()[-1].startswith("done: 200 steps, final eval loss ")


def test_a_thread_count_the_user_chose_stands(monkeypatch):
    """The launcher's command line or environment tells a chosen thread count from accelerate's default."""
    clean = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    for args, env, chosen in [([], {}, False), (["--num_cpu_threads_per_process", "1"], {}, True),
                              ([], {"OMP_NUM_THREADS": "1"}, True)]:
        # a stand-in launcher process, whose /proc entries the check reads
        launcher = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", *args], env={**clean, **env})
        monkeypatch.setattr(os, "getppid", lambda pid=launcher.pid: pid)
        for _ in range(100):  # until /proc shows the started program (not yet, on a busy machine)
            if b"time.sleep" in Path(f"/proc/{launcher.pid}/cmdline").read_bytes():
                break
            time.sleep(0.05)
        try:
            assert cpu_threads.launcher_set_threads() is chosen, (args, env)
        finally:
            launcher.kill()
            launcher.wait()


@pytest.mark.quick
def test_an_offloaded_optimizer_on_a_gpu_node_gets_its_share_of_the_cores(monkeypatch):
    """torchrun and accelerate start GPU ranks with OMP_NUM_THREADS=1; DeepSpeedCPUAdam or FSDP2
    offload's AdamW would step on one core. Each rank gets the cores it may use over the local ranks."""
    import torch
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    threads = []
    monkeypatch.setattr(torch, "set_num_threads", threads.append)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on a GPU node
    monkeypatch.setattr(cpu_threads, "launcher_set_threads", lambda: False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)), raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    monkeypatch.delenv("SLURM_CPUS_PER_TASK", raising=False)
    assert cpu_threads.for_offloaded_optimizer(True) == 8 and threads == [8]
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "32")  # the job's share of the machine
    assert cpu_threads.for_offloaded_optimizer(True) == 4
    assert cpu_threads.for_offloaded_optimizer(False) is None  # the GPU steps: nothing to do
    monkeypatch.setattr(cpu_threads, "launcher_set_threads", lambda: True)  # the user's count stands
    assert cpu_threads.for_offloaded_optimizer(True) is None and threads == [8, 4]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU run: use_available_cores' part
    assert cpu_threads.for_offloaded_optimizer(True) is None

    def launched(kind, zero=None, fsdp_offload="false"):
        monkeypatch.setenv("FSDP_OFFLOAD_PARAMS", fsdp_offload)
        config = {"zero_optimization": zero or {}}
        return SimpleNamespace(distributed_type=kind,
                               state=SimpleNamespace(deepspeed_plugin=SimpleNamespace(deepspeed_config=config)))
    assert cpu_threads.offloads_optimizer(launched(DistributedType.DEEPSPEED, {"offload_optimizer": {"device": "cpu"}}))
    assert not cpu_threads.offloads_optimizer(launched(DistributedType.DEEPSPEED, {"stage": 3}))
    assert cpu_threads.offloads_optimizer(launched(DistributedType.FSDP, fsdp_offload="true"))
    assert not cpu_threads.offloads_optimizer(launched(DistributedType.FSDP))
    assert not cpu_threads.offloads_optimizer(launched(DistributedType.MULTI_GPU, fsdp_offload="true"))


@pytest.mark.quick
def test_shakespeare_is_kept_as_it_is():
    """Blank lines between speeches survive (a model learns to write them); the held-out part is
    the last 10% of the characters; the file is the one the provenance names."""
    train, held_out = data.shakespeare_split()
    text = data.SHAKESPEARE.read_text()
    assert train + held_out == text and len(held_out) == len(text) - int(len(text) * 0.9)
    assert "\n\nROMEO:\n" in train
    assert TrainConfig().data_files is None and TrainConfig().dataset_name is None
    assert TrainConfig().eval_fraction is None
