"""Shared fixtures: each (recipe, config) is launched once per session with `accelerate launch`
(~14 s of start-up each), and many tests read the one run_summary.json it writes."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import torch
import yaml
from accelerate.utils import set_seed
from transformers import AutoModelForCausalLM, AutoTokenizer

from common.config import parse
from common.data import build_tokenizer
from common.files import write_json
from common.model import build_model
from synthetic import corpus_file
from train_extras.options import TrainConfig
import warm_launch

ROOT = Path(__file__).resolve().parents[1]
ACCELERATE = str(Path(sys.executable).with_name("accelerate"))

# The toy language of tests/synthetic.py, as a data file (2000 documents unless a test says otherwise).
SYNTHETIC = corpus_file(2000)
# The debug preset, small enough that a launched run takes seconds on 2 CPU cores. The options
# every recipe has; train.py's own (e.g. --sample_length) are added where a test launches it.
CORE_DEBUG_ARGS = ["--preset", "debug", "--seq_len", "64", "--micro_batch_size", "8", "--data_files", SYNTHETIC,
                   "--max_steps", "60", "--warmup_steps", "6", "--eval_every", "30", "--log_every", "10"]
DEBUG_ARGS = CORE_DEBUG_ARGS + ["--sample_length", "8"]  # train.py


@pytest.fixture(scope="session")
def hf_home(tmp_path_factory):
    """One Hugging Face home for the session: datasets' cache is shared between launches, and
    nothing in the user's own cache is read or written."""
    return tmp_path_factory.mktemp("hf_home")


PROBES = ROOT / "tests" / "probes"  # the test-only probes: a sitecustomize every launched process loads


def launch_env(hf_home: Path) -> dict:
    env = dict(os.environ)
    env.update(
        HF_HOME=str(hf_home),
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
        PYTHONFAULTHANDLER="1",  # a hung launch's processes print their stacks (run_showing_stacks_on_timeout)
        # The warm processes fork each run after importing pyarrow, whose jemalloc starts a background
        # thread: a lock it holds at a fork stays held in the child (jemalloc issues 1805, 2019, 2402: rare
        # deadlocks after fork). Off, the warm processes fork from one thread of jemalloc's fewer.
        JE_ARROW_MALLOC_CONF="background_thread:false",
        # The checkout under test first (not whatever copy of the package is installed), then the probes.
        PYTHONPATH=os.pathsep.join([str(ROOT), str(PROBES)]),
        ACCELERATE_RECIPES_CPUINFO_CACHE=str(hf_home / "cpuinfo.json"),  # see tests/probes/sitecustomize.py
    )
    return env


def probe_dir(output_dir: Path) -> Path:
    """Where the probes of a run with this --output_dir write (beside it, not inside the run's folder)."""
    return output_dir.with_name(output_dir.name + ".probe")


# How each config runs as 2 CPU processes over gloo (docs/toolchain.md#multi-process-cpu-runs): DDP
# through accelerate's own MULTI_CPU path; FSDP2 and DeepSpeed through the CPU harness (which the
# probes' sitecustomize chains). fp32, because parity is checked at fp32 tolerances (and bf16 is
# slow on CPUs without bf16 units: docs/toolchain.md#bf16-and-fp16-on-cpu).
_HARNESS_ENV = {"ACCELERATE_RECIPES_CPU_HARNESS": "1"}
TWO_CPU_PROCESSES = {
    "ddp.yaml": {"ACCELERATE_USE_CPU": "true"},
    **{config: _HARNESS_ENV for config in (
        "fsdp.yaml", "fsdp_shard_grad_op.yaml", "fsdp_offload.yaml",
        "deepspeed_zero1.yaml", "deepspeed_zero2.yaml", "deepspeed_zero3.yaml", "deepspeed_zero3_offload.yaml")},
}
TWO_PROCESS_LAUNCH = ["--num_processes", "2", "--num_cpu_threads_per_process", "1", "--mixed_precision", "no"]


def deepspeed_json_in(config: str, precision: str) -> Path:
    """The DeepSpeed JSON of `config` with `precision` ("no", "bf16", "fp16") set in it. A DeepSpeed
    run's precision is the JSON's (accelerate_configs/*.json enable bf16; --mixed_precision cannot
    override an explicit value), so a test launch that asks for fp32 (parity at fp32 tolerances;
    bf16 is ~10x slower on this CPU) gets a JSON that says so. test_documented_commands.py runs the
    configs as written."""
    ds_file = yaml.safe_load((ROOT / "accelerate_configs" / config).read_text())["deepspeed_config"]
    ds_config = json.loads((ROOT / ds_file["deepspeed_config_file"]).read_text())
    ds_config.update(bf16={"enabled": precision == "bf16"}, fp16={"enabled": precision == "fp16"})
    out = Path(tempfile.gettempdir()) / "accelerate-recipes-tests" / f"{Path(config).stem}.{precision}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json(out, ds_config)
    return out


def launch_command(recipe: str, args: list[str], hf_home: Path, config: str = "cpu.yaml",
                   launch_args: list[str] | None = None, env: dict | None = None,
                   recipe_path: Path | None = None) -> tuple[list[str], dict]:
    """The `accelerate launch` command line and environment of a recipe run."""
    launch_args = launch_args if launch_args is not None else ["--num_cpu_threads_per_process", "2"]
    if config.startswith("deepspeed") and "--mixed_precision" in launch_args:  # the JSON decides: say it there
        precision = launch_args[launch_args.index("--mixed_precision") + 1]
        launch_args = [*launch_args, "--deepspeed_config_file", str(deepspeed_json_in(config, precision))]
    REACHED_RECIPES.add(Path(recipe_path or ROOT / "recipes" / recipe))
    cmd = [ACCELERATE, "launch", "--config_file", str(ROOT / "accelerate_configs" / config), *launch_args,
           str(recipe_path or ROOT / "recipes" / recipe), *args]
    full_env = launch_env(hf_home)
    if recipe_path is not None and ROOT not in Path(recipe_path).resolve().parents:
        full_env["PYTHONPATH"] = str(PROBES)  # a recipe copied out of the repository imports its own copies
    if "--output_dir" in args:
        full_env["ACCELERATE_RECIPES_PROBE_DIR"] = str(probe_dir(Path(args[args.index("--output_dir") + 1])))
    return cmd, {**full_env, **(env or {})}


# The warm processes of tests/warm_launch.py: 1-process runs' by Zygote.key, workers' by worker_key
_zygotes: dict[tuple, warm_launch.Zygote] = {}
_worker_zygotes: dict[tuple, warm_launch.WorkerZygote] = {}
MAX_ZYGOTES = 3  # each holds ~0.4 GB


_served_by_closed: list[list[str]] = []  # the workers the closed workers' zygotes forked


@pytest.fixture(scope="session", autouse=True)
def _close_zygotes():
    yield
    for pool in (_zygotes, _worker_zygotes):
        while pool:
            _close(pool.pop(next(iter(pool))))


def _close(zygote) -> None:
    if isinstance(zygote, warm_launch.WorkerZygote):
        _served_by_closed.extend(zygote.served())
    zygote.close()


def served_workers() -> list[list[str]]:
    """The command line of every worker forked warm this session (tests/warm_launch.py)."""
    return [*_served_by_closed, *(argv for zygote in _worker_zygotes.values() for argv in zygote.served())]


def _warm(pool: dict, key: tuple, start):
    """The pool's zygote for `key`, started if needed; the most recently used last, so a run with an
    environment of its own evicts another one-off, not the session's main one."""
    if key in pool:
        pool[key] = pool.pop(key)
    else:
        if len(pool) >= MAX_ZYGOTES:
            _close(pool.pop(next(iter(pool))))
        pool[key] = start()
    return pool[key]


def warm_workers_env(full_env: dict) -> dict:
    """`full_env` plus what makes torchrun fork the launch's workers from a warm process
    (tests/warm_launch.py): for a several-process launch run by `accelerate launch` for real."""
    zygote = _warm(_worker_zygotes, warm_launch.worker_key(full_env), lambda: warm_launch.WorkerZygote(full_env))
    return {**full_env, **zygote.launch_env()}


def warm_or_cold(cmd: list[str], full_env: dict, cwd: Path, timeout: int, warm: bool = True):
    """A 1-process launch forked from the warm process (same worker command and environment as
    `accelerate launch` gives, ~8 s less start-up: tests/warm_launch.py); several processes through
    the launcher with warm workers; with warm=False, or OMP_NUM_THREADS=1 on one process, the
    launcher and fresh interpreters."""
    worker = warm_launch.simple_launch(cmd[2:], full_env) if warm else None
    key = warm_launch.Zygote.key(worker[1]) if worker is not None else None
    if key is not None:
        try:
            return _warm(_zygotes, key, lambda: warm_launch.Zygote(worker[1])).run(*worker, cwd, timeout)
        except subprocess.TimeoutExpired as hang:
            raise AssertionError(f"{' '.join(cmd)} still running after {timeout} s (a hang): its output's end, "
                                 f"then its stack\n{hang.output[-3000:]}\n{_stacks(hang.stderr)}") from None
    if warm and worker is None:
        full_env = warm_workers_env(full_env)
    return run_showing_stacks_on_timeout(cmd, full_env, cwd, timeout)


def _stacks(stderr: str) -> str:
    """faulthandler's dumps in a hung run's stderr, without the list of extension modules each ends with."""
    return "\n".join(line for line in stderr.splitlines() if not line.startswith("Extension modules:"))[-20000:]


def run_showing_stacks_on_timeout(cmd: list[str], env: dict, cwd: Path, timeout: int) -> subprocess.CompletedProcess:
    """subprocess.run; a run still going after `timeout` s is a hang: every process it started
    prints its Python stack (faulthandler, enabled by launch_env, on SIGABRT; a warm worker's
    stand-in forwards it) before all are killed, and the test fails with where each one waited."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for child in psutil.Process(proc.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                child.send_signal(signal.SIGABRT)
        time.sleep(10)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"{' '.join(cmd)} still running after {timeout} s (a hang): its output's end, then "
                             f"each process's stack\n{out[-3000:]}\n{_stacks(err)}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def launch(recipe: str, args: list[str], hf_home: Path, config: str = "cpu.yaml", check: bool = True,
           timeout: int = 900, launch_args: list[str] | None = None, env: dict | None = None,
           recipe_path: Path | None = None, cwd: Path = ROOT, warm: bool = True) -> subprocess.CompletedProcess:
    """`accelerate launch` of a recipe; with `warm` (default) a 1-process launch runs forked from the
    warm process (tests/warm_launch.py), warm=False keeps the real launcher."""
    cmd, full_env = launch_command(recipe, args, hf_home, config, launch_args, env, recipe_path)
    proc = warm_or_cold(cmd, full_env, cwd, timeout, warm)
    if check and proc.returncode != 0:
        # The launcher's own traceback comes last; the workers' errors are earlier in stderr.
        worker_lines = [line for line in proc.stderr.splitlines() if "Error" in line or "error" in line]
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                             + "\n".join(worker_lines[:40]) + "\n" + proc.stderr[-4000:])
    return proc


def load_recipe(name: str):
    """A recipe file as a module (its main() and Options), in this process."""
    REACHED_RECIPES.add(ROOT / "recipes" / f"{name}.py")  # reached in this process (the quick tier's check)
    spec = importlib.util.spec_from_file_location(f"recipe_{name}", ROOT / "recipes" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def parse_train(argv: list[str]) -> TrainConfig:
    """train.py's option parsing, in-process."""
    return parse(TrainConfig, argv, recipe="train.py")


def read_summary(output_dir: Path) -> dict:
    return json.loads((output_dir / "run_summary.json").read_text())


def read_probes(output_dir: Path) -> list[list[dict]]:
    """Per rank, the JSON lines the probes of tests/probes/sitecustomize.py wrote, in order."""
    files = sorted(probe_dir(output_dir).glob("rank*.jsonl"), key=lambda p: int(p.stem[4:]))
    return [[json.loads(line) for line in f.read_text().splitlines()] for f in files]


class Run:
    """A finished launch: its run_summary.json (what a user keeps) and the probes' record (what
    only the tests read: sample ids, sharding facts, export logits, memory points)."""

    def __init__(self, output_dir: Path, proc: subprocess.CompletedProcess):
        self.output_dir = output_dir
        self.proc = proc
        self.summary = read_summary(output_dir)
        self.probes = read_probes(output_dir)

    def probed(self, key: str) -> list[list]:
        """Per rank, every value recorded under `key`."""
        return [[row[key] for row in rows if key in row] for rows in self.probes]

    @property
    def final(self) -> list[dict]:
        """Per rank, the facts recorded at end_training (strategy, sharding, export logits...)."""
        return [values[-1] for values in self.probed("final")]

    @property
    def parameters_per_rank(self) -> list[dict]:
        """Per rank: local and global parameter elements, and how sharded tensors are placed."""
        return [facts["parameters"] for facts in self.final]

    @property
    def strategy(self) -> dict:
        """What the prepared model and optimizer really are (rank 0): engine, ZeRO stage, FSDP2 policies."""
        return self.final[0]["strategy"]

    @property
    def batches(self) -> list[list[list[int]]]:
        """Per rank, the sample ids of every training micro-batch, in order."""
        return self.probed("batch")

    @property
    def memory_points(self) -> list[dict]:
        """Per rank: {point: memory in use}, points before_model, after_backward, after_step."""
        return [{k: v for row in values for k, v in row.items()} for values in self.probed("memory")]


# train.py also saves a checkpoint half-way, which the resume tests start from.
TRAIN_ARGS = DEBUG_ARGS + ["--save_every", "30"]


@pytest.fixture(scope="session")
def train_run(tmp_path_factory, hf_home):
    out = tmp_path_factory.mktemp("train_debug")
    return Run(out, launch("train.py", TRAIN_ARGS + ["--output_dir", str(out)], hf_home))


@pytest.fixture(scope="session")
def train_run_unmasked(tmp_path_factory, hf_home):
    """train.py without document masks (--document_mask false): the 1-process reference of the
    focused recipes, which pack documents without masks (docs/data.md#document-masks)."""
    out = tmp_path_factory.mktemp("train_debug_unmasked")
    args = CORE_DEBUG_ARGS + ["--sample_length", "0", "--save_model", "false", "--document_mask", "false"]
    return Run(out, launch("train.py", args + ["--output_dir", str(out)], hf_home))


def reference_run(recipe: str, train_run: Run, train_run_unmasked: Run) -> Run:
    """The 1-process run a recipe's losses must equal: train.py's own (document masks on), or for a
    focused recipe, which packs without masks, train.py's with --document_mask false."""
    return train_run if recipe == "train.py" else train_run_unmasked


@pytest.fixture(scope="session")
def train_run_again(tmp_path_factory, hf_home, train_run):
    """The same command again (after train_run, so it also shows the tokenised cache is reused),
    through the real launcher: train_run, like every 1-process run, is forked from the warm process
    (tests/warm_launch.py), so the two runs also show that both ways train the same."""
    out = tmp_path_factory.mktemp("train_debug_again")
    return Run(out, launch("train.py", TRAIN_ARGS + ["--output_dir", str(out)], hf_home, warm=False))


@pytest.fixture(scope="session")
def baseline_run(tmp_path_factory, hf_home):
    """The bf16 baseline with the single-GPU config; on a CPU machine accelerate runs it with bf16
    autocast on the CPU (~10x slower than fp32 there, hence fewer steps)."""
    out = tmp_path_factory.mktemp("baseline_bf16")
    args = CORE_DEBUG_ARGS + ["--max_steps", "30", "--eval_every", "15", "--output_dir", str(out)]
    return Run(out, launch("bf16_baseline.py", args, hf_home, config="single_gpu.yaml"))


def launch_two_processes(recipe: str, config: str, args: list[str], hf_home: Path, extra_launch_args=(), **kwargs):
    """`accelerate launch` with 2 CPU processes; env overrides merge over the config's own."""
    env = {**TWO_CPU_PROCESSES[config], **kwargs.pop("env", {})}
    return launch(recipe, args, hf_home, config=config, launch_args=TWO_PROCESS_LAUNCH + list(extra_launch_args),
                  env=env, **kwargs)


# Checks shared by the 1-process and the 2-process end-to-end tests.
def check_loss_goes_down(summary: dict):
    losses = [row["loss"] for row in summary["losses"]]
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0, losses
    assert summary["eval"][-1]["loss"] < summary["eval"][0]["loss"] - 1.0, summary["eval"]


EXPORT_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}  # by the run's mixed precision (export_dtype auto)


def check_export_reproduces_model(run: Run, load_tokenizer=None):
    """The exported folder, reloaded by plain transformers, is in the run's precision and gives the
    trained model's logits (fp32, recorded by the probe at the end of the run): within 1e-5 from an
    fp32 export, within 5% of the largest logit from a bf16/fp16 one, whose weights are rounded to 8
    (11) significant bits (measured from bf16: 0.37% after a 30-step fine-tune at 4e-4, 1.6% after 20
    TP steps at 3e-3, whose weights moved further)."""
    from probes.sitecustomize import PROBE_INPUT_IDS

    assert run.summary["export"] == str(run.output_dir / "model")
    model = AutoModelForCausalLM.from_pretrained(run.summary["export"])
    (load_tokenizer or AutoTokenizer.from_pretrained)(run.summary["export"])  # it travels with the weights
    assert (run.output_dir / "model" / "model.safetensors").exists()
    dtype = EXPORT_DTYPES.get(run.summary["setup"]["mixed_precision"], torch.float32)
    assert {p.dtype for p in model.parameters()} == {dtype}
    with torch.no_grad():
        logits = model.float()(torch.tensor([PROBE_INPUT_IDS])).logits[0]
    trained = torch.tensor(run.final[0]["probe_logits"])
    diff = (logits - trained).abs().max().item()
    assert diff < (1e-5 if dtype == torch.float32 else 0.05 * trained.abs().max().item()), diff


def check_resumed_losses(full: Run, resumed: Run, half: int, tolerance: float = 0.0):
    """The resumed run trained steps half+1.. with the losses of the run that never stopped."""
    assert resumed.summary["resumed_from"]["step"] == half
    full_losses = {row["step"]: row["loss"] for row in full.summary["losses"]}
    resumed_losses = {row["step"]: row["loss"] for row in resumed.summary["losses"]}
    assert sorted(resumed_losses) == [s for s in sorted(full_losses) if s > half]
    for step, loss in resumed_losses.items():
        assert abs(loss - full_losses[step]) <= tolerance, (step, loss, full_losses[step])


def check_exact_resume(full: Run, resumed: Run, half: int, tolerance: float = 0.0):
    check_resumed_losses(full, resumed, half, tolerance)
    # the very same samples, micro-batch by micro-batch, on every rank
    accumulation = full.summary["setup"]["options"]["gradient_accumulation_steps"]
    assert len(resumed.batches) == len(full.batches) > 0
    for full_ids, resumed_ids in zip(full.batches, resumed.batches):
        assert resumed_ids == full_ids[half * accumulation:] and resumed_ids


# ---- 2-process runs of each (recipe, config) pair, shared by the distributed and checkpoint tests ----
# Global batch 8 like the 1-process reference: 4 sequences x 2 ranks.
TWO_RANK_ARGS = CORE_DEBUG_ARGS + ["--micro_batch_size", "4"]

PAIRS = {
    "ddp.py/ddp.yaml": ("ddp.py", "ddp.yaml"),
    "train.py/ddp.yaml": ("train.py", "ddp.yaml"),
    "fsdp_full_shard.py/fsdp.yaml": ("fsdp_full_shard.py", "fsdp.yaml"),
    "train.py/fsdp.yaml": ("train.py", "fsdp.yaml"),
    "deepspeed_zero3_offload.py/deepspeed_zero3_offload.yaml": ("deepspeed_zero3_offload.py",
                                                                "deepspeed_zero3_offload.yaml"),
    "train.py/deepspeed_zero3_offload.yaml": ("train.py", "deepspeed_zero3_offload.yaml"),
}
# Options a pair's run adds. The DeepSpeed recipe's run (no parity partner: its zero.Init draws
# another random init) clips at 0.5, so a --max_grad_norm that does not reach DeepSpeed's config
# (accelerate fills "auto" with 1.0) shows in its engine (test_distributed).
PAIR_ARGS = {"deepspeed_zero3_offload.py/deepspeed_zero3_offload.yaml": ["--max_grad_norm", "0.5"]}


@pytest.fixture(scope="session")
def initial_model(tmp_path_factory):
    """The reference run's initial weights (seed 1234, debug preset), saved as a HF folder.

    train.py under FSDP2 and ZeRO-3 starts from this folder, which tests the pretrained path of
    both (FSDP2: rank 0 reads the weights, the others get them by broadcast) and lets ZeRO-3 take
    part in the parity test: built inside deepspeed.zero.Init, a random init is drawn in another
    order (measured: step-0 held-out loss 5.6113 instead of 5.5656)."""
    folder = tmp_path_factory.mktemp("initial_model")
    set_seed(1234)
    build_model(TrainConfig(preset="debug"), 259).save_pretrained(folder)
    build_tokenizer(TrainConfig()).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def two_process_runs(tmp_path_factory, hf_home, initial_model):
    """Launch each pair once, lazily, and keep the result for every test that asks."""
    runs = {}

    def get(pair: str) -> Run:
        if pair not in runs:
            recipe, config = PAIRS[pair]
            out = tmp_path_factory.mktemp(pair.replace("/", "__"))
            args = TWO_RANK_ARGS + PAIR_ARGS.get(pair, []) + ["--output_dir", str(out)]
            if recipe == "train.py":
                args += ["--save_every", "30", "--sample_length", "8"]  # the resume tests start from step 30
            if pair.startswith("train.py/") and config != "ddp.yaml":
                # the pretrained path: FSDP2's rank-0 loading + broadcast, ZeRO-3's partitioned load
                args += ["--model_name_or_path", str(initial_model)]
            runs[pair] = Run(out, launch_two_processes(recipe, config, args, hf_home))
        return runs[pair]

    return get


# ---- fp16 on CPU through the harness, shared by the precision and checkpoint tests ----
HARNESS = _HARNESS_ENV
# An initial scale of 2^24 makes the first steps overflow for real (no mock): each is skipped and
# the scale halves until the scaled gradients fit in fp16.
FP16_ARGS = CORE_DEBUG_ARGS + ["--max_steps", "20", "--eval_every", "20", "--fp16_init_scale", "16777216"]


@pytest.fixture(scope="session")
def fp16_recipe_run(tmp_path_factory, hf_home):
    out = tmp_path_factory.mktemp("fp16_scaler")
    proc = launch("fp16_scaler.py", FP16_ARGS + ["--output_dir", str(out)], hf_home, config="fp16.yaml",
                  launch_args=["--cpu", "--num_cpu_threads_per_process", "2"], env=HARNESS)
    return Run(out, proc)


@pytest.fixture(scope="session")
def fp16_train_run(tmp_path_factory, hf_home):
    """train.py with fp16, accumulation and clipping together."""
    out = tmp_path_factory.mktemp("fp16_train")
    args = FP16_ARGS + ["--micro_batch_size", "4", "--gradient_accumulation_steps", "2", "--max_grad_norm", "1.0",
                        "--save_every", "10", "--sample_length", "8", "--output_dir", str(out)]
    proc = launch("train.py", args, hf_home, config="fp16.yaml",
                  launch_args=["--cpu", "--num_cpu_threads_per_process", "2"], env=HARNESS)
    return Run(out, proc)


# ---- the quick tier (`python -m pytest -m quick`): every module, in minutes ----
# Tests marked `quick` launch nothing heavier than one 1-process train.py run (train_run); the tier
# must import every module of the product (in this process, or in a recipe it launches), which the
# session's end checks.
PRODUCT_PACKAGES = ("common", "train_extras", "tools")
REACHED_RECIPES: set[Path] = set()  # recipes the session launched or loaded in-process


def product_modules() -> set[str]:
    """Every module of the product: common/, train_extras/, tools/ (dotted names), recipes/ (files)."""
    names = {".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
             for package in PRODUCT_PACKAGES for path in (ROOT / package).rglob("*.py")
             if path.name != "__main__.py"}  # `python -m` stubs: they call a main the tests call
    return names | {f"recipes/{path.name}" for path in (ROOT / "recipes").glob("*.py")}


def imported_by(path: Path, seen: set[str]) -> set[str]:
    """The product modules a file imports, and theirs in turn (read from the source, nothing run)."""
    import ast

    for node in ast.walk(ast.parse(path.read_text())):
        names = ([alias.name for alias in node.names] if isinstance(node, ast.Import) else
                 [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
                 if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else [])
        for name in names:
            where = ROOT / Path(*name.split("."))
            for candidate in where.with_suffix(".py"), where / "__init__.py":
                if name.split(".")[0] in PRODUCT_PACKAGES and name not in seen and candidate.exists():
                    seen.add(name)
                    imported_by(candidate, seen)
    return seen


def pytest_configure(config):
    config.addinivalue_line("markers", "quick: the quick tier (`python -m pytest -m quick`, docs/testing.md)")


def pytest_sessionfinish(session, exitstatus):
    if session.config.option.markexpr != "quick" or exitstatus != 0:
        return
    covered = {name for name in sys.modules if name.split(".")[0] in PRODUCT_PACKAGES}
    for recipe in REACHED_RECIPES:  # launched, or loaded here by load_recipe
        covered |= {f"recipes/{recipe.name}"} | imported_by(recipe, set())
    missing = sorted(product_modules() - covered)
    if missing:
        print(f"\nerror: the quick tier reached no test of {', '.join(missing)}: mark one quick (docs/testing.md)")
        session.exitstatus = 1
