"""Plant each mutant of mutants.py in a scratch copy of the checkout and run the tests that must catch it.

    python -m scripts.mutation [--list] [--only ID ...] [--timeout S] [--baseline] [--collect]
                               [--workdir DIR] [--keep] [--out DIR]
    python scripts/mutation/run.py ...                    # the same

One scratch copy per run: the working tree as it is (tracked files and untracked ones git does not
ignore, uncommitted changes included; no .git, virtual environments, outputs or caches). For each
mutant: its `old` snippet must occur exactly once in its file (else STALE, not run); the file is
mutated, `python -m pytest -x -q -p no:cacheprovider <its tests>` runs from the scratch root with a
timeout, and the file is put back byte for byte. Outcomes:

    caught     pytest exit 1: a test failed (or errored in a fixture)
    SURVIVED   pytest exit 0: every test passed with the bug in place
    ERROR      pytest exit 2-5 (collection or usage error, no tests): the tests did not judge the bug
    TIMEOUT    the tests ran past the timeout (their process group is killed)
    STALE      the `old` snippet is not in its file exactly once (the code moved: fix mutants.py)
    MISSING    a test file the mutant names does not exist
    BASELINE   --baseline: one of its tests already fails unmutated, so it is not run

The score is caught / selected mutants: everything but `caught` counts against it.

Before the mutants, a self-check: run as pytest runs (from the scratch root), `import common` must
resolve inside the scratch copy, and so must it in a process started with the environment
tests/conftest.py gives launched recipes; otherwise the run stops (exit 2) before any mutant.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make `scripts.mutation` importable from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scripts.mutation.mutants import MUTANTS, Mutant  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PYTEST = ["-m", "pytest", "-x", "-q", "-p", "no:cacheprovider"]
DEFAULT_TIMEOUT = 900
# Never copied into the scratch folder (a listing from git already leaves out what .gitignore names).
EXCLUDED_PARTS = {".git", ".venv", "venv", "__pycache__", ".pytest_cache", ".ruff_cache", ".mypy_cache", "outputs",
                  "build", "dist", "wheels"}
CAUGHT, SURVIVED, ERROR, TIMEOUT, STALE, MISSING, BASELINE = (
    "caught", "SURVIVED", "ERROR", "TIMEOUT", "STALE", "MISSING", "BASELINE")
LOG_LIMIT = 200_000  # bytes of each mutant's pytest output kept in the results (the end of it)


class Stale(Exception):
    """The snippet is not in the file exactly once."""

    def __init__(self, count: int):
        super().__init__(f"the old snippet occurs {count} times (must be exactly once)")
        self.count = count


# ---- pure logic (tests/test_mutation_tool.py) ----

def apply(text: str, old: str, new: str) -> str:
    """`text` with its one occurrence of `old` replaced by `new`; Stale if `old` is not there exactly once."""
    count = text.count(old)
    if count != 1:
        raise Stale(count)
    return text.replace(old, new, 1)


def classify(returncode: int | None, timed_out: bool = False) -> str:
    """The outcome of a mutant's pytest run from its exit code."""
    if timed_out:
        return TIMEOUT
    return {0: SURVIVED, 1: CAUGHT}.get(returncode, ERROR)


def spec_file(spec: str) -> str:
    """The file of a pytest node id ('tests/x.py::test_y[p]' -> 'tests/x.py')."""
    return spec.split("::", 1)[0]


def missing_tests(root: Path, mutant: Mutant) -> list[str]:
    return [spec for spec in mutant.tests if not (root / spec_file(spec)).is_file()]


def failed_nodes(output: str) -> list[str]:
    """The node ids pytest's short summary (-ra) lists as FAILED or ERROR."""
    found = []
    for line in output.splitlines():
        match = re.match(r"^(?:FAILED|ERROR) (\S.*?)(?: - .*)?$", line)
        if match:
            found.append(match.group(1))
    return found


def judged_by(spec: str, node: str) -> bool:
    """Whether the node id `node` belongs to the test spec `spec` (a file, a test, or a parametrized case)."""
    return node == spec or node.startswith((spec + "::", spec + "["))


def is_excluded(relative: str) -> bool:
    parts = Path(relative).parts
    return (any(p in EXCLUDED_PARTS or p.endswith(".egg-info") for p in parts)
            or relative.endswith((".pyc", ".pyo")))


def score(outcomes: list[str]) -> dict:
    counts = {name: outcomes.count(name) for name in (CAUGHT, SURVIVED, ERROR, TIMEOUT, STALE, MISSING, BASELINE)}
    judged = counts[CAUGHT] + counts[SURVIVED]
    return {"caught": counts[CAUGHT], "total": len(outcomes), "counts": counts,
            "caught_of_judged": f"{counts[CAUGHT]}/{judged}"}


# ---- the scratch copy ----

def venv_dirs(root: Path) -> set[str]:
    """Top-level folders that are virtual environments (whatever their name)."""
    return {p.name for p in root.iterdir() if p.is_dir() and (p / "pyvenv.cfg").is_file()}


def source_files(root: Path, use_git: bool = True) -> list[str]:
    """The working tree's files, relative to `root`: git's tracked and untracked-but-not-ignored files
    when git can list them, else a walk; never .git, virtual environments, outputs or caches."""
    files = None
    if use_git and (root / ".git").exists():
        try:
            out = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others",
                                  "--exclude-standard"], capture_output=True, check=True).stdout
            files = [name for name in out.decode().split("\0") if name]
        except (OSError, subprocess.CalledProcessError):
            files = None
    if files is None:
        files = [p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() or p.is_symlink()]
    venvs = venv_dirs(root)
    return sorted(name for name in set(files) if not is_excluded(name) and Path(name).parts[0] not in venvs
                  and ((root / name).is_file() or (root / name).is_symlink()))  # a deleted tracked file: skipped


def make_scratch(root: Path, dest: Path, use_git: bool = True) -> int:
    """Copy the working tree into `dest` (empty or missing); returns the number of files."""
    names = source_files(root, use_git)
    for name in names:
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / name, target, follow_symlinks=False)
    return len(names)


class Planted:
    """A mutant planted in the scratch copy; `restore()` puts the file back byte for byte (and its mtime)."""

    def __init__(self, scratch: Path, mutant: Mutant):
        self.path = scratch / mutant.file
        self.original = self.path.read_bytes()
        self.stat = self.path.stat()
        self.path.write_text(apply(self.original.decode(), mutant.old, mutant.new))

    def restore(self) -> None:
        self.path.write_bytes(self.original)
        os.utime(self.path, ns=(self.stat.st_atime_ns, self.stat.st_mtime_ns))


# ---- running pytest ----

def child_env(workdir: Path) -> dict:
    """The environment of every pytest run: no bytecode written (the same files change and come back
    within seconds), no PYTHONPATH of the caller (the scratch root comes first by itself), a Hugging
    Face home of this run's own (datasets' caches of mutated code never reach the user's)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "HF_DATASETS_CACHE", "HF_HOME")}
    env.update(PYTHONDONTWRITEBYTECODE="1", HF_HOME=str(workdir / "hf_home"), HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1")
    return env


@dataclass
class Finished:
    returncode: int | None
    timed_out: bool
    seconds: float
    output: str = field(repr=False)


def run_process(args: list[str], cwd: Path, env: dict, timeout: float, log: Path) -> Finished:
    """Run `args` in its own process group (launched workers included), output to `log`; on timeout
    the whole group is stopped (SIGTERM, then SIGKILL)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(log, "wb") as out:
        proc = subprocess.Popen(args, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        timed_out = False
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            _stop_group(proc)
        except BaseException:  # Ctrl-C: nothing of ours left running
            _stop_group(proc)
            raise
    seconds = time.perf_counter() - start
    data = log.read_bytes()
    if len(data) > LOG_LIMIT:
        log.write_bytes(b"[... cut ...]\n" + data[-LOG_LIMIT:])
    return Finished(proc.returncode, timed_out, seconds, data.decode(errors="replace"))


def _stop_group(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 15)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def pytest_args(tests: list[str], basetemp: Path, stop_at_first: bool = True) -> list[str]:
    args = [sys.executable, *PYTEST, "--basetemp", str(basetemp), *tests]
    return args if stop_at_first else [a for a in args if a != "-x"]


SELF_CHECK_IMPORT = ("import common, train_extras; print('MODULE', common.__file__); "
                     "print('MODULE', train_extras.__file__)")
SELF_CHECK_LAUNCH = f"""
import subprocess, sys, tempfile
sys.path.insert(0, "tests")
from conftest import ROOT, launch_env
env = launch_env(ROOT / ".mutation-self-check")  # (a path only: nothing is written there)
with tempfile.TemporaryDirectory() as elsewhere:  # only PYTHONPATH decides there, as for a launched worker
    out = subprocess.run([sys.executable, "-c", {SELF_CHECK_IMPORT!r}], cwd=elsewhere, env=env, capture_output=True,
                         text=True)
print(out.stdout, end="")
print(out.stderr, end="", file=sys.stderr)
sys.exit(out.returncode)
"""


def self_check(scratch: Path, env: dict) -> list[str]:
    """Where `common` comes from, run as pytest runs here and as a launched recipe runs; [] if all is
    inside the scratch copy, else the problems."""
    problems = []
    checks = {"pytest's process (from the scratch root)": SELF_CHECK_IMPORT,
              "a launched recipe (tests/conftest.py's launch_env)": SELF_CHECK_LAUNCH}
    for where, code in checks.items():
        out = subprocess.run([sys.executable, "-c", code], cwd=scratch, env=env, capture_output=True, text=True,
                             timeout=300)
        paths = [line.split(" ", 1)[1] for line in out.stdout.splitlines() if line.startswith("MODULE ")]
        outside = [p for p in paths if not Path(p).resolve().is_relative_to(scratch.resolve())]
        if out.returncode != 0 or not paths or outside:
            problems.append(f"{where}: imports {outside or paths or 'nothing'} (exit {out.returncode}) "
                            f"{out.stderr.strip()[-1500:]}")
    return problems


# ---- the run ----

def select(only: list[str] | None) -> list[Mutant]:
    if not only:
        return list(MUTANTS)
    known = {m.id: m for m in MUTANTS}
    unknown = [i for i in only if i not in known]
    if unknown:
        raise SystemExit(f"error: unknown mutant id(s): {', '.join(unknown)} (see --list)")
    return [known[i] for i in dict.fromkeys(only)]


def status_in(root: Path, mutant: Mutant) -> str:
    """'ok', or why the mutant cannot run in the tree at `root`."""
    path = root / mutant.file
    count = path.read_text().count(mutant.old) if path.is_file() else 0
    if count != 1:
        return f"STALE ({count} occurrences)"
    missing = missing_tests(root, mutant)
    return f"MISSING {', '.join(missing)}" if missing else "ok"


def list_mutants(mutants: list[Mutant]) -> None:
    for m in mutants:
        print(f"{m.id}  [{status_in(ROOT, m)}]\n    {m.file}: {m.what}\n    tests: {' '.join(m.tests)}"
              + (f"\n    note: {m.note}" if m.note else ""))
    print(f"{len(mutants)} mutants")


def git_facts(root: Path) -> dict:
    def git(*args):
        try:
            return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                                  check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return None
    status = git("status", "--porcelain")
    return {"commit": git("rev-parse", "HEAD"), "uncommitted_changes": bool(status) if status is not None else None}


def out_dir_for(root: Path, given: str | None) -> Path:
    if given:
        return Path(given)
    base = root / "benchmarks" / "results" / f"mutation-{datetime.date.today().isoformat()}"
    out, n = base, 1
    while out.exists():
        n += 1
        out = base.with_name(f"{base.name}-{n}")
    return out


def run_baseline(mutants: list[Mutant], scratch: Path, env: dict, workdir: Path, timeout: float,
                 out: Path) -> dict[str, str]:
    """Every test the mutants name, once, unmutated. Returns {mutant id: BASELINE} for the mutants
    whose tests already fail; stops the run if pytest could not judge (errors, timeout)."""
    specs = list(dict.fromkeys(spec for m in mutants for spec in m.tests if not missing_tests(scratch, m)))
    if not specs:
        return {}
    print(f"baseline: {len(specs)} test spec(s) unmutated ...", flush=True)
    done = run_process(pytest_args(specs, workdir / "pytest-tmp", stop_at_first=False), scratch, env, timeout,
                       out / "logs" / "baseline.log")
    print(f"baseline: exit {done.returncode}{' (timeout)' if done.timed_out else ''} in {done.seconds:.0f} s",
          flush=True)
    if done.timed_out or done.returncode not in (0, 1):
        raise SystemExit(f"error: the baseline did not finish cleanly (see {out / 'logs' / 'baseline.log'}): "
                         "the mutants cannot be judged")
    failed = failed_nodes(done.output)
    for node in failed:
        print(f"baseline: FAILED {node}", flush=True)
    return {m.id: BASELINE for m in mutants if any(judged_by(spec, node) for spec in m.tests for node in failed)}


def run_mutant(mutant: Mutant, scratch: Path, env: dict, workdir: Path, timeout: float, out: Path) -> dict:
    row = {"id": mutant.id, "file": mutant.file, "what": mutant.what, "tests": list(mutant.tests),
           "returncode": None, "seconds": 0.0, "log": None}
    if missing_tests(scratch, mutant):
        return {**row, "outcome": MISSING, "detail": f"missing: {', '.join(missing_tests(scratch, mutant))}"}
    try:
        planted = Planted(scratch, mutant)
    except Stale as err:
        return {**row, "outcome": STALE, "detail": str(err)}
    log = out / "logs" / f"{mutant.id}.log"
    try:
        done = run_process(pytest_args(list(mutant.tests), workdir / "pytest-tmp"), scratch, env,
                           mutant.timeout or timeout, log)
    finally:
        planted.restore()
    tail = [line for line in done.output.splitlines() if line.strip()][-1:] or [""]
    return {**row, "outcome": classify(done.returncode, done.timed_out), "returncode": done.returncode,
            "seconds": round(done.seconds, 1), "log": str(log.relative_to(out)), "detail": tail[0][-300:]}


def write_results(out: Path, rows: list[dict], meta: dict) -> None:
    result = score([r["outcome"] for r in rows])
    (out / "mutation.json").write_text(json.dumps({**meta, "score": result, "mutants": rows}, indent=1) + "\n")
    lines = [f"# Mutation check, {meta['date']}", "",
             f"Source: `{meta['source']}` at commit `{meta['commit']}`"
             + (" with uncommitted changes" if meta["uncommitted_changes"] else "") + ".",
             f"Command: `{meta['command']}`", "",
             f"**Score: {result['caught']} / {result['total']} caught** "
             f"({', '.join(f'{v} {k}' for k, v in result['counts'].items() if v and k != CAUGHT) or 'nothing else'}); "
             f"{meta['selected']} of the {meta['listed']} listed mutants ran"
             + (" (a partial run)" if meta["selected"] < meta["listed"] else "") + ".",
             f"Time: {sum(r['seconds'] for r in rows):.0f} s in the mutants' tests"
             + (f", {meta['baseline_seconds']:.0f} s baseline" if meta.get("baseline_seconds") else "") + ".", "",
             "| mutant | outcome | s | tests | bug |", "|---|---|---:|---|---|"]
    for r in rows:
        tests = "<br>".join(f"`{t}`" for t in r["tests"])
        lines.append(f"| `{r['id']}` | {r['outcome']} | {r['seconds']:.0f} | {tests} | {r['what']} |")
    lines += ["", "Outcomes: caught = pytest exit 1; SURVIVED = exit 0 with the bug in place; ERROR = exit 2-5; "
              "TIMEOUT; STALE = the snippet is no longer in its file once; MISSING = a test file is missing; "
              "BASELINE = a test fails unmutated. Each mutant's pytest output: `logs/<id>.log`."]
    (out / "mutation.md").write_text("\n".join(lines) + "\n")


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m scripts.mutation", description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="list the mutants and whether each applies; run nothing")
    parser.add_argument("--only", nargs="+", metavar="ID", help="run these mutants only")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT,
                        help=f"seconds per mutant's tests (a mutant's own timeout wins; default {DEFAULT_TIMEOUT})")
    parser.add_argument("--baseline", action="store_true",
                        help="first run every selected mutant's tests unmutated; mutants whose tests fail are not run")
    parser.add_argument("--baseline_timeout", type=float, default=4 * 3600, help="seconds for the baseline run")
    parser.add_argument("--collect", action="store_true",
                        help="only check that every test spec collects (pytest --collect-only) in the scratch copy")
    parser.add_argument("--workdir", help="where the scratch copy goes (default: a new temporary folder)")
    parser.add_argument("--keep", action="store_true", help="keep the scratch copy and its caches afterwards")
    parser.add_argument("--out", help="results folder (default: benchmarks/results/mutation-<date>/ of the checkout)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    mutants = select(args.only)
    if args.list:
        list_mutants(mutants)
        return 0
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="accelerate-recipes-mutation-"))
    scratch = workdir / "checkout"
    ours = [workdir] if args.workdir is None else [workdir / name for name in ("checkout", "hf_home", "pytest-tmp")]
    if scratch.exists():
        shutil.rmtree(scratch)
    try:
        count = make_scratch(ROOT, scratch)
        env = child_env(workdir)
        print(f"scratch copy: {count} files in {scratch}", flush=True)
        problems = self_check(scratch, env)
        if problems:
            print("error: the scratch copy's tests would not run the scratch copy's code:\n  "
                  + "\n  ".join(problems), file=sys.stderr)
            return 2
        print("self-check: common and train_extras import from the scratch copy (pytest and launched recipes)",
              flush=True)
        if args.collect:
            return collect_only(mutants, scratch, env, workdir)
        return run_all(args, mutants, scratch, env, workdir)
    finally:
        if not args.keep:  # what this run made, never more (a --workdir given may hold other things)
            for path in ours:
                shutil.rmtree(path, ignore_errors=True)


def collect_only(mutants: list[Mutant], scratch: Path, env: dict, workdir: Path) -> int:
    """How many tests each spec selects (pytest --collect-only): all specs in one run, and one run per
    spec only when that fails (one node id not found makes pytest collect nothing)."""
    specs = list(dict.fromkeys(spec for m in mutants for spec in m.tests if not missing_tests(scratch, m)))

    def collected(chosen):
        done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                               "--basetemp", str(workdir / "pytest-tmp"), *chosen], cwd=scratch, env=env,
                              capture_output=True, text=True)
        return done.returncode, [line for line in done.stdout.splitlines() if "::" in line]

    code, ids = collected(specs)
    counts = {spec: sum(judged_by(spec, node) for node in ids) for spec in specs}
    if code != 0:
        counts = {spec: len(collected([spec])[1]) for spec in specs}
    for spec, n in counts.items():
        print(f"{'ok' if n else 'NOT COLLECTED'}  {n:4d}  {spec}", flush=True)
    missing = [f"{m.id}: {', '.join(missing_tests(scratch, m))}" for m in mutants if missing_tests(scratch, m)]
    for line in missing:
        print(f"MISSING  {line}")
    return 1 if missing or not all(counts.values()) else 0


def run_all(args, mutants: list[Mutant], scratch: Path, env: dict, workdir: Path) -> int:
    out = out_dir_for(ROOT, args.out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    meta = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "source": str(ROOT), **git_facts(ROOT),
            "command": " ".join(["python -m scripts.mutation", *(sys.argv[1:])]), "python": sys.version.split()[0],
            "timeout_s": args.timeout, "selected": len(mutants), "listed": len(MUTANTS)}
    skipped = {}
    if args.baseline:
        start = time.perf_counter()
        skipped = run_baseline(mutants, scratch, env, workdir, args.baseline_timeout, out)
        meta["baseline_seconds"] = round(time.perf_counter() - start, 1)
    rows = []
    for i, mutant in enumerate(mutants, 1):
        print(f"[{i}/{len(mutants)}] {mutant.id} ({mutant.file}) ...", end=" ", flush=True)
        if mutant.id in skipped:
            row = {"id": mutant.id, "file": mutant.file, "what": mutant.what, "tests": list(mutant.tests),
                   "outcome": BASELINE, "returncode": None, "seconds": 0.0, "log": None,
                   "detail": "a test fails unmutated (logs/baseline.log)"}
        else:
            row = run_mutant(mutant, scratch, env, workdir, args.timeout, out)
        rows.append(row)
        print(f"{row['outcome']} ({row['seconds']:.0f} s)", flush=True)
        write_results(out, rows, meta)  # after each mutant: a long run killed half-way keeps what it found
    result = score([r["outcome"] for r in rows])
    width = max(len(r["id"]) for r in rows)
    print("\n" + "\n".join(f"{r['id']:<{width}}  {r['outcome']:<8}  {r['seconds']:7.1f} s  {' '.join(r['tests'])}"
                           for r in rows))
    print(f"\nscore: {result['caught']} / {result['total']} caught ({result['counts']}); results in {out}")
    return 0 if result["caught"] == result["total"] else 1


if __name__ == "__main__":
    sys.exit(main())
