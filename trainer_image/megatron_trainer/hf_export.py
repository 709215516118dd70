"""Where a Hugging Face export goes: a local directory (a PVC) or an object-store prefix (pure: no torch).

hf_torch.export_weights streams the safetensors shards; a target says where they land and when the
export becomes visible as complete. Both targets promise the same:

- **Never overwrite.** A target that holds anything this trainer did not write is refused (exit 2,
  naming it); one that holds this export of the same iteration is skipped (a restart after the
  export finished).
- **Nothing looks complete until it is.** Local: everything goes into `.<name>.partial-<iteration>`
  beside the target, renamed into place last. Object store (no rename on S3): a partial marker is
  written first, then the shards, config.json, generation_config.json and the tokenizer files, then
  `model.safetensors.index.json` (without it transformers loads nothing), then the completion marker
  `.megatron-export.json`, and the partial marker is deleted. A crash leaves the partial marker; the
  next attempt deletes what it finds under a prefix that holds it and starts again.
- **Bounded memory.** A shard is written to a local file a tensor at a time; for the object store
  that file is a staging copy under $TMPDIR (the pod's /tmp emptyDir), uploaded (multipart, by
  boto3's transfer manager) and deleted before the next shard is started: the staging space is one
  shard per writing rank (at most 5 GB), never the model.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from .hf_source import MARKER, PARTIAL_MARKER, prepare_export_dir

log = logging.getLogger(__name__)

#: The MSC profile of the export (the checkpoints have their own, objstore.PROFILE).
EXPORT_PROFILE = "hf-export"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalExport:
    """--hf-export DIR: a temporary directory beside DIR, renamed into place when complete."""

    def __init__(self, final: str):
        self.final = Path(final)
        self.dir: Path | None = None

    def __str__(self) -> str:
        return str(self.final)

    def prepare(self, iteration: int) -> tuple[str, str]:
        """Rank 0: ('go', detail) | ('skip', why) | ('fail', message)."""
        try:
            return prepare_export_dir(self.final, iteration)
        except OSError as e:
            return "fail", f"--hf-export {self.final}: cannot create the export: {e}"

    def begin(self, detail: str) -> None:
        """Every rank, after prepare's 'go' (detail: the temporary directory)."""
        self.dir = Path(detail)

    def shard_path(self, name: str) -> Path:
        assert self.dir is not None
        return self.dir / name

    def shard_written(self, name: str, path: Path) -> None:
        """Nothing to do: the shard is in the temporary directory already."""

    def publish(self, files: list[str], marker: dict) -> None:
        """Rank 0, after every shard is written: `files` (config, tokenizer, index) are in self.dir."""
        assert self.dir is not None
        (self.dir / MARKER).write_text(json.dumps(marker) + "\n")
        (self.dir / PARTIAL_MARKER).unlink()
        for f in self.dir.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        _fsync_dir(self.dir)
        os.rename(self.dir, self.final)
        _fsync_dir(self.final.parent)

    def close(self) -> None:
        """Nothing to clean up: a crash's temporary directory is removed by the next attempt."""


class StoreExport:
    """--hf-export s3://BUCKET/PREFIX: the files under PREFIX/, the index and the marker last."""

    def __init__(self, url: str, endpoint: str | None, region: str | None, profile: str = EXPORT_PROFILE):
        from .objstore import MscStore, configure

        self.url = url.rstrip("/")
        self.store = MscStore(configure(url, endpoint, region, profile=profile))
        self.dir: Path | None = None  # local staging: one shard at a time (rank 0: also the small files)

    def __str__(self) -> str:
        return self.url

    def inspect(self) -> tuple[str, dict | None, list[str]]:
        """('empty' | 'complete' | 'partial' | 'foreign', the marker's content, the keys under the prefix)."""
        keys = self.store.list_keys()
        if not keys:
            return "empty", None, keys
        for name, state in ((MARKER, "complete"), (PARTIAL_MARKER, "partial")):
            if name in keys:
                try:
                    content = json.loads(self.store.read_text(name) or "")
                except ValueError:
                    content = None
                return state, content if isinstance(content, dict) else {}, keys
        return "foreign", None, keys

    def check_at_start(self) -> str | None:
        """Rank 0 at start-up: the bucket answers with these credentials (ObjectStoreError otherwise) and
        the prefix holds nothing this trainer did not write; a message when it does."""
        state, _, keys = self.inspect()
        if state == "foreign":
            return self._foreign(keys)
        return None

    def _foreign(self, keys: list[str]) -> str:
        return (f"--hf-export {self.url} already holds {len(keys)} object(s) this trainer did not write (e.g. "
                f"{keys[0]!r}); an export never overwrites (choose another spec.export.huggingFace.path, or delete "
                "them)")

    def prepare(self, iteration: int) -> tuple[str, str]:
        """Rank 0: ('go', '') | ('skip', why) | ('fail', message). ObjectStoreError when the store refuses."""
        state, marker, keys = self.inspect()
        if state == "complete":
            if marker.get("iteration") == iteration:
                return "skip", f"{self.url} already holds the export of iteration {iteration}"
            return "fail", (f"--hf-export {self.url} already holds an export of iteration {marker.get('iteration')}; "
                            "an export never overwrites (choose another spec.export.huggingFace.path, or delete it)")
        if state == "foreign":
            return "fail", self._foreign(keys)
        if state == "partial":  # an earlier attempt died mid-export: its marker goes last
            others = [k for k in keys if k != PARTIAL_MARKER]
            self.store.delete_keys(others)
            log.info("hf export: removed %d object(s) an interrupted export left under %s", len(others), self.url)
        self.store.write_text(PARTIAL_MARKER, json.dumps({"iteration": iteration}))
        return "go", ""

    def begin(self, detail: str) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="hf-export-"))

    def shard_path(self, name: str) -> Path:
        assert self.dir is not None
        return self.dir / name

    def shard_written(self, name: str, path: Path) -> None:
        """Upload the shard just written and free its staging space."""
        self.store.upload_file(name, path)
        path.unlink()

    def publish(self, files: list[str], marker: dict) -> None:
        """Rank 0, after every rank uploaded its shards: the small files, the index (last of the files in
        `files`), the completion marker, then the partial marker deleted."""
        assert self.dir is not None
        for name in files:
            self.store.upload_file(name, self.dir / name)
        self.store.write_text(MARKER, json.dumps(marker) + "\n")
        self.store.delete_keys([PARTIAL_MARKER])

    def close(self) -> None:
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None


def export_target(checkpoint_cfg) -> LocalExport | StoreExport:
    """The target of --hf-export (a directory, or s3://BUCKET/PREFIX through the object-store flags)."""
    path = checkpoint_cfg.hf_export
    if path.startswith("s3://"):
        return StoreExport(path, checkpoint_cfg.object_store_endpoint, checkpoint_cfg.object_store_region)
    return LocalExport(path)
