"""One-process launches without the start-up: `accelerate launch` works out the worker's command line
and environment, and a warm process forks to run it.

A 1-process `accelerate launch` spends ~8 s before the recipe's first line: the launcher imports
accelerate and torch, then the worker imports torch, transformers, accelerate and datasets again.
Here the command line and environment come from accelerate's own launcher code
(`_validate_launch_command` + `prepare_simple_launcher_cmd_env`, the path `accelerate launch` takes
for every 1-process config), so the worker sees what a real launch would give it. The worker itself
is a fork of a "zygote" that imported those libraries once (and nothing of this repository): the
fork sets the environment, sys.argv and sys.path a fresh `python recipe.py` would have, loads the
`sitecustomize` on that PYTHONPATH (the tests' probes, which chain the CPU harness), runs the recipe
as `__main__` and exits as Python would (threads joined, atexit handlers run). The caller gets what
`accelerate launch` gives: the worker's output, and exit code 1 with the launcher's
CalledProcessError line when the worker failed.

A zygote serves the runs whose environment agrees with the one it started with in what libraries
read when they are imported (HF_*, TRANSFORMERS_*, PYTHON*, ...); another environment gets another
zygote. Not warm (a real launch instead): several processes, and OMP_NUM_THREADS=1 (see Zygote.key).
tests/test_recipes.py launches the same command both ways and compares the runs.

    python tests/warm_launch.py      # the zygote: reads one JSON request per line on stdin
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from unittest import mock

# Read when a library is imported (huggingface_hub's and datasets' caches and offline mode, torch's
# allocator, Python's own flags): a run whose environment differs here needs a process of its own.
IMPORT_TIME_PREFIXES = ("HF_", "HUGGINGFACE", "TRANSFORMERS_", "DATASETS_", "TORCH", "PYTORCH", "PYTHON", "LD_",
                        "DS_", "CUDA", "KMP_", "MALLOC")
# Handled in the fork: the thread count is set with torch.set_num_threads, PYTHONPATH rebuilt.
HANDLED = {"PYTHONPATH", "OMP_NUM_THREADS", "MKL_NUM_THREADS"}
PRELOAD = ("torch", "numpy", "yaml", "tqdm", "psutil", "safetensors.torch", "datasets", "accelerate",
           "transformers", "transformers.models.llama.modeling_llama", "transformers.models.auto.modeling_auto")


# ---- the test side ----

def simple_launch(launch_argv: list[str], env: dict) -> tuple[list[str], dict] | None:
    """(worker command, worker environment) of `accelerate launch <launch_argv>` run with `env`, from
    accelerate's own launcher code; None unless it would start exactly one process (simple_launcher)."""
    from accelerate.commands.launch import (_validate_launch_command, launch_command_parser,
                                            prepare_simple_launcher_cmd_env)

    with mock.patch.dict(os.environ, env, clear=True):
        args = launch_command_parser().parse_args(launch_argv)
        args, defaults, _ = _validate_launch_command(args)
        several = (args.use_deepspeed or args.use_fsdp or args.use_megatron_lm or args.multi_gpu or args.tpu)
        if (several and not args.cpu) or args.num_processes not in (None, 1) or getattr(defaults, "compute_environment",
                                                                                       None) == "AMAZON_SAGEMAKER":
            return None
        return prepare_simple_launcher_cmd_env(args)


class Zygote:
    """The warm process: started once per environment, serves one run at a time."""

    def __init__(self, env: dict):
        """Started with a run's environment (without its PYTHONPATH: each run brings its own)."""
        self.env = {k: v for k, v in env.items() if k != "PYTHONPATH"}
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve())], env=self.env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        assert self._reply(600) == {"ready": True}

    def _reply(self, timeout: float) -> dict | None:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            return None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the warm launcher died ({self.proc.poll()})")
        return json.loads(line)

    @staticmethod
    def key(env: dict) -> tuple | None:
        """What of `env` the libraries read when imported: runs with the same key share a zygote.
        None for a run that must be launched for real: with OMP_NUM_THREADS=1 train.py asks its
        parent, the launcher, whether the user chose it (train_extras/parallel/cpu_threads.py)."""
        if env.get("OMP_NUM_THREADS") == "1":
            return None
        return tuple(sorted((k, v) for k, v in env.items() if k.startswith(IMPORT_TIME_PREFIXES) and k not in HANDLED))

    def run(self, cmd: list[str], env: dict, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
        with tempfile.TemporaryDirectory() as tmp:
            out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
            request = {"argv": cmd[1:], "env": env, "cwd": str(cwd), "stdout": str(out), "stderr": str(err)}
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            pid = self._reply(60)["pid"]
            reply = self._reply(timeout)
            if reply is None:  # kill the run (and anything it started), then collect the zygote's answer
                os.killpg(pid, signal.SIGKILL)
                self._reply(60)
                raise subprocess.TimeoutExpired(cmd, timeout, out.read_text(), err.read_text())
            stdout, stderr = out.read_text(), err.read_text()
        code = reply["code"]
        if code != 0:  # what accelerate's simple_launcher does with a failed worker
            stderr += (f"subprocess.CalledProcessError: Command '{cmd}' returned non-zero exit status {code}.\n")
        result = subprocess.CompletedProcess(["accelerate", "launch", *cmd[1:]], 0 if code == 0 else 1, stdout, stderr)
        result.worker_returncode = code
        result.cpu_s = reply["cpu_s"]  # the run's CPU time (user + system)
        return result

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)


# ---- the zygote ----

def _serve() -> None:
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    base_path = sys.path[1:]  # without this file's folder (started with no PYTHONPATH: see Zygote)
    reply = sys.stdout
    reply.write(json.dumps({"ready": True}) + "\n")
    reply.flush()
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request, base_path)  # never returns
        reply.write(json.dumps({"pid": pid}) + "\n")
        reply.flush()
        _, status, usage = os.wait4(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        cpu_s = usage.ru_utime + usage.ru_stime
        reply.write(json.dumps({"code": code if code >= 0 else 128 - code, "cpu_s": cpu_s}) + "\n")
        reply.flush()


def _child(request: dict, base_path: list[str]) -> None:
    code = 1
    try:
        os.setpgid(0, 0)  # its own group: a timeout kills it and whatever it started
        stdin = os.open(os.devnull, os.O_RDONLY)
        os.dup2(stdin, 0)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        script, *args = request["argv"]
        # `python script.py`: the script's folder, then PYTHONPATH, then the interpreter's own paths
        python_path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = [os.path.dirname(os.path.abspath(script)), *python_path, *base_path]
        sys.argv = [script, *args]
        import torch

        if os.environ.get("OMP_NUM_THREADS"):  # read by OpenMP when torch loaded, in the zygote
            torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        import runpy
        import site

        site.execsitecustomize()  # the one on this run's PYTHONPATH, as Python's start-up does (errors printed)

        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: B036  (what the interpreter prints for an uncaught exception)
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        try:
            import atexit
            import threading

            threading._shutdown()  # as at interpreter exit: non-daemon threads joined, then atexit
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


if __name__ == "__main__":
    _serve()
