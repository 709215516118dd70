"""Hang recovery on the real control plane: spec.restart.onStall makes the operator restart a Stalled
job's gang (its JobSet is deleted and recreated; training resumes from the last checkpoint), counted
in status.stallRestarts. The e2e operator's stall timeout is 15 s (mjob.operator)."""

from __future__ import annotations

import json

import pytest
from mjob import run_for, small_job

pytestmark = pytest.mark.e2e


def test_on_stall_restarts_the_gang_and_counts_it(cluster, operator, jobs):
    jobs.create(small_job("hung", podMetadata=run_for(300), restart={"onStall": True}))
    jobs.wait_phase("hung", "Running")
    first_uid = jobs.jobset("hung")["metadata"]["uid"]
    first_pods = {p.metadata.name for p in jobs.pods("hung")}
    # no progress is ever reported: Stalled after 15 s, then the gang is restarted
    st = cluster.wait_for(lambda: (s := jobs.status("hung")).get("stallRestarts") == 1 and s, 90,
                          "stallRestarts 1", namespace=jobs.ns)
    js = cluster.wait_for(lambda: (j := jobs.jobset("hung")) and j["metadata"]["uid"] != first_uid and j, 60,
                          "a new JobSet", namespace=jobs.ns)
    assert js["metadata"]["uid"] != first_uid
    st = jobs.wait_phase("hung", "Running")
    assert not first_pods & {p.metadata.name for p in jobs.pods("hung") if not p.metadata.deletion_timestamp}
    # events are posted asynchronously
    cluster.wait_for(lambda: {"StallRestart", "JobSetRecreated"} <= {e.reason for e in jobs.events("hung")} or None,
                     30, "StallRestart and JobSetRecreated events", namespace=jobs.ns)
    stalled = {c["type"]: c for c in st["conditions"]}["Stalled"]
    print("status seen by the user:\n" + json.dumps({k: st.get(k) for k in ("phase", "reason", "message",
                                                                           "restarts", "stallRestarts")}, indent=2)
          + "\nStalled: " + json.dumps(stalled))
    assert st["stallRestarts"] == 1 and st["restarts"] == 0  # counted apart from the JobSet's restarts
