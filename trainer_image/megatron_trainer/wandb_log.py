"""Weights & Biases: the log line's scalars to a W&B run, from the last rank (Megatron-LM's get_wandb_writer).

Megatron-LM's flags (--wandb-project, --wandb-exp-name, --wandb-entity, --wandb-save-dir) and two of this
trainer's own: --wandb-mode (online | offline) and --wandb-api-key-file, a file of a Secret volume. The key is
read in-process and handed to wandb.init's settings: never an argument or an environment variable (wandb's
service process inherits the environment), never written to ~/.netrc (wandb.login(key=...) would).

The run's id is kept beside the checkpoints (--save, a PVC directory or s3://) or else in --wandb-save-dir, so
a restart that resumes from a checkpoint continues the same run (resume="allow"). Steps are iterations.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
import re
from collections.abc import Mapping
from typing import Any

from .exitcodes import ExitCode, Fatal

log = logging.getLogger(__name__)

#: The file beside the checkpoints (or in --wandb-save-dir) that holds the run's id.
RUN_ID_FILE = "wandb-run-id"
RUN_ID = r"[a-z0-9]{8,32}"
#: A key file larger than this is not a key.
MAX_KEY_BYTES = 1024


def enabled(cfg) -> bool:
    return bool(cfg.logging.wandb_project)


def read_api_key(path: str) -> str:
    """The key in ``path``: one token, no whitespace inside. Fatal (exit 2, not retried) otherwise; the message
    names the file, never its content."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_KEY_BYTES + 1)
    except OSError as e:
        raise Fatal(ExitCode.BAD_ARGUMENTS, f"--wandb-api-key-file {path}: cannot read it ({e.strerror or e}); "
                    "check spec.logging.wandb.apiKeySecret's name and key") from None
    try:
        key = data.decode("ascii").strip()
    except UnicodeDecodeError:
        key = ""
    if len(data) > MAX_KEY_BYTES or not key or any(c.isspace() for c in key) or not key.isprintable():
        raise Fatal(ExitCode.BAD_ARGUMENTS, f"--wandb-api-key-file {path}: does not hold one API key (expected one "
                    "line of printable characters, at most 1 KiB); check the Secret's value")
    return key


def preflight(cfg, environ: Mapping[str, str]) -> None:
    """Start-up checks on every rank, before CUDA and the process group: wandb importable, the key readable.
    Fatal (exit 2) with one line saying what to fix."""
    if not enabled(cfg):
        return
    lg = cfg.logging
    if importlib.util.find_spec("wandb") is None:
        raise Fatal(ExitCode.BAD_ARGUMENTS, "--wandb-project needs the wandb package in the trainer image; use an "
                    "image built from this repository's Dockerfile.trainer (the trainer extra pins wandb), or pip "
                    "install wandb")
    if lg.wandb_api_key_file:
        read_api_key(lg.wandb_api_key_file)
    elif lg.wandb_mode == "online" and not environ.get("WANDB_API_KEY"):
        raise Fatal(ExitCode.BAD_ARGUMENTS, "--wandb-mode online needs an API key: --wandb-api-key-file "
                    "(spec.logging.wandb.apiKeySecret), or --wandb-mode offline")


def save_dir(cfg) -> str:
    """--wandb-save-dir, or Megatron-LM's default <--save>/wandb for a directory --save, else ./wandb."""
    lg, save = cfg.logging, cfg.checkpoint.save
    if lg.wandb_save_dir:
        return lg.wandb_save_dir
    return os.path.join(save, "wandb") if save and not save.startswith("s3://") else os.path.abspath("wandb")


def flat_config(cfg) -> dict[str, Any]:
    """The resolved command line as the run's config: section.field -> value (no key material: the key file's
    path is a path)."""
    out: dict[str, Any] = {}
    for section in dataclasses.fields(cfg):
        for name, value in dataclasses.asdict(getattr(cfg, section.name)).items():
            out[f"{section.name}.{name}"] = list(value) if isinstance(value, tuple) else value
    return out


def run_id(cfg, directory: str) -> str:
    """The run's id: the one kept beside the checkpoints (or in ``directory``), or a new one, kept there."""
    from . import ckpt_layout

    root = cfg.checkpoint.save or directory
    found = (ckpt_layout.read_small_file(root, RUN_ID_FILE) or "").strip()
    if re.fullmatch(RUN_ID, found):
        return found
    import secrets

    new = "".join(secrets.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(12))
    ckpt_layout.write_small_file(root, RUN_ID_FILE, new + "\n")
    return new


class WandbWriter:
    """One W&B run on the logging rank; `log` at each log line, `close` at the end (also on errors and SIGTERM)."""

    def __init__(self, cfg, job_name: str | None = None):
        import wandb

        lg = cfg.logging
        directory = save_dir(cfg)
        os.makedirs(directory, exist_ok=True)
        key = read_api_key(lg.wandb_api_key_file) if lg.wandb_api_key_file else None
        self.run_id = run_id(cfg, directory)
        settings = wandb.Settings(api_key=key, console="off", quiet=True) if key else \
            wandb.Settings(console="off", quiet=True)
        self.run = wandb.init(project=lg.wandb_project, entity=lg.wandb_entity or None,
                              name=lg.wandb_exp_name or job_name or None, dir=directory, mode=lg.wandb_mode,
                              id=self.run_id, resume="allow", config=flat_config(cfg), settings=settings)
        del key
        log.info("wandb: run %s (%s) in project %s, files under %s", self.run_id, lg.wandb_mode, lg.wandb_project,
                 directory)

    def log(self, scalars: Mapping[str, float | None], step: int) -> None:
        self.run.log({k: v for k, v in scalars.items() if v is not None}, step=step)

    def close(self, exit_code: int = 0) -> None:
        run, self.run = self.run, None
        if run is not None:
            run.finish(exit_code=exit_code)
