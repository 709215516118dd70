"""pytest fixtures for the e2e tests against the local control plane.

- `cluster` (session): a helpers.Cluster. Reuses the cluster named by MEGATRON_E2E_KUBECONFIG, or a
  healthy one already up in $MEGATRON_OPERATOR_RUN; otherwise starts one with e2e/cluster/cluster.py
  and stops it at the end of the session (set MEGATRON_E2E_KEEP_CLUSTER=1 to keep it).
  If the cluster cannot start, every test using it FAILS (never skips).
- `namespace`: a fresh namespace per test (label megatron-e2e=true), deleted afterwards.
- `wait_for`: cluster.wait_for bound to that namespace (dumps its objects and events on timeout).
- `api_client`: a kubernetes ApiClient for the cluster.

Binaries must be built first: `e2e/cluster/cluster.py build` (see docs/local-cluster.md).
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import warnings
from pathlib import Path

import kubernetes
import pytest
from k8s import Cluster, load_cluster_module

# The operator, the CRD and the per-test `jobs` helper, registered once here for every test module.
# Imported into each module instead, a session-scoped fixture gets one instance per module: a CI run
# had three session operators at once, all reconciling every job (duplicate events, racing status).
from mjob import crd, jobs, operator  # noqa: F401

NAMESPACE_DELETE_TIMEOUT_S = 90
TEST_NAMESPACE_LABEL = "megatron-e2e=true"


@pytest.fixture(scope="session")
def cluster() -> Cluster:
    local = load_cluster_module()
    run_dir = local.run_dir()
    external = os.environ.get("MEGATRON_E2E_KUBECONFIG")
    started_here = False
    if external:
        kubectl = local.binaries()["kubectl"]
        if not os.access(kubectl, os.X_OK):
            kubectl = Path(shutil.which("kubectl") or kubectl)
        handle = Cluster(kubeconfig=Path(external), run_dir=run_dir, kubectl_path=kubectl)
        proc = handle.kubectl("get", "--raw=/readyz", check=False, timeout=20)
        if proc.returncode != 0:
            pytest.fail(
                f"MEGATRON_E2E_KUBECONFIG={external} is set but the cluster does not answer /readyz:\n"
                f"{proc.stderr}{proc.stdout}",
                pytrace=False,
            )
    else:
        try:
            started_here = not local.is_up()
            state = local.up()
        except local.ClusterError as e:
            pytest.fail(f"the local e2e cluster could not start (run dir {run_dir}):\n{e}", pytrace=False)
        handle = Cluster(
            kubeconfig=Path(state["kubeconfig"]), run_dir=run_dir, kubectl_path=Path(state["kubectl"])
        )
    yield handle
    tearing_down = started_here and os.environ.get("MEGATRON_E2E_KEEP_CLUSTER") != "1"
    if not tearing_down:
        _check_test_namespaces_deleted(handle)
    handle.close()
    if tearing_down:
        local.down()


def _check_test_namespaces_deleted(handle: Cluster) -> None:
    """A cluster that outlives the session must not keep test namespaces (stuck finalizers etc.)."""
    core = kubernetes.client.CoreV1Api(handle.api_client())

    def left() -> list[str]:
        return [n.metadata.name for n in core.list_namespace(label_selector=TEST_NAMESPACE_LABEL).items]

    try:
        handle.wait_for(lambda: not left(), NAMESPACE_DELETE_TIMEOUT_S, "test namespaces to be deleted")
    except AssertionError as e:
        warnings.warn(f"test namespaces still present after the session: {left()}\n{e}", stacklevel=1)


@pytest.fixture
def api_client(cluster: Cluster) -> kubernetes.client.ApiClient:
    return cluster.api_client()


@pytest.fixture
def namespace(cluster: Cluster, request: pytest.FixtureRequest) -> str:
    """A fresh namespace named after the test, deleted afterwards."""
    slug = re.sub(r"[^a-z0-9]+", "-", request.node.name.lower()).strip("-")[:40].strip("-")
    name = f"e2e-{slug}-{secrets.token_hex(3)}"
    core = kubernetes.client.CoreV1Api(cluster.api_client())
    core.create_namespace(
        {"metadata": {"name": name, "labels": {TEST_NAMESPACE_LABEL.split("=")[0]: "true"}}}
    )
    # Pods are rejected until kube-controller-manager has created the namespace's default ServiceAccount.
    cluster.wait_for(
        lambda: core.read_namespaced_service_account("default", name),
        30,
        f"ServiceAccount {name}/default (kube-controller-manager)",
        namespace=name,
        kinds=("serviceaccounts",),
    )
    yield name
    # Not waited for here (namespace deletion takes ~5 s even when empty); the session end checks
    # that every test namespace went away.
    core.delete_namespace(name, propagation_policy="Background")


@pytest.fixture
def wait_for(cluster: Cluster, namespace: str):
    """cluster.wait_for(predicate, timeout, what, ...) with the test's namespace in the dumps."""

    def bound(predicate, timeout, what, **kwargs):
        kwargs.setdefault("namespace", namespace)
        return cluster.wait_for(predicate, timeout, what, **kwargs)

    return bound
