"""goodput.py: the ledger across attempts (failure, clean stop), its file, and the projection (pure)."""

from __future__ import annotations

import json

import pytest
from megatron_trainer import goodput as G


def _run(ledger: G.Ledger, iteration: int, productive: float, startup: float, save_blocked: float, at: float,
         clean: bool = False) -> G.Ledger:
    cur = ledger.current
    cur.iteration, cur.productive, cur.startup, cur.save_blocked = iteration, productive, startup, save_blocked
    cur.report_time, cur.ended_cleanly = at, clean
    return ledger


def test_a_failed_attempt_is_closed_into_lost_and_restart_time():
    first = _run(G.begin(None, 1000.0, 0), iteration=100, productive=297.0, startup=30.0, save_blocked=4.0,
                 at=1340.0)
    assert G.summary(first, 1340.0) == {"ratio": round(297 / 340, 4), "wallSeconds": 340.0, "attempts": 1,
                                        "productiveSeconds": 297.0, "startupSeconds": 30.0,
                                        "saveBlockedSeconds": 4.0, "lostSeconds": 0.0, "restartSeconds": 0.0,
                                        "otherSeconds": 9.0}
    # killed after its last report; the next attempt starts at 1400 from the checkpoint of iteration 80
    second = G.begin(G.Ledger.from_json(first.to_json()), 1400.0, 80)
    assert second.attempts == 2 and second.since == 1000.0
    lost = 20 * 297.0 / 100  # 20 iterations redone at the first attempt's step time
    assert second.closed["lost"] == pytest.approx(lost)
    assert second.closed["productive"] == pytest.approx(297.0 - lost)
    assert second.closed["restart"] == pytest.approx(60.0)
    _run(second, iteration=150, productive=200.0, startup=25.0, save_blocked=3.0, at=1630.0)
    g = G.summary(second, 1630.0)
    assert g["wallSeconds"] == 630.0 and g["attempts"] == 2
    assert g["productiveSeconds"] == pytest.approx(297.0 - lost + 200.0, abs=0.1)
    assert g["startupSeconds"] == 55.0 and g["saveBlockedSeconds"] == 7.0 and g["restartSeconds"] == 60.0
    parts = sum(g[k] for k in ("productiveSeconds", "startupSeconds", "saveBlockedSeconds", "lostSeconds",
                               "restartSeconds", "otherSeconds"))
    assert parts == pytest.approx(g["wallSeconds"], abs=0.5)


def test_time_after_a_clean_stop_is_not_wall_time():
    first = _run(G.begin(None, 0.0, 0), iteration=50, productive=100.0, startup=20.0, save_blocked=60.0, at=200.0,
                 clean=True)  # SIGTERM: a final save, exit 0 (suspended for an hour: a layout change)
    second = G.begin(first, 3800.0, 50)
    assert second.stopped == 3600.0 and second.closed["restart"] == 0.0 and second.closed["lost"] == 0.0
    g = G.summary(second, 3800.0)
    assert g["wallSeconds"] == 200.0 and g["startupSeconds"] == 20.0  # the new attempt has not aged yet


def test_before_its_first_step_an_attempt_is_start_up():
    ledger = G.begin(None, 100.0, 0)
    assert G.summary(ledger, 125.0)["startupSeconds"] == 25.0


@pytest.mark.parametrize("text", ["", "[]", "{}", '{"version": 2}', "not json",
                                  json.dumps({"version": 1, "since": float("nan"), "attempts": 1,
                                              "closed": dict.fromkeys(G.PARTS, 0.0), "current": None}),
                                  json.dumps({"version": 1, "since": 1.0, "attempts": 1,
                                              "closed": dict.fromkeys(G.PARTS, -5.0), "current": None}),
                                  json.dumps({"version": 1, "since": 1.0, "attempts": 1, "closed": {}})])
def test_an_unreadable_ledger_starts_a_new_one(text):
    assert G.Ledger.from_json(text) is None
    assert G.begin(G.Ledger.from_json(text), 5.0, 10).attempts == 1


def test_a_week_long_7b_job_from_per_event_costs():
    # a start-up of 30 s, saves every 30 minutes blocking 2 s, one failure a day costing 60 s + a start-up
    g = G.projected(startup_s=30.0, save_blocked_s=2.0, save_interval_s=1800.0, restart_s=60.0, failures_per_day=1)
    assert g["per_failure_s"] == 30.0 + 60.0 + 900.0
    assert 0.985 < g["goodput"] < 0.99
