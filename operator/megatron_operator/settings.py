"""Operator-wide defaults and knobs, in one place (pure; read from the environment at start-up).

Every field can be set with an environment variable ``MEGATRON_OPERATOR_<FIELD IN UPPER CASE>``
(the Helm chart sets them from its values). A spec field, where it exists, always wins.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, fields

from . import __version__
from .vocab.patterns import QUALIFIED_NAME_RE

#: Pod annotation/label key prefixes refused by default: AppArmor and seccomp profile annotations
#: (e.g. `unconfined`), kube2iam/kiam's IAM role annotation, Azure Workload Identity's pod label.
DEFAULT_DENIED_METADATA_KEYS = ("container.apparmor.security.beta.kubernetes.io/,seccomp.security.alpha.kubernetes.io/,"
                                "iam.amazonaws.com/,azure.workload.identity/")


@dataclass(frozen=True)
class Settings:
    #: Trainer image when ``spec.image`` is omitted.
    default_image: str = f"ghcr.io/megatron-operator/megatron-trainer:{__version__}"
    #: /dev/shm per GPU when ``spec.resources.shmSize`` is omitted (GiB) ...
    shm_gib_per_gpu: int = 8
    #: ... and never less than this (GiB).
    shm_min_gib: int = 16
    #: ``terminationGracePeriodSeconds`` when the spec has none: time for a checkpoint on SIGTERM.
    termination_grace_period_s: int = 600
    #: Gang restarts when ``spec.restart.maxRestarts`` is omitted.
    max_restarts: int = 3
    #: Seconds between the trainer's progress writes to ``status.progress``.
    progress_interval_s: int = 30
    #: Port of the trainer's Prometheus endpoint.
    trainer_metrics_port: int = 9400
    #: the trainer launcher's rendezvous port (TCP store) on pod 0.
    rendezvous_port: int = 29500
    #: A Running job whose ``status.progress.iteration`` has not moved for this long is ``Stalled``.
    stall_timeout_s: int = 1800
    #: UID/GID the trainer runs as (non-root).
    run_as_user: int = 1000
    #: Seconds between status re-derivations of a live job (a timer; events also trigger it).
    resync_interval_s: float = 10.0
    #: Port of the operator's /metrics and /healthz.
    metrics_port: int = 8080
    #: Address /metrics and /healthz bind to.
    metrics_host: str = "0.0.0.0"
    #: Node label of one host in the Kueue Topology of the cluster's GPU ResourceFlavors (e.g.
    #: kubernetes.io/hostname), or empty. When set, a queued job whose tensor-parallel groups span
    #: several pods asks Kueue's topology-aware scheduling to place each group on one host
    #: (kueue.x-k8s.io/podset-required-topology on each group's replicated job): the job is admitted only
    #: when every group fits on a host, and waits in the queue, holding no GPUs, until then. Only for
    #: clusters whose GPU flavors all have a topologyName: on a flavor without one Kueue cannot admit it.
    kueue_tp_group_topology: str = ""
    #: Seconds a job may stay deadlocked by its own tensor-parallel groups before its JobSet is created again: two
    #: groups whose first pods started on one host that has room for only one of them (``status.tp_group_collision``;
    #: the scheduler places pod by pod and nothing moves them apart). Doubles for each further re-placement of the
    #: same job, up to 8x, until it runs. 0: never (the job waits until that host frees room).
    tp_group_collision_s: int = 30
    #: Namespaces to watch (comma-separated); empty watches the whole cluster.
    namespaces: str = ""
    # Guardrails (guardrails.py): what a job may ask for on this cluster. Empty/0/false: no limit.
    # The defaults close what is dangerous on any shared cluster and needed by no training job (pod
    # identity and confinement annotations, hour-long grace periods); the rest is the admin's choice.
    #: Image registries (comma-separated prefixes, e.g. nvcr.io,registry.example.com/ml) spec.image may use.
    allowed_image_registries: str = ""
    #: PriorityClasses spec.priorityClassName may name (comma-separated).
    allowed_priority_classes: str = ""
    #: Toleration keys spec.resources.tolerations may use (comma-separated).
    allowed_toleration_keys: str = ""
    #: Node label keys spec.resources.nodeSelector may use (comma-separated).
    allowed_node_selector_keys: str = ""
    #: The largest spec.terminationGracePeriodSeconds (0: the schema's 86400).
    max_termination_grace_period_s: int = 3600
    #: Every job must name a Kueue LocalQueue (spec.queueName): no Kueue bypass.
    require_queue_name: bool = False
    #: Refuse spec.env entries with valueFrom.secretKeyRef, and spec.checkpoint.objectStore.credentialsSecret.
    deny_secret_env: bool = False
    #: Refuse spec.imagePullSecrets.
    deny_image_pull_secrets: bool = False
    #: The volume types spec.pod.volumes may use (comma-separated; of persistentVolumeClaim, configMap, secret,
    #: emptyDir, csi, image, hostPath). Enforced also when empty: then no extra volume at all.
    allowed_volume_types: str = "persistentVolumeClaim,configMap,secret,emptyDir"
    #: Images whose init containers and sidecars (spec.pod.initContainers) may run privileged or add capabilities
    #: (comma-separated; an image, or a path prefix). Empty: none may.
    allowed_privileged_images: str = ""
    #: Pod label/annotation key prefixes spec.podMetadata may not use (comma-separated, case-insensitive),
    #: e.g. container.apparmor.security.beta.kubernetes.io/,eks.amazonaws.com/,app
    denied_metadata_keys: str = DEFAULT_DENIED_METADATA_KEYS

    def __post_init__(self) -> None:
        if self.tp_group_collision_s < 0:
            raise ValueError(f"tp_group_collision_s {self.tp_group_collision_s} is negative (0 turns the re-placement off)")
        label = self.kueue_tp_group_topology
        if label and not re.fullmatch(QUALIFIED_NAME_RE, label):
            raise ValueError(f"kueue_tp_group_topology {label!r} is not a node label key (e.g. kubernetes.io/hostname)")

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, **overrides: object) -> Settings:
        """The defaults, then the environment, then ``overrides`` (the command line's flags; None is unset)."""
        env = os.environ if environ is None else environ
        values: dict[str, object] = {}
        for f in fields(cls):
            key = "MEGATRON_OPERATOR_" + f.name.upper()
            if key in env:
                raw = env[key]
                try:
                    kind = type(getattr(cls, f.name))
                    if kind is bool:  # bool("false") is True
                        if raw.strip().lower() not in ("true", "false", "1", "0", ""):
                            raise ValueError("use true or false")
                        values[f.name] = raw.strip().lower() in ("true", "1")
                        continue
                    values[f.name] = kind(raw)
                except ValueError as exc:
                    raise ValueError(f"{key}={raw!r}: {exc}") from None
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)  # type: ignore[arg-type]

    def watched_namespaces(self) -> list[str]:
        return [n.strip() for n in self.namespaces.split(",") if n.strip()]
