"""The MegatronJob API against the real API server and the real scheduler (no operator here):
the CRD installs, the admission rules reject exactly what the models reject with the same
message, rendered objects pass server-side dry-run, and rendered JobSets are placed as promised.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import kubernetes
import pytest
import yaml
from k8s import (
    POD_FAIL_EXIT_CODE,
    POD_FAIL_LABEL,
    POOL_LABEL,
    gpu_node,
    pod_runtime_annotations,
    schedulable_nodes,
)
from mjob import EXAMPLES, GROUP, PLURAL, VERSION

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "unit"))
from megatron_operator.crd import to_yaml
from megatron_operator.render import render
from megatron_operator.settings import Settings
from megatron_operator.validation import SpecError, parse_job
from spec_table import CASES, SCHEMA_CASES

pytestmark = pytest.mark.e2e
EXAMPLE_FILES = sorted(EXAMPLES.glob("*.yaml"))


def server_verdict(api: kubernetes.client.CustomObjectsApi, namespace: str, doc: dict) -> str | None:
    """None if the API server admits ``doc`` (server dry-run, strict field validation), else its message."""
    doc = copy.deepcopy(doc)
    doc["metadata"].pop("namespace", None)
    try:
        api.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, doc, dry_run="All",
                                            field_validation="Strict")
        return None
    except kubernetes.client.ApiException as e:
        assert e.status == 422 or e.status == 400, (e.status, e.body)
        return json.loads(e.body)["message"]


def test_crd_is_established_with_printer_columns(cluster, crd):
    out = json.loads(cluster.kubectl("get", "crd", f"{PLURAL}.{GROUP}", "-o", "json").stdout)
    cols = [c["name"] for c in out["spec"]["versions"][0]["additionalPrinterColumns"]]
    assert cols[:5] == ["Phase", "GPUs", "TP/PP/DP", "Iteration", "Restarts"]
    assert out["spec"]["names"]["shortNames"] == ["mj", "mjob"]


@pytest.mark.parametrize("case_id,doc,rule", CASES, ids=[c[0] for c in CASES])
def test_api_server_agrees_with_the_models(cluster, crd, namespace, case_id, doc, rule):
    api = kubernetes.client.CustomObjectsApi(cluster.api_client())
    verdict = server_verdict(api, namespace, doc)
    if rule is None:
        assert verdict is None, verdict
        return
    with pytest.raises(SpecError) as exc:
        parse_job(doc)
    (problem,) = exc.value.problems
    assert verdict is not None, f"the API server admitted {case_id}"
    # the API server's error carries the very message the CLI and the operator print
    assert problem.message in verdict, verdict


@pytest.mark.parametrize("mutate,expected", [
    (lambda s: s["parallelism"].update(tensor=0), "spec.parallelism.tensor: Invalid value: 0"),
    (lambda s: s["parallelism"].update(tensr=2), 'unknown field "spec.parallelism.tensr"'),
    (lambda s: s["training"].update(precision="bf32"), 'spec.training.precision: Unsupported value: "bf32"'),
    (lambda s: s["training"].pop("trainIters"), "spec.training.trainIters: Required value"),
    (lambda s: s.update(numNodes=None), "spec.numNodes"),
])
def test_structural_errors_rejected(cluster, crd, namespace, mutate, expected):
    doc = copy.deepcopy(CASES[0][1])
    mutate(doc["spec"])
    verdict = server_verdict(kubernetes.client.CustomObjectsApi(cluster.api_client()), namespace, doc)
    assert verdict is not None and expected in verdict, verdict


@pytest.mark.parametrize("case_id,doc,server_says", SCHEMA_CASES, ids=[c[0] for c in SCHEMA_CASES])
def test_schema_level_refusals_on_the_api_server(cluster, crd, namespace, case_id, doc, server_says):
    with pytest.raises(SpecError):
        parse_job(doc)
    verdict = server_verdict(kubernetes.client.CustomObjectsApi(cluster.api_client()), namespace, doc)
    assert verdict is not None and server_says in verdict, verdict


def test_name_too_long_rejected(cluster, crd, namespace):
    doc = copy.deepcopy(CASES[0][1])
    doc["metadata"]["name"] = "a" * 41
    verdict = server_verdict(kubernetes.client.CustomObjectsApi(cluster.api_client()), namespace, doc)
    assert verdict and "at most 40 characters" in verdict


def test_immutable_fields_and_suspend(cluster, crd, namespace):
    api = kubernetes.client.CustomObjectsApi(cluster.api_client())
    doc = copy.deepcopy(CASES[0][1])
    doc["metadata"] = {"name": "immut"}
    api.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, doc)
    with pytest.raises(kubernetes.client.ApiException) as e:
        api.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "immut", {"spec": {"numNodes": 4}})
    assert "spec.numNodes is immutable" in e.value.body
    api.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "immut", {"spec": {"suspend": True}})
    with pytest.raises(kubernetes.client.ApiException) as e:
        api.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "immut",
                                           {"spec": {"checkpoint": {"pvc": "late"}}})
    assert "spec.checkpoint is immutable" in e.value.body


def test_create_only_rules_at_create_and_on_updates(cluster, crd, namespace):
    """The layout rules are create-only (optionalOldSelf, crd.create_only): the API server refuses a bad
    spec at create with the models' message, evaluates them on no update (a status write, suspend),
    and an update of an immutable field is still refused, by the immutability rule."""
    from megatron_operator.kube import Kube

    api = kubernetes.client.CustomObjectsApi(cluster.api_client())
    bad = {c[0]: c for c in CASES}["bad-global-batch"][1]
    with pytest.raises(SpecError) as exc:
        parse_job(bad)
    (problem,) = exc.value.problems
    assert problem.message.startswith("spec.training.globalBatchSize: 100 is not divisible by")
    bad = copy.deepcopy(bad)
    bad["metadata"].pop("namespace", None)
    with pytest.raises(kubernetes.client.ApiException) as e:
        api.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, bad)
    assert e.value.status == 422 and problem.message in json.loads(e.value.body)["message"], e.value.body

    doc = copy.deepcopy(CASES[0][1])
    doc["metadata"] = {"name": "create-only"}
    api.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, doc)
    # the operator's status write, a merge patch and a full update that change only suspend
    Kube(cluster.api_client()).apply_status(namespace, "create-only", {"phase": "Pending", "message": "x"})
    api.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "create-only", {"spec": {"suspend": True}})
    obj = api.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "create-only")
    obj["spec"]["suspend"] = False
    obj["spec"]["activeDeadlineSeconds"] = 3600
    obj = api.replace_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "create-only", obj)
    assert obj["spec"]["suspend"] is False and obj["status"]["phase"] == "Pending"
    # an immutable field changed to a value that breaks a layout rule: refused as immutable, and the
    # layout rule is not evaluated on the update
    with pytest.raises(kubernetes.client.ApiException) as e:
        api.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "create-only",
                                           {"spec": {"training": {"globalBatchSize": 100}}})
    message = json.loads(e.value.body)["message"]
    assert e.value.status == 422 and "spec.training is immutable" in message, message
    assert "is not divisible" not in message, message


HF_CASES = {c[0]: c for c in CASES if c[0].startswith(("hf-", "bad-hf-"))}


@pytest.mark.parametrize("case_id,fragment", [
    ("bad-hf-init-gpt", "spec.init.huggingFace: a Hugging Face import needs a Llama-family spec.model"),
    ("bad-hf-export-inside-init", "spec.export.huggingFace.path: a/ft is inside spec.init.huggingFace.path a on "
                                  "PVC m"),
    ("hf-init-export", None),
    ("bad-hf-export-inside-checkpoints", "spec.export.huggingFace.path: runs/a/hf is inside "
                                         "spec.checkpoint.objectStore.prefix runs/a; export to a prefix apart"),
    ("bad-hf-export-object-store-without-one", "spec.export.huggingFace.objectStore: the export goes to the bucket "
                                               "of spec.checkpoint.objectStore, and this job has none"),
    ("hf-export-object-store", None),
], ids=["init-non-llama-refused", "export-inside-init-refused", "init-and-export-admitted",
        "export-inside-checkpoint-prefix-refused", "export-to-store-without-store-refused", "export-to-store-admitted"])
def test_hf_init_and_export_rules_at_the_api_server(cluster, crd, namespace, case_id, fragment):
    """The Hugging Face rules by name (the table above runs them all): the API server's message."""
    verdict = server_verdict(kubernetes.client.CustomObjectsApi(cluster.api_client()), namespace,
                             HF_CASES[case_id][1])
    assert verdict is None if fragment is None else (verdict is not None and fragment in verdict), verdict


def test_hf_init_and_export_are_immutable(cluster, crd, namespace):
    api = kubernetes.client.CustomObjectsApi(cluster.api_client())
    doc = copy.deepcopy(HF_CASES["hf-init-export"][1])
    doc["metadata"] = {"name": "hf-immut"}
    api.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, doc)
    for patch, field in (({"init": {"huggingFace": {"pvc": "models", "path": "other"}}}, "spec.init"),
                         ({"export": {"huggingFace": {"pvc": "other", "path": "exports/x"}}}, "spec.export"),
                         ({"init": None}, "spec.init")):
        with pytest.raises(kubernetes.client.ApiException) as e:
            api.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "hf-immut", {"spec": patch})
        assert f"{field} is immutable" in e.value.body, e.value.body
    doc = copy.deepcopy(CASES[0][1])
    doc["metadata"] = {"name": "hf-late"}
    doc["spec"]["model"] = copy.deepcopy(HF_CASES["hf-init-export"][1]["spec"]["model"])
    api.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, doc)
    with pytest.raises(kubernetes.client.ApiException) as e:
        api.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "hf-late",
                                           {"spec": {"init": {"huggingFace": {"pvc": "m", "path": "x"}}}})
    assert "spec.init is immutable" in e.value.body, e.value.body


@pytest.mark.parametrize("path", EXAMPLE_FILES, ids=[p.stem for p in EXAMPLE_FILES])
def test_examples_apply_and_renders_pass_server_dry_run(cluster, crd, namespace, path):
    doc = yaml.safe_load(path.read_text())
    # server dry-run for the job too: an operator running in the same session (another test file's)
    # must not create these children for real, or the dry-run below would meet them
    out = cluster.kubectl("apply", "--server-side", "--dry-run=server", "--field-manager=e2e", "-o", "json",
                          "-n", namespace, "-f", "-", input=yaml.safe_dump(doc))
    stored = json.loads(out.stdout)
    assert stored["spec"]["numNodes"] == doc["spec"]["numNodes"] and stored["metadata"]["uid"]
    job = parse_job({**doc, "metadata": {**doc["metadata"], "namespace": namespace}})
    objs = render(job, Settings(), owner_uid=stored["metadata"]["uid"])
    text = "\n---\n".join(to_yaml(o) for o in objs)  # what `megatron-operator render` prints
    out = cluster.kubectl("apply", "--server-side", "--dry-run=server", "--field-manager=e2e", "-f", "-",
                          input=text)
    assert out.stdout.count("(server dry run)") == len(objs), out.stdout


# ---- rendered JobSets on the real scheduler (applied by the test; no operator) -----------------

def apply_rendered(cluster, namespace, doc, run_s=None):
    doc = copy.deepcopy(doc)
    doc["metadata"]["namespace"] = namespace
    if run_s is not None:
        doc["spec"].setdefault("podMetadata", {})["annotations"] = pod_runtime_annotations(run_s)
    objs = render(parse_job(doc), Settings())
    cluster.apply(objs, namespace=namespace)
    return doc["metadata"]["name"]


def pods_of(cluster, namespace, job):
    core = kubernetes.client.CoreV1Api(cluster.api_client())
    return core.list_namespaced_pod(namespace, label_selector=f"megatron-operator.io/job-name={job}").items


def tp_job(name, num_nodes, tp, **spec):
    d = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "MegatronJob", "metadata": {"name": name},
         "spec": {"numNodes": num_nodes, "gpusPerNode": 1, "parallelism": {"tensor": tp},
                  "model": {"numLayers": 2, "hiddenSize": 256, "numAttentionHeads": 16, "seqLength": 256,
                            "vocabSize": 1000},
                  "training": {"microBatchSize": 1, "trainIters": 1}}}
    d["spec"].update(spec)
    return d


def test_kubeflow_example_keeps_the_tp_group_on_one_node(cluster, namespace, wait_for):
    name = apply_rendered(cluster, namespace, yaml.safe_load((EXAMPLES / "kubeflow-tp2.yaml").read_text()),
                          run_s=60)

    def scheduled():
        pods = pods_of(cluster, namespace, name)
        return pods if len(pods) == 2 and all(p.spec.node_name for p in pods) else None

    pods = wait_for(scheduled, 60, "both pods of the TP group scheduled")
    assert pods[0].spec.node_name == pods[1].spec.node_name


@pytest.fixture
def two_gpu_nodes(cluster, namespace):
    """Two fresh 2-GPU kwok nodes only this test schedules onto (label = the test's namespace), ready for pods."""
    pool = namespace[-30:].lstrip("-.")  # a label value starts with a letter or digit
    names = [f"{namespace[-6:]}-2gpu-{i}" for i in range(2)]
    cluster.apply([gpu_node(n, pool, 2) for n in names])
    # Both nodes must take pods before the job comes: while one still has the not-ready taint, both groups'
    # first pods can only go to the other, and then neither group's second pod fits anywhere (CI, 2026-11-28:
    # "1 node(s) had untolerated taint(s)", then "didn't match pod affinity rules"). The operator places such a
    # job anew (e2e/test_placement.py); this test, without the operator, is about the groups' placement rules.
    core = kubernetes.client.CoreV1Api(cluster.api_client())
    cluster.wait_for(lambda: schedulable_nodes(core, names), 60, f"nodes {', '.join(names)} Ready, without the "
                     "not-ready taint", namespace=namespace, kinds=("nodes",))
    yield {POOL_LABEL: pool}
    cluster.kubectl("delete", "nodes", "-l", f"{POOL_LABEL}={pool}", "--wait=false", check=False)


def nodes_by_tp_group(cluster, namespace, name, count, wait_for) -> dict[str, set[str]]:
    """Once all ``count`` pods of the job are bound: the nodes of each tensor-parallel group."""
    def scheduled():
        pods = pods_of(cluster, namespace, name)
        return pods if len(pods) == count and all(p.spec.node_name for p in pods) else None

    by_group: dict[str, set[str]] = {}
    for p in wait_for(scheduled, 60, f"all {count} pods scheduled"):
        by_group.setdefault(p.metadata.labels["megatron-operator.io/tp-group"], set()).add(p.spec.node_name)
    return by_group


def test_two_tp_groups_are_not_forced_onto_one_node(cluster, namespace, wait_for, two_gpu_nodes):
    # Each 2-GPU node fits exactly one TP=2 group of 1-GPU pods: the second group must land on the
    # other node, which it can only do if the affinity binds each group, not the whole job, to a host.
    doc = tp_job("twogroups", 4, 2, resources={"nodeSelector": two_gpu_nodes})
    name = apply_rendered(cluster, namespace, doc, run_s=60)
    by_group = nodes_by_tp_group(cluster, namespace, name, 4, wait_for)
    assert all(len(nodes) == 1 for nodes in by_group.values()), by_group
    assert by_group["0"] != by_group["1"], by_group


def _own_pods_term(job: str, topology_key: str) -> dict:
    return {"topologyKey": topology_key, "labelSelector": {"matchLabels": {"megatron-operator.io/job-name": job}}}


def test_required_pod_affinity_to_other_pods_would_never_place_a_tp_group_that_spans_pods(
        cluster, crd, namespace, wait_for, two_gpu_nodes):
    """Why admission refuses such a term (rule pod-affinity-selects-own-pods), on the real kube-scheduler: a
    running pod the user's term selects sits on a node with room for the whole TP group, yet no pod of the
    group is ever placed, because no existing pod matches the group's term and the user's at once."""
    core = kubernetes.client.CoreV1Api(cluster.api_client())
    node0 = f"{namespace[-6:]}-2gpu-0"
    cluster.apply([{"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "cache", "labels": {"app": "cache"}},
                    "spec": {"nodeName": node0, "tolerations": [{"operator": "Exists"}],
                             "containers": [{"name": "cache", "image": "cache:1"}]}}], namespace=namespace)
    wait_for(lambda: core.read_namespaced_pod("cache", namespace).status.phase == "Running" or None, 60,
             "the cache pod Running")
    term = {"topologyKey": "kubernetes.io/hostname", "labelSelector": {"matchLabels": {"app": "cache"}}}
    refused = tp_job("otheraff", 2, 2, resources={"nodeSelector": two_gpu_nodes},
                     pod={"affinity": {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [term]}}})
    verdict = server_verdict(kubernetes.client.CustomObjectsApi(cluster.api_client()), namespace, refused)
    assert verdict is not None and "would leave every worker Pending" in verdict, verdict
    # What the operator rendered for it before the rule: the user's term beside the group's.
    doc = tp_job("otheraff", 2, 2, resources={"nodeSelector": two_gpu_nodes})
    doc["metadata"]["namespace"] = namespace
    doc["spec"]["podMetadata"] = {"annotations": pod_runtime_annotations(60)}
    objs = render(parse_job(doc), Settings())
    for o in objs:
        if o["kind"] == "JobSet":
            for rj in o["spec"]["replicatedJobs"]:
                affinity = rj["template"]["spec"]["template"]["spec"]["affinity"]
                affinity["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"].append(term)
    cluster.apply(objs, namespace=namespace)

    def all_unschedulable():
        pods = pods_of(cluster, namespace, "otheraff")
        msgs = [c.message for p in pods for c in p.status.conditions or []
                if c.type == "PodScheduled" and c.status == "False" and c.reason == "Unschedulable"]
        return msgs if len(pods) == 2 and len(msgs) == 2 else None

    msgs = wait_for(all_unschedulable, 60, "both pods of the group Unschedulable")
    assert all("didn't match pod affinity rules" in m for m in msgs), msgs
    assert not [p.spec.node_name for p in pods_of(cluster, namespace, "otheraff") if p.spec.node_name]


def test_required_pod_affinity_to_the_jobs_own_pods_places_tp_groups_that_span_pods(
        cluster, crd, namespace, wait_for, two_gpu_nodes):
    """The form admission accepts: the user's term selects the job's own pods (here: every worker in the test's
    pool of nodes), so each group's first pod matches all its terms itself and its partner finds it."""
    pool_key = next(iter(two_gpu_nodes))
    doc = tp_job("ownaff", 4, 2, resources={"nodeSelector": two_gpu_nodes},
                 pod={"affinity": {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
                     _own_pods_term("ownaff", pool_key)]}}})
    assert server_verdict(kubernetes.client.CustomObjectsApi(cluster.api_client()), namespace, doc) is None
    name = apply_rendered(cluster, namespace, doc, run_s=60)
    by_group = nodes_by_tp_group(cluster, namespace, name, 4, wait_for)
    assert all(len(nodes) == 1 for nodes in by_group.values()), by_group


def test_gpu_and_efa_requests_are_honoured(cluster, namespace, wait_for):
    doc = tp_job("efa", 2, 8, gpusPerNode=8, resources={"efaPerNode": 32})
    name = apply_rendered(cluster, namespace, doc, run_s=60)

    def scheduled():
        pods = pods_of(cluster, namespace, name)
        return pods if len(pods) == 2 and all(p.spec.node_name for p in pods) else None

    pods = wait_for(scheduled, 60, "both EFA pods scheduled")
    core = kubernetes.client.CoreV1Api(cluster.api_client())
    for p in pods:
        node = core.read_node(p.spec.node_name)
        assert node.status.allocatable.get("vpc.amazonaws.com/efa") == "32"
        assert p.spec.containers[0].resources.limits["nvidia.com/gpu"] == "8"
    assert pods[0].spec.node_name != pods[1].spec.node_name  # 8 GPUs each: one node apiece


def test_more_gpus_per_node_than_any_node_stays_pending_with_the_schedulers_reason(cluster, namespace, wait_for):
    doc = tp_job("toobig", 1, 16, gpusPerNode=16)
    name = apply_rendered(cluster, namespace, doc)

    def unschedulable():
        for p in pods_of(cluster, namespace, name):
            for c in p.status.conditions or []:
                if c.type == "PodScheduled" and c.status == "False" and c.reason == "Unschedulable":
                    return c.message
        return None

    message = wait_for(unschedulable, 60, "the scheduler to report the pod Unschedulable")
    assert "Insufficient nvidia.com/gpu" in message


def test_injected_failure_restarts_the_gang(cluster, namespace, wait_for):
    doc = tp_job("restart", 2, 1, gpusPerNode=1, restart={"maxRestarts": 2})
    name = apply_rendered(cluster, namespace, doc, run_s=30)
    core = kubernetes.client.CoreV1Api(cluster.api_client())

    def running():
        pods = pods_of(cluster, namespace, name)
        return pods if len(pods) == 2 and all(p.status.phase == "Running" for p in pods) else None

    first = wait_for(running, 60, "both pods Running")
    old = {p.metadata.name for p in first}
    victim = first[0]
    core.patch_namespaced_pod(victim.metadata.name, namespace, {"metadata": {
        "labels": {POD_FAIL_LABEL: "true"}, "annotations": {POD_FAIL_EXIT_CODE: "1"}}})
    api = kubernetes.client.CustomObjectsApi(cluster.api_client())

    def restarted():
        js = api.get_namespaced_custom_object("jobset.x-k8s.io", "v1alpha2", namespace, "jobsets", name)
        pods = [p for p in pods_of(cluster, namespace, name) if p.metadata.name not in old]
        return (js.get("status", {}).get("restarts", 0) >= 1 and len(pods) == 2 and
                all(p.metadata.labels.get("jobset.sigs.k8s.io/restart-attempt") == "1" for p in pods))

    wait_for(restarted, 90, "the JobSet to restart the whole gang (restarts=1, two new pods)")
