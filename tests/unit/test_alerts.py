"""The chart's PrometheusRule, evaluated by Prometheus' own rule engine: `promtool test rules` on the
rules `helm template` renders, with input series shaped like what the operator and the trainer export.
And the dashboard's queries, parsed by Prometheus' PromQL parser (`promtool check rules`)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from test_chart import ALL_ON, CHART, _pinned_versions, one, render_chart

PROMTOOL_TIMEOUT_S = 60


def promtool_binary() -> str:
    """$PROMTOOL, else e2e/cluster's pinned build (`cluster.py build promtool`), else `promtool` on PATH."""
    if os.environ.get("PROMTOOL"):
        return os.environ["PROMTOOL"]
    cache = Path(os.environ.get("MEGATRON_OPERATOR_CACHE")
                 or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "megatron-operator")
    pinned = cache / "bin" / f"promtool-{_pinned_versions()['PROMETHEUS_MODULE_VERSION']}" / "promtool"
    if os.access(pinned, os.X_OK):
        return str(pinned)
    found = shutil.which("promtool")
    if found:
        return found
    pytest.fail(f"promtool not found: build the pinned one with `.venv/bin/python e2e/cluster/cluster.py build "
                f"promtool` (expected at {pinned}), put promtool on PATH, or set PROMTOOL=/path/to/promtool",
                pytrace=False)


def promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([promtool_binary(), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=PROMTOOL_TIMEOUT_S)


@pytest.fixture(scope="module")
def rules_file(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("rules")
    rule = one(render_chart(ALL_ON, d), "PrometheusRule")
    path = d / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    return path


def run_tests(rules_file: Path, tests: list[dict]) -> None:
    test_file = rules_file.parent / "tests.yaml"
    test_file.write_text(yaml.safe_dump({"rule_files": [rules_file.name], "evaluation_interval": "1m",
                                         "tests": tests}, sort_keys=False))
    proc = promtool("test", "rules", test_file.name, cwd=rules_file.parent)
    assert proc.returncode == 0, f"promtool test rules failed:\n{proc.stdout}{proc.stderr}"


def test_rules_pass_promtool_check(rules_file):
    proc = promtool("check", "rules", rules_file.name, cwd=rules_file.parent)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "4 rules found" in proc.stdout


FAILED = 'megatron_operator_job_phase{namespace="team-a",name="llama",phase="Failed",pod="operator-%s"}'
RUNNING = 'megatron_operator_job_phase{namespace="team-a",name="ok",phase="Running",pod="operator-1"}'
FAILED_ALERT = {
    "exp_labels": {"severity": "critical", "namespace": "team-a", "name": "llama"},
    "exp_annotations": {
        "summary": "MegatronJob team-a/llama failed",
        "description": "MegatronJob team-a/llama is Failed; kubectl describe mj says why (status.reason: "
                       "NonRetriableExitCode, RestartsExhausted, DeadlineExceeded, InvalidSpec; status.lastFailure "
                       "names the pod, node and exit code). Delete or fix and re-create the job to resolve the alert."},
}


def test_job_failed_fires_per_failed_job_while_it_is_failed(rules_file):
    """The job's own namespace in the alert (honorLabels); one alert across an operator restart (two
    operator pods' series); resolved when the job is gone (its series ends); a Running job never fires."""
    run_tests(rules_file, [{
        "interval": "1m",
        "input_series": [
            {"series": FAILED % "1", "values": "_x4 1x10"},        # Failed at 4m; operator pod 1 gone at 14m
            {"series": FAILED % "2", "values": "_x12 1x8 _x20"},   # the new operator pod: 12m-20m, job deleted
            {"series": RUNNING, "values": "1x40"},
        ],
        "alert_rule_test": [
            {"eval_time": "3m", "alertname": "MegatronJobFailed", "exp_alerts": []},
            {"eval_time": "5m", "alertname": "MegatronJobFailed", "exp_alerts": [FAILED_ALERT]},
            {"eval_time": "13m", "alertname": "MegatronJobFailed", "exp_alerts": [FAILED_ALERT]},
            {"eval_time": "19m", "alertname": "MegatronJobFailed", "exp_alerts": [FAILED_ALERT]},
            {"eval_time": "30m", "alertname": "MegatronJobFailed", "exp_alerts": []},
        ],
    }])


ITER = 'megatron_trainer_iteration{namespace="team-a",megatron_job="%s",pod="%s-worker-0-0-x"}'
TRAIN_ITERS = 'megatron_trainer_train_iters{namespace="team-a",megatron_job="%s",pod="%s-worker-0-0-x"}'


def test_stalled_fires_only_for_a_job_with_iterations_left_that_stopped(rules_file):
    run_tests(rules_file, [{
        "interval": "1m",
        "input_series": [
            {"series": ITER % ("hung", "hung"), "values": "0+10x5 50x60"},   # stops at 50 of 1000 at 5m
            {"series": TRAIN_ITERS % ("hung", "hung"), "values": "1000x65"},
            {"series": ITER % ("busy", "busy"), "values": "0+10x65"},
            {"series": TRAIN_ITERS % ("busy", "busy"), "values": "1000x65"},
            {"series": ITER % ("done", "done"), "values": "0+100x10 1000x55"},  # finished: iteration == train_iters
            {"series": TRAIN_ITERS % ("done", "done"), "values": "1000x65"},
        ],
        "alert_rule_test": [
            {"eval_time": "30m", "alertname": "MegatronJobStalled", "exp_alerts": []},  # still inside `for`
            {"eval_time": "45m", "alertname": "MegatronJobStalled", "exp_alerts": [
                {"exp_labels": {"severity": "warning", "namespace": "team-a", "megatron_job": "hung"},
                 "exp_annotations": {
                     "summary": "MegatronJob team-a/hung makes no progress",
                     "description": "The training iteration has not moved for 30m although iterations are left. "
                                    "Look for an NCCL timeout, a hung data loader or slow storage: kubectl describe "
                                    "mj hung -n team-a (condition Stalled) and the trainer logs; "
                                    "docs/troubleshooting.md."}}]},
        ],
    }])


RESTARTS = 'megatron_trainer_restarts{namespace="team-a",megatron_job="flaky",pod="flaky-worker-0-0-%s"}'


def test_restarts_climbing_fires_at_the_threshold_within_the_window(rules_file):
    # Each restart is a new pod (a new series) whose gauge is the JobSet restart attempt.
    run_tests(rules_file, [{
        "interval": "1m",
        "input_series": [
            {"series": RESTARTS % "a", "values": "0x10"},
            {"series": RESTARTS % "b", "values": "_x10 1x10"},
            {"series": RESTARTS % "c", "values": "_x20 2x10"},
        ],
        "alert_rule_test": [
            {"eval_time": "15m", "alertname": "MegatronJobRestartsClimbing", "exp_alerts": []},  # 1 restart
            {"eval_time": "25m", "alertname": "MegatronJobRestartsClimbing", "exp_alerts": [
                {"exp_labels": {"severity": "warning", "namespace": "team-a", "megatron_job": "flaky"},
                 "exp_annotations": {
                     "summary": "MegatronJob team-a/flaky restarted 2 times",
                     "description": "The job's gang restarted 2 times within 1h. Each restart resumes from the last "
                                    "checkpoint and loses the work since; find the failing rank: kubectl get events "
                                    "-n team-a --field-selector involvedObject.name=flaky; docs/troubleshooting.md."}}]},
        ],
    }])


def test_operator_errors_fire_after_they_persist(rules_file):
    series = 'megatron_operator_reconcile_errors_total{namespace="ops",kind="MegatronJob",error="Forbidden"}'
    run_tests(rules_file, [{
        "interval": "1m",
        "input_series": [{"series": series, "values": "0+1x40"}],
        "alert_rule_test": [
            {"eval_time": "10m", "alertname": "MegatronOperatorReconcileErrors", "exp_alerts": []},
            {"eval_time": "25m", "alertname": "MegatronOperatorReconcileErrors", "exp_alerts": [
                {"exp_labels": {"severity": "warning", "namespace": "ops", "kind": "MegatronJob",
                                "error": "Forbidden"},
                 "exp_annotations": {
                     "summary": "The megatron-operator keeps failing (MegatronJob, Forbidden)",
                     "description": "Reconciles of MegatronJob fail with Forbidden errors. Check the operator's log; "
                                    "a Forbidden error means its RBAC does not match the chart "
                                    "(docs/troubleshooting.md)."}}]},
        ],
    }])


def test_dashboard_queries_parse(tmp_path):
    """Every panel query of the Grafana dashboard is valid PromQL (Prometheus' parser, via a rules file
    of recording rules); Grafana's $__rate_interval and $variables are substituted first."""
    dash = json.loads((CHART / "files" / "dashboards" / "megatron-operator.json").read_text())
    rules = []
    for panel in dash["panels"]:
        for i, target in enumerate(panel.get("targets", [])):
            expr = target["expr"].replace("$__rate_interval", "5m").replace("$__interval", "1m")
            for var in dash.get("templating", {}).get("list", []):
                expr = expr.replace(f"${var['name']}", ".*").replace(f"${{{var['name']}}}", ".*")
            rules.append({"record": f"dashboard:panel{panel['id']}:target{i}", "expr": expr})
    assert rules
    (tmp_path / "dash.yaml").write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    proc = promtool("check", "rules", "dash.yaml", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dashboard_layout_and_datasources():
    """What Grafana needs to import the JSON cleanly: a uid and title, panels on the 24-column grid that do
    not overlap, every query on the dashboard's Prometheus variable, unique refIds per panel, and the
    template variables the queries use."""
    dash = json.loads((CHART / "files" / "dashboards" / "megatron-operator.json").read_text())
    assert dash["uid"] and dash["title"] and isinstance(dash["schemaVersion"], int)
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    cells: dict[tuple[int, int], int] = {}
    for panel in dash["panels"]:
        g = panel["gridPos"]
        assert g["w"] >= 1 and g["h"] >= 1 and 0 <= g["x"] and g["x"] + g["w"] <= 24, panel["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"panel {panel['id']} overlaps panel {cells[(x, y)]}"
                cells[(x, y)] = panel["id"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            assert target["datasource"] == panel["datasource"]
            for used in re.findall(r"\$(\w+)", target["expr"]):
                assert used.startswith("__") or used in variables, f"{panel['title']}: ${used} is not defined"
