"""Tracker, completeness, resume selection and retention (pure file-system logic)."""

from __future__ import annotations

import errno
import json
import shutil

from megatron_trainer import ckpt_layout
from megatron_trainer import ckpt_layout as L


def make_ckpt(root, iteration, complete=True):
    path = root / L.checkpoint_name(iteration)
    path.mkdir(parents=True)
    (path / "__0_0.distcp").write_bytes(b"shard")
    if complete:
        (path / ".metadata").write_bytes(b"global metadata")
        (path / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1}))
    return path


def test_names_and_tracker_roundtrip(tmp_path):
    assert L.checkpoint_name(1000) == "iter_0001000"
    assert L.read_tracker(tmp_path) is None
    L.write_tracker(tmp_path, 1200)
    assert (tmp_path / L.TRACKER_NAME).read_text() == "1200\n"
    assert L.read_tracker(tmp_path) == 1200
    assert [p.name for p in tmp_path.iterdir()] == [L.TRACKER_NAME]  # no temp file left behind


def test_corrupt_tracker_reads_as_none(tmp_path):
    for content in ("", "abc", "release", "12 13", "\x00"):
        (tmp_path / L.TRACKER_NAME).write_text(content)
        assert L.read_tracker(tmp_path) is None


def test_completeness(tmp_path):
    assert L.is_complete(make_ckpt(tmp_path, 1))
    assert not L.is_complete(make_ckpt(tmp_path, 2, complete=False))
    bad = make_ckpt(tmp_path, 3)
    (bad / "metadata.json").write_text("{trunc")
    assert not L.is_complete(bad)
    no_global = make_ckpt(tmp_path, 4)
    (no_global / ".metadata").unlink()
    assert not L.is_complete(no_global)


def test_resume_uses_tracker(tmp_path):
    make_ckpt(tmp_path, 100)
    make_ckpt(tmp_path, 200)
    L.write_tracker(tmp_path, 200)
    choice = L.find_resume_checkpoint(tmp_path)
    assert (choice.iteration, choice.reason) == (200, "tracker")


def test_resume_never_picks_a_partial_checkpoint(tmp_path):
    make_ckpt(tmp_path, 100)
    make_ckpt(tmp_path, 200, complete=False)  # a save cut short: killed during async write
    L.write_tracker(tmp_path, 100)
    assert L.find_resume_checkpoint(tmp_path).iteration == 100
    (tmp_path / L.TRACKER_NAME).unlink()
    choice = L.find_resume_checkpoint(tmp_path)
    assert choice.iteration == 100 and "tracker missing" in choice.reason


def test_resume_with_corrupt_tracker_or_tracker_naming_partial(tmp_path):
    make_ckpt(tmp_path, 100)
    make_ckpt(tmp_path, 300)
    make_ckpt(tmp_path, 400, complete=False)
    (tmp_path / L.TRACKER_NAME).write_text("")
    assert L.find_resume_checkpoint(tmp_path).iteration == 300
    L.write_tracker(tmp_path, 400)
    choice = L.find_resume_checkpoint(tmp_path)
    assert choice.iteration == 300 and "not a complete checkpoint" in choice.reason


def test_resume_prefers_complete_checkpoint_newer_than_tracker(tmp_path):
    make_ckpt(tmp_path, 100)
    make_ckpt(tmp_path, 200)  # died after metadata.json, before the tracker rename
    L.write_tracker(tmp_path, 100)
    choice = L.find_resume_checkpoint(tmp_path)
    assert choice.iteration == 200 and "newer than the tracker" in choice.reason


def test_resume_nothing(tmp_path):
    assert L.find_resume_checkpoint(tmp_path / "missing") is None
    make_ckpt(tmp_path, 5, complete=False)
    L.write_tracker(tmp_path, 5)
    assert L.find_resume_checkpoint(tmp_path) is None


def test_retention_deletes_only_old_complete_checkpoints(tmp_path):
    for it, complete in ((100, True), (150, False), (200, True), (300, True), (400, True), (500, False)):
        make_ckpt(tmp_path, it, complete)
    entries = L.list_checkpoints(tmp_path)
    assert [e.iteration for e in entries] == [100, 150, 200, 300, 400, 500]
    doomed = L.select_for_deletion(entries, keep=2)
    assert [e.iteration for e in doomed] == [100, 200]
    assert [e.iteration for e in L.select_for_deletion(entries, keep=2, protect={200})] == [100]
    assert L.select_for_deletion(entries, keep=0) == []
    assert L.select_for_deletion(entries, keep=10) == []
    # keep=1 still never deletes the newest complete one
    assert 400 not in [e.iteration for e in L.select_for_deletion(entries, keep=1)]
    for e in doomed:
        L.delete_checkpoint(e)
    assert [e.iteration for e in L.list_checkpoints(tmp_path)] == [150, 300, 400, 500]


def test_prepare_save_dir_clears_a_stale_attempt(tmp_path):
    stale = make_ckpt(tmp_path, 700)  # complete-looking leftovers of an earlier attempt at 700
    path = L.prepare_save_dir(tmp_path, 700)
    assert path == stale and path.is_dir() and list(path.iterdir()) == []
    assert not L.is_complete(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000700"]


def test_final_save_fits_the_sigkill_grace():
    assert L.final_save_fits(2.0, None, grace_s=30)  # unknown duration: try
    assert L.final_save_fits(2.0, 10.0, grace_s=30)
    assert not L.final_save_fits(2.0, 26.0, grace_s=30)
    assert not L.final_save_fits(20.0, 8.0, grace_s=30)


def test_a_full_volume_is_named_with_the_bytes_needed_and_free(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    # what the async writer reported when a 235 GiB disk filled at a 7B model's third save (issue 49)
    short_write = RuntimeError("Worker failure: [enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    for exc in (OSError(errno.ENOSPC, "No space left on device"), short_write):
        problem = ckpt_layout.volume_full_problem(tmp_path, 3 * 2**30, exc)
        assert problem.startswith(f"the checkpoint volume at {tmp_path} is full: a save needs about 3.0 GiB, ")
        assert "\n" not in problem and " free of " in problem
    # more needed than free is full whatever the error said
    assert ckpt_layout.volume_full_problem(tmp_path, free * 2, RuntimeError("boom")) is not None
    # another error with room to spare is not a full volume, nor is an object store's
    assert ckpt_layout.volume_full_problem(tmp_path, 1024, RuntimeError("NCCL timeout")) is None
    assert ckpt_layout.volume_full_problem("msc://p/x", 1024, OSError(errno.ENOSPC, "x")) is None


def test_start_up_warns_when_keep_plus_one_checkpoints_cannot_fit(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    warning = ckpt_layout.space_warning(tmp_path, free // 2, keep=2)
    assert warning is not None and "keep=2 complete checkpoints and the one being written" in warning
    assert ckpt_layout.space_warning(tmp_path, 1024, keep=2) is None
    assert ckpt_layout.space_warning(tmp_path, free * 2, keep=0).count("one more checkpoint") == 1
    # checkpoints retention would delete count as room
    (tmp_path / "iter_0000010").mkdir()
    (tmp_path / "iter_0000010" / "metadata.json").write_text("{}")
    (tmp_path / "iter_0000010" / "shard").write_bytes(b"x" * 4096)
    assert ckpt_layout.tree_bytes(tmp_path / "iter_0000010") == 4098


def test_saves_cut_short_are_removed_and_complete_ones_kept(tmp_path):
    make_ckpt(tmp_path, 10)
    make_ckpt(tmp_path, 20, complete=False)
    make_ckpt(tmp_path, 5, complete=False)
    removed = ckpt_layout.remove_incomplete(tmp_path)
    assert sorted(e.iteration for e in removed) == [5, 20]
    assert [(e.iteration, e.complete) for e in L.list_checkpoints(tmp_path)] == [(10, True)]


def test_enospc_inside_a_dcp_style_failure_table_is_found():
    class Wrapped(BaseException):  # torch.distributed.checkpoint's CheckpointException keeps {rank: (exc, tb)}
        failures = {3: (OSError(errno.ENOSPC, "No space left on device"), [])}

        def __str__(self):
            raise TypeError("str() of this one fails")

    assert ckpt_layout._says_no_space(Wrapped())
    assert not ckpt_layout._says_no_space(RuntimeError("NCCL watchdog timeout"))
