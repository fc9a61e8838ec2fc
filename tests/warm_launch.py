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
zygote. Not warm (a real launch instead): OMP_NUM_THREADS=1 (see Zygote.key).
tests/test_recipes.py launches the same command both ways and compares the runs.

Several processes: `accelerate launch` and torchrun run for real (their environment, rendezvous,
signal forwarding, failure handling), and only the workers are warm. torchrun starts each worker
as `$PYTHON_EXEC -u recipe.py args` (torch/distributed/run.py); the tests set PYTHON_EXEC to
tests/warm_python, a client that hands its argv, environment, working folder and standard streams
(the file descriptors themselves) to a WorkerZygote over a Unix socket, which forks the worker from
its warm state. The client stays in torchrun's place as the worker's stand-in: it forwards the
signals torchrun or a user sends, takes the worker's exit code (or its death by a signal) as its
own, and when the client dies (torchrun's SIGKILL) the zygote kills the worker. A worker whose
environment differs from the zygote's in what is read at import, or any failure to reach the
zygote, runs the real interpreter instead (the client execs it).
tests/test_distributed.py launches one command both ways and compares the runs.

    python tests/warm_launch.py            # the zygote: reads one JSON request per line on stdin
    python tests/warm_launch.py --workers SOCKET   # the workers' zygote, on a Unix socket
    tests/warm_python -u recipe.py ...     # the client, as torchrun runs it
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

# Read when a library is imported (huggingface_hub's and datasets' caches and offline mode, torch's
# allocator, Python's own flags): a run whose environment differs here needs a process of its own.
IMPORT_TIME_PREFIXES = ("HF_", "HUGGINGFACE", "TRANSFORMERS_", "DATASETS_", "TORCH", "PYTORCH", "PYTHON", "LD_",
                        "DS_", "CUDA", "KMP_", "MALLOC")
# Handled in the fork: the thread count is set with torch.set_num_threads, PYTHONPATH rebuilt.
HANDLED = {"PYTHONPATH", "OMP_NUM_THREADS", "MKL_NUM_THREADS"}
# Set for each worker by torchrun, accelerate's DeepSpeed launcher and these tests; read when the
# worker runs (torch.cuda.is_available() reads the NVML switch), not when torch is imported.
WORKER_IGNORED = ("TORCHELASTIC_", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "PYTORCH_NVML_BASED_CUDA_CHECK", "PYTHON_EXEC")
SOCKET_VAR = "ACCELERATE_RECIPES_WARM_SOCKET"  # the client's way to its zygote
PYTHON_VAR = "ACCELERATE_RECIPES_WARM_PYTHON"  # the real interpreter, for a worker that cannot be warm
CLIENT = Path(__file__).resolve().with_name("warm_python")
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
             signal.SIGABRT)  # SIGABRT: a hung test's stacks (conftest.run_showing_stacks_on_timeout)
PRELOAD = ("torch", "numpy", "yaml", "tqdm", "psutil", "safetensors.torch", "datasets", "accelerate",
           "transformers", "transformers.models.llama.modeling_llama", "transformers.models.auto.modeling_auto")


# ---- the test side ----

def simple_launch(launch_argv: list[str], env: dict) -> tuple[list[str], dict] | None:
    """(worker command, worker environment) of `accelerate launch <launch_argv>` run with `env`, from
    accelerate's own launcher code; None unless it would start exactly one process (simple_launcher)."""
    from unittest import mock

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
        return worker_key(env)

    def run(self, cmd: list[str], env: dict, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
        with tempfile.TemporaryDirectory() as tmp:
            out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
            request = {"argv": cmd[1:], "env": env, "cwd": str(cwd), "stdout": str(out), "stderr": str(err)}
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            pid = self._reply(60)["pid"]
            reply = self._reply(timeout)
            if reply is None:  # a hang: its stacks (faulthandler), then kill it and what it started
                os.killpg(pid, signal.SIGABRT)
                reply = self._reply(10)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
                if reply is None:
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


def worker_key(env: dict) -> tuple:
    """What of a worker's environment the libraries read when imported (what torchrun and the
    launchers set for the run itself aside)."""
    return tuple(sorted((k, v) for k, v in env.items() if k.startswith(IMPORT_TIME_PREFIXES)
                        and k not in HANDLED and not k.startswith(WORKER_IGNORED)))


class WorkerZygote:
    """The workers' warm process for one environment: forks every worker a client asks for, several at once."""

    def __init__(self, env: dict):
        self.folder = tempfile.mkdtemp(prefix="warm")  # short: a Unix socket's path has ~100 characters
        self.socket = os.path.join(self.folder, "socket")
        self.env = {k: v for k, v in env.items() if k != "PYTHONPATH"}
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--workers", self.socket],
                                     env=self.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ready, _, _ = select.select([self.proc.stdout], [], [], 600)
        assert ready and json.loads(self.proc.stdout.readline()) == {"ready": True}

    def launch_env(self) -> dict:
        """What a launch's environment needs so that torchrun starts its workers from here."""
        return {"PYTHON_EXEC": str(CLIENT), SOCKET_VAR: self.socket, PYTHON_VAR: sys.executable}

    def served(self) -> list[list[str]]:
        """The command line (script and arguments) of every worker forked here so far."""
        log = Path(self.folder, "served")
        return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()  # the zygote kills what still runs and exits
            self.proc.wait(timeout=30)
        for name in ("socket", "served"):
            Path(self.folder, name).unlink(missing_ok=True)
        os.rmdir(self.folder)


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
    """The forked run of a 1-process launch: output to the files the test reads."""
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
    _run_as_main(request, base_path)


def _run_as_main(request: dict, base_path: list[str]) -> None:
    """`python script args` in this (forked) process, with the request's environment and folder;
    exits as the interpreter would. Standard streams are set up by the caller."""
    code = 1
    try:
        os.setpgid(0, 0)  # its own group: a timeout kills it and whatever it started
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


def _serve_workers(path: str) -> None:
    """The workers' zygote: each connection is one worker (a client's request), answered with the
    worker's pid and, when it exits, its exit code; a client that goes away takes its worker with it."""
    import importlib
    import selectors

    own_key = worker_key(os.environ)  # before the imports: torch's sets TORCHINDUCTOR_CACHE_DIR
    for name in PRELOAD:
        importlib.import_module(name)
    base_path = sys.path[1:]
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    selector.register(sys.stdin, selectors.EVENT_READ)  # closed by the tests: time to go
    clients: dict[int, socket.socket] = {}  # worker pid -> its client's connection
    sys.stdout.write(json.dumps({"ready": True}) + "\n")
    sys.stdout.flush()
    while True:
        for key, _ in selector.select(timeout=0.05):
            if key.fileobj is sys.stdin:
                if not sys.stdin.readline():
                    for pid in clients:
                        _kill_group(pid)
                    return
            elif key.fileobj is listener:
                conn, _ = listener.accept()
                pid = _start_worker(conn, own_key, base_path, [listener, *clients.values()], selector, path)
                if pid is None:
                    conn.close()
                else:
                    clients[pid] = conn
                    selector.register(conn, selectors.EVENT_READ)
            elif not key.fileobj.recv(1):  # the client died (its launcher's SIGKILL): so does its worker
                selector.unregister(key.fileobj)
                _kill_group(next(p for p, c in clients.items() if c is key.fileobj))
        while clients:  # collect the workers that ended
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = clients.pop(pid)
            if conn.fileno() in selector.get_map():
                selector.unregister(conn)
            try:
                conn.sendall((json.dumps({"code": os.waitstatus_to_exitcode(status)}) + "\n").encode())
            except OSError:
                pass
            conn.close()


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _start_worker(conn, own_key, base_path, open_sockets, selector, listener_path) -> int | None:
    """Fork the worker a client asks for, with the client's standard streams; None when it cannot be warm."""
    _, fds, _, _ = socket.recv_fds(conn, 1, 3)
    reader = conn.makefile("rb")
    request = json.loads(reader.readline())
    reader.close()
    if len(fds) != 3 or worker_key(request["env"]) != own_key:
        for fd in fds:
            os.close(fd)
        conn.sendall(b'{"fallback": true}\n')
        return None
    pid = os.fork()
    if pid == 0:
        selector.close()
        for sock in (*open_sockets, conn):
            sock.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        _run_as_main(request, base_path)  # never returns
    for fd in fds:  # the streams are the worker's now: held here, a pipe would never end
        os.close(fd)
    with open(os.path.join(os.path.dirname(listener_path), "served"), "a") as log:  # for WorkerZygote.served
        log.write(json.dumps(request["argv"]) + "\n")
    conn.sendall((json.dumps({"pid": pid}) + "\n").encode())
    return pid


def _client(argv: list[str]) -> None:
    """torchrun's worker, `$PYTHON_EXEC -u script args`: forked by the zygote when it can be, else the
    real interpreter."""
    python = os.environ[PYTHON_VAR]
    if argv[:1] != ["-u"] or len(argv) < 2 or argv[1].startswith("-"):
        os.execv(python, [python, *argv])
    import ctypes

    ctypes.CDLL(None).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG, as the worker itself does
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(os.environ[SOCKET_VAR])
        socket.send_fds(conn, [b"\0"], [0, 1, 2])
        env = {k: v for k, v in os.environ.items()}
        conn.sendall((json.dumps({"argv": argv[1:], "env": env, "cwd": os.getcwd()}) + "\n").encode())
        replies = conn.makefile("rb")
        reply = json.loads(replies.readline())
    except (OSError, KeyError, ValueError):
        reply = {"fallback": True}
    if "pid" not in reply:
        conn.close()
        os.execv(python, [python, *argv])
    pid = reply["pid"]

    def forward(signum, _frame):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for signum in FORWARDED:
        signal.signal(signum, forward)
    line = replies.readline()
    code = json.loads(line)["code"] if line else 1
    if code < 0:  # died of a signal: so does its stand-in, for torchrun to see
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--workers"]:
        _serve_workers(sys.argv[2])
    elif sys.argv[1:2] == ["--client"]:
        _client(sys.argv[2:])
    else:
        _serve()
