"""MegatronJob -> the objects the operator applies (a pure function; no API calls).

``render()`` returns, in apply order: the job's ServiceAccount, a Role that lets that identity
patch only its own MegatronJob's status, the RoleBinding, and the JobSet that runs the trainer's
launcher (`python -m megatron_trainer.launch`, one worker per GPU) in one pod per node. The
command line uses Megatron-LM flag names (docs/trainer-contract.md), so a Megatron-LM image could
run the same job. A spec block with a room of its own (``blocks/``) builds its part (its flags, env, volumes,
what it adds to the pod); this module places each part where it goes.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from . import blocks
from .failures import FAIL_MESSAGE_PATTERN, FAIL_RULE_NAME, NON_RETRIABLE_EXIT_CODES
from .names import (
    ANNOTATION_PARALLELISM,
    API_VERSION,
    CHECKPOINT_MOUNT,
    CHECKPOINT_VOLUME,
    DATA_MOUNT,
    DATA_VOLUME,
    EFA_RESOURCE,
    GPU_RESOURCE,
    GROUP,
    JOBSET_API_VERSION,
    JOBSET_GLOBAL_INDEX_LABEL,
    JOBSET_RESTART_ATTEMPT_LABEL,
    KIND,
    KUEUE_PODSET_REQUIRED_TOPOLOGY,
    KUEUE_PODSET_TOPOLOGY_ANNOTATIONS,
    KUEUE_PRIORITY_CLASS_LABEL,
    KUEUE_QUEUE_LABEL,
    LABEL_APP_INSTANCE,
    LABEL_APP_NAME,
    LABEL_JOB_NAME,
    LABEL_MANAGED_BY,
    LABEL_TP_GROUP,
    MANAGED_BY,
    PLURAL,
    SHM_MOUNT,
    SHM_VOLUME,
    TMP_MOUNT,
    TMP_VOLUME,
    TRAINER_APP_NAME,
    TRAINER_CONTAINER,
)
from .rules import derived_layout, resolved_model
from .settings import Settings
from .spec import MegatronJob, MegatronJobSpec, ModelSpec

CONTAINER_NAME = TRAINER_CONTAINER


# Megatron-Core's TransformerConfig.layernorm_epsilon default (and the trainer's --norm-epsilon default).
DEFAULT_NORM_EPSILON = 1e-5

EFA_ENV = {
    # aws-ofi-nccl: use the EFA libfabric provider with GPUDirect RDMA (p4d/p5) and make
    # libfabric's memory registration fork-safe (data-loader workers fork).
    "FI_PROVIDER": "efa",
    "FI_EFA_USE_DEVICE_RDMA": "1",
    "FI_EFA_FORK_SAFE": "1",
}


def labels_for(name: str) -> dict[str, str]:
    """On everything of the job, its pods included (rules: pod-affinity-selects-own-pods reads the same names)."""
    return {LABEL_APP_NAME: TRAINER_APP_NAME, LABEL_APP_INSTANCE: name, LABEL_MANAGED_BY: MANAGED_BY,
            LABEL_JOB_NAME: name}


def service_account_name(name: str) -> str:
    return f"{name}-trainer"


def checkpoint_dir(job: MegatronJob) -> str | None:
    """The checkpoint directory on the PVC; None without one (no checkpoint, or object storage)."""
    ckpt = job.spec.checkpoint
    if ckpt is None or ckpt.pvc is None:
        return None
    return f"{CHECKPOINT_MOUNT}/{ckpt.path or job.metadata.name}"


def hf_export_location(job: MegatronJob) -> str:
    """--hf-export: the directory on the export PVC, or s3://BUCKET/PATH in the checkpoint bucket (whose
    --object-store-endpoint/--object-store-region the trainer uses for both)."""
    export = job.spec.export.hugging_face
    store = job.spec.checkpoint.object_store if export.object_store and job.spec.checkpoint else None
    if store is not None:
        return blocks.object_store.url(store, export.path)
    return blocks.hf.export_dir(job.spec.export)


def checkpoint_location(job: MegatronJob) -> str | None:
    """--save/--load: the PVC directory, or s3://BUCKET/PREFIX for spec.checkpoint.objectStore."""
    ckpt = job.spec.checkpoint
    if ckpt is None:
        return None
    if ckpt.object_store is not None:
        return blocks.object_store.checkpoint_url(ckpt.object_store, job.metadata.name)
    return checkpoint_dir(job)


def shm_size(spec: MegatronJobSpec, settings: Settings) -> str:
    if spec.resources.shm_size is not None:
        return str(spec.resources.shm_size)
    if spec.on_cpu:  # nothing of NCCL's there: 1 GiB a process (data-loader workers), within a CPU pod's memory
        return f"{spec.processes_per_node}Gi"
    return f"{max(settings.shm_min_gib, settings.shm_gib_per_gpu * spec.gpus_per_node)}Gi"


# --------------------------------------------------------------------------------------------
# The trainer's command line
# --------------------------------------------------------------------------------------------


def _fmt(x: float) -> str:
    return repr(float(x))  # round-trips exactly through float()


#: spec.model's MoE fields beyond numExperts and moeRouterTopk, in flag order; each renders as its Megatron flag
#: (the field's name with hyphens): a switch when true, a float as _fmt writes it, anything else as it is.
_MOE_FIELDS = ("moe_ffn_hidden_size", "moe_router_pre_softmax", "moe_router_load_balancing_type", "moe_aux_loss_coeff",
               "moe_z_loss_coeff", "moe_router_dtype", "moe_token_dispatcher_type",
               "moe_shared_expert_intermediate_size", "moe_shared_expert_gate", "moe_router_score_function", "moe_router_enable_expert_bias",
               "moe_router_bias_update_rate", "moe_expert_capacity_factor", "moe_token_drop_policy",
               "moe_pad_expert_input_to_capacity", "moe_layer_freq", "moe_router_num_groups", "moe_router_group_topk",
               "moe_router_topk_scaling_factor")
#: spec.model's multi-head latent attention fields, in flag order, rendered as the MoE ones are (only with MLA).
_MLA_FIELDS = ("q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "rope_type",
               "rotary_scaling_factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale",
               "mscale_all_dim")


def _moe_flags(m: ModelSpec, flag: Callable[..., None], fields: tuple[str, ...] = _MOE_FIELDS) -> None:
    """The MoE block's flags beyond --num-experts and --moe-router-topk (or MLA's), each only when set (unset: the
    trainer's defaults, which are megatron-core's). A list (moeLayerFreq) is one argument, Megatron-LM's spelling:
    [0,1,1]."""
    for name in fields:
        value = getattr(m, name)
        if value is None or value is False:
            continue
        if isinstance(value, list):
            value = "[" + ",".join(str(v) for v in value) + "]"
        flag(name.replace("_", "-"), None if value is True else _fmt(value) if isinstance(value, float) else value)


def megatron_args(job: MegatronJob) -> list[str]:
    """Megatron-LM flags for the spec (the table in docs/trainer-contract.md)."""
    spec = job.spec
    wire = spec.wire()
    model = resolved_model(wire)
    layout = derived_layout(wire)
    par, tr = spec.parallelism, spec.training
    a: list[str] = []

    def flag(name: str, value: Any = None) -> None:
        a.append(f"--{name}")
        if value is not None:
            a.append(str(value))

    # parallelism
    flag("tensor-model-parallel-size", par.tensor)
    flag("pipeline-model-parallel-size", par.pipeline)
    if par.virtual_pipeline is not None:
        flag("num-virtual-stages-per-pipeline-rank", par.virtual_pipeline)
    flag("context-parallel-size", par.context)
    flag("expert-model-parallel-size", par.expert)
    if par.expert_tensor is not None:
        flag("expert-tensor-parallel-size", par.expert_tensor)
    if par.sequence_parallel:
        flag("sequence-parallel")
    elif layout["sequenceParallel"]:  # the default at TP > 1: the trainer turns it on where TE runs
        flag("sequence-parallel-auto")
    # model
    flag("num-layers", model["numLayers"])
    flag("hidden-size", model["hiddenSize"])
    flag("num-attention-heads", model["numAttentionHeads"])
    if model["numQueryGroups"] != model["numAttentionHeads"]:
        flag("group-query-attention")
        flag("num-query-groups", model["numQueryGroups"])
    flag("ffn-hidden-size", model["ffnHiddenSize"])
    flag("seq-length", model["seqLength"])
    flag("max-position-embeddings", model["maxPositionEmbeddings"])
    flag("vocab-size", model["vocabSize"])
    if model["numExperts"]:
        flag("num-experts", model["numExperts"])
        flag("moe-router-topk", model["moeRouterTopk"])
        _moe_flags(spec.model, flag)
    if model["activation"] == "swiglu":
        flag("swiglu")
    flag("normalization", model["normalization"])
    flag("position-embedding-type", model["positionEmbedding"])
    if model["positionEmbedding"] == "rope":
        flag("rotary-base", model["rotaryBase"])
    if model["untieEmbeddings"]:
        flag("untie-embeddings-and-output-weights")
    if not model["addBiasLinear"]:
        flag("disable-bias-linear")
    # The Llama-family fields render only away from Megatron's defaults, so existing jobs render as before.
    if model["normEpsilon"] != DEFAULT_NORM_EPSILON:
        flag("norm-epsilon", _fmt(model["normEpsilon"]))
    heads = model["numAttentionHeads"]
    if spec.model.kv_channels is not None and (model["hiddenSize"] % heads
                                               or model["kvChannels"] != model["hiddenSize"] // heads):
        flag("kv-channels", model["kvChannels"])
    if model["qkLayernorm"]:
        flag("qk-layernorm")
    if model["addQkvBias"]:
        flag("add-qkv-bias")
    if spec.model.rotary_percent is not None:
        flag("rotary-percent", _fmt(spec.model.rotary_percent))
    if model["multiLatentAttention"]:
        flag("multi-latent-attention")
        _moe_flags(spec.model, flag, _MLA_FIELDS)
    if model["ropeScalingFactor"]:
        flag("use-rope-scaling")
        flag("rope-scaling-factor", _fmt(model["ropeScalingFactor"]))
    flag("hidden-dropout", _fmt(spec.model.hidden_dropout))
    flag("attention-dropout", _fmt(spec.model.attention_dropout))
    # training
    flag("transformer-impl", layout["transformerImpl"])  # resolved: vocab/values.impl
    a += blocks.cpu.flags(spec.gpus_per_node)
    flag("attention-backend", tr.attention_backend)
    flag("cuda-graph-impl", {"fullIteration": "full_iteration"}.get(tr.cuda_graph, tr.cuda_graph))
    flag("micro-batch-size", tr.micro_batch_size)
    flag("global-batch-size", layout["globalBatchSize"])
    flag("train-iters", tr.train_iters)
    flag("lr", _fmt(tr.lr))
    flag("min-lr", _fmt(tr.min_lr if tr.min_lr is not None else tr.lr / 10))
    flag("lr-decay-style", tr.lr_schedule.style)
    flag("lr-warmup-iters", tr.lr_schedule.warmup_iters)
    flag("lr-decay-iters", tr.lr_schedule.decay_iters or tr.train_iters)
    flag("weight-decay", _fmt(tr.weight_decay))
    flag("clip-grad", _fmt(tr.clip_grad))
    flag("adam-beta1", _fmt(tr.adam_beta1))
    flag("adam-beta2", _fmt(tr.adam_beta2))
    if tr.precision == "fp16":
        flag("fp16")
    else:
        flag("bf16")
        if tr.precision == "fp8":
            flag("fp8-format", "hybrid")
    if tr.distributed_optimizer:
        flag("use-distributed-optimizer")
    if tr.recompute == "selective":
        flag("recompute-granularity", "selective")
    elif tr.recompute == "full":
        flag("recompute-granularity", "full")
        flag("recompute-method", "uniform")
        flag("recompute-num-layers", 1)
    flag("seed", tr.seed)
    flag("log-interval", tr.log_interval)
    data = spec.data
    sft = data.sft
    flag("eval-iters", sft.eval_iters if sft is not None and sft.valid else 0)
    # data
    ckpt_dir = checkpoint_dir(job)
    if sft is not None:
        flag("data-format", "chat" if data.format == "chat" else "prompt-completion")
        flag("sft-train-path", f"{DATA_MOUNT}/{sft.train}")
        if sft.valid:
            flag("sft-valid-path", f"{DATA_MOUNT}/{sft.valid}")
            if sft.eval_interval:
                flag("eval-interval", sft.eval_interval)
        flag("sft-packing" if sft.packing else "no-sft-packing")
        flag("sft-overflow", sft.overflow)
        flag("sft-invalid-lines", sft.invalid_lines)
        if sft.chat_template:
            flag("chat-template", f"{DATA_MOUNT}/{sft.chat_template}")
        flag("tokenizer-type", "HuggingFaceTokenizer")
        if data.tokenizer is not None:
            flag("tokenizer-model", f"{DATA_MOUNT}/{data.tokenizer.path}")
        else:
            assert spec.init is not None  # rules: data-sft-tokenizer
            flag("tokenizer-model", blocks.hf.init_dir(spec.init))
        flag("data-cache-path", f"{ckpt_dir}/data-cache" if ckpt_dir else "/tmp/data-cache")
    elif data.mock:
        flag("mock-data")
        flag("tokenizer-type", "NullTokenizer")
    else:
        assert data.paths is not None and data.tokenizer is not None  # rules guarantee both
        a.append("--data-path")
        for p in data.paths:
            a += [_fmt(p.weight), f"{DATA_MOUNT}/{p.prefix}"]
        flag("split", data.split)
        if data.tokenizer.type == "HuggingFace":
            flag("tokenizer-type", "HuggingFaceTokenizer")
            flag("tokenizer-model", f"{DATA_MOUNT}/{data.tokenizer.path}")
        else:
            flag("tokenizer-type", "NullTokenizer")
        flag("data-cache-path", f"{ckpt_dir}/data-cache" if ckpt_dir else "/tmp/data-cache")
    # checkpoints
    if spec.checkpoint is not None:
        location = checkpoint_location(job)
        flag("save", location)
        flag("load", location)
        if spec.checkpoint.object_store is not None:
            a += blocks.object_store.flags(spec.checkpoint.object_store)
        flag("save-interval", spec.checkpoint.interval)
        flag("ckpt-format", "torch_dist")
        if spec.checkpoint.async_ and blocks.cpu.saves_async(spec.gpus_per_node):
            # Megatron-LM silently drops --async-save without the persistent worker (arguments.validate_args).
            flag("async-save")
            flag("use-persistent-ckpt-worker")
        flag("exit-signal-handler")
        if spec.logging.tensorboard:
            flag("tensorboard-dir", f"{ckpt_dir}/tensorboard")
    # Weights & Biases: names and where the files go; the key only as a path (the block's Secret volume)
    if spec.logging.wandb is not None:
        a += blocks.wandb.flags(spec.logging.wandb, job.metadata.name, ckpt_dir)
    # Hugging Face import/export
    a += blocks.hf.flags(spec.init, hf_export_location(job) if spec.export is not None else None)
    return a + list(tr.extra_args)


#: Seconds of terminationGracePeriodSeconds the launcher keeps back: after its own SIGKILL of the
#: workers it still has to exit before the kubelet's.
LAUNCH_GRACE_MARGIN_S = 10


def termination_grace_s(spec: MegatronJobSpec, settings: Settings) -> int:
    return spec.termination_grace_period_seconds or settings.termination_grace_period_s


def launcher_grace_s(spec: MegatronJobSpec, settings: Settings) -> int:
    """The launcher's SIGTERM -> SIGKILL budget: the pod's grace period less the margin (at most a third)."""
    grace = termination_grace_s(spec, settings)
    return max(1, grace - min(LAUNCH_GRACE_MARGIN_S, grace // 3))


def launch_command(job: MegatronJob, settings: Settings, first_replicated_job: str) -> list[str]:
    """The trainer's launcher with a static rendezvous on pod 0 (node rank = JobSet's global job index).

    `megatron_trainer.launch`, not torchrun: torchrun SIGKILLs its workers 30 s after SIGTERM
    whatever the pod's grace period; the launcher waits the grace period less a margin."""
    name = job.metadata.name
    spec = job.spec
    # JobSet pod host names are <jobset>-<replicated job>-<job index>-<pod index>, in the JobSet's
    # headless-service subdomain (the JobSet's name).
    master = f"{name}-{first_replicated_job}-0-0.{name}"
    return [
        "python", "-m", "megatron_trainer.launch",
        f"--nnodes={spec.num_nodes}",
        f"--nproc-per-node={spec.processes_per_node}",
        "--node-rank=$(NODE_RANK)",
        f"--master-addr={master}",
        f"--master-port={settings.rendezvous_port}",
        f"--grace-period-s={launcher_grace_s(spec, settings)}",
        "-m", "megatron_trainer",  # restarts are the JobSet's: the whole gang, from the checkpoint
        *megatron_args(job),
    ]


# --------------------------------------------------------------------------------------------
# Kubernetes objects
# --------------------------------------------------------------------------------------------


def owner_reference(job: MegatronJob, uid: str) -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": KIND, "name": job.metadata.name, "uid": uid,
            "controller": True, "blockOwnerDeletion": True}


def _meta(job: MegatronJob, name: str, owner_uid: str | None, labels: dict[str, str] | None = None) -> dict:
    meta: dict[str, Any] = {"name": name, "labels": {**labels_for(job.metadata.name), **(labels or {})}}
    if job.metadata.namespace:
        meta["namespace"] = job.metadata.namespace
    if owner_uid:
        meta["ownerReferences"] = [owner_reference(job, owner_uid)]
    return meta


def _env(job: MegatronJob, settings: Settings, layout: dict[str, Any]) -> list[dict[str, Any]]:
    spec = job.spec

    def field_ref(path: str) -> dict[str, Any]:
        return {"valueFrom": {"fieldRef": {"fieldPath": path}}}

    env: list[dict[str, Any]] = [
        {"name": "NODE_RANK", **field_ref(f"metadata.labels['{JOBSET_GLOBAL_INDEX_LABEL}']")},
        {"name": "MEGATRON_RESTART_ATTEMPT", **field_ref(f"metadata.labels['{JOBSET_RESTART_ATTEMPT_LABEL}']")},
        {"name": "MEGATRON_JOB_NAME", "value": job.metadata.name},
        {"name": "MEGATRON_JOB_NAMESPACE", **field_ref("metadata.namespace")},
        {"name": "MEGATRON_PROGRESS_INTERVAL_S", "value": str(settings.progress_interval_s)},
        {"name": "MEGATRON_METRICS_PORT", "value": str(settings.trainer_metrics_port)},
        {"name": "MEGATRON_CHECKPOINT_KEEP", "value": str(spec.checkpoint.keep if spec.checkpoint else 0)},
        {"name": "MEGATRON_DATA_CACHE_SHARED", "value": "true" if checkpoint_dir(job) else "false"},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
        # The root filesystem is read-only: caches (triton, torch) go to the /tmp emptyDir.
        {"name": "HOME", "value": "/tmp"},
    ]
    if layout["tensor"] > 1 or layout["context"] > 1:
        # Megatron-LM asserts this with TP or CP > 1 on Hopper and earlier (arguments.validate_args): it keeps
        # the communication kernels ordered before the compute they overlap with.
        env.append({"name": "CUDA_DEVICE_MAX_CONNECTIONS", "value": "1"})
    if spec.resources.efa_per_node > 0:
        env += [{"name": k, "value": v} for k, v in EFA_ENV.items()]
    env += blocks.object_store.env(spec.checkpoint.object_store if spec.checkpoint else None)
    env += [e.model_dump(by_alias=True, exclude_none=True, mode="json") for e in spec.env]
    return env


def _resources(spec: MegatronJobSpec) -> dict[str, Any]:
    r = spec.resources
    limits: dict[str, Any] = {GPU_RESOURCE: spec.gpus_per_node} if spec.gpus_per_node else {}  # 0: a CPU job
    if r.efa_per_node:
        limits[EFA_RESOURCE] = r.efa_per_node
    limits.update(r.extended_resources)
    requests: dict[str, Any] = {}
    for key, value in (("cpu", r.cpu), ("memory", r.memory)):
        if value is not None:
            limits[key] = requests[key] = str(value)
    out: dict[str, Any] = {"limits": limits}
    if requests:
        out["requests"] = requests
    return out


def _volumes(spec: MegatronJobSpec, settings: Settings) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """The trainer pod's own volumes (names.OPERATOR_VOLUME_MOUNTS), each with the trainer container's mount of it,
    in the order the pod lists them; spec.pod's come after them (blocks/pod.py)."""
    out = [
        # NCCL, data-loader workers and async checkpoints need far more than the 64 MiB default.
        ({"name": SHM_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": shm_size(spec, settings)}},
         {"name": SHM_VOLUME, "mountPath": SHM_MOUNT}),
        ({"name": TMP_VOLUME, "emptyDir": {}}, {"name": TMP_VOLUME, "mountPath": TMP_MOUNT}),
    ]
    if spec.checkpoint is not None and spec.checkpoint.pvc is not None:
        out.append(({"name": CHECKPOINT_VOLUME, "persistentVolumeClaim": {"claimName": spec.checkpoint.pvc}},
                    {"name": CHECKPOINT_VOLUME, "mountPath": CHECKPOINT_MOUNT}))
    out += blocks.object_store.volumes(spec.checkpoint.object_store if spec.checkpoint else None)
    out += blocks.wandb.volumes(spec.logging.wandb)
    if spec.data.pvc is not None:
        out.append(({"name": DATA_VOLUME, "persistentVolumeClaim": {"claimName": spec.data.pvc, "readOnly": True}},
                    {"name": DATA_VOLUME, "mountPath": DATA_MOUNT, "readOnly": True}))
    out += blocks.hf.volumes(spec.init, spec.export)
    return _one_volume_per_claim(out)


def _one_volume_per_claim(pairs: list[tuple[dict[str, Any], dict[str, Any]]]
                          ) -> list[tuple[dict[str, Any] | None, dict[str, Any]]]:
    """One pod volume per PersistentVolumeClaim, its mounts keeping their own readOnly: a claim two of the pod's
    volumes name (the Hugging Face source and the export on one PVC; data and checkpoints on one) is counted twice
    by kube-scheduler's volume binding (1.36.3), and while the claim is unbound on a WaitForFirstConsumer storage
    class the pod never schedules ("didn't find available persistent volumes to bind"; seen on the real node,
    e2e/test_real_training.py). Later volumes of a claim become None: their mount names the first one, which is
    read-write if any of them is."""
    first: dict[str, dict[str, Any]] = {}
    out: list[tuple[dict[str, Any] | None, dict[str, Any]]] = []
    for volume, mount in pairs:
        claim = (volume.get("persistentVolumeClaim") or {}).get("claimName")
        if claim is None or claim not in first:
            if claim is not None:
                first[claim] = volume
            out.append((volume, mount))
            continue
        kept = first[claim]
        if not volume["persistentVolumeClaim"].get("readOnly"):
            kept["persistentVolumeClaim"].pop("readOnly", None)
        out.append((None, {**mount, "name": kept["name"]}))
    return out


def _pod_spec(job: MegatronJob, settings: Settings, layout: dict[str, Any], first_rjob: str,
              tp_group: int | None, avoid_nodes: Sequence[str] = ()) -> dict[str, Any]:
    spec = job.spec
    name = job.metadata.name
    own = _volumes(spec, settings)
    volumes, mounts = [v for v, _ in own if v is not None], [m for _, m in own]
    container: dict[str, Any] = {
        "name": CONTAINER_NAME,
        "image": spec.image or settings.default_image,
        "command": launch_command(job, settings, first_rjob),
        "env": _env(job, settings, layout),
        "resources": _resources(spec),
        "ports": [
            {"name": "rendezvous", "containerPort": settings.rendezvous_port, "protocol": "TCP"},
            {"name": "metrics", "containerPort": settings.trainer_metrics_port, "protocol": "TCP"},
        ],
        "volumeMounts": mounts,
        # The trainer writes its fatal error there; without one, the log's last lines are kept.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
    }
    tolerations = [{"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}]
    tolerations += [t.model_dump(by_alias=True, exclude_none=True) for t in spec.resources.tolerations]
    pod: dict[str, Any] = {
        "serviceAccountName": service_account_name(name),
        "automountServiceAccountToken": True,  # the trainer writes status.progress with this identity
        "enableServiceLinks": False,
        # Never: a failed rank fails its Job, and the JobSet restarts the whole gang (a lone restarted
        # rank would only hang in NCCL waiting for peers that moved on).
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": termination_grace_s(spec, settings),
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": settings.run_as_user,
            "runAsGroup": settings.run_as_user,
            "fsGroup": settings.run_as_user,
            "fsGroupChangePolicy": "OnRootMismatch",
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [container],
        "volumes": volumes,
        "tolerations": tolerations,
    }
    if spec.resources.node_selector:
        pod["nodeSelector"] = dict(spec.resources.node_selector)
    if spec.image_pull_secrets:
        pod["imagePullSecrets"] = [{"name": s} for s in spec.image_pull_secrets]
    if spec.priority_class_name:
        pod["priorityClassName"] = spec.priority_class_name
    affinity: dict[str, Any] = {}
    if tp_group is not None:
        # This tensor-parallel group spans several pods: keep exactly these pods on one host
        # (NVLink). Other groups are free to land elsewhere, and prefer to: a group's first pod that
        # lands next to another group of the job can take the room that group's next pod needs, and
        # then both wait forever (the scheduler places pod by pod; only Kueue's topology-aware
        # scheduling places a group as a whole, docs/kueue.md).
        affinity["podAffinity"] = {"requiredDuringSchedulingIgnoredDuringExecution": [{
            "labelSelector": {"matchLabels": {LABEL_JOB_NAME: name, LABEL_TP_GROUP: str(tp_group)}},
            "topologyKey": "kubernetes.io/hostname",
        }]}
        affinity["podAntiAffinity"] = {"preferredDuringSchedulingIgnoredDuringExecution": [{
            "weight": 100,
            "podAffinityTerm": {
                "labelSelector": {"matchLabels": {LABEL_JOB_NAME: name},
                                  "matchExpressions": [{"key": LABEL_TP_GROUP, "operator": "NotIn",
                                                        "values": [str(tp_group)]}]},
                "topologyKey": "kubernetes.io/hostname",
            },
        }]}
    if avoid_nodes:
        # Nodes an earlier attempt of this job failed on for the node's sake (status.avoidedNodes).
        affinity["nodeAffinity"] = {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{
            "matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": sorted(set(avoid_nodes))}],
        }]}}
    if spec.pod is not None:
        blocks.pod.add_to_pod(pod, container, spec.pod, affinity)
    if affinity:
        pod["affinity"] = affinity
    return pod


def replicated_job_plan(spec: MegatronJobSpec) -> list[tuple[str, int, int | None]]:
    """(replicated job name, replicas, tensor-parallel group or None), in node-rank order.

    Megatron orders ranks tp-cp-ep-dp-pp (parallel_state.initialize_model_parallel), so TP is
    the fastest-varying dimension and a TP group is TP consecutive global ranks; torchrun numbers
    ranks node-major (rank = node_rank x gpusPerNode + local_rank). When TP divides gpusPerNode,
    every TP group therefore lies inside one pod and needs no placement rule. When TP is a multiple
    of gpusPerNode, group g is exactly the pods with node ranks [g*k, (g+1)*k), k = TP/gpusPerNode;
    each group gets its own replicated job so that its pods carry a group label for pod affinity,
    and JobSet's global job index (the node rank) runs through the groups in order.
    """
    tp, gpn = spec.parallelism.tensor, spec.processes_per_node
    if tp <= gpn:
        return [("worker", spec.num_nodes, None)]
    pods_per_group = tp // gpn
    return [(f"tp{g}", pods_per_group, g) for g in range(spec.num_nodes // pods_per_group)]


def parallelism_key(job: MegatronJob) -> str:
    """spec.parallelism as the JobSet's ANNOTATION_PARALLELISM records it (compact JSON, sorted keys, no nulls)."""
    wire = job.spec.wire().get("parallelism") or {}
    return json.dumps({k: v for k, v in sorted(wire.items()) if v is not None}, separators=(",", ":"))


def render_jobset(job: MegatronJob, settings: Settings, owner_uid: str | None = None,
                  avoid_nodes: Sequence[str] = ()) -> dict[str, Any]:
    """The JobSet; ``avoid_nodes``: nodes its pods must not be scheduled on (status.avoidedNodes)."""
    spec = job.spec
    name = job.metadata.name
    layout = derived_layout(spec.wire())
    plan = replicated_job_plan(spec)
    first_rjob = plan[0][0]
    replicated_jobs = []
    for rjob_name, replicas, tp_group in plan:
        pod_labels = {**spec.pod_metadata.labels, **labels_for(name)}
        if tp_group is not None:
            pod_labels[LABEL_TP_GROUP] = str(tp_group)
        annotations = dict(spec.pod_metadata.annotations)
        if tp_group is not None and spec.queue_name and settings.kueue_tp_group_topology \
                and not any(k in annotations for k in KUEUE_PODSET_TOPOLOGY_ANNOTATIONS):
            # Each group is a replicated job, i.e. a Kueue PodSet: Kueue's TAS admits the job only when
            # every group fits on one host and pins the pods there (no group split across hosts waiting
            # forever for room next to its first pod). A topology the user asked for wins.
            annotations[KUEUE_PODSET_REQUIRED_TOPOLOGY] = settings.kueue_tp_group_topology
        replicated_jobs.append({
            "name": rjob_name,
            "replicas": replicas,
            "template": {
                "metadata": {"labels": labels_for(name)},
                "spec": {
                    "parallelism": 1,
                    "completions": 1,
                    "completionMode": "Indexed",
                    "backoffLimit": 0,
                    # A pod evicted or preempted (DisruptionTarget) fails its Job with reason
                    # PodFailurePolicy; the JobSet rule below restarts the gang without counting it.
                    "podFailurePolicy": {"rules": [{
                        "action": "FailJob",
                        "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}],
                    }, {
                        # The trainer's non-retriable exit codes (failures.py): the JobSet rule
                        # nonRetriableExitCode fails the whole job at once.
                        "action": "FailJob",
                        "onExitCodes": {"containerName": CONTAINER_NAME, "operator": "In",
                                        "values": sorted(NON_RETRIABLE_EXIT_CODES)},
                    }]},
                    "template": {
                        "metadata": {"labels": pod_labels, **({"annotations": annotations} if annotations else {})},
                        "spec": _pod_spec(job, settings, layout, first_rjob, tp_group, avoid_nodes),
                    },
                },
            },
        })
    max_restarts = spec.restart.max_restarts
    labels = {}
    if spec.queue_name:
        labels[KUEUE_QUEUE_LABEL] = spec.queue_name
    if spec.workload_priority_class:
        labels[KUEUE_PRIORITY_CLASS_LABEL] = spec.workload_priority_class
    meta = _meta(job, name, owner_uid, labels)
    meta["annotations"] = {ANNOTATION_PARALLELISM: parallelism_key(job)}
    return {
        "apiVersion": JOBSET_API_VERSION,
        "kind": "JobSet",
        "metadata": meta,
        "spec": {
            # With Kueue the JobSet is created suspended and Kueue un-suspends it on admission.
            "suspend": bool(spec.suspend or spec.queue_name),
            "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True, "subdomain": name},
            "failurePolicy": {
                "maxRestarts": settings.max_restarts if max_restarts is None else max_restarts,
                # Old pods are gone before new ones start, so no rank talks to a stale peer.
                "restartStrategy": "BlockingRecreate",
                "rules": [{
                    "name": FAIL_RULE_NAME,
                    "action": "FailJobSet",
                    "onJobFailureReasons": ["PodFailurePolicy"],
                    "onJobFailureMessagePatterns": [FAIL_MESSAGE_PATTERN],
                }, {
                    "name": "disruptionDoesNotCount",
                    "action": "RestartJobSetAndIgnoreMaxRestarts",
                    "onJobFailureReasons": ["PodFailurePolicy"],
                }],
            },
            "successPolicy": {"operator": "All"},
            "replicatedJobs": replicated_jobs,
        },
    }


def render_identity(job: MegatronJob, owner_uid: str | None = None) -> list[dict[str, Any]]:
    """The job's own ServiceAccount, allowed to patch only its MegatronJob's status."""
    name = job.metadata.name
    sa = service_account_name(name)
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _sa_meta(job, sa, owner_uid),
         "automountServiceAccountToken": True},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": _meta(job, sa, owner_uid),
         "rules": [{"apiGroups": [GROUP], "resources": [f"{PLURAL}/status"], "resourceNames": [name],
                    "verbs": ["get", "patch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": _meta(job, sa, owner_uid),
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": sa},
         "subjects": [{"kind": "ServiceAccount", "name": sa,
                       **({"namespace": job.metadata.namespace} if job.metadata.namespace else {})}]},
    ]


def _sa_meta(job: MegatronJob, sa: str, owner_uid: str | None) -> dict[str, Any]:
    """The ServiceAccount's metadata, with spec.checkpoint.objectStore's workload-identity annotations."""
    meta = _meta(job, sa, owner_uid)
    store = job.spec.checkpoint.object_store if job.spec.checkpoint else None
    if annotations := blocks.object_store.service_account_annotations(store):
        meta["annotations"] = {**meta.get("annotations", {}), **annotations}
    return meta


def render(job: MegatronJob, settings: Settings | None = None, owner_uid: str | None = None,
           avoid_nodes: Sequence[str] = ()) -> list[dict[str, Any]]:
    """Every object the operator creates for ``job``, in apply order."""
    settings = settings or Settings()
    return [*render_identity(job, owner_uid), render_jobset(job, settings, owner_uid, avoid_nodes)]
