"""The megatron-operator CLI, run as a user would (a subprocess), on good and bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from factory import make_job

ROOT = Path(__file__).parents[2]
# The operator's source roots: its package and the leaf it shares with the trainer (pyproject.toml)
OPERATOR_PATH = f"{ROOT / 'operator'}:{ROOT / 'contract'}"
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


def cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megatron_operator", *args], input=stdin, capture_output=True,
                          text=True, cwd=ROOT, env={"PYTHONPATH": OPERATOR_PATH, "PATH": "/usr/bin:/bin"},
                          timeout=120)


def write(tmp_path: Path, name: str, docs) -> str:
    p = tmp_path / name
    p.write_text(yaml.safe_dump_all(docs) if isinstance(docs, list) else docs)
    return str(p)


def test_examples_exist():
    names = {p.name for p in EXAMPLES}
    assert {"kubeflow-tp2.yaml", "gpt3-7.5b-efa.yaml", "llama3-70b-checkpoint.yaml", "moe-expert-parallel.yaml",
            "long-context-cp.yaml"} <= names


def test_validate_every_example():
    r = cli("validate", *map(str, EXAMPLES))
    assert r.returncode == 0, r.stderr
    assert r.stdout.count(": valid") == len(EXAMPLES)


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_render_every_example(example):
    r = cli("render", str(example))
    assert r.returncode == 0, r.stderr
    kinds = [d["kind"] for d in yaml.safe_load_all(r.stdout)]
    assert kinds == ["ServiceAccount", "Role", "RoleBinding", "JobSet"]


def test_validate_reports_one_line_per_problem_with_file_and_field(tmp_path):
    bad = make_job(training__globalBatchSize=100, model__hiddenSize=1000)
    f = write(tmp_path, "bad.yaml", [bad])
    r = cli("validate", f)
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 2
    assert all(line.startswith(f"{f}: spec.") for line in lines)
    assert any("spec.training.globalBatchSize: 100 is not divisible" in line for line in lines)


def test_typo_is_an_error_with_a_suggestion(tmp_path):
    doc = make_job()
    doc["spec"]["parallelism"]["tensr"] = 2
    r = cli("validate", write(tmp_path, "typo.yaml", [doc]))
    assert r.returncode == 1
    assert "spec.parallelism.tensr: unknown field; did you mean tensor?" in r.stderr


@pytest.mark.parametrize("mutate,expected", [
    (lambda d: d["spec"]["parallelism"].update(tensor=0), "spec.parallelism.tensor: Input should be greater than or equal to 1"),
    (lambda d: d["spec"]["training"].update(precision="bf32"), "spec.training.precision: Input should be"),
    (lambda d: d["spec"]["training"].pop("trainIters"), "spec.training.trainIters: required"),
    (lambda d: d["spec"]["parallelism"].update(tensor=None), "null is not allowed; omit the field"),
    (lambda d: d["spec"].update(resources={"memory": "lots"}), "spec.resources.memory: must be an integer or a quantity"),
    (lambda d: d["metadata"].update(name="Bad_Name"), "metadata.name: String should match pattern"),
    (lambda d: d.update(apiVersion="megatron-operator.io/v9"), "is not a megatron-operator.io/v1alpha1 MegatronJob"),
])
def test_structural_errors_are_clear(tmp_path, mutate, expected):
    doc = make_job()
    mutate(doc)
    r = cli("validate", write(tmp_path, "x.yaml", [doc]))
    assert r.returncode == 1
    assert expected in r.stderr
    assert "Traceback" not in r.stderr


def test_bad_yaml_and_missing_file_never_traceback(tmp_path):
    r = cli("validate", write(tmp_path, "broken.yaml", "spec: [unclosed\n"))
    assert r.returncode == 1 and "invalid YAML: line" in r.stderr and "Traceback" not in r.stderr
    r = cli("validate", str(tmp_path / "nope.yaml"))
    assert r.returncode == 1 and "cannot read" in r.stderr and "Traceback" not in r.stderr
    r = cli("render", write(tmp_path, "scalar.yaml", "42\n"))
    assert r.returncode == 1 and "Traceback" not in r.stderr


def test_non_megatronjob_documents_are_named_and_skipped(tmp_path):
    pvc = {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "ckpt"}}
    f = write(tmp_path, "mixed.yaml", [pvc, make_job()])
    r = cli("validate", f)
    assert r.returncode == 0
    assert f"{f}[1]: skipped: v1/PersistentVolumeClaim ckpt is not a MegatronJob" in r.stderr
    assert f"{f}[2]: job: valid" in r.stdout


def test_file_without_megatronjob_fails(tmp_path):
    r = cli("validate", write(tmp_path, "pvc.yaml", [{"apiVersion": "v1", "kind": "ConfigMap"}]))
    assert r.returncode == 1 and "no MegatronJob found" in r.stderr


def test_validate_from_stdin():
    r = cli("validate", "-", stdin=yaml.safe_dump(make_job()))
    assert r.returncode == 0 and "-: job: valid" in r.stdout


def test_render_json_and_namespace(tmp_path):
    doc = make_job()
    del doc["metadata"]["namespace"]
    r = cli("render", "-o", "json", "-n", "ml", write(tmp_path, "j.yaml", [doc]))
    assert r.returncode == 0
    items = json.loads(r.stdout)["items"]
    assert {i["metadata"]["namespace"] for i in items} == {"ml"}


def test_crd_command_matches_committed_file():
    """Drift test: crds/ must be regenerated (megatron-operator crd > crds/...) after model changes."""
    r = cli("crd")
    assert r.returncode == 0
    assert r.stdout == (ROOT / "crds" / "megatron-operator.io_megatronjobs.yaml").read_text()


def test_usage_error_exit_code():
    r = cli("frobnicate")
    assert r.returncode == 2


def test_rendered_yaml_keeps_numeric_looking_strings_strings():
    """YAML 1.2 readers (kubectl) would read an unquoted 1e-05 as a number; the command line must stay strings."""
    from megatron_operator.crd import to_yaml

    text = to_yaml({"command": ["--min-lr", "1e-05", "--lr", "0.0001", "--x", "true", "10", "plain"]})
    assert "'1e-05'" in text and "'true'" in text and "'10'" in text and "plain\n" in text
    assert yaml.safe_load(text)["command"][1] == "1e-05"


def _as_kubectl_get(doc: dict, name: str) -> dict:
    """A MegatronJob as `kubectl get -o yaml` prints it: server metadata and a status the CLI ignores."""
    out = json.loads(json.dumps(doc))
    out["metadata"].update(name=name, uid="0e7c-uid", resourceVersion="42", generation=1,
                           managedFields=[{"manager": "kubectl", "operation": "Apply"}])
    out["status"] = {"phase": "Running", "conditions": [{"type": "Running", "status": "True"}]}
    return out


def test_kind_list_is_accepted_by_validate_render_and_estimate(tmp_path):
    items = [_as_kubectl_get(make_job(), "a"), _as_kubectl_get(make_job(), "b")]
    f = write(tmp_path, "list.yaml", [{"apiVersion": "v1", "kind": "List", "metadata": {}, "items": items}])
    r = cli("validate", f)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [f"{f}.items[0]: a: valid", f"{f}.items[1]: b: valid"]
    r = cli("render", f)
    assert r.returncode == 0, r.stderr
    jobsets = [d["metadata"]["name"] for d in yaml.safe_load_all(r.stdout) if d["kind"] == "JobSet"]
    assert jobsets == ["a", "b"]
    r = cli("estimate", "-o", "json", f)
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)) == 2


def test_a_bad_item_of_a_list_is_named(tmp_path):
    bad = make_job(training__globalBatchSize=100)
    f = write(tmp_path, "list.yaml", [{"apiVersion": "v1", "kind": "List", "items": [make_job(), bad]}])
    r = cli("validate", f)
    assert r.returncode == 1
    assert r.stderr.startswith(f"{f}.items[1]: spec.training.globalBatchSize: 100 is not divisible")


def test_render_and_estimate_take_many_files(tmp_path):
    a, b = (write(tmp_path, f"{n}.yaml", [make_job(metadata__name=n)]) for n in ("one", "two"))
    r = cli("render", a, b)
    assert r.returncode == 0, r.stderr
    assert [d["metadata"]["name"] for d in yaml.safe_load_all(r.stdout) if d["kind"] == "JobSet"] == ["one", "two"]
    r = cli("estimate", a, b)
    assert r.returncode == 0, r.stderr
    assert f"{a}: one" in r.stdout and f"{b}: two" in r.stdout


def test_estimate_without_a_megatronjob_says_so(tmp_path):
    r = cli("estimate", write(tmp_path, "cm.yaml", [{"apiVersion": "v1", "kind": "ConfigMap"}]))
    assert r.returncode == 1 and "no MegatronJob found" in r.stderr and "Traceback" not in r.stderr


def test_run_offers_no_peering():
    """docs/operations.md: one active operator, kopf standalone; a --peering flag would contradict it."""
    r = cli("run", "--help")
    assert r.returncode == 0 and "--namespace" in r.stdout
    assert "peering" not in r.stdout


# ---- hostile or mistaken input never crashes and never passes (issue 15) -------------------------

JOB_YAML = yaml.safe_dump(make_job(), sort_keys=False)


def assert_refused(r: subprocess.CompletedProcess, *needles: str) -> None:
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and "valid" not in r.stdout
    for n in needles:
        assert n in r.stderr, r.stderr


@pytest.mark.parametrize("nested", ["[" * 600 + "]" * 600, "{a: " * 600 + "1" + "}" * 600])
def test_deep_nesting_is_an_error_not_a_traceback(tmp_path, nested):
    doc = JOB_YAML.replace("image", "x") + f"extra: {nested}\n"
    r = cli("validate", write(tmp_path, "deep.yaml", doc))
    assert_refused(r)
    assert any(s in r.stderr for s in ("nested too deeply", "nested deeper than"))


def test_deep_nesting_within_yamls_limits_is_refused_by_depth(tmp_path):
    doc = make_job()
    node = doc["spec"]["podMetadata"] = {}
    for _ in range(60):
        node["a"] = {}
        node = node["a"]
    r = cli("validate", write(tmp_path, "deep.yaml", [doc]))
    assert_refused(r, "nested deeper than 32 levels")


def test_non_string_keys_are_an_error(tmp_path):
    r = cli("validate", write(tmp_path, "keys.yaml", JOB_YAML.replace("spec:\n", "spec:\n  1: null\n", 1)))
    assert_refused(r, "spec: key 1 is not a string; quote it")


def test_duplicate_keys_are_an_error(tmp_path):
    text = JOB_YAML.replace("  numNodes: 2\n", "  numNodes: 1\n  gpusPerNode: 8\n  numNodes: 64\n", 1)
    text = text.replace("  gpusPerNode: 8\n", "", 1) if text.count("gpusPerNode: 8") > 1 else text
    r = cli("validate", write(tmp_path, "dup.yaml", text))
    assert_refused(r, "duplicate key 'numNodes' (first on line")


def test_merge_keys_may_be_overridden(tmp_path):
    text = "base: &b {x: 1}\n---\n" + JOB_YAML.replace("metadata:\n", "metadata:\n  <<: {name: other}\n", 1)
    r = cli("validate", write(tmp_path, "merge.yaml", text))
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize(("change", "needle"), [
    (lambda d: d.update(kind="MegatronJobs"), "is not a MegatronJob: use apiVersion: megatron-operator.io/v1alpha1"),
    (lambda d: d.pop("apiVersion"), "is not a MegatronJob: use apiVersion"),
    (lambda d: d.update(apiVersion="megatron-operator.io/v1"), "is not a megatron-operator.io/v1alpha1 MegatronJob"),
])
def test_a_document_meant_as_a_megatronjob_with_a_wrong_kind_fails(tmp_path, change, needle):
    doc = make_job()
    change(doc)
    r = cli("validate", write(tmp_path, "kind.yaml", [doc]))
    assert_refused(r, needle)


def test_other_kinds_are_still_skipped(tmp_path):
    r = cli("validate", write(tmp_path, "mixed.yaml", [{"apiVersion": "v1", "kind": "ConfigMap",
                                                        "metadata": {"name": "c"}}, make_job()]))
    assert r.returncode == 0 and "skipped: v1/ConfigMap c" in r.stderr


@pytest.mark.parametrize(("field", "value", "needle"), [
    ("numNodes", "1", "spec.numNodes: Input should be a valid integer"),
    ("suspend", "yes", "spec.suspend: Input should be a valid boolean"),
    ("gpusPerNode", 7.5, "spec.gpusPerNode: Input should be a valid integer"),
])
def test_types_are_strict_like_the_api_server(tmp_path, field, value, needle):
    r = cli("validate", write(tmp_path, "types.yaml", [make_job(**{field: value})]))
    assert_refused(r, needle)


def test_integers_and_floats_mix_as_the_api_server_allows(tmp_path):
    # an integer for a number, an integral float for an integer (the API server stores 8)
    r = cli("validate", write(tmp_path, "lr.yaml", [make_job(training__lr=1, gpusPerNode=8.0)]))
    assert r.returncode == 0, r.stderr


def test_echoed_values_are_truncated(tmp_path):
    r = cli("validate", write(tmp_path, "long.yaml", [make_job(image="x" * 100_000)]))
    assert_refused(r, "more characters)")
    assert len(r.stderr) < 2000


@pytest.mark.parametrize(("overrides", "needle"), [
    (dict(numNodes=4, gpusPerNode=8, parallelism={"tensor": 16}, model__numAttentionHeads=16,
          training__globalBatchSize=4), "must share one node with at least 16 GPUs"),
    (dict(resources={"memory": "64Gi", "shmSize": "128Gi"}), "/dev/shm (128Gi) is larger than the pod's memory limit"),
    (dict(resources={"memory": "32Gi"}), "/dev/shm (64Gi) is larger"),  # the default: 8Gi per GPU
])
def test_warnings_for_specs_that_may_not_run_as_meant(tmp_path, overrides, needle):
    r = cli("validate", write(tmp_path, "warn.yaml", [make_job(**overrides)]))
    assert r.returncode == 0 and ": valid" in r.stdout, r.stderr
    assert "warning: " in r.stderr and needle in r.stderr, r.stderr


QWEN3_MOE_8_LAYERS = dict(model__numLayers=8, model__hiddenSize=2048, model__numAttentionHeads=32,
                         model__numQueryGroups=4, model__kvChannels=128, model__ffnHiddenSize=6144,
                         model__seqLength=4096, model__activation="swiglu", model__addBiasLinear=False,
                         model__numExperts=128, model__moeRouterTopk=8, model__moeFfnHiddenSize=768,
                         numNodes=1, gpusPerNode=1, parallelism={"tensor": 1}, training__microBatchSize=1,
                         training__globalBatchSize=16)


def test_moe_at_micro_batch_1_with_many_local_expert_weights_is_warned(tmp_path):
    """Issue 60's lever: the measured shape (docs/benchmarks/moe.md) at micro-batch 1 is warned with the figure; at
    micro-batch 4, or with the experts spread over 8 GPUs, it is not."""
    r = cli("validate", write(tmp_path, "moe1.yaml", [make_job(**QWEN3_MOE_8_LAYERS)]))
    assert r.returncode == 0, r.stderr
    assert ("spec.training.microBatchSize: 1 with 16 micro-batches a step: each GPU holds 4.8 B expert weights "
            "(128 experts a layer at spec.parallelism.expert 1)") in r.stderr, r.stderr
    for name, extra in (("moe4", dict(training__microBatchSize=4)),
                        ("ep8", dict(gpusPerNode=8, parallelism={"tensor": 1, "expert": 8}, training__globalBatchSize=128))):
        r = cli("validate", write(tmp_path, f"{name}.yaml", [make_job(**{**QWEN3_MOE_8_LAYERS, **extra})]))
        assert r.returncode == 0 and ": valid" in r.stdout, r.stderr
        assert "microBatchSize: 1 with" not in r.stderr, (name, r.stderr)


def test_no_warning_when_shm_fits_in_memory(tmp_path):
    r = cli("validate", write(tmp_path, "ok.yaml", [make_job(resources={"memory": "1Ti"})]))
    assert r.returncode == 0 and "warning" not in r.stderr, r.stderr


def test_validate_refuses_a_jobset_too_large_to_store(tmp_path):
    doc = make_job(numNodes=64, parallelism={"tensor": 16}, model__numAttentionHeads=16, training__globalBatchSize=64,
                   env=[{"name": f"E{i}", "value": "x" * 4096} for i in range(64)])
    r = cli("validate", write(tmp_path, "big.yaml", [doc]))
    assert_refused(r, "spec: the JobSet would be", "MiB")


def test_validate_applies_the_clusters_guardrails_from_the_operators_environment(tmp_path):
    """The same MEGATRON_OPERATOR_* settings as the operator (and the chart's admission policy);
    without any, the defaults the chart installs (a grace period of at most 3600 s, ...)."""
    path = write(tmp_path, "job.yaml", [make_job(image="docker.io/x:1", terminationGracePeriodSeconds=3601)])
    r = cli("validate", path)
    assert_refused(r, "spec.terminationGracePeriodSeconds: 3601 is above this cluster's maximum 3600")
    assert "spec.image" not in r.stderr
    r = subprocess.run([sys.executable, "-m", "megatron_operator", "validate", path], capture_output=True, text=True,
                       cwd=ROOT, timeout=120, env={"PYTHONPATH": OPERATOR_PATH, "PATH": "/usr/bin:/bin",
                                                   "MEGATRON_OPERATOR_ALLOWED_IMAGE_REGISTRIES": "nvcr.io",
                                                   "MEGATRON_OPERATOR_MAX_TERMINATION_GRACE_PERIOD_S": "0"})
    assert_refused(r, "spec.image: this cluster runs images only from nvcr.io; use one of them")
    assert "terminationGracePeriodSeconds" not in r.stderr
