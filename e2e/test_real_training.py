"""The main job, whole, on real pods: the trainer image on the real node's kubelet, CPU mode (`gpusPerNode: 0`).

Everything a user's first job crosses, with no fake in the path:
- the trainer image (`make images-full`: Dockerfile.trainer on the stand-in base, loaded into containerd);
- two pods of one job, each in its own network namespace (the CNI bridge), that rendezvous through the JobSet's
  headless-Service names, resolved by cluster DNS (CoreDNS, node.py);
- a tensor-parallel group spanning the two pods (TP 2, one process per pod, gloo);
- `local` PersistentVolumes an admin provisioned, bound by the scheduler when the pods are placed: the
  checkpoints, and the Hugging Face start (a tiny Llama made with transformers' from_config) with the export;
- the job's own ServiceAccount token writing status.progress; the trainer's metrics at its pod IP; TensorBoard.

The scenario: train from the Hugging Face checkpoint with a checkpoint every few iterations; kill -9 one
trainer's main process (the gang restarts and resumes from the newest checkpoint); delete a pod as a drain does
(SIGTERM: a checkpoint inside the grace period, then a resume); finish Succeeded with an export that
transformers loads, whose logits match those of the trainer's own final checkpoint (fp32, 1e-4, the HF tests'
tolerance). Then the faults a user meets first: an image that cannot start, a claim that does not bind, a pod
OOM-killed, DNS that does not answer: each ends in a readable status, never a silent hang.

The oracle runs on the host with the torch test venv (.venv-torch, `make torch-tests` builds it):
e2e/trainer_logits.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import realnode
import yaml
from k8s import Cluster
from mjob import SESSION_OPERATOR_ENV, Jobs, OperatorProcess, alone_with_the_jobs, free_port

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[1]
TRAINER_IMAGE = os.environ.get("MEGATRON_TRAINER_IMAGE", "localhost/megatron-trainer:dev")
TORCH_PYTHON = Path(os.environ.get("MEGATRON_TORCH_PYTHON", ROOT / ".venv-torch" / "bin" / "python"))
MODEL = "tiny-llama"
# ~0.2 s an iteration here: long enough to kill the gang mid-run, twice, after a checkpoint each time
TRAIN_ITERS = 160
CHECKPOINT_INTERVAL = 20
KILL_AFTER = 30  # iterations: past the first checkpoint
# Bounded waits (seconds). A start on this 2-core machine is ~30-60 s of imports and rendezvous.
FIRST_PROGRESS_TIMEOUT_S = 300
RESTART_TIMEOUT_S = 300
FINISH_TIMEOUT_S = 420
FAULT_TIMEOUT_S = 150
TOLERANCE = 1e-4  # fp32 logits, as tests/trainer/test_hf_torch.py


@pytest.fixture(scope="module")
def node(cluster: Cluster) -> dict[str, Any]:
    if not realnode.image_in_podman(TRAINER_IMAGE):
        pytest.fail(f"{TRAINER_IMAGE} is not in podman's storage: build it with `make images-full` "
                    "(scripts/images.sh trainer)", pytrace=False)
    if not TORCH_PYTHON.exists():
        pytest.fail(f"{TORCH_PYTHON} missing: the oracle needs the torch test venv (make torch-tests)", pytrace=False)
    with realnode.node_up() as state:
        t0 = time.monotonic()
        realnode.real_node.load_image(TRAINER_IMAGE)
        state["trainer_image_load_s"] = round(time.monotonic() - t0, 1)
        (cluster.logs_dir / "real-training-timings.json").write_text(json.dumps(state))
        yield state


class Scenario:
    """One job on the real node: its volumes, its manifest, and what the test reads back."""

    def __init__(self, cluster: Cluster, namespace: str, node: dict[str, Any], tmp: Path):
        self.cluster, self.ns, self.node, self.tmp = cluster, namespace, node, tmp
        api = cluster.api_client()
        self.core = kubernetes.client.CoreV1Api(api)
        self.storage = kubernetes.client.StorageV1Api(api)
        self.jobs = Jobs(cluster, namespace)
        self.created: list[tuple[str, str]] = []
        self.log_keeper = realnode.LogKeeper(namespace)

    def storage_class(self) -> str:
        name = realnode.local_storage_class(self.storage, f"e2e-local-{self.ns}")
        self.created.append(("storageclass", name))
        return name

    def volume(self, claim: str, sc: str, owner: int | None = 1000) -> Path:
        root = self.tmp / claim
        pv = realnode.local_volume(self.core, f"{self.ns}-{claim}", root, sc, self.node["node"], owner=owner,
                                   claim=(self.ns, claim))
        self.created.append(("pv", pv))
        realnode.claim(self.core, self.ns, claim, sc)
        return root

    def job(self, name: str, **spec: Any) -> dict[str, Any]:
        api = self.node["apiserver"]
        base: dict[str, Any] = {
            "image": TRAINER_IMAGE, "numNodes": 2, "gpusPerNode": 0, "cpu": {"processesPerNode": 1},
            "parallelism": {"tensor": 2},
            "training": {"microBatchSize": 1, "globalBatchSize": 2, "trainIters": TRAIN_ITERS, "lr": 2e-3,
                         "lrSchedule": {"style": "constant"}, "logInterval": 1},
            "data": {"mock": True},
            "resources": {"nodeSelector": {"megatron-operator.io/real-node": "true"},
                          "tolerations": [{"key": realnode.real_node.TAINT_KEY, "operator": "Exists",
                                           "effect": "NoSchedule"}],
                          "memory": "3Gi"},
            "restart": {"maxRestarts": 4},
            "terminationGracePeriodSeconds": 60,
            # no kube-proxy here, and the API server's certificate does not name the ClusterIP (node.py)
            "env": [{"name": "KUBERNETES_SERVICE_HOST", "value": api["host"]},
                    {"name": "KUBERNETES_SERVICE_PORT", "value": str(api["port"])}],
        }
        base.update(spec)
        return {"apiVersion": "megatron-operator.io/v1alpha1", "kind": "MegatronJob", "metadata": {"name": name},
                "spec": base}

    def wait(self, predicate, timeout: float, what: str):
        """cluster.wait_for, with every trainer container's log (CRI files) beside the dump."""
        try:
            return self.cluster.wait_for(predicate, timeout, what, namespace=self.ns,
                                         kinds=("megatronjobs", "jobsets", "jobs", "pods", "pvc"))
        finally:
            (self.cluster.logs_dir / f"pods-{self.ns}.log").write_text(self.logs())

    def logs(self) -> str:
        return self.log_keeper.read()

    def progress(self, name: str) -> dict[str, Any]:
        return self.jobs.status(name).get("progress") or {}

    def pods(self, name: str) -> list[Any]:
        return sorted((p for p in self.jobs.pods(name) if p.metadata.deletion_timestamp is None),
                      key=lambda p: p.metadata.labels.get("jobset.sigs.k8s.io/job-global-index", ""))

    def running_pods(self, name: str) -> list[Any]:
        pods = self.pods(name)
        return pods if len(pods) == 2 and all(p.status.phase == "Running" and p.status.container_statuses
                                              and p.status.container_statuses[0].state.running for p in pods) else []

    def cleanup(self) -> None:
        (self.cluster.logs_dir / f"pods-{self.ns}.log").write_text(self.logs())
        for kind, name in reversed(self.created):
            with contextlib.suppress(kubernetes.client.ApiException):
                if kind == "pv":
                    self.core.delete_persistent_volume(name)
                else:
                    self.storage.delete_storage_class(name)


@pytest.fixture
def scenario(cluster, node, namespace, tmp_path):
    s = Scenario(cluster, namespace, node, tmp_path)
    yield s
    s.cleanup()


@pytest.fixture
def real_operator(cluster, crd, namespace):
    """The operator as the session's, but with the trainer's progress written every second (the default 30 s is
    longer than this whole job): the session's operator is paused meanwhile (alone_with_the_jobs)."""
    with alone_with_the_jobs(cluster, namespace):
        op = OperatorProcess(cluster, free_port(), {**SESSION_OPERATOR_ENV,
                                                    "MEGATRON_OPERATOR_PROGRESS_INTERVAL_S": "1"})
        op.start()
        try:
            yield op
        finally:
            op.stop()


def oracle(*args: str) -> dict[str, Any]:
    proc = subprocess.run([str(TORCH_PYTHON), str(ROOT / "e2e" / "trainer_logits.py"), *args], capture_output=True,
                          text=True, timeout=600, check=False, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, f"trainer_logits.py {args[0]} failed:\n{proc.stdout[-3000:]}{proc.stderr[-5000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def hf_model_spec(config_json: Path, seq: int) -> dict[str, Any]:
    """spec.model from `megatron-operator hf-config`, as a user gets it."""
    out = subprocess.run([sys.executable, "-m", "megatron_operator", "hf-config", str(config_json), "--seq-length",
                          str(seq)], capture_output=True, text=True, check=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": f"{ROOT / 'operator'}:{ROOT / 'contract'}"})
    doc = yaml.safe_load(out.stdout)
    return doc["spec"]["model"] if "spec" in doc else doc["model"]


def scrape(ip: str, port: int = 9400) -> str:
    with urllib.request.urlopen(f"http://{ip}:{port}/metrics", timeout=5) as r:
        return r.read().decode()


def metric(text: str, name: str) -> float | None:
    m = re.search(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


@pytest.mark.timeout(1800)  # the module's node (and the 5 GB image's load) plus three starts of the gang
def test_a_cpu_job_trains_resumes_after_a_kill_and_a_drain_and_exports_on_real_pods(scenario, real_operator):
    s = scenario
    sc = s.storage_class()
    ckpt = s.volume("checkpoints", sc)
    models = s.volume("models", sc)
    made = oracle("make-model", str(models / MODEL))
    (models / "exports").mkdir()
    for p in [models / MODEL, *(models / MODEL).iterdir(), models / "exports"]:
        os.chown(p, 1000, 1000)
    model = hf_model_spec(models / MODEL / "config.json", 32)
    assert model["hiddenSize"] == made["config"]["hidden_size"]
    name = "cpu-llama"
    s.jobs.create(s.job(
        name, model=model,
        checkpoint={"pvc": "checkpoints", "interval": CHECKPOINT_INTERVAL, "keep": 3},
        init={"huggingFace": {"pvc": "models", "path": MODEL}},
        export={"huggingFace": {"pvc": "models", "path": f"exports/{MODEL}"}},
        logging={"tensorboard": True}))

    # --- both pods run on the real node, the claims bound there, and training reports through the job's token
    pods = s.wait(lambda: s.running_pods(name), FIRST_PROGRESS_TIMEOUT_S, "both trainer pods Running")
    assert {p.spec.node_name for p in pods} == {s.node["node"]}
    assert len({p.status.pod_ip for p in pods}) == 2  # a network namespace each
    for pvc in ("checkpoints", "models"):
        assert s.core.read_namespaced_persistent_volume_claim(pvc, s.ns).status.phase == "Bound"
    first = s.wait(lambda: (p := s.progress(name)).get("iteration", 0) >= KILL_AFTER and p.get("loss") is not None
                   and p, FIRST_PROGRESS_TIMEOUT_S, f"status.progress.iteration >= {KILL_AFTER} (written by the trainer)")
    table = s.cluster.kubectl("get", "mj", name, "-n", s.ns).stdout
    assert re.search(rf"{name}\s+Running", table), table
    text = scrape(pods[0].status.pod_ip)  # rank 0 serves the metrics, at its real pod IP
    assert (metric(text, "megatron_trainer_iteration") or 0) >= 1, text[:2000]
    # --- kill -9 of one trainer container's main process: the gang restarts and resumes from the newest checkpoint
    victim = pods[1]
    s.logs()  # the first attempt's lines, before its pods (and their log files) go
    os.kill(realnode.container_pid(victim), signal.SIGKILL)
    s.wait(lambda: (st := s.jobs.status(name)).get("restarts", 0) >= 1 and st, RESTART_TIMEOUT_S,
           "status.restarts 1 after the kill")
    after_kill = s.wait(lambda: (p := s.progress(name)).get("iteration", 0) > first["iteration"] and
                        s.jobs.status(name).get("restarts") == 1 and p, RESTART_TIMEOUT_S,
                        "the iteration to move past the one before the kill, after the restart")
    logs = s.logs()
    resumed = [int(m) for m in re.findall(r"resumed from \S+/iter_0*(\d+) ", logs)]
    assert resumed and resumed[0] % CHECKPOINT_INTERVAL == 0 and resumed[0] <= first["iteration"], resumed
    assert "hf import:" in logs and logs.count("hf import:") == 2  # only the first start imports (2 ranks)
    status = s.jobs.status(name)  # the killed container's 137, or its peer's 143 (stopped by the gang restart)
    assert status["lastFailure"]["exitCode"] in (137, 143), status["lastFailure"]

    # --- a drain: the pod is deleted; SIGTERM leads to a checkpoint inside the grace period, then a resume
    pods = s.wait(lambda: s.running_pods(name), RESTART_TIMEOUT_S, "both pods Running after the restart")
    s.wait(lambda: s.progress(name).get("iteration", 0) >= after_kill["iteration"] + 2, RESTART_TIMEOUT_S,
           "two more iterations before the drain")
    s.logs()
    s.core.delete_namespaced_pod(pods[0].metadata.name, s.ns)
    stop = s.wait(lambda: re.search(r"stopping at iteration (\d+) \(signal\)", s.logs()),
                  RESTART_TIMEOUT_S, "the trainer's stop on SIGTERM (the deleted pod's)")
    stopped_at = int(stop.group(1))

    # --- the end: Succeeded, the export on the PV, loadable by transformers, equal to the trainer's own model
    done = s.jobs.wait_phase(name, ("Succeeded", "Failed"), timeout=FINISH_TIMEOUT_S)
    logs = s.logs()
    (s.cluster.logs_dir / f"pods-{s.ns}.log").write_text(logs)
    assert done["phase"] == "Succeeded", json.dumps(done, indent=1)[:4000]
    resumes = [int(m) for m in re.findall(r"resumed from \S+/iter_0*(\d+) ", logs)]
    # the kill's resume from an interval checkpoint; the drain's should be from the one written on SIGTERM, in the
    # grace period. Seen on 2026-12-02 (6eca43b): the drained rank stopped at 51 on the signal, but the gang resumed
    # from 40, the last interval checkpoint: the SIGTERM save did not complete (not yet understood; the deleted pods'
    # last log lines are gone with them). Checked at the end, after everything else: an xfail names it.
    assert resumed[0] in resumes and len(resumes) >= 4, resumes  # two resumes (the kill's, the drain's), 2 ranks each
    drain_saved = stopped_at in resumes and stopped_at > resumed[0]
    assert done["progress"]["iteration"] == TRAIN_ITERS
    export = models / "exports" / MODEL
    assert {"config.json", "model.safetensors.index.json", "tokenizer.json"} <= {p.name for p in export.iterdir()}
    assert export.stat().st_uid == 1000  # written by the pods' user
    logits = oracle("compare", str(_checkpoint_dir(ckpt)), str(export))
    assert logits["iteration"] == TRAIN_ITERS, logits
    assert logits["max_abs_diff"] <= TOLERANCE and logits["argmax_equal"] == 1.0, logits
    # the loss continued across each restart rather than starting over: after resuming from checkpoint c, iteration
    # c+1 (trained before the restart too) gives the very loss it gave then (bit-identical on the 2026-12-02 run:
    # 6.782679 twice after the kill, 6.867485 twice after the drain)
    by_iteration: dict[int, list[float]] = {}
    for it, loss in logged_losses(logs):
        by_iteration.setdefault(it, []).append(loss)
    for c in sorted(set(resumes)):
        again = by_iteration.get(c + 1, [])
        assert len(again) >= 2 and max(again) - min(again) <= 1e-5, (c, again, by_iteration.get(1))
    assert done["progress"].get("loss") is not None, done["progress"]  # kept through the export's stage report
    # goodput: the job's time over all attempts, the restarts in it
    goodput = done["progress"]["goodput"]
    assert goodput["attempts"] >= 3 and 0 < goodput["ratio"] <= 1 and goodput["restartSeconds"] > 0, goodput
    # TensorBoard event files, written by the last rank under the checkpoint directory
    assert list(_checkpoint_dir(ckpt).rglob("events.out.tfevents.*")), sorted(str(p) for p in ckpt.rglob("*"))[:50]
    print(json.dumps({"first": first, "after_kill": after_kill, "resumes": resumes, "stopped_at": stopped_at,
                      "logits": logits, "goodput": goodput}))
    if not drain_saved:
        pytest.xfail(f"known bug (issue 64): the drain stopped the trainer at iteration {stopped_at} on SIGTERM, but "
                     f"the gang resumed from {max(resumes)}: the SIGTERM checkpoint did not complete")
    assert "megatron_trainer: exit 143 (signal)" in logs


LOSS_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.Ee+-]+)")


def logged_losses(logs: str) -> list[tuple[int, float]]:
    """(iteration, loss) of every log line, every attempt, in the order the CRI log files' timestamps give."""
    lines = sorted(line for line in logs.splitlines() if LOSS_LINE.search(line))
    return [(int(m.group(1)), float(m.group(2))) for m in map(LOSS_LINE.search, lines)]


def _checkpoint_dir(ckpt_volume: Path) -> Path:
    """The job's checkpoint directory on its volume (the operator puts it under checkpoint.path, or the root)."""
    trackers = sorted(ckpt_volume.rglob("latest_checkpointed_iteration.txt"))
    assert trackers, f"no checkpoint tracker under {ckpt_volume}: {sorted(str(p) for p in ckpt_volume.rglob('*'))[:40]}"
    return trackers[0].parent


# --------------------------------------------------------------------------------------------------- the faults
# What a user's first CPU job meets when something around it is wrong: each ends in a readable status within
# FAULT_TIMEOUT_S, never a silent hang. One pod, no volumes, mock data: only the fault differs.

def _small(s: Scenario, name: str, **spec: Any) -> dict[str, Any]:
    small = {"numNodes": 1, "parallelism": {"tensor": 1},
             "model": {"numLayers": 2, "hiddenSize": 64, "numAttentionHeads": 4, "seqLength": 32, "vocabSize": 128},
             "training": {"microBatchSize": 1, "globalBatchSize": 1, "trainIters": 5000, "logInterval": 1}}
    return s.job(name, **{**small, **spec})


def _status_says(s: Scenario, name: str, *words: str):
    """The job's status.message / reason / lastFailure, once it holds every word."""
    def said():
        st = s.jobs.status(name)
        text = json.dumps({k: st.get(k) for k in ("phase", "reason", "message", "lastFailure")})
        return st if all(w in text for w in words) else None
    return s.wait(said, FAULT_TIMEOUT_S, f"MegatronJob {name}'s status to say {words}")


def test_an_image_that_cannot_be_pulled_is_pending_with_the_kubelets_reason(scenario, real_operator):
    s = scenario
    s.jobs.create(_small(s, "no-image", image="localhost/megatron-trainer:not-built"))
    st = _status_says(s, "no-image", "Pending")
    st = _status_says(s, "no-image", "localhost/megatron-trainer:not-built")
    assert st["reason"] in ("ErrImagePull", "ImagePullBackOff"), st


def test_a_claim_that_does_not_bind_is_pending_with_the_schedulers_reason(scenario, real_operator):
    s = scenario
    sc = s.storage_class()
    realnode.claim(s.core, s.ns, "nowhere", sc)  # no volume for it
    s.jobs.create(_small(s, "no-volume", checkpoint={"pvc": "nowhere"}))
    st = _status_says(s, "no-volume", "Unschedulable", "persistent volumes to bind")
    assert st["phase"] == "Pending", st
    s.jobs.create(_small(s, "no-claim", checkpoint={"pvc": "never-created"}))
    st = _status_says(s, "no-claim", "Unschedulable", "never-created")
    assert st["phase"] == "Pending", st


def test_a_pod_over_its_memory_limit_fails_with_oomkilled(scenario, real_operator):
    """The pod's limit below what the trainer's processes need (estimate says ~0.9 GiB a pod here): the kernel's
    OOM killer ends it; with no restarts left the job is Failed, lastFailure naming the OOM."""
    s = scenario
    s.jobs.create(_small(s, "oom", resources={**s.job("x")["spec"]["resources"], "memory": "300Mi"},
                         restart={"maxRestarts": 0}))
    st = _status_says(s, "oom", "Failed", "OOMKilled")
    assert st["lastFailure"]["reason"] == "OOMKilled", st["lastFailure"]


def test_a_rendezvous_name_that_does_not_resolve_fails_with_the_reason(scenario, real_operator):
    """Cluster DNS stopped: the launcher waits for pod 0's name as long as the rendezvous would (here
    --distributed-timeout-minutes 1), then exits 1 with the reason as the pod's termination message; with no
    restarts left the job is Failed, lastFailure saying it."""
    s = scenario
    realnode.real_node.stop_dns()
    try:
        s.jobs.create(_small(s, "no-dns", restart={"maxRestarts": 0},
                             training={"microBatchSize": 1, "globalBatchSize": 1, "trainIters": 10,
                                       "extraArgs": ["--distributed-timeout-minutes", "1"]}))
        st = _status_says(s, "no-dns", "Failed", "did not resolve within 60 s")
        assert st["lastFailure"]["exitCode"] == 1, st["lastFailure"]
    finally:
        realnode.real_node.restart_dns()
