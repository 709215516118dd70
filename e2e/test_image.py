"""The operator image, as `make images` builds it, run by podman (runc) against the local control plane.

The container gets exactly what the chart's Deployment gives the operator pod: its command, args,
env and security context (read from the Deployment that `helm install` created), and in-cluster
config: a TokenRequest token of the chart's ServiceAccount, the cluster CA and the namespace
mounted at /var/run/secrets/kubernetes.io/serviceaccount/, and KUBERNETES_SERVICE_HOST/PORT. It
has no kubeconfig. With host networking, it reaches the API server on 127.0.0.1 and serves
/metrics and /healthz on the chart's port.

podman needs `--runtime runc`, because crun refuses this machine's hybrid cgroup v1, and explicit
limits, because the sandbox refuses to raise RLIMIT_NPROC. These tests skip only when podman is
absent; CI installs it (`make images`).
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from k8s import Cluster
from mjob import OPERATOR_START_TIMEOUT_S, Jobs, run_for, small_job
from test_helm import ChartOperator, Release, e2e_values, release

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
IMAGE = os.environ.get("MEGATRON_OPERATOR_IMAGE", "localhost/megatron-operator:dev")
BUILD_TIMEOUT_S = 900  # a cold build assembles the stand-in base and the wheelhouse first
RUN_TIMEOUT_S = 60
JOB_TIMEOUT_S = 180
TOKEN_DURATION_S = 3600
SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
# crun refuses hybrid cgroup v1; the sandbox refuses to raise RLIMIT_NPROC (docs/install.md).
PODMAN = ["podman", "--runtime", "runc"]
# --passwd=false: podman would add an /etc/passwd entry for --user; a kubelet never does.
LIMITS = ["--ulimit", "nproc=4096:4096", "--ulimit", "nofile=20000:20000", "--passwd=false"]


def podman(*args: str, timeout: float = RUN_TIMEOUT_S, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([*PODMAN, *args], capture_output=True, text=True, timeout=timeout, check=False)
    if check and proc.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)} failed (rc={proc.returncode}):\n{proc.stderr}{proc.stdout}")
    return proc


@pytest.fixture(scope="module")
def image() -> str:
    """The operator image, (re)built from this checkout (buildah's layer cache makes that seconds)."""
    if shutil.which("podman") is None:
        pytest.skip("podman is not installed: `make images` installs it (buildah, podman, runc, mmdebstrap)")
    if "MEGATRON_OPERATOR_IMAGE" not in os.environ:
        proc = subprocess.run([str(ROOT / "scripts" / "images.sh"), "operator"], capture_output=True, text=True,
                              timeout=BUILD_TIMEOUT_S, check=False)
        if proc.returncode != 0:
            pytest.fail(f"scripts/images.sh operator failed (rc={proc.returncode}):\n{proc.stderr[-5000:]}",
                        pytrace=False)
    return IMAGE


def run_image(image: str, *args: str, entrypoint: str | None = None) -> subprocess.CompletedProcess:
    """`podman run` as the user's `podman run` would be here: read-only root, uid 65532, no network."""
    ep = ["--entrypoint", entrypoint] if entrypoint else []
    return podman("run", "--rm", "--read-only", "--user", "65532", "--network", "none", *LIMITS, *ep, image, *args)


def test_image_runs_as_65532_with_a_read_only_root_and_the_cli_works(image):
    config = yaml.safe_load(podman("image", "inspect", image).stdout)[0]["Config"]
    assert config["User"] == "65532:65532"
    assert config["Entrypoint"] == ["megatron-operator"] and config["Cmd"] == ["run"]

    probe = ("import os\n"
             "print(os.getuid(), os.getgid())\n"
             "for path in ('/probe', '/opt/venv/probe'):\n"
             "    try:\n"
             "        open(path, 'w')\n"
             "    except OSError as e:\n"
             "        print(path, e.strerror)\n")
    out = podman("run", "--rm", "--read-only", "--network", "none", *LIMITS, "--entrypoint", "python", image,
                 "-c", probe).stdout.splitlines()
    assert out == ["65532 65532", "/probe Read-only file system", "/opt/venv/probe Read-only file system"]
    assert run_image(image, "python", "-c", "import os; print(os.getuid())", entrypoint="env").stdout == "65532\n"

    assert "Run Megatron-Core training as Kubernetes MegatronJobs." in run_image(image, "--help").stdout
    # the image's CLI prints the same CRD as the one committed (generated from this checkout)
    assert run_image(image, "crd").stdout == (ROOT / "crds" / "megatron-operator.io_megatronjobs.yaml").read_text()
    # hf-config's reader is megatron_contract, a source root of its own: the image installs it too
    run_image(image, "-c", "from megatron_operator.hf_config import parse_config", entrypoint="python")
    # no pip left in the image
    pip = podman("run", "--rm", "--read-only", "--network", "none", *LIMITS, "--entrypoint", "python", image,
                 "-m", "pip", "--version", check=False)
    assert pip.returncode == 1 and "No module named pip" in pip.stderr


def service_account_dir(cluster: Cluster, rel: Release, path: Path) -> Path:
    """token (TokenRequest of the chart's ServiceAccount), ca.crt and namespace, as a kubelet mounts them."""
    admin = yaml.safe_load(cluster.kubeconfig.read_text())
    ca = Path(admin["clusters"][0]["cluster"]["certificate-authority"])
    ca = ca if ca.is_absolute() else cluster.kubeconfig.parent / ca
    token = cluster.kubectl("create", "token", rel.service_account(), "-n", rel.namespace,
                            f"--duration={TOKEN_DURATION_S}s").stdout.strip()
    path.mkdir(mode=0o755)
    (path / "token").write_text(token)
    (path / "ca.crt").write_bytes(ca.read_bytes())
    (path / "namespace").write_text(rel.namespace)
    for f in path.iterdir():
        f.chmod(0o644)  # the kubelet's projected volume defaults to 0644
    return path


def security_flags(pod: dict[str, Any], container: dict[str, Any]) -> list[str]:
    """podman flags for the Deployment's pod and container securityContext and its /tmp emptyDir."""
    psc, csc = pod.get("securityContext") or {}, container.get("securityContext") or {}
    user = csc.get("runAsUser", psc.get("runAsUser"))
    group = csc.get("runAsGroup", psc.get("runAsGroup"))
    flags = ["--user", f"{user}:{group}"] if user is not None and group is not None else []
    if csc.get("readOnlyRootFilesystem"):
        flags.append("--read-only")
    if csc.get("allowPrivilegeEscalation") is False:
        flags += ["--security-opt", "no-new-privileges"]
    for cap in (csc.get("capabilities") or {}).get("drop", []):
        flags += ["--cap-drop", cap.lower()]
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    for m in container.get("volumeMounts", []):
        empty_dir = volumes[m["name"]]["emptyDir"]
        assert empty_dir is not None, f"volume {m['name']} is not an emptyDir"
        size = empty_dir.get("sizeLimit", "64Mi").replace("Mi", "m").replace("Gi", "g")
        flags += ["--tmpfs", f"{m['mountPath']}:rw,size={size},mode=1777"]
    return flags


@dataclass
class ContainerOperator(ChartOperator):
    """The chart's operator pod as a podman container (host network, in-cluster config)."""

    podman_args: list[str] = field(default_factory=list)
    name: str = ""

    @classmethod
    def from_release(cls, cluster: Cluster, rel: Release, image: str, sa_dir: Path) -> ContainerOperator:
        dep = rel.deployment()
        pod = dep["spec"]["template"]["spec"]
        c = pod["containers"][0]
        env = {}
        for e in c.get("env", []):
            assert "valueFrom" not in e, f"cannot reproduce valueFrom env {e['name']} with podman"
            env[e["name"]] = e.get("value", "")
        server = urllib.parse.urlsplit(yaml.safe_load(cluster.kubeconfig.read_text())["clusters"][0]["cluster"]["server"])
        env |= {"KUBERNETES_SERVICE_HOST": server.hostname, "KUBERNETES_SERVICE_PORT": str(server.port)}
        name = f"mo-e2e-{secrets.token_hex(3)}"
        args = ["--name", name, "--network", "host", "--pull", "never", *LIMITS, *security_flags(pod, c),
                "--volume", f"{sa_dir}:{SA_DIR}:ro",
                *(x for k, v in env.items() for x in ("--env", f"{k}={v}")),
                "--entrypoint", c["command"][0], image, *c["command"][1:], *c.get("args", [])]
        return cls(cluster, int(env["MEGATRON_OPERATOR_METRICS_PORT"]), {}, log_name="operator-container",
                   podman_args=args, name=name)

    def start(self) -> None:
        podman("run", "--detach", *self.podman_args)
        self.starts += 1
        self.cluster.wait_for(self.healthy, OPERATOR_START_TIMEOUT_S, "the operator container's /healthz",
                              kinds=("megatronjobs",))

    def running(self) -> bool:
        state = podman("inspect", "--format", "{{.State.Status}}", self.name, check=False).stdout.strip()
        return state == "running"

    def healthy(self) -> bool:
        if not self.running():
            raise AssertionError(f"the operator container exited:\n{self.logs()[-5000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/healthz", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def logs(self) -> str:
        proc = podman("logs", self.name, check=False)
        return proc.stdout + proc.stderr

    def forbidden_lines(self) -> list[str]:
        self.log_path.write_text(self.logs())
        return super().forbidden_lines()

    def stop(self) -> None:
        self.log_path.write_text(self.logs())  # kept with the cluster's logs
        podman("rm", "--force", "--time", "10", self.name, check=False)


def test_operator_container_runs_a_job_with_the_charts_pod_spec_and_in_cluster_config(
        cluster, crd, release, namespace, image, tmp_path):
    release.install(e2e_values())
    sa_dir = service_account_dir(cluster, release, tmp_path / "serviceaccount")
    op = ContainerOperator.from_release(cluster, release, image, sa_dir)
    assert "--read-only" in op.podman_args and "65532:65532" in op.podman_args  # the chart's securityContext
    op.start()
    jobs = Jobs(cluster, namespace)
    try:
        env = podman("exec", op.name, "env").stdout.splitlines()
        assert not [line for line in env if line.startswith("KUBECONFIG=")]
        assert podman("exec", op.name, "id", "-u").stdout.strip() == "65532"

        jobs.create(small_job("ok", podMetadata=run_for(3)))
        done = jobs.wait_phase("ok", "Succeeded", timeout=JOB_TIMEOUT_S)
        assert {c["type"]: c["status"] for c in done["conditions"]}["Succeeded"] == "True"
        # the work was done by the container (its /metrics), never refused
        assert op.metric("megatron_operator_reconciles_total", kind="MegatronJob", result="success") >= 1
        assert op.metric("megatron_operator_status_writes_total") > 0
        assert op.metric("megatron_operator_reconcile_errors_total") == 0
        assert not op.forbidden_lines(), "the operator was refused:\n" + "\n".join(op.forbidden_lines()[:20])
    finally:
        try:
            for item in jobs.custom.list_namespaced_custom_object("megatron-operator.io", "v1alpha1", namespace,
                                                                  "megatronjobs")["items"]:
                jobs.delete(item["metadata"]["name"])
        finally:
            op.stop()


def test_a_rebuild_removes_the_image_it_superseded(image, tmp_path):
    """Each `make images` after a change moves the tag; what it moved from must not stay on disk.

    CI rebuilds on every run, and the images left behind (~170 MB of disk a rebuild with the build
    stage's layer cache) once filled the disk. Two builds of a copy of this tree under their own tag, the
    second with one file changed: the first image is gone, and no more images carry the stand-in
    base's label than after the first build.
    """
    tag = f"localhost/megatron-operator:rebuild-{secrets.token_hex(3)}"
    tree = tmp_path / "tree"
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for rel in filter(None, files.decode().split("\0")):
        if (ROOT / rel).is_file():
            (tree / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, tree / rel)
    probe = tree / "operator" / "megatron_operator" / "__init__.py"
    original = probe.read_text()

    def build(marker: str) -> tuple[str, int]:
        probe.write_text(f"{original}# rebuild probe {marker}\n")
        proc = subprocess.run([str(tree / "scripts" / "images.sh"), "operator"], capture_output=True, text=True,
                              timeout=BUILD_TIMEOUT_S, check=False,
                              env=dict(os.environ, IMAGE_TAG=tag.rsplit(":", 1)[1]))
        assert proc.returncode == 0, f"scripts/images.sh operator failed:\n{proc.stderr[-5000:]}"
        image_id = podman("image", "inspect", "-f", "{{.Id}}", tag).stdout.strip()
        key = podman("image", "inspect", "-f", '{{index .Labels "key"}}', tag).stdout.strip()
        assert key, f"{tag} has no `key` label from the stand-in base"
        count = len(podman("images", "-a", "-q", "--filter", f"label=key={key}").stdout.split())
        return image_id, count

    try:
        first, after_first = build("a")
        second, after_second = build("b")
        assert second != first, "the changed file did not change the image"
        assert podman("image", "exists", first, check=False).returncode == 1, (
            f"the superseded image {first[:12]} is still there")
        assert after_second <= after_first, (
            f"{after_second} images carry the base's label after the rebuild, {after_first} before it")
    finally:
        podman("rmi", tag, check=False)
