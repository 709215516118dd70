"""The operator/trainer contract for refusals: every spec the operator refuses for a Megatron
start-up rule (tests/unit/spec_table.py) is refused by the trainer too, when its rendered command
line reaches it anyway (an operator older than the trainer, a hand-written command). The two rule
sets are written separately (rules.py compiles to CEL; the trainer mirrors Megatron-LM's
validate_args); this is what links them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from megatron_operator import rules
from megatron_operator.render import megatron_args
from megatron_operator.validation import SpecError, parse_job
from megatron_trainer.config import parse_args, world_layout

sys.path.insert(0, str(Path(__file__).parent / "unit"))
from spec_table import CASES

# Rules about Kubernetes objects or the spec's own shape, not about what Megatron accepts: the
# rendered command line cannot violate them, or they are outside the trainer's view.
OPERATOR_ONLY = {
    "tensor-placement": "a tensor-parallel group on one host is a pod placement rule",
    "extra-args-not-managed": "extraArgs that repeat a rendered flag: argparse takes the last one",
    "env-not-reserved": "pod environment",
    "pod-labels-not-reserved": "pod labels",
    "data-exactly-one": "the spec's data section shape (rendered as one of --mock-data and --data-path)",
    "topk-within-experts": "without experts the router's top-k is not rendered",
    "data-paths-with-pvc": "the spec's data section shape (nothing to render)",
    "data-tokenizer-with-pvc": "the spec's data section shape (nothing to render)",
    "tokenizer-path": "the spec's data section shape (nothing to render)",
    "model-complete": "an incomplete model cannot be rendered",
    "tensorboard-needs-checkpoint": "where the event files go (nothing to render without a checkpoint PVC)",
    "extra-args-known": "the trainer refuses unknown and abbreviated flags too, but --help makes argparse exit 0",
    "extended-resources-not-reserved": "pod resources",
    "pod-label-keys": "pod labels",
    "pod-annotation-keys": "pod annotations",
    "node-selector-keys": "pod placement",
    "toleration-combination": "pod tolerations",
    "toleration-key-or-exists": "pod tolerations",
    "toleration-seconds-noexecute": "pod tolerations",
    "toleration-keys": "pod tolerations",
    "env-value-or-value-from": "pod environment",
    "env-one-source": "pod environment",
    "env-names-unique": "pod environment",
    "tensor-groups-fit-one-jobset": "the size of the JobSet object",
    "hf-init-llama-family": "the trainer refuses it at start-up, against the checkpoint's config.json",
    "hf-export-llama-family": "not a command-line rule: the trainer's converter meets the model only when it exports",
    "data-sft-with-format": "the spec's data section shape (format without sft renders nothing to read)",
    "data-sft-needs-pvc": "the data volume: the command line cannot show whether /data is mounted",
    "data-sft-tokenizer": "the spec's data section shape (no tokenizer directory to render)",
    "data-sft-eval-interval": "evalInterval is rendered only with a validation file",
    "hf-export-outside-init": "the two PVCs are mounted apart (/hf-init, /hf-export): the trainer cannot see "
                              "that two paths are one directory of one volume",
    "hf-export-one-location": "the spec's export section shape (one location is rendered)",
    "hf-export-object-store-needs-checkpoint-store": "the bucket comes from spec.checkpoint.objectStore: without "
                                                     "it the spec names none to render",
    "checkpoint-one-location": "the spec's checkpoint section shape (one location is rendered)",
    "checkpoint-path-with-pvc": "the spec's checkpoint section shape (path is not rendered for objectStore)",
    "tensorboard-needs-checkpoint-pvc": "where the event files go (nothing to render without a checkpoint PVC)",
    "object-store-identity-annotations": "the job's ServiceAccount",
    "object-store-one-identity": "the pod's credentials (a Secret volume, or the ServiceAccount)",
    "env-no-literal-credentials": "pod environment",
    "env-no-url-credentials": "pod environment",
    "env-endpoint-url": "pod environment",
}


def _refused_megatron_cases():
    for case_id, manifest, rule in CASES:
        if rule is None:
            continue
        marks = [pytest.mark.skip(reason=OPERATOR_ONLY[rule])] if rule in OPERATOR_ONLY else []
        yield pytest.param(manifest, rule, id=case_id, marks=marks)


@pytest.mark.parametrize("manifest, rule", list(_refused_megatron_cases()))
def test_the_trainer_refuses_what_the_operator_refuses(manifest, rule, monkeypatch, capsys):
    with pytest.raises(SpecError) as operator_refused:
        parse_job(manifest)
    assert rule in {p.rule for p in operator_refused.value.problems}
    monkeypatch.setattr(rules, "evaluate_spec_rules", lambda spec: [])  # render it anyway
    job = parse_job(manifest)
    argv = megatron_args(job)
    world = job.spec.num_nodes * job.spec.gpus_per_node
    with pytest.raises((SystemExit, ValueError)) as refused:
        world_layout(parse_args(argv), world)
    if refused.type is SystemExit:
        assert refused.value.code == 2 and "error:" in capsys.readouterr().err



# ------------------------------------------------------------------ object-store endpoint (issue 52)
ENDPOINTS = [
    "https://s3.example.com", "http://127.0.0.1:9000", "https://h:1", "https://h:65535", "https://h:65536",
    "https://h:0", "https://h:0443", "https://h:99999", "https://h:", "https://KEY:SECRET@h", "https://h/path",
    "https://h/", "https://h?x=y", "ftp://h", "https://${AWS_SECRET_ACCESS_KEY}.example.com", "https://h:443\n",
    "https://[::1]:9000", "https://h h", "https://h:-1", "https://h:\uff11\uff12", "https://h.:80",
]


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_the_endpoint_field_and_the_trainer_flag_agree(endpoint, capsys):
    """spec.checkpoint.objectStore.endpoint (its schema pattern, as the API server runs it) and
    --object-store-endpoint (the trainer's check) accept and refuse the same endpoints."""
    import re2
    from megatron_operator.names import S3_ENDPOINT

    manifest = next(m for case_id, m, _ in CASES if case_id == "object-store")
    argv = megatron_args(parse_job(manifest))
    argv[argv.index("--object-store-endpoint") + 1] = endpoint
    try:
        parse_args(argv)
        trainer_accepts = True
    except SystemExit:
        trainer_accepts = False
        assert "--object-store-endpoint" in capsys.readouterr().err
    assert (re2.search(S3_ENDPOINT, endpoint) is not None) == trainer_accepts
