"""Rendered pods, verbatim, on a GPU machine (issue 13): the suite's scenarios "pods" and "preempt".

`megatron-operator render` turns a MegatronJob into a JobSet; each pod of it is run here as the
kubelet would run it, as its own process tree:

- command and env exactly as rendered; resolved only what the kubelet resolves: fieldRefs
  (metadata.labels[...] with JobSet's job-global-index and restart-attempt labels, metadata.namespace,
  metadata.name) and `$(VAR)` references in the command (Kubernetes' expansion rules);
- the image's part: PATH with a `python` (the device's interpreter), PYTHONPATH with megatron-core
  and the trainer package (the trainer image installs both), the host's NVLink-multicast-off NCCL
  settings; the device plugin's part: CUDA_VISIBLE_DEVICES = the pod's GPUs;
- the pod's securityContext: runAsUser/runAsGroup (1000) with no supplementary groups, no new
  privileges (PR_SET_NO_NEW_PRIVS), no capabilities;
- the pod's volumes, in a mount namespace of its own (`unshare --mount`): the Memory emptyDir at
  /dev/shm as a tmpfs of its sizeLimit, the /tmp emptyDir as a fresh directory, each PVC as a bind
  mount of a directory standing in for it (readOnly mounts read-only; fsGroup emulated by chown),
  and the root filesystem remounted read-only (readOnlyRootFilesystem);
- pod 0's DNS name (the master address) mapped to 127.0.0.1 in /etc/hosts.

Not emulated: a network namespace per pod (all pods share the host's; only rank 0 binds the
rendezvous port and only one pod per job serves metrics on these layouts), the image itself (the
device's python with megatron-core from the wheel and the trainer package copied into a site
directory stands in for it), the ServiceAccount token (no API server: progress writes are off).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
JOBS = Path(__file__).resolve().parent / "jobs"
PVC_ROOT = Path(os.environ.get("POD_PVC_ROOT", "/srv/megatron-pvc"))  # one directory per PVC claim
POD_ROOT = Path(os.environ.get("POD_EMPTYDIR_ROOT", "/srv/megatron-pods"))  # emptyDirs (disk)
GLOBAL_INDEX = "jobset.sigs.k8s.io/job-global-index"
RESTART_ATTEMPT = "jobset.sigs.k8s.io/restart-attempt"
ITER_RE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.E+-]+)")
RESUMED_RE = re.compile(r"resumed from (\S+) \(iteration (\d+),")
STOPPING_RE = re.compile(r"stopping at iteration (\d+) \((\w[\w-]*)\)")
PUBLISHED_RE = re.compile(r"checkpoint: iteration (\d+) published \(([0-9.]+) s after the save started\)")
VAR_RE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")

# The pod's side of the namespace: mounts as root, then the rendered command as the pod's user.
POD_SH = r"""
set -eu
ro_root=$1; shift
while [ "$1" != "--" ]; do
  kind=$1 src=$2 dst=$3 opt=$4; shift 4
  mkdir -p "$dst"
  case "$kind" in
    tmpfs) mount -t tmpfs -o "size=$opt,mode=1777" tmpfs "$dst" ;;
    bind)  mount --bind "$src" "$dst"; [ "$opt" = ro ] && mount -o remount,bind,ro "$dst" ;;
  esac
done
shift
cd /tmp
if [ "$ro_root" = 1 ]; then mount -o remount,bind,ro / && echo "pod: root filesystem read-only" >&2 \
  || echo "pod: root filesystem stays writable (remount refused)" >&2; fi
exec "$@"
"""
# Drop to the pod's user: no supplementary groups, no new privileges (capabilities go with the uid change).
SETUID_PY = ("import ctypes, os, sys; u, g = int(sys.argv[1]), int(sys.argv[2]); os.setgroups([]); os.setgid(g); "
             "os.setuid(u); ctypes.CDLL(None).prctl(38, 1, 0, 0, 0); os.execvp(sys.argv[3], sys.argv[3:])")


class PodError(RuntimeError):
    pass


def render(job_file: Path, namespace: str = "default") -> dict:
    """`megatron-operator render -o json` on the file: the JobSet (and it must be the only one)."""
    p = subprocess.run([sys.executable, "-m", "megatron_operator", "render", "-o", "json", "-n", namespace,
                        str(job_file)], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "operator"), str(REPO / "contract"),
                                                                         os.environ.get("PYTHONPATH", "")])))
    if p.returncode != 0:
        raise PodError(f"megatron-operator render {job_file.name}: rc={p.returncode}: {p.stderr.strip()[-600:]}")
    items = json.loads(p.stdout)["items"]
    (jobset,) = [o for o in items if o["kind"] == "JobSet"]
    return jobset


def expand(s: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: defined variables are replaced, $$ is $, anything else stays."""
    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))
    return VAR_RE.sub(sub, s)


class Pod:
    """One pod of the JobSet: its rendered spec plus what the kubelet and the device plugin decide."""

    def __init__(self, jobset: dict, rjob: dict, job_index: int, global_index: int, restart_attempt: int,
                 gpus: list[int]):
        self.jobset = jobset
        tmpl = rjob["template"]["spec"]["template"]
        self.spec = tmpl["spec"]
        self.name = f"{jobset['metadata']['name']}-{rjob['name']}-{job_index}-0"
        self.namespace = jobset["metadata"].get("namespace", "default")
        self.labels = {**tmpl["metadata"].get("labels", {}), GLOBAL_INDEX: str(global_index),
                       RESTART_ATTEMPT: str(restart_attempt), "jobset.sigs.k8s.io/job-index": str(job_index)}
        (self.container,) = self.spec["containers"]
        self.gpus = gpus
        self.proc: subprocess.Popen | None = None
        self.log_path: Path | None = None

    # ---- what the kubelet resolves
    def field(self, path: str) -> str:
        m = re.fullmatch(r"metadata\.labels\['([^']+)'\]", path)
        if m:
            if m.group(1) not in self.labels:
                raise PodError(f"{self.name}: fieldRef {path}: no such label")
            return self.labels[m.group(1)]
        if path == "metadata.namespace":
            return self.namespace
        if path == "metadata.name":
            return self.name
        raise PodError(f"{self.name}: fieldRef {path} is not resolved by this harness")

    def env(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for e in self.container.get("env", []):
            if "value" in e:
                out[e["name"]] = expand(e["value"], out)
            elif "fieldRef" in e.get("valueFrom", {}):
                out[e["name"]] = self.field(e["valueFrom"]["fieldRef"]["fieldPath"])
            else:
                raise PodError(f"{self.name}: env {e['name']}: {e.get('valueFrom')} is not resolved by this harness")
        return out

    def command(self) -> list[str]:
        env = self.env()
        return [expand(a, env) for a in self.container["command"] + self.container.get("args", [])]

    # ---- the image's and the device plugin's part of the environment
    def process_env(self, image_env: dict[str, str]) -> dict[str, str]:
        env = dict(image_env)
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in self.gpus)
        env.update(self.env())  # the container's env wins over the image's
        return env

    def mounts(self) -> list[tuple[str, str, str, str]]:
        """(kind, source, target, option) for each volumeMount, from the pod's volumes."""
        volumes = {v["name"]: v for v in self.spec.get("volumes", [])}
        out = []
        for m in self.container.get("volumeMounts", []):
            v = volumes[m["name"]]
            if "emptyDir" in v and v["emptyDir"].get("medium") == "Memory":
                out.append(("tmpfs", "-", m["mountPath"], v["emptyDir"].get("sizeLimit", "1Gi").replace("Gi", "g")))
            elif "emptyDir" in v:
                src = POD_ROOT / self.name / m["name"]
                shutil.rmtree(src, ignore_errors=True)
                src.mkdir(parents=True)
                os.chmod(src, 0o1777)
                out.append(("bind", str(src), m["mountPath"], "rw"))
            elif "persistentVolumeClaim" in v:
                src = PVC_ROOT / v["persistentVolumeClaim"]["claimName"]
                if not src.is_dir():
                    raise PodError(f"{self.name}: no directory for PVC {src.name} under {PVC_ROOT}")
                ro = m.get("readOnly") or v["persistentVolumeClaim"].get("readOnly")
                out.append(("bind", str(src), m["mountPath"], "ro" if ro else "rw"))
            else:
                raise PodError(f"{self.name}: volume {m['name']} {sorted(v)} is not emulated by this harness")
        return out

    def user(self) -> tuple[int, int]:
        sc = self.spec.get("securityContext", {})
        if not sc.get("runAsNonRoot") or "runAsUser" not in sc:
            raise PodError(f"{self.name}: pod securityContext has no non-root runAsUser: {sc}")
        return int(sc["runAsUser"]), int(sc.get("runAsGroup", sc["runAsUser"]))

    def start(self, log_path: Path, image_env: dict[str, str], namespaced: bool) -> None:
        uid, gid = self.user()
        cmd = self.command()
        as_user = [sys.executable, "-c", SETUID_PY, str(uid), str(gid), *cmd]
        ro_root = "1" if self.container.get("securityContext", {}).get("readOnlyRootFilesystem") else "0"
        mounts = self.mounts()
        if namespaced:
            spec = [x for mnt in mounts for x in mnt]
            argv = ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", POD_SH, "pod", ro_root,
                    *spec, "--", *as_user]
        else:  # no mount namespace here: the PVC directories appear at their mount paths as links
            for kind, src, dst, _ in mounts:
                if kind == "bind" and src.startswith(str(PVC_ROOT)) and not os.path.lexists(dst):
                    os.symlink(src, dst)
            argv = as_user
        self.log_path = log_path
        log = open(log_path, "w")
        log.write(f"# pod {self.name} gpus={self.gpus} uid={uid} namespaced={namespaced}\n# command: "
                  + json.dumps(cmd) + "\n# env: " + json.dumps(self.env()) + "\n")
        log.flush()
        # cwd: the image's WORKDIR (/tmp); the process tree in a session of its own (like a container).
        self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=self.process_env(image_env),
                                     cwd="/" if namespaced else str(POD_ROOT), start_new_session=True)
        log.close()

    def text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path else ""

    def sigterm(self) -> None:
        """What the kubelet does first: SIGTERM to the container's main process (the launcher)."""
        if self.proc and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)

    def dump_stacks(self) -> int:
        """SIGUSR1 to the launcher's descendants (the trainer registers faulthandler for it: every thread's
        stack into the pod log); not to the launcher, for which SIGUSR1 would be fatal. Returns how many."""
        import psutil

        if self.proc is None or self.proc.poll() is not None:
            return 0
        try:
            children = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return 0
        sent = 0
        for c in children:
            try:
                c.send_signal(signal.SIGUSR1)
                sent += 1
            except psutil.Error:
                pass
        return sent

    def kill_tree(self) -> None:
        import psutil

        if self.proc is None:
            return
        try:
            procs = [psutil.Process(self.proc.pid)] + psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return
        for p in reversed(procs):
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass


def pods_of(jobset: dict, restart_attempt: int, gpus_available: int) -> list[Pod]:
    """Every pod in node-rank order (JobSet's global job index), each with its own GPUs."""
    pods, g, next_gpu = [], 0, 0
    for rjob in jobset["spec"]["replicatedJobs"]:
        per_pod = int(rjob["template"]["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
                      ["nvidia.com/gpu"])
        for i in range(rjob["replicas"]):
            if next_gpu + per_pod > gpus_available:
                raise PodError(f"{jobset['metadata']['name']} needs more than {gpus_available} GPUs")
            pods.append(Pod(jobset, rjob, i, g, restart_attempt, list(range(next_gpu, next_gpu + per_pod))))
            g += 1
            next_gpu += per_pod
    return pods


def master_address(jobset: dict) -> str:
    cmd = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]["command"]
    (addr,) = [a.split("=", 1)[1] for a in cmd if a.startswith("--master-addr=")]
    return addr


def map_host(name: str) -> None:
    hosts = Path("/etc/hosts")
    if not re.search(rf"^127\.0\.0\.1\s.*\b{re.escape(name)}\b", hosts.read_text(), re.M):
        with hosts.open("a") as f:
            f.write(f"127.0.0.1 {name}\n")


def can_namespace() -> tuple[bool, str]:
    """Whether this machine lets us give each pod its own mount namespace (root, unshare, mount)."""
    try:
        p = subprocess.run(["unshare", "--mount", "--propagation", "private", "--", "sh", "-c",
                            "mkdir -p /srv/ns-probe && mount -t tmpfs -o size=1m tmpfs /srv/ns-probe && echo ok"],
                           capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return False, f"{type(e).__name__}: {e}"
    return p.returncode == 0 and "ok" in p.stdout, (p.stdout + p.stderr).strip()[-300:]


IMAGE_SITE = Path(os.environ.get("POD_IMAGE_SITE", "/opt/megatron-image-site"))


def image_env() -> dict[str, str]:
    """What the trainer image provides (its ENV and installed packages), here from the device's python:
    the trainer package and the leaf it imports (megatron_contract) are copied into a site directory every
    user can read (as the image's pip install)."""
    shutil.rmtree(IMAGE_SITE, ignore_errors=True)
    for root, package in (("trainer_image", "megatron_trainer"), ("contract", "megatron_contract")):
        shutil.copytree(REPO / root / package, IMAGE_SITE / package, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run(["chmod", "-R", "a+rX", str(IMAGE_SITE)], check=True)
    keep = {k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "TORCH_SYMM_", "NVSHMEM_", "HF_",
                                                                 "TRANSFORMERS_", "LD_LIBRARY_PATH", "CUDA_HOME"))}
    site = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
            if p and "trainer_image" not in p and Path(p).resolve() != REPO / "contract"]
    for p in site:
        if p.startswith("/tmp"):
            raise PodError(f"PYTHONPATH entry {p} is under /tmp, which each pod mounts over")
    keep.update({
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), "/usr/local/sbin", "/usr/local/bin",
                                 "/usr/sbin", "/usr/bin", "/sbin", "/bin"]),
        "PYTHONPATH": os.pathsep.join([*site, str(IMAGE_SITE)]),
        "PYTHONDONTWRITEBYTECODE": "1", "LANG": "C.UTF-8",
    })
    return keep


def losses_of(pods: list[Pod]) -> dict[int, float]:
    out: dict[int, float] = {}
    for p in pods:
        for m in ITER_RE.finditer(p.text()):
            out[int(m.group(1))] = float(m.group(2))
    return out


def wait_all(pods: list[Pod], timeout: float) -> list[int | None]:
    end = time.monotonic() + timeout
    while time.monotonic() < end and any(p.proc.poll() is None for p in pods):
        time.sleep(0.2)
    return [p.proc.poll() for p in pods]


def wait_log(pods: list[Pod], pattern: re.Pattern, timeout: float) -> re.Match | None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        for p in pods:
            m = pattern.search(p.text())
            if m:
                return m
        if all(p.proc.poll() is not None for p in pods):
            return None
        time.sleep(0.2)
    return None
