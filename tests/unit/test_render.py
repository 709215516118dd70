"""render(): MegatronJob -> ServiceAccount, Role, RoleBinding, JobSet. One test per promise."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from factory import DELETE, make_job
from megatron_operator.crd import to_yaml
from megatron_operator.render import megatron_args, render, replicated_job_plan
from megatron_operator.settings import Settings
from megatron_operator.validation import parse_job

GOLDEN = Path(__file__).parent / "golden"
EXAMPLES = Path(__file__).parents[2] / "examples"


def objects(doc, settings=None, uid="uid-1"):
    job = parse_job(doc)
    return {o["kind"]: o for o in render(job, settings or Settings(), owner_uid=uid)}


def pod_spec(jobset, i=0):
    return jobset["spec"]["replicatedJobs"][i]["template"]["spec"]["template"]["spec"]


def container(jobset, i=0):
    return pod_spec(jobset, i)["containers"][0]


def env_of(c):
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in c["env"]}


def test_apply_order_and_kinds():
    objs = render(parse_job(make_job()), Settings(), owner_uid="u")
    assert [o["kind"] for o in objs] == ["ServiceAccount", "Role", "RoleBinding", "JobSet"]


def test_launcher_nnodes_nproc_node_rank_rendezvous_and_grace():
    js = objects(make_job(numNodes=4, gpusPerNode=8))["JobSet"]
    cmd = container(js)["command"]
    assert cmd[:11] == ["python", "-m", "megatron_trainer.launch", "--nnodes=4", "--nproc-per-node=8",
                        "--node-rank=$(NODE_RANK)", "--master-addr=job-worker-0-0.job", "--master-port=29500",
                        "--grace-period-s=590", "-m", "megatron_trainer"]  # default grace 600 s less 10 s
    # node rank from JobSet's global job index; pod 0's DNS name via the JobSet's headless service
    assert env_of(container(js))["NODE_RANK"] == {
        "fieldRef": {"fieldPath": "metadata.labels['jobset.sigs.k8s.io/job-global-index']"}}
    assert js["spec"]["network"] == {"enableDNSHostnames": True, "publishNotReadyAddresses": True,
                                     "subdomain": "job"}


def test_one_pod_per_node():
    js = objects(make_job(numNodes=4))["JobSet"]
    (rjob,) = js["spec"]["replicatedJobs"]
    assert rjob["replicas"] == 4
    assert rjob["template"]["spec"]["parallelism"] == 1 and rjob["template"]["spec"]["completions"] == 1


def test_dev_shm_is_memory_backed_with_default_and_explicit_size():
    js = objects(make_job(gpusPerNode=8))["JobSet"]
    vols = {v["name"]: v for v in pod_spec(js)["volumes"]}
    assert vols["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "64Gi"}  # 8Gi per GPU
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container(js)["volumeMounts"]
    js1 = objects(make_job(numNodes=2, gpusPerNode=1, parallelism={"tensor": 2},
                           training={"microBatchSize": 1, "trainIters": 1}))["JobSet"]
    assert {v["name"]: v for v in pod_spec(js1)["volumes"]}["dshm"]["emptyDir"]["sizeLimit"] == "16Gi"  # floor
    js2 = objects(make_job(resources={"shmSize": "100Gi"}))["JobSet"]
    assert {v["name"]: v for v in pod_spec(js2)["volumes"]}["dshm"]["emptyDir"]["sizeLimit"] == "100Gi"


def test_tp_inside_a_pod_needs_no_affinity():
    js = objects(make_job(parallelism={"tensor": 8}))["JobSet"]
    assert "affinity" not in pod_spec(js)
    assert [r["name"] for r in js["spec"]["replicatedJobs"]] == ["worker"]


def test_tp_group_spanning_pods_gets_affinity_on_exactly_its_pods():
    doc = make_job(numNodes=4, gpusPerNode=1, parallelism={"tensor": 2},
                   training={"microBatchSize": 1, "globalBatchSize": 2, "trainIters": 1})
    js = objects(doc)["JobSet"]
    rjobs = js["spec"]["replicatedJobs"]
    assert [(r["name"], r["replicas"]) for r in rjobs] == [("tp0", 2), ("tp1", 2)]
    for g, r in enumerate(rjobs):
        pod_labels = r["template"]["spec"]["template"]["metadata"]["labels"]
        assert pod_labels["megatron-operator.io/tp-group"] == str(g)
        term = pod_spec(js, g)["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
        assert term["topologyKey"] == "kubernetes.io/hostname"
        # the group's own pods, not every pod of the job
        assert term["labelSelector"]["matchLabels"] == {"megatron-operator.io/job-name": "job",
                                                        "megatron-operator.io/tp-group": str(g)}
    assert "--master-addr=job-tp0-0-0.job" in container(js)["command"]
    # and each group's first pod prefers a host without another group of the job (soft: groups may
    # share a host that has room): a group that lands next to another can take its partner's room
    for g in range(2):
        (pref,) = pod_spec(js, g)["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
        assert pref == {"weight": 100, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname", "labelSelector": {
            "matchLabels": {"megatron-operator.io/job-name": "job"},
            "matchExpressions": [{"key": "megatron-operator.io/tp-group", "operator": "NotIn", "values": [str(g)]}]}}}
        # a preference, not a requirement: groups may share a host with room for several (docs/troubleshooting.md,
        # "Tensor-parallel placement"); a job of two groups that started on one host too small for both is placed
        # anew by the operator (status.tp_group_collision)
        assert "requiredDuringSchedulingIgnoredDuringExecution" not in pod_spec(js, g)["affinity"]["podAntiAffinity"]


def test_avoided_nodes_become_a_required_node_affinity_on_every_pod():
    from megatron_operator.render import render
    from megatron_operator.settings import Settings
    from megatron_operator.validation import parse_job

    doc = make_job(numNodes=4, gpusPerNode=1, parallelism={"tensor": 2},
                   training={"microBatchSize": 1, "globalBatchSize": 2, "trainIters": 1})
    js = render(parse_job(doc), Settings(), avoid_nodes=["gpu-b", "gpu-a", "gpu-b"])[-1]
    for g in range(2):
        aff = pod_spec(js, g)["affinity"]
        assert aff["nodeAffinity"] == {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": ["gpu-a", "gpu-b"]}]}]}}
        assert "podAffinity" in aff  # the group's own rule stays
    assert "affinity" not in pod_spec(objects(make_job())["JobSet"])  # none by default


def _group_annotations(js) -> list[dict]:
    return [r["template"]["spec"]["template"]["metadata"].get("annotations", {}) for r in js["spec"]["replicatedJobs"]]


@pytest.mark.parametrize("queued, setting, tp, expected", [
    # a queued job with groups spanning pods, on a cluster whose flavors have a host level: one PodSet per group
    (True, "kubernetes.io/hostname", 2, "kubernetes.io/hostname"),
    (False, "kubernetes.io/hostname", 2, None),  # not queued: Kueue never sees it
    (True, "", 2, None),  # the admin did not say the flavors support TAS
    (True, "kubernetes.io/hostname", 1, None),  # every group inside one pod: nothing to place
])
def test_queued_tp_groups_ask_kueue_for_one_host_each(queued, setting, tp, expected):
    doc = make_job(numNodes=4, gpusPerNode=1, parallelism={"tensor": tp},
                   training={"microBatchSize": 1, "globalBatchSize": 4 // tp, "trainIters": 1},
                   **({"queueName": "team-a"} if queued else {}))
    js = objects(doc, Settings(kueue_tp_group_topology=setting))["JobSet"]
    got = {a.get("kueue.x-k8s.io/podset-required-topology") for a in _group_annotations(js)}
    assert got == {expected}


def test_a_topology_the_user_asked_kueue_for_wins():
    doc = make_job(numNodes=4, gpusPerNode=1, parallelism={"tensor": 2}, queueName="team-a",
                   training={"microBatchSize": 1, "globalBatchSize": 2, "trainIters": 1},
                   podMetadata={"annotations": {"kueue.x-k8s.io/podset-preferred-topology": "rack"}})
    js = objects(doc, Settings(kueue_tp_group_topology="kubernetes.io/hostname"))["JobSet"]
    assert _group_annotations(js) == [{"kueue.x-k8s.io/podset-preferred-topology": "rack"}] * 2


def test_plan_keeps_tp_groups_in_node_rank_order():
    job = parse_job(make_job(numNodes=8, gpusPerNode=2, parallelism={"tensor": 4},
                             training={"microBatchSize": 1, "trainIters": 1}))
    assert replicated_job_plan(job.spec) == [("tp0", 2, 0), ("tp1", 2, 1), ("tp2", 2, 2), ("tp3", 2, 3)]


def test_gpu_efa_limits_env_toleration_selector_extended():
    doc = make_job(resources={"efaPerNode": 32, "cpu": 96, "memory": "1Ti",
                              "nodeSelector": {"node.kubernetes.io/instance-type": "p5.48xlarge"},
                              "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ml",
                                               "effect": "NoSchedule"}],
                              "extendedResources": {"rdma/hca_shared_devices_a": 1}})
    js = objects(doc)["JobSet"]
    c = container(js)
    assert c["resources"]["limits"] == {"nvidia.com/gpu": 8, "vpc.amazonaws.com/efa": 32,
                                        "rdma/hca_shared_devices_a": 1, "cpu": "96", "memory": "1Ti"}
    assert c["resources"]["requests"] == {"cpu": "96", "memory": "1Ti"}
    env = env_of(c)
    assert env["FI_PROVIDER"] == "efa" and env["FI_EFA_USE_DEVICE_RDMA"] == "1"
    ps = pod_spec(js)
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in ps["tolerations"]
    assert {"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"} in ps["tolerations"]
    assert ps["nodeSelector"] == {"node.kubernetes.io/instance-type": "p5.48xlarge"}


def test_no_efa_env_without_efa():
    env = env_of(container(objects(make_job())["JobSet"]))
    assert "FI_PROVIDER" not in env


def test_checkpoint_and_data_mounts_and_flags():
    doc = make_job(checkpoint={"pvc": "ckpt", "interval": 50, "keep": 2},
                   data={"pvc": "corpus", "paths": [{"prefix": "wiki/w_text_document", "weight": 0.7},
                                                    {"prefix": "code_text_document", "weight": 0.3}],
                         "tokenizer": {"type": "HuggingFace", "path": "tok/gpt"}})
    js = objects(doc)["JobSet"]
    vols = {v["name"]: v for v in pod_spec(js)["volumes"]}
    assert vols["checkpoints"]["persistentVolumeClaim"] == {"claimName": "ckpt"}
    assert vols["data"]["persistentVolumeClaim"] == {"claimName": "corpus", "readOnly": True}
    mounts = {m["name"]: m for m in container(js)["volumeMounts"]}
    assert mounts["data"]["readOnly"] is True and mounts["checkpoints"]["mountPath"] == "/checkpoints"
    args = container(js)["command"]
    i = args.index("--save")
    assert args[i:i + 6] == ["--save", "/checkpoints/job", "--load", "/checkpoints/job", "--save-interval", "50"]
    assert "--ckpt-format" in args and args[args.index("--ckpt-format") + 1] == "torch_dist"
    assert "--async-save" in args and "--use-persistent-ckpt-worker" in args and "--exit-signal-handler" in args
    d = args.index("--data-path")
    assert args[d + 1:d + 5] == ["0.7", "/data/wiki/w_text_document", "0.3", "/data/code_text_document"]
    assert args[args.index("--tokenizer-model") + 1] == "/data/tok/gpt"
    assert args[args.index("--data-cache-path") + 1] == "/checkpoints/job/data-cache"
    assert env_of(container(js))["MEGATRON_CHECKPOINT_KEEP"] == "2"


def test_checkpoint_path_override_and_sync_save():
    args = megatron_args(parse_job(make_job(checkpoint={"pvc": "c", "path": "runs/a", "async": False})))
    assert args[args.index("--save") + 1] == "/checkpoints/runs/a"
    assert "--async-save" not in args


def test_megatron_lm_flag_names():
    args = megatron_args(parse_job(make_job(parallelism={"tensor": 2, "pipeline": 2, "virtualPipeline": 2,
                                                         "context": 1, "expert": 2, "sequenceParallel": True},
                                            model={"preset": "llama3-8b", "numExperts": 4},
                                            training={"trainIters": 10, "globalBatchSize": 8, "recompute": "full"})))
    expected = ["--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                "--num-virtual-stages-per-pipeline-rank", "--context-parallel-size", "--expert-model-parallel-size",
                "--sequence-parallel", "--num-layers", "--hidden-size", "--num-attention-heads",
                "--group-query-attention", "--num-query-groups", "--ffn-hidden-size", "--seq-length",
                "--max-position-embeddings", "--vocab-size", "--swiglu", "--normalization",
                "--position-embedding-type", "--rotary-base", "--untie-embeddings-and-output-weights",
                "--disable-bias-linear", "--micro-batch-size", "--global-batch-size", "--train-iters", "--lr",
                "--bf16", "--use-distributed-optimizer", "--recompute-granularity", "--recompute-method",
                "--recompute-num-layers", "--mock-data", "--num-experts", "--moe-router-topk"]
    for flag in expected:
        assert flag in args, flag
    assert args[args.index("--num-layers") + 1] == "32"
    assert args[args.index("--rotary-base") + 1] == "500000"


@pytest.mark.parametrize("parallelism, impl, flags", [
    ({"tensor": 2}, "transformer_engine", ["--sequence-parallel-auto"]),  # the trainer decides from its image
    ({"tensor": 2, "sequenceParallel": True}, "transformer_engine", ["--sequence-parallel"]),
    ({"tensor": 2, "sequenceParallel": True}, "local", ["--sequence-parallel"]),
    ({"tensor": 2, "sequenceParallel": False}, "transformer_engine", []),
    ({"tensor": 2}, "local", []),
    ({"tensor": 1}, "transformer_engine", []),
])
def test_sequence_parallel_rendering(parallelism, impl, flags):
    args = megatron_args(parse_job(make_job(parallelism=parallelism, training__transformerImpl=impl)))
    assert [a for a in args if a.startswith("--sequence-parallel")] == flags


def test_expert_run_has_no_experts_flag_when_dense():
    args = megatron_args(parse_job(make_job()))
    assert "--num-experts" not in args and "--swiglu" not in args and "--group-query-attention" not in args


LLAMA_FAMILY_FLAGS = ("--norm-epsilon", "--kv-channels", "--qk-layernorm", "--add-qkv-bias", "--use-rope-scaling",
                      "--rope-scaling-factor")


@pytest.mark.parametrize("model", [{"preset": "llama3-8b"}, {"preset": "gpt-1.7b"},
                                   {"preset": "llama3-8b", "normEpsilon": 1e-5, "kvChannels": 128}])
def test_llama_family_flags_render_only_away_from_megatrons_defaults(model):
    args = megatron_args(parse_job(make_job(model=model, training={"trainIters": 10})))
    assert not set(LLAMA_FAMILY_FLAGS) & set(args)


def test_llama_family_flags_and_their_values():
    args = megatron_args(parse_job(make_job(model={"preset": "llama3-8b", "normEpsilon": 1e-6, "kvChannels": 64,
                                                   "qkLayernorm": True, "addQkvBias": True,
                                                   "ropeScalingFactor": 8},
                                            training={"trainIters": 10})))
    assert args[args.index("--norm-epsilon") + 1] == "1e-06"
    assert args[args.index("--kv-channels") + 1] == "64"
    assert args[args.index("--rope-scaling-factor") + 1] == "8.0"
    assert {"--qk-layernorm", "--add-qkv-bias", "--use-rope-scaling"} <= set(args)


def test_kv_channels_renders_when_hidden_is_not_divisible_by_heads():
    args = megatron_args(parse_job(make_job(model__hiddenSize=1000, model__kvChannels=62)))
    assert args[args.index("--kv-channels") + 1] == "62"


LLAMA = {"preset": "llama3-8b", "numLayers": 4}


def test_hf_init_is_mounted_read_only_and_export_read_write():
    js = objects(make_job(model=LLAMA, training={"trainIters": 10},
                          init={"huggingFace": {"pvc": "models", "path": "meta/llama-3.1-8b"}},
                          export={"huggingFace": {"pvc": "models", "path": "exports/ft"}}))["JobSet"]
    # one claim, one volume (read-write: the export writes), mounted twice: read-only at /hf-init
    volumes = {v["name"]: v for v in pod_spec(js)["volumes"]}
    mounts = {m["mountPath"]: m for m in container(js)["volumeMounts"]}
    assert volumes["hf-init"]["persistentVolumeClaim"] == {"claimName": "models"} and "hf-export" not in volumes
    assert mounts["/hf-init"] == {"name": "hf-init", "mountPath": "/hf-init", "readOnly": True}
    assert mounts["/hf-export"] == {"name": "hf-init", "mountPath": "/hf-export"}
    # on two claims, two volumes, the source's read-only
    js2 = objects(make_job(model=LLAMA, training={"trainIters": 10},
                           init={"huggingFace": {"pvc": "models", "path": "meta/llama-3.1-8b"}},
                           export={"huggingFace": {"pvc": "exports", "path": "ft"}}))["JobSet"]
    volumes2 = {v["name"]: v for v in pod_spec(js2)["volumes"]}
    assert volumes2["hf-init"]["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
    assert volumes2["hf-export"]["persistentVolumeClaim"] == {"claimName": "exports"}
    args = container(js)["command"]
    assert args[args.index("--hf-init") + 1] == "/hf-init/meta/llama-3.1-8b"
    assert args[args.index("--hf-export") + 1] == "/hf-export/exports/ft"


def test_no_hf_volumes_or_flags_without_init_and_export():
    js = objects(make_job())["JobSet"]
    assert not {"hf-init", "hf-export"} & {v["name"] for v in pod_spec(js)["volumes"]}
    assert not {"--hf-init", "--hf-export", "--hf-export-only"} & set(container(js)["command"])


def test_cuda_device_max_connections_only_where_megatron_requires_it():
    assert env_of(container(objects(make_job())["JobSet"]))["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    js = objects(make_job(parallelism={"pipeline": 2}, training__globalBatchSize=32))["JobSet"]
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in env_of(container(js))


def test_failure_policy_gang_restart_and_grace_period():
    js = objects(make_job(restart={"maxRestarts": 7}, terminationGracePeriodSeconds=1200))["JobSet"]
    fp = js["spec"]["failurePolicy"]
    assert fp["maxRestarts"] == 7 and fp["restartStrategy"] == "BlockingRecreate"
    assert [r["action"] for r in fp["rules"]] == ["FailJobSet", "RestartJobSetAndIgnoreMaxRestarts"]
    tmpl = js["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert tmpl["backoffLimit"] == 0
    assert pod_spec(js)["restartPolicy"] == "Never"
    assert pod_spec(js)["terminationGracePeriodSeconds"] == 1200
    default = objects(make_job(), Settings(max_restarts=5, termination_grace_period_s=777))["JobSet"]
    assert default["spec"]["failurePolicy"]["maxRestarts"] == 5
    assert pod_spec(default)["terminationGracePeriodSeconds"] == 777


def test_tensorboard_under_the_checkpoint_dir():
    on = container(objects(make_job(checkpoint={"pvc": "c", "path": "runs/a"}, logging={"tensorboard": True}))
                   ["JobSet"])["command"]
    assert on[on.index("--tensorboard-dir") + 1] == "/checkpoints/runs/a/tensorboard"
    off = container(objects(make_job(checkpoint={"pvc": "c"}))["JobSet"])["command"]
    assert "--tensorboard-dir" not in off


@pytest.mark.parametrize("grace, launcher", [(30, 20), (1200, 1190), (None, 590)])
def test_launcher_waits_the_pod_grace_period_less_a_margin(grace, launcher):
    job = make_job(terminationGracePeriodSeconds=grace) if grace else make_job()
    cmd = container(objects(job)["JobSet"])["command"]
    assert f"--grace-period-s={launcher}" in cmd[:cmd.index("megatron_trainer")]
    # an operator default below the spec's minimum still leaves the launcher a positive budget
    small = container(objects(make_job(), Settings(termination_grace_period_s=6))["JobSet"])["command"]
    assert "--grace-period-s=4" in small


def test_owner_references_and_labels_on_every_object():
    for obj in objects(make_job(), uid="abc").values():
        (ref,) = obj["metadata"]["ownerReferences"]
        assert ref == {"apiVersion": "megatron-operator.io/v1alpha1", "kind": "MegatronJob", "name": "job",
                       "uid": "abc", "controller": True, "blockOwnerDeletion": True}
        assert obj["metadata"]["labels"]["megatron-operator.io/job-name"] == "job"
        assert obj["metadata"]["namespace"] == "team-a"


def test_kueue_label_and_suspended_start():
    js = objects(make_job(queueName="team-queue"))["JobSet"]
    assert js["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "team-queue"
    assert js["spec"]["suspend"] is True
    assert objects(make_job())["JobSet"]["spec"]["suspend"] is False
    assert objects(make_job(suspend=True))["JobSet"]["spec"]["suspend"] is True
    js = objects(make_job(queueName="team-queue", workloadPriorityClass="high"))["JobSet"]
    assert js["metadata"]["labels"]["kueue.x-k8s.io/priority-class"] == "high"
    assert "kueue.x-k8s.io/priority-class" not in objects(make_job())["JobSet"]["metadata"]["labels"]


def test_service_account_role_only_patches_own_status():
    objs = objects(make_job())
    sa, role, rb = objs["ServiceAccount"], objs["Role"], objs["RoleBinding"]
    assert role["rules"] == [{"apiGroups": ["megatron-operator.io"], "resources": ["megatronjobs/status"],
                              "resourceNames": ["job"], "verbs": ["get", "patch"]}]
    assert rb["roleRef"]["name"] == role["metadata"]["name"]
    assert rb["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": "team-a"}]
    assert pod_spec(objs["JobSet"])["serviceAccountName"] == sa["metadata"]["name"]


def test_pod_security_non_root_read_only_no_host_paths():
    js = objects(make_job(checkpoint={"pvc": "c"}))["JobSet"]
    ps = pod_spec(js)
    assert ps["securityContext"]["runAsNonRoot"] is True
    assert ps["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = container(js)["securityContext"]
    assert sc == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}
    assert all("hostPath" not in v for v in ps["volumes"])


def test_user_env_is_appended():
    env = container(objects(make_job(env=[{"name": "NCCL_DEBUG", "value": "INFO"}]))["JobSet"])["env"]
    assert env[-1] == {"name": "NCCL_DEBUG", "value": "INFO"}


def test_extra_args_appended_last():
    args = megatron_args(parse_job(make_job(training__extraArgs=["--manual-gc"])))
    assert args[-1] == "--manual-gc"


@pytest.mark.parametrize("example", ["kubeflow-tp2.yaml", "llama3-70b-checkpoint.yaml"])
def test_golden_render(example):
    """Full render snapshots. Regenerate deliberately with UPDATE_GOLDEN=1 and review the diff."""
    import os

    doc = yaml.safe_load((EXAMPLES / example).read_text())
    doc["metadata"]["namespace"] = "default"
    text = "\n---\n".join(to_yaml(o).rstrip() for o in render(parse_job(doc), Settings(), owner_uid="UID"))
    golden = GOLDEN / (example.removesuffix(".yaml") + ".rendered.yaml")
    if os.environ.get("UPDATE_GOLDEN"):
        golden.parent.mkdir(exist_ok=True)
        golden.write_text(text + "\n")
    assert text + "\n" == golden.read_text()


def test_pod_metadata_reaches_the_pods_and_cannot_override_ours():
    js = objects(make_job(podMetadata={"labels": {"team": "nlp"}, "annotations": {"sidecar/inject": "false"}}))["JobSet"]
    meta = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["metadata"]
    assert meta["labels"]["team"] == "nlp" and meta["labels"]["megatron-operator.io/job-name"] == "job"
    assert meta["annotations"] == {"sidecar/inject": "false"}


def test_non_retriable_exit_codes_fail_the_jobset_at_once():
    """Exit codes 2-5, 7 and 8 (failures.py, the trainer's exitcodes.py) fail the pod's Job by podFailurePolicy;
    a JobSet rule matching the Job controller's message for an exit-code rule (not the eviction rule's
    "has condition DisruptionTarget") fails the JobSet before the eviction rule is looked at."""
    import re

    js = objects(make_job())["JobSet"]
    pfp = js["spec"]["replicatedJobs"][0]["template"]["spec"]["podFailurePolicy"]["rules"]
    assert pfp[0]["onPodConditions"] == [{"type": "DisruptionTarget", "status": "True"}]
    assert pfp[1] == {"action": "FailJob",
                      "onExitCodes": {"containerName": "trainer", "operator": "In", "values": [2, 3, 4, 5, 7, 8]}}
    fail, disruption = js["spec"]["failurePolicy"]["rules"]
    assert fail["name"] == "nonRetriableExitCode" and fail["onJobFailureReasons"] == ["PodFailurePolicy"]
    (pattern,) = fail["onJobFailureMessagePatterns"]
    # The messages of kubernetes pkg/controller/job/pod_failure_policy.go for each rule kind:
    exit_msg = "Container trainer for pod ns/j-worker-0-0-abc failed with exit code 3 matching FailJob rule at index 1"
    evicted_msg = "Pod ns/j-worker-0-0-abc has condition DisruptionTarget matching FailJob rule at index 0"
    assert re.search(pattern, exit_msg) and not re.search(pattern, evicted_msg)
    assert disruption["onJobFailureReasons"] == ["PodFailurePolicy"] and "onJobFailureMessagePatterns" not in disruption
    assert container(js)["terminationMessagePolicy"] == "FallbackToLogsOnError"


# ---- checkpoints in object storage (docs/object-storage.md) ------------------------------------------

OBJECT_STORE = {"bucket": "ckpt-bucket", "prefix": "runs/a", "endpoint": "http://minio.storage:9000",
                "region": "eu-west-1", "credentialsSecret": "s3-creds"}


def test_object_store_flags_secret_volume_and_no_pvc():
    js = objects(make_job(checkpoint={"objectStore": OBJECT_STORE, "interval": 50}))["JobSet"]
    pod = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    args = megatron_args(parse_job(make_job(checkpoint={"objectStore": OBJECT_STORE})))
    assert args[args.index("--save") + 1] == args[args.index("--load") + 1] == "s3://ckpt-bucket/runs/a"
    assert args[args.index("--object-store-endpoint") + 1] == "http://minio.storage:9000"
    assert args[args.index("--object-store-region") + 1] == "eu-west-1"
    assert not [v for v in pod["volumes"] if "persistentVolumeClaim" in v]
    secret = [v for v in pod["volumes"] if "secret" in v]
    assert secret == [{"name": "object-store-credentials", "secret": {
        "secretName": "s3-creds", "defaultMode": 0o440, "items": [{"key": "credentials", "path": "credentials"}]}}]
    c = pod["containers"][0]
    mount = [m for m in c["volumeMounts"] if m["name"] == "object-store-credentials"]
    assert mount == [{"name": "object-store-credentials", "readOnly": True,
                      "mountPath": "/var/run/secrets/megatron-operator/object-store"}]
    env = {e["name"]: e for e in c["env"]}
    assert env["AWS_SHARED_CREDENTIALS_FILE"] == {
        "name": "AWS_SHARED_CREDENTIALS_FILE", "value": "/var/run/secrets/megatron-operator/object-store/credentials"}
    assert env["MEGATRON_DATA_CACHE_SHARED"]["value"] == "false"  # no shared filesystem for the data cache


def test_object_store_prefix_defaults_to_the_job_name_and_no_secret_without_one():
    doc = make_job(checkpoint={"objectStore": {"bucket": "ckpt-bucket"}})
    args = megatron_args(parse_job(doc))
    assert args[args.index("--save") + 1] == f"s3://ckpt-bucket/{doc['metadata']['name']}"
    assert "--object-store-endpoint" not in args and "--object-store-region" not in args
    pod = objects(doc)["JobSet"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    assert not [v for v in pod["volumes"] if "secret" in v]
    assert "AWS_SHARED_CREDENTIALS_FILE" not in {e["name"] for e in pod["containers"][0]["env"]}


def test_object_store_workload_identity_annotates_only_the_jobs_service_account():
    irsa = {"eks.amazonaws.com/role-arn": "arn:aws:iam::123456789012:role/ckpt"}
    objs = render(parse_job(make_job(checkpoint={"objectStore": {"bucket": "ckpt-bucket",
                                                                 "serviceAccountAnnotations": irsa}})), Settings())
    sa = [o for o in objs if o["kind"] == "ServiceAccount"]
    assert len(sa) == 1 and sa[0]["metadata"]["annotations"] == irsa
    pod = [o for o in objs if o["kind"] == "JobSet"][0]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    assert pod["spec"]["serviceAccountName"] == sa[0]["metadata"]["name"]
    assert "eks.amazonaws.com/role-arn" not in pod.get("metadata", {}).get("annotations", {})


def test_object_store_render_carries_no_secret_material():
    """Issue 32: the operator never reads the Secret; what it renders names it and a file path only."""
    import json

    objs = render(parse_job(make_job(checkpoint={"objectStore": OBJECT_STORE})), Settings())
    text = json.dumps(objs)
    assert "secretKeyRef" not in text
    for word in ("aws_secret_access_key", "AWS_SECRET_ACCESS_KEY", "AWS_ACCESS_KEY_ID", "AWS_SESSION_TOKEN"):
        assert word not in text


def test_hf_export_to_the_checkpoint_bucket_mounts_nothing_and_names_the_bucket():
    doc = make_job(model=LLAMA, training={"trainIters": 10}, checkpoint={"objectStore": OBJECT_STORE},
                   export={"huggingFace": {"objectStore": True, "path": "exports/ft"}})
    js = objects(doc)["JobSet"]
    args = container(js)["command"]
    assert args[args.index("--hf-export") + 1] == "s3://ckpt-bucket/exports/ft"
    # the endpoint and region of the checkpoints serve the export too; no export volume
    assert args[args.index("--object-store-endpoint") + 1] == "http://minio.storage:9000"
    assert "hf-export" not in {v["name"] for v in pod_spec(js)["volumes"]}
    assert "hf-export" not in {m["name"] for m in container(js)["volumeMounts"]}
    assert [v["name"] for v in pod_spec(js)["volumes"] if "secret" in v] == ["object-store-credentials"]


def test_the_operators_volumes_are_names_table_each_at_its_mount():
    """names.OPERATOR_VOLUME_MOUNTS is the one table of the operator's own volumes: render and the blocks write
    them from it, and spec.pod may not take their names (pod-volume-names-not-reserved). Two jobs render every one
    (a checkpoint is on a PVC or in a bucket): each rendered volume the user did not add is in the table, mounted
    at its path, and together they are all of it."""
    from megatron_operator.names import OPERATOR_VOLUME_MOUNTS

    on_pvcs = make_job(model=LLAMA, checkpoint={"pvc": "c"},
                       data={"pvc": "corpus", "paths": [{"prefix": "a"}], "tokenizer": {"type": "Null"}},
                       init={"huggingFace": {"pvc": "models", "path": "llama"}},
                       # its own PVC: on the source's, the export shares its volume (_one_volume_per_claim)
                       export={"huggingFace": {"pvc": "exports", "path": "ft"}},
                       logging={"wandb": {"project": "p", "apiKeySecret": {"name": "wb"}}},
                       pod={"volumes": [{"name": "scratch", "emptyDir": {}}],
                            "initContainers": [{"name": "side", "image": "nvcr.io/x:1"}]})
    in_bucket = make_job(checkpoint={"objectStore": OBJECT_STORE})
    rendered = {}
    for doc in (on_pvcs, in_bucket):
        js = objects(doc)["JobSet"]
        mounts = {m["name"]: m["mountPath"] for m in container(js)["volumeMounts"]}
        ours = [v["name"] for v in pod_spec(js)["volumes"] if v["name"] != "scratch"]
        assert len(ours) == len(set(ours))
        rendered |= {name: mounts[name] for name in ours}
    assert rendered == OPERATOR_VOLUME_MOUNTS


# ---- spec.pod (issue 53) ------------------------------------------------------------------------------------


def test_pod_additions_come_after_the_operators_own():
    from spec_table import POD_FULL

    js = objects(make_job(checkpoint={"pvc": "c"}, pod=POD_FULL))["JobSet"]
    ps, trainer = pod_spec(js), container(js)
    names = [v["name"] for v in ps["volumes"]]
    assert names == ["dshm", "tmp", "checkpoints", *(v["name"] for v in POD_FULL["volumes"]), "trainer-token"]
    assert ps["volumes"][3] == {"name": "nfs", "persistentVolumeClaim": {"claimName": "datasets", "readOnly": True}}
    paths = [m["mountPath"] for m in trainer["volumeMounts"]]
    assert paths == ["/dev/shm", "/tmp", "/checkpoints", "/mnt/datasets", "/var/run/secrets/tracker", "/scratch",
                     "/var/run/secrets/kubernetes.io/serviceaccount"]
    assert [c["name"] for c in ps["initContainers"]] == ["prefetch", "logs"]
    assert ps["initContainers"][1]["restartPolicy"] == "Always" and "restartPolicy" not in ps["initContainers"][0]
    assert ps["topologySpreadConstraints"][0]["topologyKey"] == "topology.kubernetes.io/zone"
    # the trainer itself is as before: its securityContext, command and env
    assert trainer["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                          "capabilities": {"drop": ["ALL"]}}
    assert container(objects(make_job(checkpoint={"pvc": "c"}))["JobSet"])["command"] == trainer["command"]


def test_user_containers_are_hardened_like_the_trainer_unless_they_ask():
    pod = {"initContainers": [
        {"name": "plain", "image": "x"},
        {"name": "ptrace", "image": "x", "securityContext": {"capabilities": {"add": ["SYS_PTRACE"]}}},
        {"name": "priv", "image": "x", "securityContext": {"privileged": True}},
        {"name": "admin", "image": "x", "securityContext": {"capabilities": {"add": ["SYS_ADMIN"]}}}]}
    inits = {c["name"]: c for c in pod_spec(objects(make_job(pod=pod))["JobSet"])["initContainers"]}
    assert inits["plain"] == {"name": "plain", "image": "x", "securityContext": {
        "capabilities": {"drop": ["ALL"]}, "allowPrivilegeEscalation": False}}
    assert inits["ptrace"]["securityContext"] == {"capabilities": {"drop": ["ALL"], "add": ["SYS_PTRACE"]},
                                                  "allowPrivilegeEscalation": False}
    # the API server refuses allowPrivilegeEscalation: false beside these two
    assert "allowPrivilegeEscalation" not in inits["priv"]["securityContext"]
    assert "allowPrivilegeEscalation" not in inits["admin"]["securityContext"]


def test_with_user_containers_only_the_trainer_gets_the_jobs_token():
    ps = pod_spec(objects(make_job(pod={"initContainers": [{"name": "a", "image": "x"}]}))["JobSet"])
    assert ps["automountServiceAccountToken"] is False
    token = next(v for v in ps["volumes"] if v["name"] == "trainer-token")["projected"]["sources"]
    assert token[0] == {"serviceAccountToken": {"path": "token", "expirationSeconds": 3607}}
    assert {"name": "trainer-token", "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount",
            "readOnly": True} in ps["containers"][0]["volumeMounts"]
    assert "volumeMounts" not in ps["initContainers"][0]
    # without user containers the kubelet's automount stays (the render is unchanged)
    for pod in ({}, {"volumes": [{"name": "v", "emptyDir": {}}]}):
        ps = pod_spec(objects(make_job(pod=pod))["JobSet"])
        assert ps["automountServiceAccountToken"] is True and "initContainers" not in ps
        assert "trainer-token" not in [v["name"] for v in ps["volumes"]]


def test_an_empty_pod_block_renders_exactly_as_none():
    for doc in (make_job(), make_job(checkpoint={"pvc": "c"}, numNodes=2, gpusPerNode=1, parallelism={"tensor": 2},
                                     training={"microBatchSize": 1, "globalBatchSize": 1, "trainIters": 1})):
        with_pod = {**doc, "spec": {**doc["spec"], "pod": {}}}
        assert render(parse_job(with_pod), Settings(), avoid_nodes=["n"]) == \
            render(parse_job(doc), Settings(), avoid_nodes=["n"])


def test_user_affinity_is_merged_with_the_tp_group_and_avoided_nodes_never_replacing_them():
    doc = make_job(numNodes=2, gpusPerNode=1, parallelism={"tensor": 2},
                   training={"microBatchSize": 1, "globalBatchSize": 1, "trainIters": 1}, pod={"affinity": {
                       "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                           {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["a"]}]},
                           {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["b"]}]}]}},
                       "podAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 5, "podAffinityTerm": {
                           "topologyKey": "zone", "labelSelector": {"matchLabels": {"cache": "warm"}}}}]},
                       "podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [{
                           "topologyKey": "kubernetes.io/hostname", "labelSelector": {"matchLabels": {"team": "b"}}}]}}})
    plain = pod_spec(render(parse_job(make_job(**{k: v for k, v in doc["spec"].items() if k != "pod"})), Settings(),
                            avoid_nodes=["bad"])[-1])["affinity"]
    aff = pod_spec(render(parse_job(doc), Settings(), avoid_nodes=["bad"])[-1])["affinity"]
    # the operator's own terms first, unchanged; the user's added
    assert aff["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"] == \
        plain["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert aff["podAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]["topologyKey"] \
        == "zone"
    anti = aff["podAntiAffinity"]
    assert anti["preferredDuringSchedulingIgnoredDuringExecution"] == \
        plain["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert anti["requiredDuringSchedulingIgnoredDuringExecution"][0]["labelSelector"]["matchLabels"] == {"team": "b"}
    # node terms are ORed by the scheduler: each of the user's terms keeps the avoided node out
    avoid = {"key": "metadata.name", "operator": "NotIn", "values": ["bad"]}
    terms = aff["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert [t["matchExpressions"][0]["values"] for t in terms] == [["a"], ["b"]]
    assert all(t["matchFields"] == [avoid] for t in terms)
    # without avoided nodes, the user's terms as they are
    aff = pod_spec(render(parse_job(doc), Settings())[-1])["affinity"]
    assert all("matchFields" not in t for t in aff["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
               ["nodeSelectorTerms"])


def test_every_example_renders_as_before_and_the_golden_snapshots_have_no_pod_additions():
    """The render of every example is what it was before spec.pod existed: no example uses it, and their
    renders carry none of its traces (init containers, the trainer-token volume, automount off)."""
    for path in sorted(EXAMPLES.glob("*.yaml")):
        doc = yaml.safe_load(path.read_text())
        assert "pod" not in doc["spec"], path.name
        doc["metadata"]["namespace"] = "default"
        js = render(parse_job(doc), Settings())[-1]
        for i in range(len(js["spec"]["replicatedJobs"])):
            ps = pod_spec(js, i)
            assert "initContainers" not in ps and "topologySpreadConstraints" not in ps, path.name
            assert ps["automountServiceAccountToken"] is True, path.name
            assert "trainer-token" not in [v["name"] for v in ps["volumes"]], path.name


def test_every_moe_field_renders_as_its_flag_and_none_is_left_out_of_the_table():
    from megatron_operator import render as R
    from megatron_operator.spec import ModelSpec
    from spec_table import CASES

    moe = {f for f in ModelSpec.model_fields if f.startswith("moe_")} - {"moe_router_topk"}
    assert set(R._MOE_FIELDS) == moe  # a new field outside the table would never reach the trainer
    jobs = {name: doc for name, doc, _ in CASES if name in ("moe-full-block", "moe-shared-sigmoid-bias-capacity")}
    args = " ".join(megatron_args(parse_job(jobs["moe-full-block"])))
    assert ("--moe-ffn-hidden-size 512 --moe-router-pre-softmax --moe-router-load-balancing-type seq_aux_loss "
            "--moe-aux-loss-coeff 0.001 --moe-z-loss-coeff 0.001 --moe-router-dtype fp32 "
            "--moe-token-dispatcher-type alltoall") in args
    args = " ".join(megatron_args(parse_job(jobs["moe-shared-sigmoid-bias-capacity"])))
    assert ("--moe-token-dispatcher-type alltoall --moe-shared-expert-intermediate-size 512 "
            "--moe-shared-expert-gate --moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-router-bias-update-rate 0.01 "
            "--moe-expert-capacity-factor 1.25 --moe-token-drop-policy position "
            "--moe-pad-expert-input-to-capacity") in args
    assert "--moe-router-pre-softmax" not in args and "--moe-ffn-hidden-size" not in args  # unset: not rendered


def _selects(selector, labels):
    """A Kubernetes label selector against a pod's labels (apimachinery's LabelSelectorAsSelector)."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for r in selector.get("matchExpressions", []):
        present, value = r["key"] in labels, labels.get(r["key"])
        ok = {"In": present and value in r.get("values", []), "NotIn": not present or value not in r.get("values", []),
              "Exists": present, "DoesNotExist": not present}[r["operator"]]
        if not ok:
            return False
    return True


def test_where_tp_groups_span_pods_every_admitted_pod_matches_all_its_own_required_pod_affinity_terms():
    """kube-scheduler places a pod only next to an existing pod matching all of its required pod-affinity terms,
    or, for the first pod of a series, when the pod matches all of them itself. So where the operator adds the
    group's term, every admitted job's pods must match every required term they carry: checked on the rendered
    pod templates of every valid spec in the table, by a selector evaluator independent of the admission rule."""
    from megatron_operator.names import FIXED_JOB_LABELS, JOB_NAME_VALUED_LABELS, LABEL_TP_GROUP
    from megatron_operator.render import labels_for
    from spec_table import CASES

    # the rule reads these names for the labels every pod carries: they must be exactly render's
    assert labels_for("j") == {**FIXED_JOB_LABELS, **dict.fromkeys(JOB_NAME_VALUED_LABELS, "j")}
    checked = 0
    for name, doc, rule in CASES:
        if rule is not None:
            continue
        for rj in objects(doc)["JobSet"]["spec"]["replicatedJobs"]:
            template = rj["template"]["spec"]["template"]
            terms = (template["spec"].get("affinity", {}).get("podAffinity", {})
                     .get("requiredDuringSchedulingIgnoredDuringExecution", []))
            if not any(LABEL_TP_GROUP in t["labelSelector"].get("matchLabels", {}) for t in terms):
                continue
            assert all(_selects(t["labelSelector"], template["metadata"]["labels"]) for t in terms), (name, terms)
            checked += len(terms) > 1
    assert checked >= 3  # the table's accepted user terms on jobs whose groups span pods were all seen


# ---------------------------------------------------------------- CPU jobs (gpusPerNode 0, blocks/cpu.py)
CPU_JOB = {"numNodes": 2, "gpusPerNode": 0, "cpu": {"processesPerNode": 2}, "parallelism": {"tensor": 4},
           "model": {"numLayers": 4, "hiddenSize": 64, "numAttentionHeads": 4, "seqLength": 32, "vocabSize": 128},
           "training": {"microBatchSize": 1, "globalBatchSize": 2, "trainIters": 10}, "checkpoint": {"pvc": "c"},
           "resources": {"cpu": 2, "memory": "4Gi"}}


def test_a_cpu_job_renders_as_the_same_gpu_job_but_for_devices_backend_and_async_saves():
    """Issue 64: the rest of the JobSet renders exactly as for GPUs. The same job with one GPU per process differs
    only in the GPU limit, /dev/shm's default size and the trainer's flags: --device cpu, --transformer-impl local,
    and no background saves (the writer needs CUDA)."""
    def pods(doc):
        js = render(parse_job(doc), Settings(), owner_uid="UID")[-1]
        return js, [rj["template"]["spec"]["template"]["spec"] for rj in js["spec"]["replicatedJobs"]]

    cpu_js, cpu_pods = pods(make_job(**CPU_JOB))
    gpu_js, gpu_pods = pods(make_job(**{**CPU_JOB, "gpusPerNode": 2, "cpu": DELETE}))
    assert [rj["name"] for rj in cpu_js["spec"]["replicatedJobs"]] == ["tp0"]  # one TP group of 4 over the 2 pods
    for cpu, gpu in zip(cpu_pods, gpu_pods, strict=True):
        cc, gc = cpu["containers"][0], gpu["containers"][0]
        assert cc["resources"] == {"limits": {"cpu": "2", "memory": "4Gi"}, "requests": {"cpu": "2", "memory": "4Gi"}}
        assert gc["resources"]["limits"]["nvidia.com/gpu"] == 2
        assert next(v for v in cpu["volumes"] if v["name"] == "dshm")["emptyDir"]["sizeLimit"] == "2Gi"
        assert "--nproc-per-node=2" in cc["command"] and "--nproc-per-node=2" in gc["command"]
        flags = [a for a in cc["command"] if a not in gc["command"]]
        assert flags == ["--device", "cpu"], flags
        assert [a for a in gc["command"] if a not in cc["command"]] == ["--async-save", "--use-persistent-ckpt-worker"]
        assert cc["command"][cc["command"].index("--transformer-impl") + 1] == "local"
        for key in set(cpu) | set(gpu):
            if key not in ("containers", "volumes"):
                assert cpu.get(key) == gpu.get(key), key  # affinity, tolerations, identity, security, grace
        assert [v for v in cpu["volumes"] if v["name"] != "dshm"] == [v for v in gpu["volumes"] if v["name"] != "dshm"]
        for key in set(cc) | set(gc):
            if key not in ("command", "resources"):
                assert cc.get(key) == gc.get(key), key
    assert {k: v for k, v in cpu_js["spec"].items() if k != "replicatedJobs"} == \
        {k: v for k, v in gpu_js["spec"].items() if k != "replicatedJobs"}


@pytest.mark.parametrize("spec, impl", [
    ({}, "local"),  # the fastest measured path (docs/benchmarks/megatron-lm.md#2026-12-01-te-path)
    ({"training__precision": "fp8"}, "transformer_engine"),  # only TE runs it
    ({"parallelism__context": 2, "training__globalBatchSize": 16}, "transformer_engine"),
    ({"training__transformerImpl": "transformer_engine"}, "transformer_engine"),  # as asked
    ({"training__transformerImpl": "local"}, "local"),
])
def test_transformer_impl_default_is_local_unless_only_te_runs_the_job(spec, impl):
    args = megatron_args(parse_job(make_job(**spec)))
    assert args[args.index("--transformer-impl") + 1] == impl


def test_one_volume_per_claim_for_data_and_checkpoints_on_one_pvc():
    """kube-scheduler counts a claim two of a pod's volumes name twice: on a WaitForFirstConsumer class an unbound
    claim then never binds (seen on the real node). One claim for data and checkpoints: one read-write volume, the
    data mount read-only."""
    js = objects(make_job(checkpoint={"pvc": "shared"}, data={"pvc": "shared", "paths": [{"prefix": "a/b"}],
                                                                "tokenizer": {"type": "Null"}}))["JobSet"]
    claims = [v["persistentVolumeClaim"] for v in pod_spec(js)["volumes"] if "persistentVolumeClaim" in v]
    assert claims == [{"claimName": "shared"}]
    mounts = {m["mountPath"]: m for m in container(js)["volumeMounts"]}
    assert mounts["/data"] == {"name": "checkpoints", "mountPath": "/data", "readOnly": True}
    assert mounts["/checkpoints"] == {"name": "checkpoints", "mountPath": "/checkpoints"}
