#!/usr/bin/env python3
"""`make demo`: the operator end to end on the local control plane, with a real trainer among the jobs.

Starts the local cluster (real kube-apiserver, etcd, scheduler, controller-manager, JobSet, Kueue; kwok
simulates 20 GPU nodes and their pods' lifecycles), installs the MegatronJob CRD and runs the operator. Then:

- two GPU examples on the kwok nodes (their pods are kwok's: nothing trains there);
- examples/cpu-smoke.yaml on the real node (a kubelet on containerd, cluster DNS): the trainer image trains a tiny
  Llama from its Hugging Face checkpoint across two pods, on CPUs. Mid-run the demo kills one trainer (kill -9 of
  its container's main process): the gang restarts and resumes from its newest checkpoint. At the end the export
  on the volume is loaded by transformers and compared with the trainer's own final checkpoint.

Shows `kubectl get mj -o wide` (iteration, loss, restarts) as it changes, then stops the operator and leaves the
cluster up to explore. Bounded (15 minutes); on failure it prints what a person would look at (the jobs, pods,
events and the trainer's log). The real node needs root; without it the demo says so and runs the kwok jobs only.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import yaml
from k8s import load_cluster_module

ROOT = Path(__file__).resolve().parents[1]
DEMO_JOBS = ["kubeflow-tp2.yaml", "gpt3-7.5b-efa.yaml"]
REAL_JOB_FILE = "cpu-smoke.yaml"
TRAINER_IMAGE = os.environ.get("MEGATRON_TRAINER_IMAGE", "localhost/megatron-trainer:dev")
TORCH_PYTHON = Path(os.environ.get("MEGATRON_TORCH_PYTHON", ROOT / ".venv-torch" / "bin" / "python"))
KILL_AT_ITERATION = 40  # past the first checkpoint (examples/cpu-smoke.yaml: every 25)
TIMEOUT_S = 900
NAMESPACE = "demo"


def real_job(api: dict) -> dict:
    """examples/cpu-smoke.yaml, placed on the real node (its selector and taint), its image the local build, and
    the API server's address for the trainer's status writes (no kube-proxy here: node.py)."""
    doc = yaml.safe_load((ROOT / "examples" / REAL_JOB_FILE).read_text())
    spec = doc["spec"]
    spec["image"] = TRAINER_IMAGE
    res = spec.setdefault("resources", {})
    res["nodeSelector"] = {"megatron-operator.io/real-node": "true"}
    res["tolerations"] = [{"key": "megatron-operator.io/real-node", "operator": "Exists", "effect": "NoSchedule"}]
    spec["env"] = [*spec.get("env", []), {"name": "KUBERNETES_SERVICE_HOST", "value": api["host"]},
                   {"name": "KUBERNETES_SERVICE_PORT", "value": str(api["port"])}]
    return doc


def main() -> int:
    local = load_cluster_module()
    print("==> starting the local control plane (reused if already up)")
    try:
        state = local.up()
    except local.ClusterError as e:
        print(f"demo: the local cluster could not start:\n{e}", file=sys.stderr)
        return 1
    kubeconfig, kubectl_bin = state["kubeconfig"], state["kubectl"]
    env = {**os.environ, "KUBECONFIG": kubeconfig}

    def kubectl(*args: str, **kw) -> subprocess.CompletedProcess:
        return subprocess.run([kubectl_bin, *args], env=env, text=True, capture_output=True, timeout=60, **kw)

    print("==> installing the MegatronJob CRD")
    r = kubectl("apply", "--server-side", "-f", str(ROOT / "crds"))
    if r.returncode:
        print(r.stderr, file=sys.stderr)
        return 1
    kubectl("wait", "--for=condition=Established", "crd/megatronjobs.megatron-operator.io", "--timeout=30s")
    kubectl("create", "namespace", NAMESPACE)

    real = None
    if os.geteuid() != 0:
        print("demo: NOT running the real trainer: the real node needs root (containerd, runc, mounts, a bridge). "
              "Only the kwok jobs run, and nothing trains.", file=sys.stderr)
    else:
        try:
            real = RealTrainer(local, kubectl)
            real.prepare()
        except Exception as e:  # the demo says what failed and what to look at, never a traceback alone
            print(f"demo: the real node could not be prepared: {e}", file=sys.stderr)
            return 1

    log_path = Path(local.run_dir()) / "logs" / "operator-demo.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    port = local.free_port()
    print(f"==> starting the operator (log: {log_path})")
    op = subprocess.Popen([sys.executable, "-m", "megatron_operator", "run", "--metrics-port", str(port)],
                          env={**env, "PYTHONPATH": f"{ROOT / 'operator'}:{ROOT / 'contract'}",
                               "MEGATRON_OPERATOR_RESYNC_INTERVAL_S": "2",
                               # the trainer's status.progress every 2 s (the default, 30 s, is longer than the job)
                               "MEGATRON_OPERATOR_PROGRESS_INTERVAL_S": "2",
                               "MEGATRON_OPERATOR_METRICS_HOST": "127.0.0.1"},
                          stdout=open(log_path, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        for job in DEMO_JOBS:
            print(f"==> kubectl apply -n {NAMESPACE} -f examples/{job}   (GPU pods on kwok's nodes: simulated)")
            r = kubectl("apply", "-n", NAMESPACE, "-f", str(ROOT / "examples" / job))
            print("   ", (r.stdout or r.stderr).strip())
        if real:
            print(f"==> kubectl apply -n {NAMESPACE} -f examples/{REAL_JOB_FILE}   (the real trainer, on the real "
                  "node, CPUs; image, node selector and API address patched for this cluster)")
            r = kubectl("apply", "-n", NAMESPACE, "-f", "-", input=yaml.safe_dump(real.job))
            print("   ", (r.stdout or r.stderr).strip())
        names = [yaml.safe_load((ROOT / "examples" / j).read_text())["metadata"]["name"] for j in DEMO_JOBS]
        names += [real.name] if real else []
        deadline = time.monotonic() + TIMEOUT_S
        last = ""
        while time.monotonic() < deadline:
            if op.poll() is not None:
                print(f"demo: the operator exited (rc={op.returncode}); see {log_path}", file=sys.stderr)
                return 1
            table = kubectl("get", "mj", "-n", NAMESPACE, "-o", "wide").stdout.strip()
            if table != last:
                print(f"\n$ kubectl get mj -n {NAMESPACE} -o wide   ({time.strftime('%H:%M:%S')})\n{table}")
                last = table
            if real:
                real.step()
            phases = json.loads(kubectl("get", "mj", "-n", NAMESPACE, "-o", "json").stdout or "{}").get("items", [])
            phase = {j["metadata"]["name"]: (j.get("status") or {}).get("phase") for j in phases}
            if any(phase.get(n) == "Failed" for n in names):
                print(f"demo: a job failed: {phase}", file=sys.stderr)
                dump(kubectl, real)
                return 1
            if all(phase.get(n) == "Succeeded" for n in names):
                break
            time.sleep(2)
        else:
            print(f"demo: the jobs did not finish within {TIMEOUT_S} s", file=sys.stderr)
            dump(kubectl, real)
            return 1
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            metrics = [ln for ln in resp.read().decode().splitlines() if ln.startswith("megatron_operator_jobs{")]
        print("\n==> the operator's metrics:\n" + "\n".join(metrics))
        if real and not real.report():
            dump(kubectl, real)
            return 1
    finally:
        os.killpg(op.pid, signal.SIGTERM)
        try:
            op.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(op.pid, signal.SIGKILL)
    print(f"""==> done. The cluster is still up{' (and the real node)' if real else ''}:
    export KUBECONFIG={kubeconfig}
    {kubectl_bin} get mj -A -o wide
    make run            # the operator in the foreground against it
    make cluster-down   # stop everything""")
    return 0


class RealTrainer:
    """examples/cpu-smoke.yaml on the real node: volumes, the Hugging Face start, the kill, the report."""

    def __init__(self, local, kubectl):
        sys.path.insert(0, str(ROOT / "e2e" / "cluster"))
        import node as real_node

        self.local, self.kubectl, self.node = local, kubectl, real_node
        self.root = Path(local.run_dir()) / "demo-volumes"
        self.job: dict = {}
        self.name = ""
        self.killed_at: int | None = None
        self.samples: list[tuple[int, float, int]] = []

    def prepare(self) -> None:
        if not TORCH_PYTHON.exists():
            raise RuntimeError(f"{TORCH_PYTHON} missing (make demo builds it: the torch venv makes the model)")
        if subprocess.run(["podman", "image", "exists", TRAINER_IMAGE], check=False).returncode != 0:
            raise RuntimeError(f"{TRAINER_IMAGE} not built (make images-full)")
        print("==> the real node: kubelet + containerd + CNI bridge + CoreDNS (e2e/cluster/node.py)")
        if (Path(self.local.run_dir()) / "node" / "node.json").exists():
            self.node.down()
        state = self.node.up()
        t0 = time.monotonic()
        print(f"==> loading {TRAINER_IMAGE} into the node's containerd (5 GB: a few minutes the first time)")
        self.node.load_image(TRAINER_IMAGE)
        print(f"    loaded in {time.monotonic() - t0:.0f} s")
        self.job = real_job(state["apiserver"])
        self.name = self.job["metadata"]["name"]
        subprocess.run(["rm", "-rf", str(self.root)], check=True)
        volumes = {"checkpoints": self.root / "checkpoints", "models": self.root / "models"}
        print("==> local PersistentVolumes on the real node (an admin's static provisioning), the claims unbound "
              "until the pods are placed")
        sc = f"demo-local-{NAMESPACE}"
        manifests = [{"apiVersion": "storage.k8s.io/v1", "kind": "StorageClass", "metadata": {"name": sc},
                      "provisioner": "kubernetes.io/no-provisioner", "volumeBindingMode": "WaitForFirstConsumer"}]
        for claim, path in volumes.items():
            path.mkdir(parents=True)
            os.chown(path, 1000, 1000)
            manifests.append({"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": f"demo-{claim}"},
                              "spec": {"claimRef": {"namespace": NAMESPACE, "name": claim},  # reserved for it
                                       "capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteMany"],
                                       "storageClassName": sc, "persistentVolumeReclaimPolicy": "Delete",
                                       "local": {"path": str(path)}, "nodeAffinity": {"required": {
                                           "nodeSelectorTerms": [{"matchExpressions": [{
                                               "key": "kubernetes.io/hostname", "operator": "In",
                                               "values": [state["node"]]}]}]}}}})
            manifests.append({"apiVersion": "v1", "kind": "PersistentVolumeClaim",
                              "metadata": {"name": claim, "namespace": NAMESPACE},
                              "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": sc,
                                       "resources": {"requests": {"storage": "1Gi"}}}})
        for m in manifests:
            self.kubectl("delete", m["kind"].lower(), m["metadata"]["name"], *(["-n", NAMESPACE] if m["kind"] ==
                         "PersistentVolumeClaim" else []), "--ignore-not-found", "--wait=false")
        r = self.kubectl("apply", "-f", "-", input="\n---\n".join(json.dumps(m) for m in manifests))
        if r.returncode:
            raise RuntimeError(f"kubectl apply of the volumes failed: {r.stderr}")
        model_dir = volumes["models"] / self.job["spec"]["init"]["huggingFace"]["path"]
        print(f"==> a tiny Llama with transformers (from_config + save_pretrained, random weights) in {model_dir}")
        out = subprocess.run([str(TORCH_PYTHON), str(ROOT / "e2e" / "trainer_logits.py"), "make-model",
                              str(model_dir)], capture_output=True, text=True, timeout=300, check=False)
        if out.returncode:
            raise RuntimeError(f"making the model failed:\n{out.stderr[-2000:]}")
        (volumes["models"] / "exports").mkdir()
        subprocess.run(["chown", "-R", "1000:1000", str(volumes["models"])], check=True)
        self.volumes = volumes

    def progress(self) -> dict:
        r = self.kubectl("get", "mj", self.name, "-n", NAMESPACE, "-o", "json")
        st = (json.loads(r.stdout) if r.returncode == 0 else {}).get("status") or {}
        return {**(st.get("progress") or {}), "restarts": st.get("restarts", 0)}

    def step(self) -> None:
        p = self.progress()
        if p.get("iteration") is not None and p.get("loss") is not None:
            sample = (p["iteration"], p["loss"], p["restarts"])
            if not self.samples or self.samples[-1] != sample:
                self.samples.append(sample)
        if self.killed_at is None and (p.get("iteration") or 0) >= KILL_AT_ITERATION:
            pods = json.loads(self.kubectl("get", "pods", "-n", NAMESPACE, "-l",
                                           f"megatron-operator.io/job-name={self.name}", "-o", "json").stdout)["items"]
            running = [q for q in pods if q["status"].get("phase") == "Running"]
            victim = sorted(running, key=lambda q: q["metadata"]["name"])[-1]
            cid = victim["status"]["containerStatuses"][0]["containerID"].split("://", 1)[1]
            tasks = self.node.ctr("tasks", "list").stdout.decode().splitlines()[1:]
            pid = next(int(t.split()[1]) for t in tasks if t.split()[0] == cid)
            print(f"\n==> kill -9 {pid}: the main process of {victim['metadata']['name']}'s trainer container "
                  f"(iteration {p['iteration']}). The gang restarts and resumes from its newest checkpoint.")
            os.kill(pid, signal.SIGKILL)
            self.killed_at = p["iteration"]

    def report(self) -> bool:
        logs = "".join(f.read_text(errors="replace") for f in sorted(
            (self.node.node_dir() / "pod-logs").glob(f"{NAMESPACE}_{self.name}-*/trainer/*.log")))
        resumed = re.findall(r"resumed from (\S+) \(iteration (\d+)", logs)
        print("\n==> the real trainer, as status.progress reported it (iteration, loss, restarts):")
        print("    " + "  ".join(f"{it}:{loss:.3f}{'*' if r else ''}" for it, loss, r in self.samples))
        print("    (* after the restart)")
        for path, it in resumed:
            print(f"==> resumed from {path} (iteration {it}) after the kill at iteration {self.killed_at}")
        export = self.volumes["models"] / "exports" / self.job["spec"]["export"]["huggingFace"]["path"].split("/")[-1]
        ckpts = sorted(self.volumes["checkpoints"].rglob("latest_checkpointed_iteration.txt"))
        if not resumed or not export.is_dir() or not ckpts:
            print(f"demo: expected a resume, an export in {export} and checkpoints; got resumes {resumed}, export "
                  f"{export.is_dir()}, checkpoints {[str(c) for c in ckpts]}", file=sys.stderr)
            return False
        print(f"==> the export on the volume: {sorted(p.name for p in export.iterdir())}")
        out = subprocess.run([str(TORCH_PYTHON), str(ROOT / "e2e" / "trainer_logits.py"), "compare",
                              str(ckpts[0].parent), str(export)], capture_output=True, text=True, timeout=600,
                             check=False)
        if out.returncode:
            print(f"demo: comparing the export failed:\n{out.stderr[-3000:]}", file=sys.stderr)
            return False
        result = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"==> transformers loads the export; its logits vs the trainer's final checkpoint (iteration "
              f"{result['iteration']}): max |diff| {result['max_abs_diff']:.1e} (fp32), argmax equal "
              f"{result['argmax_equal']:.0%}")
        return result["max_abs_diff"] <= 1e-4


def dump(kubectl, real) -> None:
    print(kubectl("describe", "mj", "-n", NAMESPACE).stdout, file=sys.stderr)
    print(kubectl("get", "jobsets,jobs,pods,pvc", "-n", NAMESPACE, "-o", "wide").stdout, file=sys.stderr)
    print(kubectl("get", "events", "-n", NAMESPACE, "--sort-by=.lastTimestamp").stdout[-6000:], file=sys.stderr)
    if real:
        logs = sorted((real.node.node_dir() / "pod-logs").glob(f"{NAMESPACE}_*/*/*.log"))
        for f in logs:
            print(f"===== {f.name} ({f.parent.parent.name})\n" + "".join(f.read_text(errors="replace")
                                                                     .splitlines(True)[-40:]), file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
