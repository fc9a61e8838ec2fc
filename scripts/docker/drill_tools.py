"""The Docker drill's bookkeeping (scripts/docker/drill.sh): standard library only, run by the host's
python3 (not the image's), so that the drill needs nothing installed beside Docker.

  serve      the pip settings of this machine, rewritten for a build container: local indexes and
             wheel folders (file:// or plain paths) become URLs of one local HTTP server, the CA
             bundle and constraint files are copied; plus a one-package index holding the CPU torch
  build-steps  seconds per step of a timestamped `docker build` log, and which came from the cache
  record     append one drill step (name, command, exit code, expected code, facts) to steps.jsonl
  last-step  the last train step a run folder's metrics.jsonl holds (0 if none)
  preempted  what a stopped run left: requeue marker, its checkpoint, metrics, file owners
  compare    a stopped-and-resumed run against an uninterrupted one: contiguous metrics, same losses
  meta       the machine, Docker and commit the drill ran on
  report     results.json and drill.md from steps.jsonl; exit 1 if a step failed
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
import urllib.parse
from pathlib import Path

LOCATION_KEYS = ("index-url", "extra-index-url", "find-links")
FILE_KEYS = ("cert", "client-cert", "constraint", "requirement")


# ---------------------------------------------------------------- serve

def pip_settings(python: str) -> dict[str, str]:
    """`pip config list` (files and PIP_* variables), the later source winning as pip's does."""
    out = subprocess.run([python, "-m", "pip", "config", "list"], capture_output=True, text=True, check=True).stdout
    settings: dict[str, str] = {}
    for line in out.splitlines():
        match = re.fullmatch(r"([^.=]*)\.([\w-]+)='(.*)'", line.strip())
        if match and match.group(1) in ("global", "install", ":env:"):
            settings[match.group(2)] = match.group(3)
    return settings


def local_path(location: str) -> Path | None:
    if location.startswith("file://"):
        return Path(urllib.parse.unquote(urllib.parse.urlparse(location).path))
    if location.startswith("/"):
        return Path(location)
    return None  # an http(s) index: reachable from the build as it is (--network host)


def serve_path(served: Path, path: Path) -> str:
    """Make `path` visible under `served` at its own absolute path; the URL path. For a PEP 503 index
    (a folder named simple) its parent is linked, since index pages link to ../../files/..."""
    root = path.parent if path.name == "simple" else path
    link = served / root.relative_to("/")
    link.parent.mkdir(parents=True, exist_ok=True)
    if not link.exists() and not link.is_symlink():  # (inside a folder linked already: nothing to do)
        link.symlink_to(root, target_is_directory=True)
    return urllib.parse.quote(str(path)) + "/"


def cmd_serve(args) -> None:
    served, context = Path(args.served), Path(args.context)
    for folder in (served, context):
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)
    (context / "pip-drill").mkdir()
    base_url = f"http://127.0.0.1:{args.port}"
    settings = pip_settings(args.python)
    lines, facts, wheel_dirs = ["[global]"], {"host_pip_settings": settings}, []
    for key, value in settings.items():
        if key in LOCATION_KEYS:
            urls = []
            for location in value.split():
                path = local_path(location)
                if path is None:
                    urls.append(location)
                elif path.exists():
                    urls.append(base_url + serve_path(served, path))
                    wheel_dirs.append(path / ".." / "files" if path.name == "simple" else path)
            if urls:
                lines.append(f"{key} = {' '.join(urls)}")
        elif key in FILE_KEYS:
            copies = []
            for i, name in enumerate(value.split()):
                if Path(name).is_file():
                    target = f"/etc/pip-drill/{key}-{i}-{Path(name).name}"
                    shutil.copy(name, context / "pip-drill" / Path(target).name)
                    copies.append(target)
            if copies:
                lines.append(f"{key} = {' '.join(copies)}")
        else:
            lines.append(f"{key} = {value}")
    (context / "pip.conf").write_text("\n".join(lines) + "\n")
    facts["image_pip_conf"] = lines

    # The torch index: one page listing the CPU builds of the pinned version found on this machine.
    pattern = f"torch-{args.torch_version}+cpu-*.whl"
    wheels = sorted({w.resolve() for d in wheel_dirs if d.is_dir() for w in d.glob(pattern)})
    if not wheels:
        sys.exit(f"drill_tools serve: no torch-{args.torch_version}+cpu wheel in {[str(d) for d in wheel_dirs]}")
    page = served / "torch-cpu-index" / "torch"
    page.mkdir(parents=True)
    for wheel in wheels:
        serve_path(served, wheel.parent)
    links = "\n".join(f'<a href="{urllib.parse.quote(str(w))}">{w.name}</a><br>' for w in wheels)
    (page / "index.html").write_text(f"<!DOCTYPE html><html><body>\n{links}\n</body></html>\n")
    facts["torch_index_url"] = f"{base_url}/torch-cpu-index/"
    facts["torch_wheels"] = [str(w) for w in wheels]
    Path(args.facts).write_text(json.dumps(facts, indent=1) + "\n")
    print(facts["torch_index_url"])


# ---------------------------------------------------------------- runs

def metrics(run: Path, kind: str) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a line being written
        if row.get("kind") == kind:
            rows.append(row)
    return rows


def cmd_last_step(args) -> None:
    rows = metrics(Path(args.run), "train")
    print(rows[-1]["step"] if rows else 0)


def owners(run: Path) -> list[int]:
    return sorted({p.stat().st_uid for p in [run, *run.rglob("*")]})


def cmd_preempted(args) -> None:
    run = Path(args.run)
    marker = run / "requeue.json"
    facts: dict = {"requeue_json": marker.exists()}
    if marker.exists():
        content = json.loads(marker.read_text())
        facts["marker"] = content
        # The marker names the checkpoint as the container saw it (/workspace/outputs/...).
        checkpoint = run / "checkpoints" / Path(content["checkpoint"]).name
        facts["checkpoint"] = checkpoint.name
        facts["checkpoint_complete"] = (checkpoint / "checkpoint.json").is_file()
    facts["checkpoints"] = sorted(p.name for p in (run / "checkpoints").glob("step_*"))
    rows = metrics(run, "train")
    facts["last_train_step"] = rows[-1]["step"] if rows else 0
    facts["file_owner_uids"] = owners(run)
    Path(args.facts).write_text(json.dumps(facts) + "\n")
    ok = (marker.exists() and facts["checkpoint_complete"] and facts["marker"]["step"] == facts["last_train_step"]
          and facts["file_owner_uids"] == [args.uid])
    print(json.dumps(facts))
    sys.exit(0 if ok else 1)


def cmd_compare(args) -> None:
    """The stopped-and-resumed run's metrics.jsonl against the uninterrupted one's, step by step."""
    ref, run = Path(args.reference), Path(args.run)
    facts: dict = {}
    ok = True
    for kind in ("train", "eval"):
        ref_rows, run_rows = metrics(ref, kind), metrics(run, kind)
        steps = [r["step"] for r in run_rows]
        ref_loss = {r["step"]: r["loss"] for r in ref_rows}
        diffs = [abs(r["loss"] - ref_loss[r["step"]]) for r in run_rows if r["step"] in ref_loss]
        facts[kind] = {
            "steps": len(steps), "unique_steps": len(set(steps)), "first": steps[0] if steps else None,
            "last": steps[-1] if steps else None, "in_order": steps == sorted(steps),
            "compared": len(diffs), "max_abs_diff": max(diffs) if diffs else None,
            "bitwise_equal": sum(d == 0.0 for d in diffs),
        }
        if kind == "train":
            facts[kind]["contiguous"] = steps == list(range(1, args.max_steps + 1))
            ok &= facts[kind]["contiguous"] and facts[kind]["compared"] == args.max_steps
            after = [r for r in run_rows if r["step"] > args.resumed_from]
            facts["resumed_from"] = args.resumed_from
            facts["losses_after_resume"] = [
                {"step": r["step"], "resumed": r["loss"], "uninterrupted": ref_loss.get(r["step"])}
                for r in after[: args.show]]
            facts["final"] = {"step": steps[-1] if steps else None,
                              "resumed": run_rows[-1]["loss"] if run_rows else None,
                              "uninterrupted": ref_rows[-1]["loss"] if ref_rows else None}
        else:
            ok &= facts[kind]["compared"] == len(ref_rows) and facts[kind]["unique_steps"] == len(steps)
        ok &= facts[kind]["max_abs_diff"] is not None and facts[kind]["max_abs_diff"] <= args.tolerance
    facts["tolerance"] = args.tolerance
    facts["file_owner_uids"] = owners(run)
    ok &= facts["file_owner_uids"] == [args.uid] and not (run / "requeue.json").exists()
    facts["requeue_json_left"] = (run / "requeue.json").exists()
    Path(args.facts).write_text(json.dumps(facts) + "\n")
    print(json.dumps({k: v for k, v in facts.items() if k != "losses_after_resume"}))
    sys.exit(0 if ok else 1)


# ---------------------------------------------------------------- builds

def cmd_build_steps(args) -> None:
    """Seconds per Dockerfile step of a timestamped legacy-builder log ("<epoch> Step 5/30 : RUN ...")."""
    steps, end = [], None
    for line in Path(args.log).read_text().splitlines():
        stamp, _, text = line.partition(" ")
        try:
            end = float(stamp)
        except ValueError:
            continue
        match = re.match(r"Step (\d+)/(\d+) : (.*)", text)
        if match:
            steps.append({"step": int(match.group(1)), "instruction": match.group(3)[:160], "start": end,
                          "cached": False})
        elif steps and text.strip() == "---> Using cache":
            steps[-1]["cached"] = True
    for here, after in zip(steps, steps[1:] + [None]):
        here["seconds"] = round((after["start"] if after else end) - here.pop("start"), 1)
    facts = {"steps": steps, "cached_steps": sum(s["cached"] for s in steps), "total_steps": len(steps)}
    for phase in ("torch", "deps", "project"):
        found = [s for s in steps if f"install.sh {phase}" in s["instruction"]]
        if found:
            facts[f"install_{phase}"] = {"seconds": found[0]["seconds"], "cached": found[0]["cached"]}
    Path(args.facts).write_text(json.dumps(facts) + "\n")
    ok = not args.expect_cached or all(facts.get(f"install_{p}", {}).get("cached") for p in args.expect_cached)
    print(json.dumps({k: v for k, v in facts.items() if k != "steps"}))
    sys.exit(0 if ok else 1)


# ---------------------------------------------------------------- record and report

def value(text: str):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def cmd_record(args) -> None:
    entry = {"step": args.name, "command": args.command, "exit_code": value(args.exit_code),
             "expected_exit_code": value(args.expected), "ok": str(args.exit_code) == str(args.expected)}
    if args.check is not None:  # a check beside the exit code (its own exit status)
        entry["ok"] = entry["ok"] and args.check == 0
        entry["checks_passed"] = args.check == 0
    facts = {}
    for item in args.fact:
        key, _, text = item.partition("=")
        facts[key] = value(text)
    if args.facts_file and Path(args.facts_file).is_file():
        facts.update(json.loads(Path(args.facts_file).read_text()))
    entry["facts"] = facts
    entry["time"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    with open(args.steps, "a") as f:
        f.write(json.dumps(entry) + "\n")
    verdict = "ok" if entry["ok"] else "FAILED"
    print(f"drill: {args.name}: exit {args.exit_code} (expected {args.expected}) -> {verdict}", flush=True)


def short(facts: dict) -> str:
    """The facts of one step in a table cell: the scalar ones, the rest left to results.json."""
    keep = []
    for key, val in facts.items():
        if isinstance(val, (int, float, str, bool)) and len(str(val)) <= 80:
            keep.append(f"{key}={val}")
        elif key in ("train", "eval") and isinstance(val, dict):
            keep.append(f"{key}: {val['compared']} steps compared, max |diff| {val['max_abs_diff']}, "
                        f"{val['bitwise_equal']} bitwise equal" + (f", contiguous {val['contiguous']}"
                                                                  if "contiguous" in val else ""))
        elif key.startswith("install_") and isinstance(val, dict):
            keep.append(f"{key[8:]} layer: {'cached' if val['cached'] else str(val['seconds']) + ' s'}")
        elif key == "marker" and isinstance(val, dict):
            keep.append(f"marker step {val.get('step')} signal {val.get('signal')}")
    return "; ".join(keep).replace("|", "\\|")


def cmd_report(args) -> None:
    results = Path(args.results)
    steps = [json.loads(line) for line in Path(args.steps).read_text().splitlines() if line.strip()]
    meta = json.loads(Path(args.meta).read_text()) if args.meta else {}
    failed = [s["step"] for s in steps if not s["ok"]]
    doc = {**meta, "steps": steps, "all_ok": not failed, "failed": failed}
    (results / "results.json").write_text(json.dumps(doc, indent=1) + "\n")
    lines = [f"# Docker drill, {meta.get('date', '?')}", "",
             "Written by `scripts/docker/drill.sh` (run it again to replace this file and results.json).", "",
             f"Machine: {meta.get('machine', '?')}. Docker {meta.get('docker_server', '?')}. "
             f"Base: {meta.get('base_image', '?')}. torch index: {meta.get('torch_index_url', '?')}. "
             f"Commit {meta.get('commit', '?')}{' + uncommitted changes' if meta.get('dirty') else ''}.", "",
             "| step | command | exit code | expected | ok | key facts |", "|---|---|---|---|---|---|"]
    for s in steps:
        command = s["command"].replace("|", "\\|")
        lines.append(f"| {s['step']} | `{command}` | {s['exit_code']} | {s['expected_exit_code']} | "
                     f"{'yes' if s['ok'] else '**NO**'} | {short(s['facts'])} |")
    lines += ["", f"All checks passed: {'yes' if not failed else 'NO (' + ', '.join(failed) + ')'}.", ""]
    compared = next((s["facts"] for s in steps if "losses_after_resume" in s["facts"]), None)
    if compared:
        lines += [f"Losses after the resume (from step {compared['resumed_from']}), first "
                  f"{len(compared['losses_after_resume'])} and the last:", "",
                  "| step | resumed run | uninterrupted run |", "|---|---|---|"]
        for row in compared["losses_after_resume"] + [compared["final"]]:
            lines.append(f"| {row['step']} | {row['resumed']!r} | {row['uninterrupted']!r} |")
        lines.append("")
    (results / "drill.md").write_text("\n".join(lines))
    print(f"drill: {len(steps)} steps, {'all ok' if not failed else 'FAILED: ' + ', '.join(failed)} -> {results}")
    sys.exit(0 if not failed else 1)


def cmd_meta(args) -> None:
    """What the drill ran on: the machine, Docker, the commit, plus the drill's own key=value facts."""
    def out(*cmd):
        return subprocess.run(cmd, capture_output=True, text=True).stdout.strip()

    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    mem = int(Path("/proc/meminfo").read_text().split()[1]) / 2**20
    gpu = "an NVIDIA device" if Path("/dev/nvidia0").exists() else "no GPU"
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{os.cpu_count()} cores ({cpu}), {mem:.0f} GiB, {gpu}, {platform.platform()}",
        "docker_server": out("docker", "version", "-f", "{{.Server.Version}}"),
        "docker_client": out("docker", "version", "-f", "{{.Client.Version}}"),
        "commit": out("git", "-C", args.root, "rev-parse", "--short", "HEAD"),
        "dirty": bool(out("git", "-C", args.root, "status", "--porcelain")),
    }
    for item in args.fact:
        key, _, text = item.partition("=")
        meta[key] = value(text)
    meta["serve"] = json.loads(Path(args.serve).read_text())
    Path(args.out).write_text(json.dumps(meta, indent=1) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("serve")
    p.add_argument("--served", required=True)
    p.add_argument("--context", required=True, help="folder for pip.conf and the copied files (the base's build)")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--torch_version", required=True)
    p.add_argument("--python", default=sys.executable, help="whose `pip config list` to read")
    p.add_argument("--facts", required=True)
    p.set_defaults(func=cmd_serve)
    p = sub.add_parser("record")
    p.add_argument("--steps", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--command", required=True)
    p.add_argument("--exit_code", required=True)
    p.add_argument("--expected", required=True)
    p.add_argument("--check", type=int)
    p.add_argument("--facts_file")
    p.add_argument("fact", nargs="*", help="key=value")
    p.set_defaults(func=cmd_record)
    p = sub.add_parser("last-step")
    p.add_argument("run")
    p.set_defaults(func=cmd_last_step)
    p = sub.add_parser("preempted")
    p.add_argument("run")
    p.add_argument("--uid", type=int, required=True)
    p.add_argument("--facts", required=True)
    p.set_defaults(func=cmd_preempted)
    p = sub.add_parser("compare")
    p.add_argument("--reference", required=True)
    p.add_argument("--run", required=True)
    p.add_argument("--max_steps", type=int, required=True)
    p.add_argument("--resumed_from", type=int, required=True)
    p.add_argument("--tolerance", type=float, default=0.0)
    p.add_argument("--show", type=int, default=10)
    p.add_argument("--uid", type=int, required=True)
    p.add_argument("--facts", required=True)
    p.set_defaults(func=cmd_compare)
    p = sub.add_parser("build-steps")
    p.add_argument("--log", required=True)
    p.add_argument("--facts", required=True)
    p.add_argument("--expect_cached", nargs="*", default=[], help="install.sh phases that must come from the cache")
    p.set_defaults(func=cmd_build_steps)
    p = sub.add_parser("meta")
    p.add_argument("--out", required=True)
    p.add_argument("--root", required=True)
    p.add_argument("--serve", required=True)
    p.add_argument("fact", nargs="*", help="key=value")
    p.set_defaults(func=cmd_meta)
    p = sub.add_parser("report")
    p.add_argument("--steps", required=True)
    p.add_argument("--results", required=True)
    p.add_argument("--meta")
    p.set_defaults(func=cmd_report)
    args = parser.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    os.umask(0o022)
    main()
