"""Checkpoint directory layout: tracker, completeness, resume selection, retention. Pure (stdlib).

Layout (Megatron-LM's, docs/trainer-contract.md):
    <dir>/iter_0001000/                       torch_dist: __*.distcp, .metadata, metadata.json
    <dir>/latest_checkpointed_iteration.txt   "<iteration>", written by temp file + rename

A torch_dist checkpoint is complete when `metadata.json` exists: Megatron-Core's
`metadata_finalize_fn` writes it last, on rank 0, after every rank's shards and the global
`.metadata` are on disk (dist_checkpointing/serialization.py). The tracker is published after that.

A root may also be an object-store location, `msc://PROFILE/PREFIX` (objstore.py): the same layout
as keys, the same rules. The tracker is one PUT (atomic on S3), written after metadata.json; deletes
remove metadata.json first. Paths of such checkpoints are `str` URLs, local ones `Path`s.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

TRACKER_NAME = "latest_checkpointed_iteration.txt"
_ITER_RE = re.compile(r"^iter_(\d{7,})$")


def checkpoint_name(iteration: int) -> str:
    """`iter_0001000`, Megatron-LM's `get_checkpoint_name` for torch_dist."""
    if iteration < 0:
        raise ValueError(f"iteration must be >= 0, got {iteration}")
    return f"iter_{iteration:07d}"


def _store(root):
    """The object store behind an msc:// root (objstore.MscStore), or None for a local directory."""
    if isinstance(root, str) and root.startswith("msc://"):
        from .objstore import MscStore

        return MscStore(root)
    return None


def _split(url: str) -> tuple[str, str]:
    parent, _, name = url.rstrip("/").rpartition("/")
    return parent, name


def checkpoint_path(root: str | Path, iteration: int) -> Path | str:
    if isinstance(root, str) and root.startswith("msc://"):
        return f"{root.rstrip('/')}/{checkpoint_name(iteration)}"
    return Path(root) / checkpoint_name(iteration)


def read_tracker(root: str | Path) -> int | None:
    """The iteration the tracker names; None when missing, empty, corrupt or 'release'."""
    store = _store(root)
    if store is not None:
        text = (store.read_text(TRACKER_NAME) or "").strip()
        return int(text) if text.isdigit() else None
    try:
        text = (Path(root) / TRACKER_NAME).read_text().strip()
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError, UnicodeDecodeError):
        return None
    return int(text) if text.isdigit() else None


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_tracker(root: str | Path, iteration: int) -> None:
    """Publish `iteration` atomically: write a temp file, fsync, rename over the tracker, fsync the dir
    (on an object store: one PUT, which replaces the object atomically)."""
    store = _store(root)
    if store is not None:
        store.write_text(TRACKER_NAME, f"{iteration}\n")
        return
    root = Path(root)
    tmp = root / f".{TRACKER_NAME}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(f"{iteration}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / TRACKER_NAME)
    _fsync_dir(root)


def write_small_file(root: str | Path, name: str, text: str) -> None:
    """A small file at the checkpoint root (the goodput ledger), replaced atomically: temp file + rename
    locally, one PUT on an object store. No fsync: losing the last write to a crash costs one report."""
    store = _store(root)
    if store is not None:
        store.write_text(name, text)
        return
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{name}.tmp.{os.getpid()}"
    tmp.write_text(text)
    os.replace(tmp, root / name)


def read_small_file(root: str | Path, name: str, limit: int = 1 << 20) -> str | None:
    """A small file at the checkpoint root, or None when it is missing, larger than `limit` or not text."""
    store = _store(root)
    if store is not None:
        text = store.read_text(name)
        return text if text is not None and len(text) <= limit else None
    try:
        path = Path(root) / name
        if path.stat().st_size > limit:
            return None
        return path.read_text()
    except (OSError, UnicodeDecodeError):
        return None


def is_complete(path: str | Path) -> bool:
    """A torch_dist checkpoint directory whose metadata.json (written last) is present and valid."""
    store = _store(path)
    if store is not None:
        try:
            meta = json.loads(store.read_text("metadata.json") or "")
        except ValueError:
            return False
        return isinstance(meta, dict) and meta.get("sharded_backend") == "torch_dist" and store.is_file(".metadata")
    path = Path(path)
    try:
        meta = json.loads((path / "metadata.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and meta.get("sharded_backend") == "torch_dist" and (path / ".metadata").is_file()


@dataclass(frozen=True)
class CheckpointEntry:
    iteration: int
    path: Path | str
    complete: bool


def list_checkpoints(root: str | Path) -> list[CheckpointEntry]:
    """Every `iter_*` directory under root, oldest first."""
    store = _store(root)
    if store is not None:
        return sorted((CheckpointEntry(int(m.group(1)), store.join(name), is_complete(store.join(name)))
                       for name in store.list_dirs() if (m := _ITER_RE.match(name))), key=lambda e: e.iteration)
    root = Path(root)
    if not root.is_dir():
        return []
    entries = []
    for child in root.iterdir():
        m = _ITER_RE.match(child.name)
        if m and child.is_dir():
            entries.append(CheckpointEntry(int(m.group(1)), child, is_complete(child)))
    return sorted(entries, key=lambda e: e.iteration)


@dataclass(frozen=True)
class ResumeChoice:
    iteration: int
    path: Path | str
    reason: str


def find_resume_checkpoint(root: str | Path) -> ResumeChoice | None:
    """The newest COMPLETE checkpoint under root, or None (start from scratch).

    The tracker names the last published checkpoint. It is trusted only if its directory is
    complete. A complete directory newer than the tracker means the run died between writing
    metadata.json and publishing the tracker: that checkpoint is whole and is preferred.
    Incomplete directories (a save cut short) are never chosen.
    """
    entries = list_checkpoints(root)
    complete = [e for e in entries if e.complete]
    tracked = read_tracker(root)
    newest = complete[-1] if complete else None
    if tracked is not None:
        tracked_entry = next((e for e in complete if e.iteration == tracked), None)
        if tracked_entry is not None and (newest is None or newest.iteration <= tracked):
            return ResumeChoice(tracked, tracked_entry.path, "tracker")
        if newest is None:
            return None
        why = ("newer than the tracker" if tracked_entry is not None
               else f"tracker names iteration {tracked}, which is not a complete checkpoint")
        return ResumeChoice(newest.iteration, newest.path, f"newest complete ({why})")
    if newest is None:
        return None
    return ResumeChoice(newest.iteration, newest.path, "newest complete (tracker missing or corrupt)")


def select_for_deletion(entries: list[CheckpointEntry], keep: int, protect: set[int] = frozenset()) -> list[CheckpointEntry]:
    """Old complete checkpoints beyond the newest `keep` complete ones (keep=0: none).

    Never returns the newest complete checkpoint, an incomplete directory (it may be a save in
    flight) or an iteration in `protect` (e.g. the one the tracker names, or the one resumed from).
    """
    if keep <= 0:
        return []
    complete = [e for e in entries if e.complete]
    keep_set = {e.iteration for e in complete[-max(keep, 1):]} | set(protect)
    return [e for e in complete[:-1] if e.iteration not in keep_set]


def delete_checkpoint(entry: CheckpointEntry) -> None:
    """Remove a complete checkpoint: metadata.json first, so a half-deleted dir reads as incomplete."""
    if isinstance(entry.path, str) and entry.path.startswith("msc://"):
        parent, name = _split(entry.path)
        _store(parent).delete_tree(name, first="metadata.json")
        return
    meta = entry.path / "metadata.json"
    try:
        meta.unlink()
    except FileNotFoundError:
        pass
    shutil.rmtree(entry.path, ignore_errors=True)


def remove_incomplete(root: str | Path) -> list[CheckpointEntry]:
    """Delete the `iter_*` directories that are not complete checkpoints: saves a failure cut short. None of them
    can ever be resumed from or completed (a resume picks the newest complete one, and a later save of the same
    iteration starts afresh), and each can hold a whole checkpoint's bytes: left alone, they filled the volume of
    a job that failed during saves. Called at start-up, when no save of this job is in flight."""
    removed = []
    for entry in list_checkpoints(root):
        if entry.complete:
            continue
        if isinstance(entry.path, str):
            parent, name = _split(entry.path)
            _store(parent).delete_tree(name)
        else:
            shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(entry)
    return removed


def prepare_save_dir(root: str | Path, iteration: int) -> Path | str:
    """Create `iter_N` for a new save. A leftover dir of the same iteration (an earlier attempt) is
    removed first, so stale shards or a stale metadata.json can never make a partial save look complete.
    On an object store there is nothing to create: leftover keys under `iter_N/` are deleted."""
    store = _store(root)
    if store is not None:
        store.delete_tree(checkpoint_name(iteration), first="metadata.json")
        return checkpoint_path(root, iteration)
    path = checkpoint_path(root, iteration)
    if path.exists():
        stale = path.with_name(path.name + f".stale.{os.getpid()}")
        os.replace(path, stale)
        (stale / "metadata.json").unlink(missing_ok=True)
        shutil.rmtree(stale, ignore_errors=True)
    path.mkdir(parents=True, exist_ok=False)
    return path


def gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def tree_bytes(path: Path) -> int:
    """Bytes of the files under a local directory (0 where it is gone)."""
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass
    return total


def _says_no_space(exc: BaseException | None) -> bool:
    """ENOSPC anywhere in the exception's causes, or the short write torch's zip writer reports for it
    ("[enforce fail at inline_container.cc] unexpected pos"), which the async writer wraps in
    "Worker failure: ...", as seen when a 235 GiB disk filled at a 7B model's third save (issue 49)."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        exc = todo.pop()
        if exc is None or id(exc) in seen:
            continue
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno == 28:
            return True
        try:
            text = str(exc)
        except Exception:
            text = ""
        if "No space left on device" in text or ("inline_container" in text and "unexpected pos" in text):
            return True
        todo += [exc.__cause__, exc.__context__]
        # torch.distributed.checkpoint's CheckpointException: {rank: (exception, traceback)}
        failures = getattr(exc, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) and f else f for f in failures.values()
                     if isinstance(f, (tuple, BaseException))]
    return False


def volume_full_problem(root: str | Path, needed_bytes: int | None, exc: BaseException | None = None) -> str | None:
    """Why a save into the local directory `root` cannot be written for lack of space, or None.

    Full: the error says so (ENOSPC, a short write), or less is free than the save needs."""
    if not isinstance(root, Path):
        return None  # an object store has no volume to fill (its quota errors are its own)
    try:
        usage = shutil.disk_usage(root)
    except OSError:
        return None
    short = needed_bytes is not None and usage.free < needed_bytes
    if not (_says_no_space(exc) or short):
        return None
    need = f"needs about {gib(needed_bytes)}" if needed_bytes else "could not be written"
    return f"the checkpoint volume at {root} is full: a save {need}, {gib(usage.free)} free of {gib(usage.total)}"


def space_warning(root: str | Path, checkpoint_bytes: int, keep: int) -> str | None:
    """At start-up: a local volume that cannot hold `keep` complete checkpoints and the one being written
    (keep 0 keeps them all: then one more save must fit). None when it can, or on an object store."""
    if not isinstance(root, Path) or checkpoint_bytes <= 0:
        return None
    try:
        usage = shutil.disk_usage(root)
    except OSError:
        return None
    held = sum(tree_bytes(e.path) for e in list_checkpoints(root)) if keep else 0
    need = (keep + 1) * checkpoint_bytes if keep else checkpoint_bytes
    if usage.free + held >= need:
        return None
    holds = f"keep={keep} complete checkpoints and the one being written" if keep else "one more checkpoint"
    return (f"the checkpoint volume at {root} has {gib(usage.free)} free ({gib(held)} in checkpoints that retention "
            f"may delete) but {holds} need {gib(need)} at {gib(checkpoint_bytes)} each: a save will fail once "
            f"it is full. Make the volume larger or keep fewer checkpoints")


def final_save_fits(seconds_since_signal: float, last_save_seconds: float | None, grace_s: float,
                    margin_s: float = 3.0) -> bool:
    """Whether a checkpoint started now should finish before the launcher's SIGKILL.

    torchrun SIGKILLs its workers `grace_s` after forwarding SIGTERM (30 s in torch 2.11, not
    configurable there). Unknown save time: try.
    """
    if last_save_seconds is None:
        return True
    return seconds_since_signal + last_save_seconds + margin_s <= grace_s
