"""spec.logging.wandb (issue 53): what admission refuses, what render emits (the key only as a mounted file's
path), the guardrail, and the trainer's start-up checks. The offline run itself: tests/trainer/test_wandb_torch.py."""

from __future__ import annotations

import json

import pytest
from factory import make_job
from megatron_operator.guardrails import guardrail_problems
from megatron_operator.render import render
from megatron_operator.settings import Settings
from megatron_operator.validation import SpecError, parse_job

ONLINE = {"project": "llm runs", "apiKeySecret": {"name": "wandb", "key": "token"}}


def _pod(job):
    jobset = render(parse_job(job))[-1]
    return jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]


def _refusal(job) -> list[tuple[str, str]]:
    with pytest.raises(SpecError) as e:
        parse_job(job)
    return [(p.rule, p.message) for p in e.value.problems]


def test_online_mounts_the_secret_and_passes_only_its_path():
    pod = _pod(make_job(checkpoint={"pvc": "ckpt"}, logging={"wandb": ONLINE}))
    (trainer,) = pod["containers"]
    cmd = trainer["command"]
    assert cmd[cmd.index("--wandb-api-key-file") + 1] == "/var/run/secrets/megatron-operator/wandb/key"
    assert cmd[cmd.index("--wandb-project") + 1] == "llm runs"
    assert cmd[cmd.index("--wandb-mode") + 1] == "online"
    assert cmd[cmd.index("--wandb-exp-name") + 1] == make_job()["metadata"]["name"]
    assert cmd[cmd.index("--wandb-save-dir") + 1].endswith("/wandb") and "--wandb-entity" not in cmd
    (volume,) = [v for v in pod["volumes"] if v["name"] == "wandb-api-key"]
    assert volume["secret"] == {"secretName": "wandb", "defaultMode": 0o440, "items": [{"key": "token", "path": "key"}]}
    assert {"name": "wandb-api-key", "mountPath": "/var/run/secrets/megatron-operator/wandb",
            "readOnly": True} in trainer["volumeMounts"]
    assert pod["securityContext"]["fsGroup"] == 1000
    assert not [e for e in trainer["env"] if e["name"].startswith("WANDB")]


def test_without_the_block_nothing_of_wandb_is_rendered():
    text = json.dumps(render(parse_job(make_job(checkpoint={"pvc": "ckpt"}))))
    assert "wandb" not in text


def test_offline_writes_beside_the_checkpoints_or_in_a_mounted_volume():
    pod = _pod(make_job(checkpoint={"pvc": "ckpt"}, logging={"wandb": {"project": "p", "mode": "offline"}}))
    cmd = pod["containers"][0]["command"]
    assert cmd[cmd.index("--wandb-save-dir") + 1] == f"/checkpoints/{make_job()['metadata']['name']}/wandb"
    assert "--wandb-api-key-file" not in cmd and not [v for v in pod["volumes"] if v["name"] == "wandb-api-key"]
    job = make_job(logging={"wandb": {"project": "p", "mode": "offline", "saveDir": "/mnt/runs/wandb"}},
                   pod={"volumes": [{"name": "runs", "persistentVolumeClaim": {"claimName": "runs"}}],
                        "volumeMounts": [{"name": "runs", "mountPath": "/mnt/runs"}]})
    cmd = _pod(job)["containers"][0]["command"]
    assert cmd[cmd.index("--wandb-save-dir") + 1] == "/mnt/runs/wandb"


@pytest.mark.parametrize("job, rule, words", [
    (make_job(logging={"wandb": {"project": "p"}}), "wandb-online-needs-key", "apiKeySecret"),
    (make_job(logging={"wandb": {"project": "p", "mode": "offline"}}), "wandb-offline-needs-volume", "/tmp"),
    (make_job(logging={"wandb": {"project": "p", "mode": "offline", "saveDir": "/tmp/wandb"}}),
     "wandb-save-dir-on-volume", "/tmp/wandb"),
    (make_job(checkpoint={"pvc": "c"}, logging={"wandb": {"project": "p", "mode": "offline",
                                                          "saveDir": "/checkpoints"}}),
     "wandb-save-dir-on-volume", "/checkpoints/"),
    (make_job(logging={"wandb": {"project": "p", "mode": "offline", "saveDir": "/mnt/ro/w"}},
              pod={"volumes": [{"name": "ro", "configMap": {"name": "x"}}],
                   "volumeMounts": [{"name": "ro", "mountPath": "/mnt/ro", "readOnly": True}]}),
     "wandb-save-dir-on-volume", "writable"),
    (make_job(env=[{"name": "WANDB_API_KEY", "value": "abc"}]), "env-no-literal-wandb-key", "WANDB_API_KEY"),
])
def test_admission_refuses_with_one_line(job, rule, words):
    ((got_rule, message),) = _refusal(job)
    assert got_rule == rule and words in message and "\n" not in message


@pytest.mark.parametrize("project", ["a/b", "a\\b", "a#b", "a?b", "a%b", "a:b", "x" * 129, "", "a\nb"])
def test_project_names_wandb_refuses_are_refused(project):
    with pytest.raises(SpecError) as e:
        parse_job(make_job(logging={"wandb": {**ONLINE, "project": project}}))
    assert [p.field for p in e.value.problems] == ["spec.logging.wandb.project"]


def test_no_key_material_is_a_field():
    with pytest.raises(SpecError):
        parse_job(make_job(logging={"wandb": {**ONLINE, "apiKey": "abc"}}))
    with pytest.raises(SpecError):
        parse_job(make_job(logging={"wandb": {**ONLINE, "apiKeySecret": {"name": "wandb", "value": "abc"}}}))


def test_deny_secret_env_refuses_the_key_secret_too():
    job = parse_job(make_job(logging={"wandb": ONLINE}))
    (problem,) = guardrail_problems(job, Settings(deny_secret_env=True))
    assert problem.rule == "guardrail-wandb-secret" and problem.field == "spec.logging.wandb.apiKeySecret"
    assert guardrail_problems(job, Settings()) == []


def test_the_trainer_checks_wandb_and_the_key_file_at_start_up(tmp_path, monkeypatch):
    from megatron_trainer import wandb_log
    from megatron_trainer.config import parse_args
    from megatron_trainer.exitcodes import ExitCode, Fatal

    from tests.trainer.conftest import MOCK_ARGV

    key = tmp_path / "key"
    cfg = parse_args([*MOCK_ARGV, "--wandb-project", "p", "--wandb-api-key-file", str(key)])
    monkeypatch.setattr(wandb_log.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(Fatal) as e:
        wandb_log.preflight(cfg, {})
    assert e.value.code == ExitCode.BAD_ARGUMENTS and "wandb package" in str(e.value) and "\n" not in str(e.value)
    monkeypatch.setattr(wandb_log.importlib.util, "find_spec", lambda name: object())
    with pytest.raises(Fatal, match="cannot read it") as e:  # missing
        wandb_log.preflight(cfg, {})
    assert e.value.code == ExitCode.BAD_ARGUMENTS
    key.write_text("two words-secretvalue\n")
    with pytest.raises(Fatal, match="does not hold one API key") as e:
        wandb_log.preflight(cfg, {})
    assert "secretvalue" not in str(e.value)
    key.write_text("local-abc123\n")
    wandb_log.preflight(cfg, {})
    assert wandb_log.read_api_key(str(key)) == "local-abc123"
    online_without_key = parse_args([*MOCK_ARGV, "--wandb-project", "p"])
    with pytest.raises(Fatal, match="needs an API key"):
        wandb_log.preflight(online_without_key, {})
    with pytest.raises(SystemExit):
        parse_args([*MOCK_ARGV, "--wandb-project", "a/b"])
