"""Experiment trackers through accelerate (`--report_to tensorboard wandb trackio`), with secrets
removed before any tracker sees them.

accelerate's `init_trackers(config=...)` writes every value as given: a token passed in an option
ends up in TensorBoard's hparams and event file, in wandb's run file and debug log, and in
trackio's database (docs/toolchain.md#trackers-and-secrets). So the config (and the run name) go through `redact` first:
- the whole value of any key that names a secret (token, api_key, password, secret, credential...);
- substrings that look like credentials wherever they are: Hugging Face / OpenAI / GitHub / Slack
  tokens, AWS access key ids, 40-hex keys (wandb's format), passwords in URLs, `token=` query values;
- the value of every environment variable whose name names a secret (HF_TOKEN, WANDB_API_KEY, ...),
  wherever it turns up (a path or an id that embeds it).
wandb also records the command line and host metadata on its own; that is switched off, since the
command line holds the options before redaction.

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
import uuid

TRACKERS = ("tensorboard", "wandb", "trackio")
REDACTED = "[redacted]"

SECRET_NAME = re.compile(r"api[_-]?key|token(?!izer)|secret|passw(or)?d|credential|auth|private[_-]?key|signature",
                         re.IGNORECASE)
SECRET_VALUE = re.compile(
    r"hf_[A-Za-z0-9]{20,}"              # Hugging Face
    r"|sk-[A-Za-z0-9_-]{20,}"           # OpenAI-style
    r"|gh[pousr]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,}"
    r"|xox[abprs]-[A-Za-z0-9-]{10,}"    # Slack
    r"|AKIA[0-9A-Z]{16}"                # AWS access key id
    r"|\b[0-9a-fA-F]{40}\b"             # wandb API keys are 40 hex digits
)
URL_PASSWORD = re.compile(r"(://[^/\s:@]*:)[^/\s@]+(@)")  # user:password@ (the user may be empty)
# a query or key=value pair whose name mentions a secret: ?api_key=..., &X-Amz-Signature=..., access-token=...
QUERY_SECRET = re.compile(r"((?:^|[?&;,\s])[\w.-]*(?:token(?!izer)|key|secret|passw|sig|credential|auth)[\w.-]*=)"
                          r"[^&;,\s]+",
                          re.IGNORECASE)
BEARER = re.compile(r"((?:bearer|basic|token)\s+)[A-Za-z0-9._~+/=-]{8,}", re.IGNORECASE)


def secret_env_values() -> list[str]:
    """Values of environment variables whose names name a secret (long enough to be one), longest first."""
    return sorted({v for k, v in os.environ.items() if SECRET_NAME.search(k) and len(v) >= 8}, key=len, reverse=True)


def redact_text(text: str, env_secrets: list[str]) -> str:
    for secret in env_secrets:
        text = text.replace(secret, REDACTED)
    text = SECRET_VALUE.sub(REDACTED, text)
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
    if stored and stored.get("output_dir") == here:
        return stored
    return {"id": os.environ.get("WANDB_RUN_ID") or uuid.uuid4().hex[:16], "name": run_name(cfg), "output_dir": here}


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
