"""The kopf glue's registrations: only what the level-based design allows (handlers.py's docstring)."""

from __future__ import annotations

import kopf
import pytest
from megatron_operator import handlers


def test_no_changing_handlers_or_daemons():
    """NoDiffBase is only correct while kopf has nothing to diff for: no create/update/resume/delete
    handlers (they also cost an annotation PATCH per job) and no daemons or timers (a finalizer each)."""
    registry = kopf.get_default_registry()
    assert list(registry._changing.get_all_handlers()) == []
    assert list(registry._spawning.get_all_handlers()) == []
    watched = {h.id for h in registry._watching.get_all_handlers()}
    assert watched == {"observe-job", "observe-jobset", "observe-pod"}


def test_no_diff_base_copies_nothing_and_refuses_to_store():
    storage = handlers.NoDiffBase()
    body = kopf.Body({"metadata": {"name": "a", "labels": {"x": "y"}}, "spec": {"numNodes": 2}})
    assert storage.build(body=body) == {}
    assert storage.fetch(body=body) is None
    with pytest.raises(RuntimeError, match="real diff base"):
        storage.store(body=body, patch=kopf.Patch(), essence=storage.build(body=body))
