"""A real Argo CD (application controller + repo server, built by e2e/cluster/build.sh argocd) run
out of cluster against the local control plane, with Redis (Debian's redis-server) and a Git
repository served by `git daemon` on loopback. Used by e2e/test_argocd.py; docs/gitops.md.

Argo CD's CRDs come from its module zip in build.sh's Go module cache (the same version as the
binary), never from a copy in this repository.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kubernetes
import yaml
from k8s import Cluster, load_cluster_module
from mjob import free_port

ROOT = Path(__file__).resolve().parents[1]
HEALTH_LUA = ROOT / "charts" / "megatron-operator" / "files" / "argocd" / "health.lua"
HEALTH_KEY = "resource.customizations.health.megatron-operator.io_MegatronJob"
ARGO = ("argoproj.io", "v1alpha1")
NS = "argocd"
START_TIMEOUT_S = 90
# How often Argo CD polls Git (timeout.reconciliation); changes of live objects arrive by watch.
APP_RESYNC_S = 3


def argocd_version() -> str:
    return load_cluster_module().versions()["ARGOCD_VERSION"]


def argocd_bin_dir() -> Path:
    return load_cluster_module().cache_dir() / "bin" / f"argocd-{argocd_version()}"


def argocd_crds() -> list[dict[str, Any]]:
    """Application and AppProject CRDs from the module zip of the built version."""
    mod = load_cluster_module().module_dir("github.com/argoproj/argo-cd/v3", f"v{argocd_version()}")
    return [yaml.safe_load((mod / "manifests" / "crds" / f).read_text())
            for f in ("application-crd.yaml", "appproject-crd.yaml")]


def ensure_redis() -> str:
    """Argo CD's cache: Debian's redis-server, installed with apt-get when absent (as node.py does)."""
    if shutil.which("redis-server") is None and shutil.which("apt-get") and os.geteuid() == 0:
        subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", "redis-server"],
                       capture_output=True, timeout=600, check=False, env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
        if shutil.which("redis-server") is None:
            subprocess.run(["apt-get", "update", "-qq"], capture_output=True, timeout=300, check=False)
            subprocess.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", "redis-server"],
                           capture_output=True, timeout=600, check=False,
                           env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    path = shutil.which("redis-server")
    if path is None:
        raise AssertionError("redis-server missing: apt-get install --no-install-recommends redis-server")
    return path


class GitRepo:
    """A working repository served read-only by `git daemon` on 127.0.0.1 (git:// protocol)."""

    def __init__(self, root: Path, log: Path):
        self.root = root
        self.dir = root / "repo"
        self.dir.mkdir(parents=True)
        self.port = free_port()
        self.url = f"git://127.0.0.1:{self.port}/repo"
        self.git("init", "-q", "-b", "main")
        self.git("config", "user.email", "e2e@megatron-operator.io")
        self.git("config", "user.name", "e2e")
        (self.dir / "README").write_text("e2e repository for Argo CD\n")
        self.commit("initial")
        self.proc = subprocess.Popen(
            ["git", "daemon", "--reuseaddr", "--export-all", f"--base-path={root}", "--listen=127.0.0.1",
             f"--port={self.port}", "--verbose", str(root)],
            stdout=open(log, "a"), stderr=subprocess.STDOUT, start_new_session=True)

    def git(self, *args: str) -> str:
        return subprocess.run(["git", *args], cwd=self.dir, check=True, capture_output=True, text=True).stdout

    def ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"git daemon exited (rc={self.proc.returncode})")
        return subprocess.run(["git", "ls-remote", self.url], capture_output=True, timeout=10).returncode == 0

    def write(self, files: dict[str, str | dict | list | None], message: str) -> str:
        """Write (or, for None, delete) files relative to the repository root, commit; returns the SHA."""
        for rel, content in files.items():
            path = self.dir / rel
            if content is None:
                if path.is_dir():
                    shutil.rmtree(path)
                else:
                    path.unlink()
                continue
            path.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(content, str):
                path.write_text(content)
            else:
                docs = content if isinstance(content, list) else [content]
                path.write_text(yaml.safe_dump_all(docs, sort_keys=False))
        return self.commit(message)

    def copy_tree(self, src: Path, rel: str, message: str) -> str:
        shutil.copytree(src, self.dir / rel)
        return self.commit(message)

    def commit(self, message: str) -> str:
        self.git("add", "-A")
        self.git("commit", "-q", "--allow-empty", "-m", message)
        return self.git("rev-parse", "HEAD").strip()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)
            self.proc.wait(timeout=10)


@dataclass
class ArgoCD:
    """Argo CD's application controller and repo server as host processes, and their state."""

    cluster: Cluster
    work: Path
    server_side_diff: bool = False
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    git: GitRepo | None = None

    # -- start / stop ---------------------------------------------------------------------------

    def start(self) -> None:
        bins = argocd_bin_dir()
        for b in ("argocd-application-controller", "argocd-repo-server"):
            if not os.access(bins / b, os.X_OK):
                raise AssertionError(f"{bins / b} missing: run `e2e/cluster/cluster.py build argocd` "
                                     f"(docs/gitops.md)")
        redis = ensure_redis()
        self.work.mkdir(parents=True, exist_ok=True)
        logs = self.cluster.logs_dir
        self.git = GitRepo(self.work / "git", logs / "argocd-git-daemon.log")
        self._install()

        self.redis_port = free_port()
        self._spawn("redis", [redis, "--bind", "127.0.0.1", "--port", str(self.redis_port), "--save", "",
                              "--appendonly", "no", "--protected-mode", "yes"], {})
        for d in ("tls", "ssh", "gpg", "gnupg", "tmp"):
            (self.work / d).mkdir(exist_ok=True)
        helm_dir = load_cluster_module().helm_binary().parent
        env = {
            "ARGOCD_FAKE_IN_CLUSTER": "true",  # the in-cluster destination is this kubeconfig's cluster
            "KUBECONFIG": str(self.cluster.kubeconfig),
            "ARGOCD_TLS_DATA_PATH": str(self.work / "tls"),
            "ARGOCD_SSH_DATA_PATH": str(self.work / "ssh"),
            "ARGOCD_GPG_DATA_PATH": str(self.work / "gpg"),
            "ARGOCD_GNUPGHOME": str(self.work / "gnupg"),
            "ARGOCD_GPG_ENABLED": "false",
            "TMPDIR": str(self.work / "tmp"),
            "PATH": f"{bins}:{helm_dir}:{os.environ.get('PATH', '/usr/bin:/bin')}",  # the repo server runs helm, git
            "HOME": str(self.work),
            # argocd-cm's timeout.reconciliation, as the install manifests pass it to both: how often
            # the controller polls Git and how long the repo server caches what a branch points to.
            "ARGOCD_RECONCILIATION_TIMEOUT": f"{APP_RESYNC_S}s",
        }
        self.repo_port, self.repo_metrics, self.ctrl_metrics = free_port(), free_port(), free_port()
        self._spawn("argocd-repo-server", [
            str(bins / "argocd-repo-server"), "--address", "127.0.0.1", "--port", str(self.repo_port),
            "--metrics-address", "127.0.0.1", "--metrics-port", str(self.repo_metrics),
            "--redis", f"127.0.0.1:{self.redis_port}", "--logformat", "text"], env)
        self._spawn("argocd-application-controller", [
            str(bins / "argocd-application-controller"), "--namespace", NS,
            "--redis", f"127.0.0.1:{self.redis_port}", "--repo-server", f"127.0.0.1:{self.repo_port}",
            "--metrics-port", str(self.ctrl_metrics),
            "--self-heal-timeout-seconds", "0", "--status-processors", "4", "--operation-processors", "4",
            # Resource health in Application.status.resources (Argo CD >= 3.0 keeps it only in Redis by default),
            # so the test reads each MegatronJob's health and message from the Application.
            "--persist-resource-health",
            f"--server-side-diff-enabled={'true' if self.server_side_diff else 'false'}",
            "--logformat", "text"], env)
        self.cluster.wait_for(self.git.ready, START_TIMEOUT_S, "git daemon to serve the repository",
                              kinds=())
        self.cluster.wait_for(lambda: self._metrics_ok(self.repo_metrics) and self._metrics_ok(self.ctrl_metrics),
                              START_TIMEOUT_S, "argocd repo server and application controller /metrics", kinds=())

    def _spawn(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        log = open(self.cluster.logs_dir / f"{name}.log", "a")
        log.write(f"\n===== {' '.join(argv)} =====\n")
        log.flush()
        self.procs[name] = subprocess.Popen(argv, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True, cwd=self.work)

    def _metrics_ok(self, port: int) -> bool:
        for name, p in self.procs.items():
            if p.poll() is not None:
                raise AssertionError(f"{name} exited (rc={p.returncode}); log: {self.cluster.logs_dir / name}.log")
        import urllib.request
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def _install(self) -> None:
        """CRDs, the argocd namespace, the settings Argo CD reads, the default AppProject."""
        self.cluster.apply(argocd_crds())

        def established() -> bool:
            for crd in ("applications.argoproj.io", "appprojects.argoproj.io"):
                out = json.loads(self.cluster.kubectl("get", "crd", crd, "-o", "json").stdout)
                if not any(c["type"] == "Established" and c["status"] == "True"
                           for c in out.get("status", {}).get("conditions", [])):
                    return False
            return True

        self.cluster.wait_for(established, 30, "Argo CD CRDs Established", kinds=("crd",))
        labels = {"app.kubernetes.io/part-of": "argocd"}
        self.cluster.apply([
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}},
            {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "argocd-cm", "namespace": NS,
                                                                  "labels": labels},
             "data": self.settings()},
            {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "argocd-rbac-cm", "namespace": NS,
                                                                  "labels": labels}, "data": {}},
            {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "argocd-secret", "namespace": NS,
                                                               "labels": labels},
             "stringData": {"server.secretkey": secrets.token_hex(32)}},
            # argocd-server creates the default project on start-up; without the server, the test does.
            {"apiVersion": "/".join(ARGO), "kind": "AppProject", "metadata": {"name": "default", "namespace": NS},
             "spec": {"sourceRepos": ["*"], "destinations": [{"server": "*", "namespace": "*"}],
                      "clusterResourceWhitelist": [{"group": "*", "kind": "*"}]}},
        ])

    def settings(self, health: bool = True) -> dict[str, str]:
        data = {"timeout.reconciliation": f"{APP_RESYNC_S}s"}
        if health:
            data[HEALTH_KEY] = HEALTH_LUA.read_text()   # the chart's file, as docs/gitops.md says
        return data

    def set_health_check(self, on: bool) -> None:
        """Add or remove the chart's MegatronJob health check in argocd-cm (Argo CD watches it)."""
        core = kubernetes.client.CoreV1Api(self.cluster.api_client())
        cm = core.read_namespaced_config_map("argocd-cm", NS)
        data = dict(cm.data or {})
        if on:
            data[HEALTH_KEY] = HEALTH_LUA.read_text()
        else:
            data.pop(HEALTH_KEY, None)
        cm.data = data
        core.replace_namespaced_config_map("argocd-cm", NS, cm)

    def stop(self) -> None:
        for name in ("argocd-application-controller", "argocd-repo-server", "redis"):
            p = self.procs.get(name)
            if p is not None and p.poll() is None:
                os.killpg(p.pid, 15)
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, 9)
                    p.wait(timeout=10)
        if self.git is not None:
            self.git.stop()

    # -- Applications -----------------------------------------------------------------------------

    @property
    def custom(self) -> kubernetes.client.CustomObjectsApi:
        return kubernetes.client.CustomObjectsApi(self.cluster.api_client())

    def application(self, name: str, source: dict[str, Any], namespace: str, prune: bool = True,
                    retry: dict[str, Any] | None = None, server_side: bool = False, **spec: Any) -> dict[str, Any]:
        """An Application with automated sync (and prune) of `source` (repoURL filled in) into `namespace`.
        `server_side`: server-side apply and server-side diff instead of Argo CD's defaults."""
        if server_side:
            spec["syncPolicy"] = {"syncOptions": ["ServerSideApply=true"]}
        app = {"apiVersion": "/".join(ARGO), "kind": "Application",
               "metadata": {"name": name, "namespace": NS,
                            **({"annotations": {"argocd.argoproj.io/compare-options": "ServerSideDiff=true"}}
                               if server_side else {}),
                            "finalizers": ["resources-finalizer.argocd.argoproj.io"]},
               "spec": {"project": "default",
                        "source": {"repoURL": self.git.url, "targetRevision": "main", **source},
                        "destination": {"server": "https://kubernetes.default.svc", "namespace": namespace},
                        **spec}}
        app["spec"]["syncPolicy"] = {**app["spec"].get("syncPolicy", {}),
                                     "automated": {"prune": prune, "selfHeal": True},
                                     **({"retry": retry} if retry else {})}
        return self.cluster.apply(app)[0]

    def app(self, name: str) -> dict[str, Any]:
        return self.custom.get_namespaced_custom_object(*ARGO, NS, "applications", name)

    def refresh(self, name: str, hard: bool = False) -> None:
        self.custom.patch_namespaced_custom_object(
            *ARGO, NS, "applications", name,
            {"metadata": {"annotations": {"argocd.argoproj.io/refresh": "hard" if hard else "normal"}}})

    def resource(self, app: dict[str, Any], kind: str, name: str) -> dict[str, Any] | None:
        for r in (app.get("status") or {}).get("resources") or []:
            if r.get("kind") == kind and r.get("name") == name:
                return r
        return None

    def wait(self, name: str, predicate, timeout: float, what: str, namespace: str | None = None):
        """Poll the Application until predicate(app) is truthy and return it; on timeout dump it and the logs."""
        last: dict[str, Any] = {}

        def check():
            nonlocal last
            last = self.app(name)
            return last if predicate(last) else None

        try:
            return self.cluster.wait_for(check, timeout, f"Application {name}: {what}", namespace=namespace,
                                         kinds=("megatronjobs", "jobsets", "pods"))
        except AssertionError as e:
            raise AssertionError(f"{e}\n--- Application {name} status ---\n"
                                 f"{json.dumps(last.get('status'), indent=1)[:20000]}") from None

    def delete_application(self, name: str, timeout: float = 120) -> None:
        """Delete the Application and, through its resources finalizer, what it deployed. Auto-sync
        is turned off and a running (retrying) sync terminated first, as `argocd app terminate-op`
        does: Argo CD does not process the deletion while an operation runs."""
        try:
            self.custom.patch_namespaced_custom_object(*ARGO, NS, "applications", name,
                                                       {"spec": {"syncPolicy": None}})
            app = self.app(name)
            if ((app.get("status") or {}).get("operationState") or {}).get("phase") == "Running":
                self.custom.patch_namespaced_custom_object(*ARGO, NS, "applications", name,
                                                           {"status": {"operationState": {"phase": "Terminating"}}})
            self.custom.delete_namespaced_custom_object(*ARGO, NS, "applications", name)
        except kubernetes.client.ApiException as e:
            if e.status != 404:
                raise

        def gone() -> bool:
            try:
                self.app(name)
            except kubernetes.client.ApiException as e:
                return e.status == 404
            return False

        self.cluster.wait_for(gone, timeout, f"Application {name} deleted (with its resources)", kinds=())
