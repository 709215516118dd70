"""The one home for API names: groups, versions, kinds, labels and the field manager (pure).

Every module that talks about these objects imports the names from here, so that a version bump
(JobSet v1alpha2 -> v1) or a renamed label is one edit.
"""

from __future__ import annotations

# The MegatronJob API
GROUP = "megatron-operator.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "MegatronJob"
PLURAL = "megatronjobs"
# The longest MegatronJob name: the JobSet, its Jobs and pod hostnames are built from it
# (``<name>-<replicated job>-<job index>-<pod index>``, e.g. ``<name>-tp3-0-1``, must stay a
# 63-character DNS label).
MAX_NAME_LENGTH = 40
# What a MegatronJob's name must match, besides MAX_NAME_LENGTH (rules.NAME_RULE, and the spec model's field).
RFC1035_LABEL = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
#: An objectStore endpoint (the spec field's pattern, and rules' env-endpoint-url): scheme, host and a port
#: 1-65535 without leading zeros; no path, no user info, so no credential can ride in the URL.
TCP_PORT = r"([1-9][0-9]{0,3}|[1-5][0-9]{4}|6[0-4][0-9]{3}|65[0-4][0-9]{2}|655[0-2][0-9]|6553[0-5])"
S3_ENDPOINT = r"^https?://[A-Za-z0-9.-]+(:" + TCP_PORT + r")?/?$"
#: The service-account annotations of workload identity an objectStore may set (IRSA, GKE, Azure).
WORKLOAD_IDENTITY_ANNOTATIONS = ("eks.amazonaws.com/role-arn", "eks.amazonaws.com/sts-regional-endpoints",
                                 "eks.amazonaws.com/token-expiration", "iam.gke.io/gcp-service-account",
                                 "azure.workload.identity/client-id", "azure.workload.identity/tenant-id")

# JobSet (sigs.k8s.io/jobset), the child every MegatronJob runs as
JOBSET_GROUP = "jobset.x-k8s.io"
JOBSET_VERSION = "v1alpha2"
JOBSET_API_VERSION = f"{JOBSET_GROUP}/{JOBSET_VERSION}"
JOBSET_PLURAL = "jobsets"
JOBSET_GLOBAL_INDEX_LABEL = "jobset.sigs.k8s.io/job-global-index"
JOBSET_RESTART_ATTEMPT_LABEL = "jobset.sigs.k8s.io/restart-attempt"
JOBSET_UID_LABEL = "jobset.sigs.k8s.io/jobset-uid"

# What the operator writes and selects on
FIELD_MANAGER = "megatron-operator"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY = "megatron-operator"
MANAGED_LABELS = {LABEL_MANAGED_BY: MANAGED_BY}
MANAGED_SELECTOR = f"{LABEL_MANAGED_BY}={MANAGED_BY}"
LABEL_JOB_NAME = f"{GROUP}/job-name"
LABEL_APP_NAME = "app.kubernetes.io/name"
LABEL_APP_INSTANCE = "app.kubernetes.io/instance"
TRAINER_APP_NAME = "megatron-trainer"
#: Keys of the labels on everything of a job, its pods included, whose value is the job's name (render.labels_for).
JOB_NAME_VALUED_LABELS = (LABEL_APP_INSTANCE, LABEL_JOB_NAME)
#: ... and those whose value is fixed.
FIXED_JOB_LABELS = {LABEL_APP_NAME: TRAINER_APP_NAME, LABEL_MANAGED_BY: MANAGED_BY}
#: On the JobSet: the spec.parallelism it was rendered for (compact JSON). spec.parallelism may change while the
#: job is suspended; a suspended JobSet whose value differs is deleted and created again for the new layout.
ANNOTATION_PARALLELISM = f"{GROUP}/parallelism"
LABEL_TP_GROUP = f"{GROUP}/tp-group"
TRAINER_CONTAINER = "trainer"

# Other controllers' names
KUEUE_GROUP = "kueue.x-k8s.io"
KUEUE_VERSION = "v1beta2"  # served (and stored) by Kueue v0.15 and later; tested on v0.19.2
KUEUE_WORKLOADS = "workloads"
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
KUEUE_PRIORITY_CLASS_LABEL = "kueue.x-k8s.io/priority-class"  # a WorkloadPriorityClass name
#: Kueue topology-aware scheduling: every pod of the PodSet in one domain of this node label (required),
#: or preferably so; a PodSet is one replicated job of the JobSet.
KUEUE_PODSET_REQUIRED_TOPOLOGY = "kueue.x-k8s.io/podset-required-topology"
KUEUE_PODSET_TOPOLOGY_ANNOTATIONS = (KUEUE_PODSET_REQUIRED_TOPOLOGY, "kueue.x-k8s.io/podset-preferred-topology",
                                     "kueue.x-k8s.io/podset-unconstrained-topology",
                                     "kueue.x-k8s.io/podset-slice-required-topology")
KUEUE_JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"  # on the Workload Kueue creates for a JobSet
GPU_RESOURCE = "nvidia.com/gpu"
EFA_RESOURCE = "vpc.amazonaws.com/efa"

# The trainer container's own mounts and volumes (render.py and the blocks). spec.pod may add volumes and mounts,
# never on, inside or around these paths, nor under these volume names (rules: pod-mounts-not-reserved,
# pod-volume-names-not-reserved).
SHM_MOUNT = "/dev/shm"
TMP_MOUNT = "/tmp"
CHECKPOINT_MOUNT = "/checkpoints"
DATA_MOUNT = "/data"
HF_INIT_MOUNT = "/hf-init"
HF_EXPORT_MOUNT = "/hf-export"
#: Where the object-store credentials Secret is mounted (read-only) in the trainer container.
OBJECT_STORE_CREDENTIALS_MOUNT = "/var/run/secrets/megatron-operator/object-store"
#: Where the Weights & Biases API key Secret is mounted (read-only): the trainer reads the file `key` there.
WANDB_API_KEY_MOUNT = "/var/run/secrets/megatron-operator/wandb"
#: Where the Weights & Biases run's files go without spec.logging.wandb.saveDir: beside the checkpoints, on a PVC
#: (blocks/wandb.py, save_dir), else this scratch directory (online mode only).
WANDB_SCRATCH_DIR = "/tmp/wandb"
#: Where the job's ServiceAccount token is (the kubelet's automount, or render's trainer-token volume).
SERVICE_ACCOUNT_MOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"
OPERATOR_MOUNTS = (SHM_MOUNT, TMP_MOUNT, CHECKPOINT_MOUNT, DATA_MOUNT, HF_INIT_MOUNT, HF_EXPORT_MOUNT,
                   "/var/run/secrets/megatron-operator", SERVICE_ACCOUNT_MOUNT)
#: Where no extra mount may go at all: the container's devices (GPUs, /dev/infiniband), kernel interfaces.
SYSTEM_MOUNTS = ("/dev", "/proc", "/sys")
#: The NVIDIA container runtime's device list as mounts: with the device plugin's volume-mounts strategy (the GPU
#: Operator's default where env requests from unprivileged containers are refused) the runtime gives a container
#: every device named by a mount destination under this root (nvidia-container-toolkit internal/config/image
#: DeviceListAsVolumeMountsRoot; /var/run/nvidia-container-devices/all is every GPU of the node). No container of
#: spec.pod may mount there (rules: pod-mounts-not-reserved, pod-init-container-mounts-not-device-list).
NVIDIA_DEVICE_LIST_MOUNTS = ("/var/run/nvidia-container-devices", "/run/nvidia-container-devices")
#: The operator's own volumes (render.py and the blocks name them from here), ...
SHM_VOLUME = "dshm"
TMP_VOLUME = "tmp"
CHECKPOINT_VOLUME = "checkpoints"
OBJECT_STORE_CREDENTIALS_VOLUME = "object-store-credentials"
DATA_VOLUME = "data"
HF_INIT_VOLUME = "hf-init"
HF_EXPORT_VOLUME = "hf-export"
TRAINER_TOKEN_VOLUME = "trainer-token"
WANDB_API_KEY_VOLUME = "wandb-api-key"
#: ... and where the trainer container mounts each: the one table of them (tests/unit/test_render.py renders a job
#: with every one and checks the pod against it).
OPERATOR_VOLUME_MOUNTS = {
    SHM_VOLUME: SHM_MOUNT, TMP_VOLUME: TMP_MOUNT, CHECKPOINT_VOLUME: CHECKPOINT_MOUNT,
    OBJECT_STORE_CREDENTIALS_VOLUME: OBJECT_STORE_CREDENTIALS_MOUNT, DATA_VOLUME: DATA_MOUNT,
    HF_INIT_VOLUME: HF_INIT_MOUNT, HF_EXPORT_VOLUME: HF_EXPORT_MOUNT, TRAINER_TOKEN_VOLUME: SERVICE_ACCOUNT_MOUNT,
    WANDB_API_KEY_VOLUME: WANDB_API_KEY_MOUNT,
}
OPERATOR_VOLUMES = tuple(OPERATOR_VOLUME_MOUNTS)
#: The volume sources spec.pod.volumes offers, as guardrails.allowedVolumeTypes names them.
VOLUME_TYPES = ("persistentVolumeClaim", "configMap", "secret", "emptyDir", "csi", "image", "hostPath")
