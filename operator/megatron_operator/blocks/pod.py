"""spec.pod: what a platform team adds to every trainer pod (docs/pod-customization.md): volumes and the
trainer's mounts of them, init containers and native sidecars, affinity and topology spread.

The block's room: its schema, its admission rules, the cluster admin's guardrails on it and its part of the
rendered pod. The schema has the shape of core/v1 and of Kubeflow Trainer's PodSpecPatch, restricted to what a
training job needs. hostPath, privilege and added capabilities exist here only so that the cluster's
guardrails can refuse them by default and an admin can allow them by name; host namespaces, the pod's
ServiceAccount and projected tokens are not fields at all.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any, Literal

from pydantic import Field

from ..expr import All, Expr, Filter, Get, Has, In, Index, Matches, Size, Var, cond, fmt, lit
from ..expr import Field as ExprField
from ..names import (
    FIXED_JOB_LABELS,
    JOB_NAME_VALUED_LABELS,
    LABEL_JOB_NAME,
    NVIDIA_DEVICE_LIST_MOUNTS,
    OPERATOR_MOUNTS,
    OPERATOR_VOLUMES,
    SERVICE_ACCOUNT_MOUNT,
    SYSTEM_MOUNTS,
    TRAINER_CONTAINER,
    TRAINER_TOKEN_VOLUME,
    VOLUME_TYPES,
)
from ..settings import Settings
from ..vocab.api import ApiModel, EnvVar, Quantity
from ..vocab.guardrail import Guardrail, Violation, listed, registry_ok
from ..vocab.patterns import (
    ABS_PATH,
    CONFIG_KEY,
    CREDENTIAL_ENV_RE,
    DNS_LABEL,
    GPU_DEVICE_ENV,
    GPU_DEVICE_ENV_RE,
    KEY_TO_PATH,
    LABEL_VALUE,
    QUALIFIED_NAME_RE,
    REL_PATH,
    URL_USERINFO_RE,
)
from ..vocab.rule import Rule, count_present, first_attr, unique_by
from ..vocab.values import f, has

_REQ, _PREF = "requiredDuringSchedulingIgnoredDuringExecution", "preferredDuringSchedulingIgnoredDuringExecution"


# --------------------------------------------------------------------------------------------
# Schema
# --------------------------------------------------------------------------------------------


# A container image reference: no whitespace or control characters (the registry guardrail compares prefixes).
IMAGE_REF = r"^[A-Za-z0-9][A-Za-z0-9._/:@+-]*$"
# Linux capability names as the container runtime takes them (CAP_ prefix optional).
CAPABILITY = r"^[A-Z][A-Z0-9_]*$"


class KeyToPath(ApiModel):
    """One key of a ConfigMap or Secret as a file."""

    key: str = Field(..., max_length=253, pattern=CONFIG_KEY)
    path: str = Field(..., min_length=1, max_length=253, pattern=KEY_TO_PATH, description="File path inside the "
                      "volume (relative, no '..' part, not starting with '..').")


class ConfigMapVolume(ApiModel):
    name: str = Field(..., max_length=253, pattern=DNS_LABEL, description="ConfigMap in the job's namespace.")
    items: list[KeyToPath] = Field(default_factory=list, max_length=32, description="Keys to project (default: all).")
    default_mode: int | None = Field(None, ge=0, le=0o777, description="File mode bits (decimal in JSON).")
    optional: bool | None = None


class SecretVolume(ApiModel):
    secret_name: str = Field(..., max_length=253, pattern=DNS_LABEL, description="Secret in the job's namespace.")
    items: list[KeyToPath] = Field(default_factory=list, max_length=32, description="Keys to project (default: all).")
    default_mode: int | None = Field(None, ge=0, le=0o777, description="File mode bits (decimal in JSON).")
    optional: bool | None = None


class PvcVolume(ApiModel):
    claim_name: str = Field(..., max_length=253, pattern=DNS_LABEL, description="PersistentVolumeClaim in the "
                            "job's namespace (e.g. a dataset on NFS or a CSI share).")
    read_only: bool | None = None


class EmptyDirVolume(ApiModel):
    medium: Literal["", "Memory"] | None = None
    size_limit: Quantity | None = None


class CsiVolume(ApiModel):
    """A CSI ephemeral inline volume (the driver must support the Ephemeral lifecycle mode)."""

    driver: str = Field(..., max_length=63, pattern=r"^[A-Za-z0-9]([-A-Za-z0-9.]*[A-Za-z0-9])?$")
    read_only: bool | None = None
    fs_type: str | None = Field(None, max_length=32, pattern=r"^[a-z0-9]+$")
    volume_attributes: dict[Annotated[str, Field(max_length=253)], Annotated[str, Field(max_length=1024)]] = Field(
        default_factory=dict, max_length=16)


class ImageVolume(ApiModel):
    """An OCI image or artifact mounted read-only (Kubernetes' ImageVolume feature, where the cluster has it)."""

    reference: str = Field(..., max_length=512, pattern=IMAGE_REF)
    pull_policy: Literal["Always", "Never", "IfNotPresent"] | None = None


class HostPathVolume(ApiModel):
    """A directory or file of the node. Refused unless the cluster admin allows the type
    (guardrails.allowedVolumeTypes); never without a type (pod-host-path-type) nor on, inside or above the node's
    devices, kernel interfaces, runtime sockets and state (pod-host-path-not-system)."""

    path: str = Field(..., max_length=512, pattern=ABS_PATH)
    # No "" (the core/v1 default, HostPathUnset) and no Socket, CharDevice or BlockDevice: the kubelet checks the
    # path is of the type given before it mounts it (pkg/volume/hostpath/host_path.go, checkType), and an unset
    # type checks nothing, so /run/containerd/containerd.sock or /dev/nvidia0 would be mounted as they are.
    type: Literal["Directory", "DirectoryOrCreate", "File", "FileOrCreate"] | None = Field(
        None, description="Required: Directory, DirectoryOrCreate, File or FileOrCreate (the kubelet checks the path "
        "is one before mounting it; no socket or device node).")


class Volume(ApiModel):
    """A volume of the trainer pods: a name and exactly one source."""

    name: str = Field(..., max_length=63, pattern=DNS_LABEL)
    persistent_volume_claim: PvcVolume | None = None
    config_map: ConfigMapVolume | None = None
    secret: SecretVolume | None = None
    empty_dir: EmptyDirVolume | None = None
    csi: CsiVolume | None = None
    image: ImageVolume | None = None
    host_path: HostPathVolume | None = None

    def volume_type(self) -> str:
        return next((t for t in VOLUME_TYPES if self.wire().get(t) is not None), "")


class VolumeMount(ApiModel):
    name: str = Field(..., max_length=63, pattern=DNS_LABEL, description="A volume of spec.pod.volumes.")
    mount_path: str = Field(..., max_length=256, pattern=ABS_PATH, description="Absolute path in the container; "
                            "never on or around the operator's own mounts (/dev/shm, /tmp, /checkpoints, /data, "
                            "/hf-init, /hf-export, /var/run/secrets/...).")
    read_only: bool | None = None
    sub_path: str | None = Field(None, max_length=256, pattern=REL_PATH)


class ResourceAmounts(ApiModel):
    cpu: Quantity | None = None
    memory: Quantity | None = None
    ephemeral_storage: Quantity | None = Field(None, alias="ephemeral-storage")


class ContainerResources(ApiModel):
    requests: ResourceAmounts | None = None
    limits: ResourceAmounts | None = None


class Capabilities(ApiModel):
    add: list[Annotated[str, Field(max_length=64, pattern=CAPABILITY)]] = Field(
        default_factory=list, max_length=16, description="Refused unless the container's image is in "
        "guardrails.allowedPrivilegedImages. Every other capability is dropped.")


class ContainerSecurityContext(ApiModel):
    """The container runs as the pod does (non-root, uid 1000, seccomp RuntimeDefault, all capabilities
    dropped, no privilege escalation) unless it says otherwise here."""

    run_as_user: int | None = Field(None, ge=1, le=2147483647, description="A non-root uid.")
    run_as_group: int | None = Field(None, ge=1, le=2147483647, description="A non-root gid.")
    read_only_root_filesystem: bool | None = None
    privileged: bool | None = Field(None, description="Refused unless the container's image is in "
                                    "guardrails.allowedPrivilegedImages.")
    capabilities: Capabilities | None = None


class PodContainer(ApiModel):
    """An init container of the trainer pods; with restartPolicy Always, a native sidecar that runs beside the
    trainer for the pod's life and never holds the job back (the pod completes when the trainer does)."""

    name: str = Field(..., max_length=63, pattern=DNS_LABEL)
    image: str = Field(..., max_length=512, pattern=IMAGE_REF)
    restart_policy: Literal["Always"] | None = Field(None, description="Always: a sidecar (starts before the "
                                                     "trainer, stopped after it).")
    command: list[Annotated[str, Field(max_length=4096)]] = Field(default_factory=list, max_length=64)
    args: list[Annotated[str, Field(max_length=4096)]] = Field(default_factory=list, max_length=64)
    working_dir: str | None = Field(None, max_length=256, pattern=ABS_PATH)
    env: list[EnvVar] = Field(default_factory=list, max_length=32)
    volume_mounts: list[VolumeMount] = Field(default_factory=list, max_length=16, description="Mounts of "
                                             "spec.pod.volumes.")
    resources: ContainerResources | None = None
    security_context: ContainerSecurityContext | None = None


LabelKey = Annotated[str, Field(max_length=316, pattern=QUALIFIED_NAME_RE)]
LabelValue = Annotated[str, Field(max_length=63, pattern=LABEL_VALUE)]


class LabelSelectorRequirement(ApiModel):
    key: LabelKey
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"]
    values: list[LabelValue] = Field(default_factory=list, max_length=32)


class LabelSelector(ApiModel):
    match_labels: dict[LabelKey, LabelValue] = Field(default_factory=dict, max_length=16)
    match_expressions: list[LabelSelectorRequirement] = Field(default_factory=list, max_length=16)


class NodeSelectorRequirement(ApiModel):
    key: LabelKey
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt"]
    values: list[LabelValue] = Field(default_factory=list, max_length=32)


class NodeSelectorTerm(ApiModel):
    match_expressions: list[NodeSelectorRequirement] = Field(default_factory=list, max_length=16)


class NodeSelector(ApiModel):
    node_selector_terms: list[NodeSelectorTerm] = Field(..., min_length=1, max_length=8)


class PreferredSchedulingTerm(ApiModel):
    weight: int = Field(..., ge=1, le=100)
    preference: NodeSelectorTerm


class NodeAffinity(ApiModel):
    required_during_scheduling_ignored_during_execution: NodeSelector | None = None
    preferred_during_scheduling_ignored_during_execution: list[PreferredSchedulingTerm] = Field(
        default_factory=list, max_length=8)


class PodAffinityTerm(ApiModel):
    """Pods of the job's own namespace only (no namespaces or namespaceSelector)."""

    label_selector: LabelSelector
    topology_key: LabelKey


class WeightedPodAffinityTerm(ApiModel):
    weight: int = Field(..., ge=1, le=100)
    pod_affinity_term: PodAffinityTerm


class PodAffinity(ApiModel):
    required_during_scheduling_ignored_during_execution: list[PodAffinityTerm] = Field(default_factory=list,
                                                                                      max_length=8)
    preferred_during_scheduling_ignored_during_execution: list[WeightedPodAffinityTerm] = Field(
        default_factory=list, max_length=8)


class Affinity(ApiModel):
    """Merged with the operator's own rules (a tensor-parallel group's pods on one host, nodes avoided after
    a failure): added to them, never replacing them."""

    node_affinity: NodeAffinity | None = None
    pod_affinity: PodAffinity | None = None
    pod_anti_affinity: PodAffinity | None = None


class TopologySpreadConstraint(ApiModel):
    max_skew: int = Field(..., ge=1, le=1000)
    topology_key: LabelKey
    when_unsatisfiable: Literal["DoNotSchedule", "ScheduleAnyway"]
    label_selector: LabelSelector | None = None
    min_domains: int | None = Field(None, ge=1, le=1000)
    match_label_keys: list[LabelKey] = Field(default_factory=list, max_length=8)
    node_affinity_policy: Literal["Honor", "Ignore"] | None = None
    node_taints_policy: Literal["Honor", "Ignore"] | None = None


class PodSpecAdditions(ApiModel):
    """Added to every trainer pod (docs/pod-customization.md); the operator's own volumes, mounts, affinity
    and security settings stay as they are."""

    volumes: list[Volume] = Field(default_factory=list, max_length=16, description="Extra volumes: "
                                  "persistentVolumeClaim, configMap, secret, emptyDir, csi (ephemeral), image; "
                                  "hostPath only where the cluster allows it (guardrails.allowedVolumeTypes).")
    volume_mounts: list[VolumeMount] = Field(default_factory=list, max_length=16, description="Mounts of these "
                                             "volumes in the trainer container.")
    init_containers: list[PodContainer] = Field(default_factory=list, max_length=8, description="Init "
                                                "containers (run to completion, in order, before the trainer "
                                                "starts) and native sidecars (restartPolicy: Always).")
    affinity: Affinity | None = Field(None, description="Extra affinity, merged with the operator's own.")
    topology_spread_constraints: list[TopologySpreadConstraint] = Field(default_factory=list, max_length=8)


# --------------------------------------------------------------------------------------------
# Admission rules (on spec; OBJECT_RULES on the whole MegatronJob)
# --------------------------------------------------------------------------------------------


def _ancestors(path: str) -> list[str]:
    parts = path.strip("/").split("/")
    return ["/" + "/".join(parts[:i]) for i in range(1, len(parts))]


def _alt(paths) -> str:
    return "|".join(p.replace(".", r"\.") for p in dict.fromkeys(paths))


# A mount path on, inside or around one of the operator's own mounts (the paths are schema-normalised: absolute,
# no trailing slash, no '.' or '..' parts, so a prefix test is exact). /var/run is /run in most images.
_RESERVED = [*OPERATOR_MOUNTS, *(p.replace("/var/run/", "/run/", 1) for p in OPERATOR_MOUNTS if p.startswith("/var/run/"))]
RESERVED_MOUNT_RE = (f"^({_alt([*_RESERVED, *SYSTEM_MOUNTS, *NVIDIA_DEVICE_LIST_MOUNTS])})(/.*)?$|"
                     f"^({_alt(a for p in _RESERVED for a in _ancestors(p))})$")
RESERVED_VOLUME_RE = f"^({_alt(OPERATOR_VOLUMES)})$"
DEVICE_LIST_MOUNT_RE = f"^({_alt(NVIDIA_DEVICE_LIST_MOUNTS)})(/.*)?$"
# hostPath: never on, inside or above the node's devices, kernel interfaces, the container runtime's and the kubelet's
# sockets and state (other pods' Secrets under /var/lib/kubelet/pods), or /etc (the kubelet's credentials). Paths
# are schema-normalised (absolute, no '.' or '..' parts, no trailing '/'), so prefix tests are exact.
HOST_PATH_DENIED = ("/dev", "/proc", "/sys", "/run", "/var/run", "/var/lib/kubelet", "/var/lib/containerd",
                    "/var/lib/containers", "/var/lib/docker", "/etc", "/boot", "/root")
HOST_PATH_DENIED_RE = (f"^({_alt(HOST_PATH_DENIED)})(/.*)?$|"
                       f"^({_alt(a for p in HOST_PATH_DENIED for a in _ancestors(p))})$")
HOST_PATH_TYPES = ("Directory", "DirectoryOrCreate", "File", "FileOrCreate")
INTEGER_RE = r"^-?[0-9]{1,18}$"

has_pod = has("pod")
pod_volumes = f("pod.volumes")
pod_mounts = f("pod.volumeMounts")
pod_inits = f("pod.initContainers")


def _known_volume(mount: str) -> Expr:
    return Size(Filter(pod_volumes, "v", ExprField("name", "v").eq(ExprField("name", mount)))) > 0


def _requirement_ok(r: str) -> Expr:
    """A label or node selector requirement as the API server validates it: In/NotIn take values, Exists and
    DoesNotExist none, Gt and Lt one integer."""
    op, values = ExprField("operator", r), ExprField("values", r)
    return cond(op.eq("In") | op.eq("NotIn"), Size(values) > 0,
                cond(op.eq("Exists") | op.eq("DoesNotExist"), Size(values).eq(0),
                     Size(values).eq(1) & Matches(Index(values, 0), INTEGER_RE)))


def _requirements_ok(items: Expr, var: str, path: str) -> Expr:
    """Every requirement of the selector at ``path`` (under each of ``items``) is well formed."""
    return All(items, var, All(ExprField(path, var), "r", _requirement_ok("r")))


def _label_selectors_ok(terms: Expr, var: str, prefix: str = "") -> Expr:
    return _requirements_ok(terms, var, f"{prefix}labelSelector.matchExpressions")


_affinity = "pod.affinity"
_node_affinity = f"{_affinity}.nodeAffinity"


def _pod_affinity_ok(kind: str) -> Expr:
    base = f"{_affinity}.{kind}"
    return ~has(base) | (_label_selectors_ok(f(f"{base}.{_REQ}"), "t")
                         & _label_selectors_ok(f(f"{base}.{_PREF}"), "t", "podAffinityTerm."))


selectors_ok = (
    (~has(_affinity) | (
        (~has(_node_affinity) | (
            (~has(f"{_node_affinity}.{_REQ}")
             | _requirements_ok(f(f"{_node_affinity}.{_REQ}.nodeSelectorTerms"), "t", "matchExpressions"))
            & _requirements_ok(f(f"{_node_affinity}.{_PREF}"), "t", "preference.matchExpressions")))
        & _pod_affinity_ok("podAffinity") & _pod_affinity_ok("podAntiAffinity")))
    & All(f("pod.topologySpreadConstraints"), "t", ~Has(ExprField("labelSelector", "t"))
          | All(ExprField("labelSelector.matchExpressions", "t"), "r", _requirement_ok("r"))))

pod_spread = f("pod.topologySpreadConstraints")


def _mount_paths_unique(c: str) -> Expr:
    mounts = ExprField("volumeMounts", c)
    return All(mounts, "m", Size(Filter(mounts, "x", ExprField("mountPath", "x").eq(ExprField("mountPath", "m")))).eq(1))


def _spread_unique(t: str) -> Expr:
    same = (ExprField("topologyKey", "x").eq(ExprField("topologyKey", t))
            & ExprField("whenUnsatisfiable", "x").eq(ExprField("whenUnsatisfiable", t)))
    return Size(Filter(pod_spread, "x", same)).eq(1)


def _min_domains_ok(t: str) -> Expr:
    return ~Has(ExprField("minDomains", t)) | ExprField("whenUnsatisfiable", t).eq("DoNotSchedule")


def _match_label_keys_ok(t: str) -> Expr:
    # (labelSelector's matchLabels and matchExpressions are defaulted: present whenever it is)
    keys, selector = ExprField("matchLabelKeys", t), "labelSelector"
    return Size(keys).eq(0) | (Has(ExprField(selector, t)) & All(keys, "k", ~In(Var("k"), ExprField(
        f"{selector}.matchLabels", t)) & All(ExprField(f"{selector}.matchExpressions", t), "r",
                                             ExprField("key", "r").ne(Var("k")))))


_init_env_ok = (~(Has(ExprField("value", "e")) & Has(ExprField("valueFrom", "e")))
                & (~Has(ExprField("valueFrom", "e"))
                   | Has(ExprField("valueFrom.secretKeyRef", "e")).ne(Has(ExprField("valueFrom.configMapKeyRef", "e"))))
                & ~(Has(ExprField("value", "e")) & (Matches(ExprField("name", "e"), CREDENTIAL_ENV_RE)
                                                  | Matches(ExprField("value", "e"), URL_USERINFO_RE))))

RULES: list[Rule] = [
    Rule("pod-volume-one-source", "pod.volumes",
         All(pod_volumes, "v", count_present("v", VOLUME_TYPES).eq(1)), when=has_pod,
         message=fmt("spec.pod.volumes: ", first_attr(pod_volumes, "v", count_present("v", VOLUME_TYPES).ne(1)),
                     " needs exactly one source: " + ", ".join(VOLUME_TYPES))),
    Rule("pod-volume-names-unique", "pod.volumes",
         All(pod_volumes, "v", unique_by(pod_volumes, "v", "name")), when=has_pod,
         message=fmt("spec.pod.volumes: ", first_attr(pod_volumes, "v", ~unique_by(pod_volumes, "v", "name")),
                     " is given more than once; give each volume its own name")),
    Rule("pod-volume-names-not-reserved", "pod.volumes",
         All(pod_volumes, "v", ~Matches(ExprField("name", "v"), RESERVED_VOLUME_RE)), when=has_pod,
         message=fmt("spec.pod.volumes: ", first_attr(pod_volumes, "v", Matches(ExprField("name", "v"), RESERVED_VOLUME_RE)),
                     " is the name of one of the operator's own volumes (" + ", ".join(OPERATOR_VOLUMES)
                     + "); use another name")),
    Rule("pod-mounts-known-volume", "pod.volumeMounts",
         All(pod_mounts, "m", _known_volume("m")), when=has_pod,
         message=fmt("spec.pod.volumeMounts: ", first_attr(pod_mounts, "m", ~_known_volume("m")),
                     " is not a volume of spec.pod.volumes; the trainer mounts only the volumes listed there")),
    Rule("pod-mounts-not-reserved", "pod.volumeMounts",
         All(pod_mounts, "m", ~Matches(ExprField("mountPath", "m"), RESERVED_MOUNT_RE)), when=has_pod,
         message=fmt("spec.pod.volumeMounts: ", first_attr(pod_mounts, "m", Matches(ExprField("mountPath", "m"),
                                                                               RESERVED_MOUNT_RE), "mountPath"),
                     " is on, inside or around one of the operator's own mounts (" + ", ".join(OPERATOR_MOUNTS)
                     + ") or the container's " + ", ".join(SYSTEM_MOUNTS) + ", or in the NVIDIA container "
                     "runtime's device list (" + ", ".join(NVIDIA_DEVICE_LIST_MOUNTS) + ": a mount there is a "
                     "request for GPUs); mount it elsewhere, e.g. under /mnt")),
    Rule("pod-mount-paths-unique", "pod.volumeMounts",
         All(pod_mounts, "m", unique_by(pod_mounts, "m", "mountPath")), when=has_pod,
         message=fmt("spec.pod.volumeMounts: ", first_attr(pod_mounts, "m", ~unique_by(pod_mounts, "m", "mountPath"),
                                                      "mountPath"), " is mounted more than once")),
    Rule("pod-init-container-names", "pod.initContainers",
         All(pod_inits, "c", unique_by(pod_inits, "c", "name") & ExprField("name", "c").ne(TRAINER_CONTAINER)),
         when=has_pod,
         message=fmt("spec.pod.initContainers: ", first_attr(pod_inits, "c", ~unique_by(pod_inits, "c", "name")
                                                        | ExprField("name", "c").eq(TRAINER_CONTAINER)),
                     " is given more than once or is the trainer's own name; give each container its own name")),
    Rule("pod-init-container-mounts-known-volume", "pod.initContainers",
         All(pod_inits, "c", All(ExprField("volumeMounts", "c"), "m", _known_volume("m"))), when=has_pod,
         message=fmt("spec.pod.initContainers: ", first_attr(pod_inits, "c", ~All(ExprField("volumeMounts", "c"), "m",
                                                                              _known_volume("m"))),
                     " mounts a volume that is not in spec.pod.volumes (init containers and sidecars mount only "
                     "those)")),
    Rule("pod-init-container-env", "pod.initContainers",
         All(pod_inits, "c", All(ExprField("env", "c"), "e", _init_env_ok)), when=has_pod,
         message=fmt("spec.pod.initContainers: ", first_attr(pod_inits, "c", ~All(ExprField("env", "c"), "e", _init_env_ok)),
                     " has an env entry with both value and valueFrom, a valueFrom without exactly one of "
                     "secretKeyRef and configMapKeyRef, or a credential as a literal value (an AWS key, a URL with "
                     "user info); put credentials in a Secret (valueFrom.secretKeyRef or a secret volume)")),
    # nvidia-container-toolkit reads these from every container of the pod, not only the one that requested GPUs:
    # a sidecar with NVIDIA_VISIBLE_DEVICES=all gets every GPU of the node (env-not-reserved refuses the same for
    # the trainer).
    Rule("pod-init-container-gpu-env", "pod.initContainers",
         All(pod_inits, "c", All(ExprField("env", "c"), "e", ~Matches(ExprField("name", "e"), GPU_DEVICE_ENV_RE))),
         when=has_pod,
         message=fmt("spec.pod.initContainers: ", first_attr(pod_inits, "c", ~All(ExprField("env", "c"), "e", ~Matches(
                         ExprField("name", "e"), GPU_DEVICE_ENV_RE))),
                     " sets a variable the NVIDIA container runtime reads to choose a container's GPUs or driver "
                     "capabilities (" + ", ".join(GPU_DEVICE_ENV) + "); the GPU device plugin decides that "
                     "(NVIDIA_VISIBLE_DEVICES=all would give the container every GPU of the node): remove it")),
    Rule("pod-init-container-mounts-not-device-list", "pod.initContainers",
         All(pod_inits, "c", All(ExprField("volumeMounts", "c"), "m",
                                 ~Matches(ExprField("mountPath", "m"), DEVICE_LIST_MOUNT_RE))), when=has_pod,
         message=fmt("spec.pod.initContainers: ", first_attr(pod_inits, "c", ~All(ExprField("volumeMounts", "c"), "m", ~Matches(
                         ExprField("mountPath", "m"), DEVICE_LIST_MOUNT_RE))),
                     " mounts a volume in the NVIDIA container runtime's device list (" + ", ".join(
                         NVIDIA_DEVICE_LIST_MOUNTS) + "), where a mount is a request for GPUs (/var/run/nvidia-"
                     "container-devices/all: every GPU of the node); mount it elsewhere, e.g. under /mnt")),
    Rule("pod-host-path-type", "pod.volumes",
         All(pod_volumes, "v", ~Has(ExprField("hostPath", "v")) | Has(ExprField("hostPath.type", "v"))), when=has_pod,
         message=fmt("spec.pod.volumes: ", first_attr(pod_volumes, "v", Has(ExprField("hostPath", "v"))
                                                      & ~Has(ExprField("hostPath.type", "v"))),
                     " is a hostPath without type, which the kubelet mounts whatever it is (a container runtime "
                     "socket, a device node); set hostPath.type to " + ", ".join(HOST_PATH_TYPES) + " (the kubelet "
                     "then checks it before mounting: Kubernetes pkg/volume/hostpath/host_path.go, checkType)")),
    Rule("pod-host-path-not-system", "pod.volumes",
         All(pod_volumes, "v", ~Has(ExprField("hostPath", "v"))
             | ~Matches(ExprField("hostPath.path", "v"), HOST_PATH_DENIED_RE)), when=has_pod,
         message=fmt("spec.pod.volumes: ", first_attr(pod_volumes, "v", Has(ExprField("hostPath", "v"))
                                                      & Matches(ExprField("hostPath.path", "v"), HOST_PATH_DENIED_RE)),
                     " is a hostPath on, inside or above " + ", ".join(HOST_PATH_DENIED) + " (the node's devices, "
                     "kernel interfaces, the container runtime's and kubelet's sockets and state, its credentials); "
                     "use a data directory of the node, e.g. under /mnt or /raid")),
    # Kubernetes' pod validation (pkg/apis/core/validation/validation.go), which the API server applies to the
    # JobSet's Jobs after the MegatronJob was admitted: the job would never start.
    Rule("pod-init-container-mount-paths-unique", "pod.initContainers",
         All(pod_inits, "c", _mount_paths_unique("c")), when=has_pod,
         message=fmt("spec.pod.initContainers: ", first_attr(pod_inits, "c", ~_mount_paths_unique("c")),
                     " mounts two volumes at one mountPath, which Kubernetes refuses (ValidateVolumeMounts: "
                     "\"must be unique\"); give each mount its own mountPath")),
    Rule("pod-spread-unique", "pod.topologySpreadConstraints",
         All(pod_spread, "t", _spread_unique("t")), when=has_pod,
         message=fmt("spec.pod.topologySpreadConstraints: ", first_attr(pod_spread, "t", ~_spread_unique("t"),
                                                                         "topologyKey"),
                     " is given twice with the same whenUnsatisfiable, which Kubernetes refuses "
                     "(ValidateSpreadConstraintNotRepeat); keep one constraint per {topologyKey, whenUnsatisfiable}")),
    Rule("pod-spread-min-domains", "pod.topologySpreadConstraints",
         All(pod_spread, "t", _min_domains_ok("t")), when=has_pod,
         message=fmt("spec.pod.topologySpreadConstraints: ", first_attr(pod_spread, "t", ~_min_domains_ok("t"),
                                                                         "topologyKey"),
                     " has minDomains with whenUnsatisfiable ScheduleAnyway, which Kubernetes refuses "
                     "(validateMinDomains: minDomains only with DoNotSchedule); set whenUnsatisfiable: DoNotSchedule "
                     "or drop minDomains")),
    Rule("pod-spread-match-label-keys", "pod.topologySpreadConstraints",
         All(pod_spread, "t", _match_label_keys_ok("t")), when=has_pod,
         message=fmt("spec.pod.topologySpreadConstraints: ", first_attr(pod_spread, "t", ~_match_label_keys_ok("t"),
                                                                         "topologyKey"),
                     " has matchLabelKeys without a labelSelector, or a key in both matchLabelKeys and the "
                     "labelSelector, which Kubernetes refuses (ValidateMatchLabelKeysInTopologySpread: \"exists in "
                     "both matchLabelKeys and labelSelector\"); name each key in one of them, with a labelSelector")),
    Rule("pod-selector-requirements", "pod",
         selectors_ok, when=has_pod,
         message=lit("spec.pod: a label or node selector requirement is malformed: operator In and NotIn need "
                     "values, Exists and DoesNotExist take none, Gt and Lt take one integer")),
]

# A user's required pod-affinity term on a job whose tensor-parallel groups span pods. Each such pod already has
# the operator's required term "next to the pods of my group" (render: the group's pods on one host), and
# kube-scheduler's InterPodAffinity filter counts only existing pods that match *all* of a pod's required terms
# (the first pod of a series passes only if it matches all its terms itself). A term of the user's that does
# not select the job's own pods therefore can never be met together with the group's: no worker is ever
# placed, without an error anywhere. It can be met when it selects the job's own pods (e.g. "every worker of
# this job in one zone"): check it against the labels every pod of the job carries (render.labels_for and
# spec.podMetadata.labels; the tensor-parallel group and JobSet's labels differ between pods and are not used).
job_name = f("metadata.name")
_pod_labels = f("spec.podMetadata.labels")
_has_pod_labels = has("spec.podMetadata") & has("spec.podMetadata.labels")


def _own_has(key: Expr) -> Expr:
    known: Expr | None = None
    for k in (*FIXED_JOB_LABELS, *JOB_NAME_VALUED_LABELS):
        known = key.eq(k) if known is None else known | key.eq(k)
    return known | (_has_pod_labels & In(key, _pod_labels))


def _own_value(key: Expr) -> Expr:
    """The value of label ``key`` on every pod of the job (guard with ``_own_has``)."""
    value: Expr = Get(_pod_labels, key)
    for k, v in FIXED_JOB_LABELS.items():
        value = cond(key.eq(k), v, value)
    for k in JOB_NAME_VALUED_LABELS:
        value = cond(key.eq(k), job_name, value)
    return value


def _own_pods_meet(r: str) -> Expr:
    """Label selector requirement ``r`` holds for the job's own pods."""
    op, key, values = ExprField("operator", r), ExprField("key", r), ExprField("values", r)
    present = _own_has(key)
    return cond(op.eq("In"), present & In(_own_value(key), values),
                cond(op.eq("NotIn"), ~present | ~In(_own_value(key), values),
                     cond(op.eq("Exists"), present, ~present)))


_match_labels = ExprField("labelSelector.matchLabels", "t")
_selects_own_pods = ((~Has(_match_labels) | All(_match_labels, "k", _own_has(Var("k"))
                                                 & _own_value(Var("k")).eq(Get(_match_labels, Var("k")))))
                     & All(ExprField("labelSelector.matchExpressions", "t"), "r", _own_pods_meet("r")))
_user_required_pod_affinity = f(f"spec.pod.affinity.podAffinity.{_REQ}")

OBJECT_RULES: list[Rule] = [
    Rule("pod-affinity-selects-own-pods", f"spec.pod.affinity.podAffinity.{_REQ}",
         All(_user_required_pod_affinity, "t", _selects_own_pods),
         when=has("spec.pod") & has("spec.pod.affinity") & has("spec.pod.affinity.podAffinity")
         & has(f"spec.pod.affinity.podAffinity.{_REQ}")
         & (f("spec.parallelism.tensor") > f("spec.gpusPerNode")),
         message=fmt("spec.pod.affinity.podAffinity.requiredDuringSchedulingIgnoredDuringExecution: with "
                     "spec.parallelism.tensor ", f("spec.parallelism.tensor").str(), " larger than spec.gpusPerNode ",
                     f("spec.gpusPerNode").str(), " every worker already has a required pod affinity that keeps "
                     "its tensor-parallel group on one host, and kube-scheduler places a pod only next to an "
                     "existing pod that matches all of its required terms at once; a term that does not select "
                     "this job's own pods would leave every worker Pending. Select the job's pods (matchLabels "
                     + LABEL_JOB_NAME + ": ", job_name, ", or labels of spec.podMetadata.labels) with the "
                     "topologyKey you need, or make the term preferredDuringSchedulingIgnoredDuringExecution, or "
                     "use nodeAffinity")),
]


# --------------------------------------------------------------------------------------------
# Guardrails (guardrails.py collects them; the chart's policy is generated from them)
# --------------------------------------------------------------------------------------------


_POD = "!has(spec.pod) || "
_INITS = "spec.pod.initContainers"
_VOLS = "spec.pod.volumes"


def _volume_type(v: str) -> str:
    """CEL: the type (the source's field name) of the volume ``v``; '' for none."""
    out = "''"
    for t in reversed(VOLUME_TYPES):
        out = f"(has({v}.{t}) ? '{t}' : {out})"
    return out


def _image_allowed(image: str) -> str:
    """CEL: ``image`` is under one of LIMIT's path prefixes (an entry ending in '/'), or is one of its repositories
    (any other entry) exactly, with or without a tag or digest: ``r``, ``r:tag``, ``r@sha256:...``, never a path
    below it (``r/evil:1``) or a longer name (``r-evil``). (``substring``: Kubernetes' CEL strings library.)"""
    return (f"LIMIT.exists(r, r.endsWith('/') ? {image}.startsWith(r) : ({image} == r || "
            f"(({image}.startsWith(r + ':') || {image}.startsWith(r + '@')) && "
            f"!{image}.substring(size(r)).contains('/'))))")


def _registry_allowed(image: str) -> str:
    return f"LIMIT.exists(r, {image}.startsWith(r.endsWith('/') ? r : r + '/'))"


_PRIVILEGED = "has(c.securityContext) && has(c.securityContext.privileged) && c.securityContext.privileged"
_CAPS_ADDED = ("has(c.securityContext) && has(c.securityContext.capabilities) && "
               "size(c.securityContext.capabilities.add) > 0")
_NODE_AFFINITY = "spec.pod.affinity.nodeAffinity"
# The node label keys of spec.pod's node affinity, as a list of lists (required terms', then preferred terms').
_AFFINITY_KEYS = (f"(has({_NODE_AFFINITY}.{_REQ}) ? {_NODE_AFFINITY}.{_REQ}.nodeSelectorTerms.map(t, "
                  f"t.matchExpressions.map(r, r.key)) : []) + {_NODE_AFFINITY}.{_PREF}.map(p, "
                  f"p.preference.matchExpressions.map(r, r.key))")
_HAS_NODE_AFFINITY = "!has(spec.pod) || !has(spec.pod.affinity) || !has(spec.pod.affinity.nodeAffinity) || "

GUARDRAILS: tuple[Guardrail, ...] = (
    Guardrail("volume-type", "spec.pod.volumes", "allowedVolumeTypes",
              "volume {item} is of a type this cluster does not allow; allowed types: {limit}",
              f"{_POD}{_VOLS}.all(v, {_volume_type('v')} in LIMIT)",
              f"{_VOLS}.filter(v, !({_volume_type('v')} in LIMIT)).map(v, v.name + ' (' + {_volume_type('v')} + ')')[0]",
              always=True),
    # denySecretEnv covers every way a job's pods read a Secret (env, the object-store credentials, volumes).
    Guardrail("secret-volume", "spec.pod.volumes[].secret", "denySecretEnv",
              "volume {item} reads a Secret, which is not allowed here",
              f"{_POD}!{_VOLS}.exists(v, has(v.secret))", f"{_VOLS}.filter(v, has(v.secret))[0].name"),
    Guardrail("init-container-secret-env", "spec.pod.initContainers[].env", "denySecretEnv",
              "container {item} takes a Secret (valueFrom.secretKeyRef), which is not allowed here",
              f"{_POD}!{_INITS}.exists(c, c.env.exists(e, has(e.valueFrom) && has(e.valueFrom.secretKeyRef)))",
              f"{_INITS}.filter(c, c.env.exists(e, has(e.valueFrom) && has(e.valueFrom.secretKeyRef)))[0].name"),
    Guardrail("init-container-image", "spec.pod.initContainers[].image", "allowedImageRegistries",
              "{item} is not from this cluster's registries; this cluster runs images only from {limit}",
              f"{_POD}{_INITS}.all(c, {_registry_allowed('c.image')})",
              f"{_INITS}.filter(c, !{_registry_allowed('c.image')})[0].image"),
    Guardrail("image-volume", "spec.pod.volumes[].image", "allowedImageRegistries",
              "{item} is not from this cluster's registries; this cluster runs images only from {limit}",
              f"{_POD}{_VOLS}.all(v, !has(v.image) || {_registry_allowed('v.image.reference')})",
              f"{_VOLS}.filter(v, has(v.image) && !{_registry_allowed('v.image.reference')})[0].image.reference"),
    Guardrail("privileged", "spec.pod.initContainers[].securityContext.privileged", "allowedPrivilegedImages",
              "container {item} runs privileged, which this cluster allows only for the images {limit}",
              f"{_POD}{_INITS}.all(c, !({_PRIVILEGED}) || {_image_allowed('c.image')})",
              f"{_INITS}.filter(c, ({_PRIVILEGED}) && !{_image_allowed('c.image')})[0].name", always=True),
    Guardrail("capabilities", "spec.pod.initContainers[].securityContext.capabilities", "allowedPrivilegedImages",
              "container {item} adds capabilities, which this cluster allows only for the images {limit}",
              f"{_POD}{_INITS}.all(c, !({_CAPS_ADDED}) || {_image_allowed('c.image')})",
              f"{_INITS}.filter(c, ({_CAPS_ADDED}) && !{_image_allowed('c.image')})[0].name", always=True),
    # Node affinity selects nodes as nodeSelector does: the same allowed keys.
    Guardrail("node-affinity-key", "spec.pod.affinity.nodeAffinity", "allowedNodeSelectorKeys",
              "{item} is not allowed here; allowed keys: {limit}",
              f"{_HAS_NODE_AFFINITY}({_AFFINITY_KEYS}).all(l, l.all(k, k in LIMIT))",
              f"({_AFFINITY_KEYS}).map(l, l.filter(k, !(k in LIMIT))).filter(l, size(l) > 0)[0][0]"),
)

_BY_FIELD = {r.field: r for r in GUARDRAILS}


def _image_ok(image: str, images: list[str]) -> bool:
    """The Python twin of ``_image_allowed``."""
    return any(image.startswith(r) if r.endswith("/") else
               image == r or (image.startswith((r + ":", r + "@")) and "/" not in image[len(r):]) for r in images)


def _privileged(c: PodContainer) -> bool:
    return bool(c.security_context and c.security_context.privileged)


def _adds_capabilities(c: PodContainer) -> bool:
    return bool(c.security_context and c.security_context.capabilities and c.security_context.capabilities.add)


def guardrail_violations(pod: PodSpecAdditions | None, settings: Settings) -> Iterator[Violation]:
    """Every entry of spec.pod that breaks one of GUARDRAILS on this cluster (the Python twin of their CEL)."""
    if pod is None:
        return
    g = _BY_FIELD
    types = listed(settings.allowed_volume_types)
    for v in pod.volumes:
        if v.volume_type() not in types:
            yield g["spec.pod.volumes"], f"{v.name} ({v.volume_type()})", ", ".join(types) or "none"
    if settings.deny_secret_env:
        for v in pod.volumes:
            if v.secret is not None:
                yield g["spec.pod.volumes[].secret"], v.name, ""
        for c in pod.init_containers:
            if any(e.value_from and e.value_from.secret_key_ref for e in c.env):
                yield g["spec.pod.initContainers[].env"], c.name, ""
    if registries := listed(settings.allowed_image_registries):
        for c in pod.init_containers:
            if not registry_ok(c.image, registries):
                yield g["spec.pod.initContainers[].image"], c.image, ", ".join(registries)
        for v in pod.volumes:
            if v.image is not None and not registry_ok(v.image.reference, registries):
                yield g["spec.pod.volumes[].image"], v.image.reference, ", ".join(registries)
    privileged_images = listed(settings.allowed_privileged_images)
    for test, where in ((_privileged, "privileged"), (_adds_capabilities, "capabilities")):
        for c in pod.init_containers:
            if test(c) and not _image_ok(c.image, privileged_images):
                yield (g[f"spec.pod.initContainers[].securityContext.{where}"], c.name,
                       ", ".join(privileged_images) or "none")
    affinity = pod.affinity.node_affinity if pod.affinity else None
    if affinity is not None and (keys := listed(settings.allowed_node_selector_keys)):
        required = affinity.required_during_scheduling_ignored_during_execution
        terms = [*(required.node_selector_terms if required else []),
                 *(p.preference for p in affinity.preferred_during_scheduling_ignored_during_execution)]
        for term in terms:
            for r in term.match_expressions:
                if r.key not in keys:
                    yield g["spec.pod.affinity.nodeAffinity"], r.key, ", ".join(keys)


# --------------------------------------------------------------------------------------------
# Render: spec.pod's part of the trainer pod (render._pod_spec calls add_to_pod last)
# --------------------------------------------------------------------------------------------


#: The trainer's token (the trainer writes status.progress with it) when the pod has containers of the user's:
#: the same files as the kubelet's automount (kube-api-access), in the trainer container only.
TOKEN_EXPIRATION_S = 3607


def _trainer_token_volume() -> dict[str, Any]:
    return {"name": TRAINER_TOKEN_VOLUME, "projected": {"defaultMode": 0o444, "sources": [
        {"serviceAccountToken": {"path": "token", "expirationSeconds": TOKEN_EXPIRATION_S}},
        {"configMap": {"name": "kube-root-ca.crt", "items": [{"key": "ca.crt", "path": "ca.crt"}]}},
        {"downwardAPI": {"items": [{"path": "namespace", "fieldRef": {"apiVersion": "v1",
                                                                      "fieldPath": "metadata.namespace"}}]}}]}}


def _user_container(c: PodContainer) -> dict[str, Any]:
    """An init container or sidecar of spec.pod, with the trainer's hardening unless it asks otherwise: no
    privilege escalation and every capability dropped (the pod's non-root uid and seccomp profile apply)."""
    out = c.model_dump(by_alias=True, exclude_none=True, mode="json", exclude={"security_context"})
    for key in ("command", "args", "env", "volumeMounts"):
        if not out.get(key):
            out.pop(key, None)
    sc = c.security_context.model_dump(by_alias=True, exclude_none=True, mode="json") if c.security_context else {}
    added = sc.pop("capabilities", {}).get("add", [])
    sc["capabilities"] = {"drop": ["ALL"], **({"add": added} if added else {})}
    # The API server refuses allowPrivilegeEscalation: false beside privileged or CAP_SYS_ADMIN.
    if not sc.get("privileged") and not {"SYS_ADMIN", "CAP_SYS_ADMIN"} & set(added):
        sc["allowPrivilegeEscalation"] = False
    out["securityContext"] = sc
    return out


def add_to_pod(pod: dict[str, Any], trainer: dict[str, Any], extra: PodSpecAdditions,
               affinity: dict[str, Any]) -> None:
    """spec.pod added to the rendered pod: volumes and the trainer's mounts after the operator's, the init
    containers and sidecars, and affinity merged into the operator's own (``affinity``, changed in place)."""
    pod["volumes"] += [v.model_dump(by_alias=True, exclude_none=True, mode="json") for v in extra.volumes]
    trainer["volumeMounts"] += [m.model_dump(by_alias=True, exclude_none=True, mode="json")
                                for m in extra.volume_mounts]
    if extra.init_containers:
        pod["initContainers"] = [_user_container(c) for c in extra.init_containers]
        # Only the trainer gets the job's token: another image in the pod (a log shipper, say) has no use for it.
        pod["automountServiceAccountToken"] = False
        pod["volumes"].append(_trainer_token_volume())
        trainer["volumeMounts"].append({"name": TRAINER_TOKEN_VOLUME, "mountPath": SERVICE_ACCOUNT_MOUNT, "readOnly": True})
    if extra.topology_spread_constraints:
        pod["topologySpreadConstraints"] = [t.model_dump(by_alias=True, exclude_none=True, mode="json")
                                            for t in extra.topology_spread_constraints]
    if extra.affinity is not None:
        _merge_affinity(affinity, extra.affinity.model_dump(by_alias=True, exclude_none=True, mode="json"))


def _merge_affinity(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    """The user's affinity added to the operator's: every term of both must hold. Required node selector terms
    are ORed by the scheduler, so each of the user's terms gets the operator's requirements (the avoided nodes);
    the pod (anti-)affinity terms of both are ANDed already; preferences add up."""
    for kind in ("podAffinity", "podAntiAffinity"):
        if kind in theirs:
            merged = ours.setdefault(kind, {})
            for when in (_REQ, _PREF):
                if theirs[kind].get(when):
                    merged[when] = [*merged.get(when, []), *theirs[kind][when]]
            if not merged:
                del ours[kind]
    node = theirs.get("nodeAffinity") or {}
    if node.get(_PREF):
        ours.setdefault("nodeAffinity", {})[_PREF] = node[_PREF]
    if node.get(_REQ):
        mine = (ours.get("nodeAffinity") or {}).get(_REQ, {"nodeSelectorTerms": [{}]})["nodeSelectorTerms"]
        terms = [{k: [*a.get(k, []), *b.get(k, [])] for k in ("matchExpressions", "matchFields") if a.get(k) or b.get(k)}
                 for b in node[_REQ]["nodeSelectorTerms"] for a in mine]
        ours.setdefault("nodeAffinity", {})[_REQ] = {"nodeSelectorTerms": terms}
