"""Secrets kept out of everything a run writes and prints, and experiment trackers through accelerate
(`--report_to tensorboard wandb trackio`).

A token given inside an option (`--run_name exp-hf_...`, a URL with a password) must not end up at
rest. accelerate's `init_trackers(config=...)` writes every value as given (TensorBoard's hparams and
event file, wandb's run file and debug log, trackio's database: docs/toolchain.md#trackers-and-secrets),
and the recipe itself writes the options into checkpoint.json, run_summary.json and its log. So every
string the recipe writes goes through `redact` (train.py: checkpoint.json's options and data, the
run's record in run_record.py, requeue.json) and every line it prints through `RedactedStream`.
Removed:
- the whole value of any option whose name names a secret (token, api_key, password, secret,
  credential...);
- values shaped like a credential wherever they are (TOKEN_SHAPES: Hugging Face, OpenAI-style `sk-`,
  GitHub, Slack, AWS access key ids, wandb's 40-hex keys), passwords in URLs, bearer tokens,
  `token=` query values;
- the value of every environment variable whose name names a secret (HF_TOKEN, WANDB_API_KEY, ...),
  wherever it turns up (a path or an id that embeds it).
Left alone, as they must be: ordinary words and paths, and digests (checkpoint.json's 32-hex xxh3
checksums, a chat template's 64-hex sha256, a Hub cache's `snapshots/<commit>` folder).
wandb also records the command line and host metadata on its own; that is switched off, and a
command line holding a token is warned about at start (`warn_command_line`): it is visible to `ps`
and `accelerate launch` prints it whole when the run fails, beyond the recipe's reach.

One tracker run per training run: the run's identity (an id and a name) is made once, stored in
every checkpoint.json, and reused on resume, so a run preempted and requeued N times is one curve,
not N: wandb gets `id=<id>, resume="allow"`; trackio the stored name with `resume="allow"` (trackio
finds runs by name); TensorBoard already writes to one folder per run and gets `purge_step`, which
hides the events a crash logged past the checkpoint resumed from (they are trained again). wandb
ignores steps at or below one it already has (after a crash, the steps between the checkpoint and
the crash are kept as first logged; with exact resume, the same numbers). A fresh run (no
checkpoint) is a new tracker run; $WANDB_RUN_ID, if set, is its id.

Where the files go: TensorBoard `<output_dir>/<project_name>/`, wandb `<output_dir>/wandb/`
(`WANDB_MODE=offline` writes there without network), trackio `$TRACKIO_DIR` or
`$HF_HOME/trackio/<project_name>.db`.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import threading
import uuid

TRACKERS = ("tensorboard", "wandb", "trackio")
REDACTED = "[redacted]"

SECRET_NAME = re.compile(r"api[_-]?key|token(?!izer)|secret|passw(or)?d|credential|auth|private[_-]?key|signature",
                         re.IGNORECASE)
# Credential shapes, as their issuers document them: (name, pattern, random base62 that must mix
# upper and lower case, as any real one does, so that words and paths of that shape are kept:
# `hf_finetunedsummarizationmodel`, `sk-learn-baseline-comparison`).
TOKEN_SHAPES = (
    ("Hugging Face", r"hf_[A-Za-z0-9]{20,}", True),  # hf_ + 34 letters
    ("OpenAI-style", r"sk-[A-Za-z0-9_-]{20,}", True),  # sk-..., sk-proj-..., sk-ant-api03-...
    ("GitHub", r"gh[pousr]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,}", True),
    ("Slack", r"xox[abeprs]-[A-Za-z0-9-]{10,}|xapp-[A-Za-z0-9-]{10,}", False),  # bot, user, app...
    ("AWS access key id", r"(?:AKIA|ASIA)[0-9A-Z]{16}", False),
    # wandb API keys: 40 hex digits (so is a git commit: a Hub cache's snapshots/<commit> is kept)
    ("wandb", r"(?<!snapshots/)[0-9a-fA-F]{40}", False),
)


def _standing_alone(patterns) -> re.Pattern:
    """Not inside a longer word: `mask-...` holds no `sk-` key, a 64-hex sha256 no 40-hex one."""
    return re.compile("|".join(rf"(?<![A-Za-z0-9])(?:{p})(?![A-Za-z0-9])" for p in patterns))


SECRET_VALUE = _standing_alone(pattern for _, pattern, _ in TOKEN_SHAPES)
MIXED_CASE_SHAPES = _standing_alone(pattern for _, pattern, mixed in TOKEN_SHAPES if mixed)
URL_PASSWORD = re.compile(r"(://[^/\s:@]*:)[^/\s@]+(@)")  # user:password@ (the user may be empty)
# a query or key=value pair whose name ends with a secret's: ?api_key=..., &X-Amz-Signature=..., access-token=...
QUERY_SECRET = re.compile(r"((?:^|[?&;,\s])[\w.-]*(?:token|key|secret|passw(?:or)?d|pass|sig|signature|credentials?"
                          r"|auth)=)[^&;,\s]+", re.IGNORECASE)
BEARER = re.compile(r"((?:\bbearer|\bauthorization:\s*(?:basic|token))\s+)[A-Za-z0-9._~+/=-]{8,}", re.IGNORECASE)


def _token_shaped(match: re.Match) -> str:
    token = match.group()
    if MIXED_CASE_SHAPES.fullmatch(token) and (token.lower() == token or token.upper() == token):
        return token  # a word or a path of a token's shape, not a random key
    return REDACTED


def secret_env_values() -> list[str]:
    """Values of environment variables whose names name a secret (long enough to be one), longest first."""
    return sorted({v for k, v in os.environ.items() if SECRET_NAME.search(k) and len(v) >= 8}, key=len, reverse=True)


def redact_text(text: str, env_secrets: list[str]) -> str:
    for secret in env_secrets:
        text = text.replace(secret, REDACTED)
    text = SECRET_VALUE.sub(_token_shaped, text)
    text = URL_PASSWORD.sub(rf"\g<1>{REDACTED}\g<2>", text)
    text = BEARER.sub(rf"\g<1>{REDACTED}", text)
    return QUERY_SECRET.sub(rf"\g<1>{REDACTED}", text)


def redact(value, env_secrets: list[str] | None = None, key: str = ""):
    """A copy of `value` (dicts, lists, scalars) with secrets replaced by '[redacted]'."""
    env_secrets = secret_env_values() if env_secrets is None else env_secrets
    if key and SECRET_NAME.search(key) and value not in (None, "", False):
        return REDACTED  # the whole value, whatever its type (a dict of credentials too)
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
    if isinstance(value, dict):
        return {k: redact(v, env_secrets, str(k)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact(v, env_secrets) for v in value]
    if isinstance(value, str):
        return redact_text(value, env_secrets)
    return value


def redact_strings(value, env_secrets: list[str] | None = None):
    """A copy of a record (dicts, lists, scalars) with every string in it redacted, dict keys too, but
    no value removed for its key's name: the record's keys are the project's (`tokens_seen` names no
    secret). Numbers, and digests (which have no token's shape), pass unchanged."""
    env_secrets = secret_env_values() if env_secrets is None else env_secrets
    if isinstance(value, dict):
        return {redact_strings(k, env_secrets): redact_strings(v, env_secrets) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [redact_strings(v, env_secrets) for v in value]
    if isinstance(value, (str, os.PathLike)):
        return redact_text(os.fspath(value), env_secrets)
    return value


class RedactedStream:
    """sys.stdout or sys.stderr with every write redacted: the recipe's lines, the libraries' warnings
    and a traceback's message alike. (A write is redacted whole: a token cut across two writes would
    pass, which print() of one string never does.) A library that patches `write` to see what is
    printed (wandb's console capture, on import) gets the redacted text: its patch runs inside ours."""

    def __init__(self, stream, env_secrets: list[str]):
        vars(self).update(stream=stream, env_secrets=env_secrets, patch=None, inside=threading.local())

    def write(self, text: str) -> int:
        text = redact_text(text, self.env_secrets)
        if self.patch is None or getattr(self.inside, "patch", False):
            return self.stream.write(text)
        self.inside.patch = True  # the patch calls the `write` it replaced: this one, which then writes
        try:
            return self.patch(text)
        finally:
            self.inside.patch = False

    def writelines(self, lines) -> None:
        for line in lines:
            self.write(line)

    def __setattr__(self, name, value):
        if name != "write":
            raise AttributeError(f"{name} of a redacted stream")
        vars(self)["patch"] = value

    def __getattr__(self, name):  # flush, isatty, fileno, encoding...: the stream's own
        return getattr(self.stream, name)


def redact_printed_lines() -> None:
    """From here on, everything this process prints goes through `redact_text`; logging handlers that
    already hold the streams (transformers', accelerate's) are pointed at the redacted ones."""
    import logging

    env_secrets = secret_env_values()
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if isinstance(stream, RedactedStream):
            continue
        redacted = RedactedStream(stream, env_secrets)
        setattr(sys, name, redacted)
        loggers = [logging.getLogger()] + [logger for logger in logging.Logger.manager.loggerDict.values()
                                           if isinstance(logger, logging.Logger)]
        for handler in {h for logger in loggers for h in logger.handlers}:
            if isinstance(handler, logging.StreamHandler) and handler.stream is stream:
                handler.setStream(redacted)


def warn_command_line(argv: list[str], main_process: bool) -> list[str]:
    """The options on the command line that hold a secret-looking value, with a warning (main process):
    they are redacted from what the run writes, but a command line is visible to every user of the
    machine (`ps`) and `accelerate launch` prints it whole when the run fails."""
    env_secrets = secret_env_values()
    named = []
    for i, arg in enumerate(argv):
        if redact_text(arg, env_secrets) == arg:
            continue
        if arg.startswith("--"):
            named.append(arg.split("=", 1)[0])
        else:  # the value of the option before it (or of a list option further back)
            named.append(next((a for a in reversed(argv[:i]) if a.startswith("--")), "an argument"))
    named = list(dict.fromkeys(named))
    if named and main_process:
        print(f"warning: {', '.join(named)} on the command line holds a secret-looking value: it is redacted "
              "from what this run writes and prints, but a command line is visible to other users (ps) and "
              "accelerate launch prints it whole if the run fails; pass secrets through the environment "
              "(HF_TOKEN, WANDB_API_KEY) instead", file=sys.stderr, flush=True)
    return named


def flatten(config: dict, prefix: str = "") -> dict:
    """Nested config -> {'a/b': scalar}: TensorBoard's hparams take only scalars and strings."""
    flat = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, f"{name}/"))
        elif isinstance(value, (int, float, str, bool)):
            flat[name] = value
        else:  # None, lists, paths: strings, redacted again (str() of an object was never checked)
            flat[name] = redact_text(str(value), secret_env_values())
    return flat


def check_available(report_to: list[str]) -> None:
    """Before any heavy work: an unknown tracker, or one whose package is missing, is bad input."""
    from common.config import ConfigError

    import importlib.util

    for name in report_to:
        if name not in TRACKERS:
            raise ConfigError(f"unknown tracker {name!r} in --report_to; choose from {', '.join(TRACKERS)}")
        if importlib.util.find_spec(name) is None:  # each tracker's package has the tracker's name
            raise ConfigError(f"--report_to {name} needs the {name} package: pip install -e '.[trackers]'")


def run_name(cfg) -> str:
    return redact_text(cfg.run_name or os.path.basename(os.path.abspath(cfg.output_dir)), secret_env_values())


def run_identity(cfg, resume_meta: dict | None) -> dict:
    """{"id", "name", "output_dir"} of the tracker run: the one a resumed checkpoint of this output
    folder recorded, else a new one (a checkpoint of another folder starts a run of its own). uuid4
    reads the OS's randomness, not the seeded RNGs: the run's numbers stay as they were."""
    stored = (resume_meta or {}).get("tracker_run")
    here = os.path.abspath(cfg.output_dir)
    recorded = redact_text(here, secret_env_values())  # as checkpoint.json keeps it (older ones: as it is)
    if stored and stored.get("output_dir") in (here, recorded):
        return stored
    return {"id": os.environ.get("WANDB_RUN_ID") or uuid.uuid4().hex[:16], "name": run_name(cfg),
            "output_dir": recorded}


def start(accelerator, cfg, setup: dict, identity: dict, start_step: int) -> None:
    """init_trackers with the redacted, flattened config (main process only, inside accelerate),
    continuing `identity`'s run from start_step (> 0: a checkpoint of this folder; 0: a new run)."""
    if not cfg.report_to:
        return
    env_secrets = secret_env_values()
    config = flatten(redact({**dataclasses.asdict(cfg), "setup": {k: v for k, v in setup.items() if k != "options"}},
                            env_secrets))
    resumed = start_step > 0
    init_kwargs = {"trackio": {"name": identity["name"], "resume": "allow" if resumed else "never"},
                   # Events at or past this step, from a crash or an earlier run in this folder, are hidden.
                   "tensorboard": {"purge_step": start_step + 1 if resumed else 0}}
    if "wandb" in cfg.report_to:
        import wandb

        # No command line (it holds the options unredacted), no code, git or host metadata.
        init_kwargs["wandb"] = {"name": identity["name"], "dir": cfg.output_dir, "id": identity["id"],
                                "resume": "allow",
                                "settings": wandb.Settings(x_disable_meta=True, save_code=False, disable_git=True)}
    accelerator.init_trackers(redact_text(cfg.project_name, env_secrets), config=config, init_kwargs=init_kwargs)
