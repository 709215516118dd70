"""bench/cel_validator_cost.py's pure parts: the jobs it times are valid MegatronJobs, its Go tool builds against the
apiextensions-apiserver of the test control plane's Kubernetes, and a variant changes only the spec's rules."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import cel_validator_cost as cvc  # noqa: E402
from megatron_operator.validation import parse_job  # noqa: E402


@pytest.mark.parametrize("name", cvc.JOBS)
def test_the_timed_jobs_are_valid(name):
    doc = cvc.job(name)
    parse_job(doc)  # raises SpecError with the problems otherwise
    assert doc["metadata"]["namespace"]


def test_the_tool_builds_against_the_control_planes_kubernetes():
    kube = cvc.CLUSTER.versions()["KUBE_VERSION"]
    assert cvc.tool_module_version() == "v0." + kube.split(".", 1)[1]


def test_a_rules_variant_replaces_the_spec_rules_only():
    crd = yaml.safe_load((ROOT / "crds" / "megatron-operator.io_megatronjobs.yaml").read_text())
    out = cvc.spec_rules_variant(crd, [{"rule": "true"}])
    schema = out["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert schema["properties"]["spec"]["x-kubernetes-validations"] == [{"rule": "true"}]
    before = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert schema["x-kubernetes-validations"] == before["x-kubernetes-validations"]  # the name rule stays
    assert schema["properties"]["spec"]["properties"] == before["properties"]["spec"]["properties"]
    assert len(before["properties"]["spec"]["x-kubernetes-validations"]) > 1  # the input is not changed
