#!/usr/bin/env python3
"""`make demo`: the operator end to end on the local control plane.

Starts the local cluster (real kube-apiserver, etcd, scheduler, controller-manager, JobSet
controller; kwok simulates 20 GPU nodes and the pods' lifecycles), installs the MegatronJob CRD,
runs the operator, applies two examples, shows `kubectl get mj` until both jobs succeed, then stops
the operator and leaves the cluster up for you to explore. Bounded: gives up after 5 minutes and
prints what a person would look at.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from k8s import load_cluster_module

ROOT = Path(__file__).resolve().parents[1]
DEMO_JOBS = ["kubeflow-tp2.yaml", "gpt3-7.5b-efa.yaml"]
TIMEOUT_S = 300


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
    kubectl("create", "namespace", "demo")

    log_path = Path(local.run_dir()) / "logs" / "operator-demo.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    port = local.free_port()
    print(f"==> starting the operator (log: {log_path})")
    op = subprocess.Popen([sys.executable, "-m", "megatron_operator", "run", "--metrics-port", str(port)],
                          env={**env, "PYTHONPATH": f"{ROOT / 'operator'}:{ROOT / 'contract'}",
                               "MEGATRON_OPERATOR_RESYNC_INTERVAL_S": "2",
                               "MEGATRON_OPERATOR_METRICS_HOST": "127.0.0.1"},
                          stdout=open(log_path, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        for job in DEMO_JOBS:
            print(f"==> kubectl apply -n demo -f examples/{job}")
            r = kubectl("apply", "-n", "demo", "-f", str(ROOT / "examples" / job))
            print("   ", (r.stdout or r.stderr).strip())
        deadline = time.monotonic() + TIMEOUT_S
        last = ""
        while time.monotonic() < deadline:
            if op.poll() is not None:
                print(f"demo: the operator exited (rc={op.returncode}); see {log_path}", file=sys.stderr)
                return 1
            table = kubectl("get", "mj", "-n", "demo").stdout.strip()
            if table != last:
                print(f"\n$ kubectl get mj -n demo   ({time.strftime('%H:%M:%S')})\n{table}")
                last = table
            phases = kubectl("get", "mj", "-n", "demo", "-o", "jsonpath={.items[*].status.phase}").stdout.split()
            if len(phases) == len(DEMO_JOBS) and all(p == "Succeeded" for p in phases):
                break
            time.sleep(2)
        else:
            print(f"demo: the jobs did not finish within {TIMEOUT_S} s", file=sys.stderr)
            print(kubectl("describe", "mj", "-n", "demo").stdout, file=sys.stderr)
            print(kubectl("get", "jobsets,jobs,pods", "-n", "demo", "-o", "wide").stdout, file=sys.stderr)
            return 1
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            metrics = [ln for ln in resp.read().decode().splitlines() if ln.startswith("megatron_operator_jobs{")]
        print("\n==> the operator's metrics:\n" + "\n".join(metrics))
        print("\n==> events of gpt-tp2:")
        print(kubectl("get", "events", "-n", "demo", "--field-selector", "involvedObject.name=gpt-tp2").stdout)
    finally:
        os.killpg(op.pid, signal.SIGTERM)
        try:
            op.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(op.pid, signal.SIGKILL)
    print(f"""==> done. The cluster is still up:
    export KUBECONFIG={kubeconfig}
    {kubectl_bin} get mj -A
    make run            # the operator in the foreground against it
    make cluster-down   # stop everything""")
    return 0


if __name__ == "__main__":
    sys.exit(main())
