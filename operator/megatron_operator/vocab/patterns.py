"""Field patterns (regular expressions, RE2 syntax): the schema's ``pattern`` and the rules' ``matches()``."""

from __future__ import annotations

DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
# A relative path inside a volume: no leading slash, no empty components, and no component that is
# only dots: "../tmp/ckpt" would leave the volume for the pod's ephemeral /tmp (resume silently
# lost), "." would put a job's checkpoints beside every other job's (retention deletes them).
REL_PATH = r"^[A-Za-z0-9_.-]*[A-Za-z0-9_-][A-Za-z0-9_.-]*(/[A-Za-z0-9_.-]*[A-Za-z0-9_-][A-Za-z0-9_.-]*)*$"
# A file of a ConfigMap or Secret volume (KeyToPath.path): REL_PATH, and not starting with '..' (Kubernetes
# pkg/apis/core/validation, validateKeyToPath -> validateLocalNonReservedPath: validateLocalDescendingPath, no
# absolute path and no '..' part, plus no leading '..', the kubelet's own ..data and ..<timestamp> entries).
KEY_TO_PATH = r"^\.?[A-Za-z0-9_-][A-Za-z0-9_.-]*(/[A-Za-z0-9_.-]*[A-Za-z0-9_-][A-Za-z0-9_.-]*)*$"
# An absolute path: components as in REL_PATH (none empty, none made only of dots), no trailing slash.
ABS_PATH = r"^(/[A-Za-z0-9_.-]*[A-Za-z0-9_-][A-Za-z0-9_.-]*)+$"
# A quantity the API server can store and a pod can use: at most 15 digits, suffixes up to P/Pi.
QUANTITY = r"^[0-9]{1,15}(\.[0-9]{1,9})?(m|k|Ki|M|Mi|G|Gi|T|Ti|P|Pi)?$"
# Label values: at most 63 characters, alphanumeric at both ends (Kubernetes' IsValidLabelValue).
LABEL_VALUE = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
# ConfigMap and Secret keys (Kubernetes' IsConfigMapKey, k8s.io/apimachinery pkg/util/validation: letters, digits,
# '-', '_', '.', and not '.', '..' or anything starting with '..' (hasChDirPrefix)). The API server refuses such a
# key in an env secretKeyRef or configMapKeyRef (pkg/apis/core/validation, validateSecretKeySelector,
# validateConfigMapKeySelector), and no Secret or ConfigMap can hold one, so a volume item naming it never mounts.
CONFIG_KEY = r"^\.?[-_a-zA-Z0-9][-._a-zA-Z0-9]*$"
# The largest integer a CRD schema bound can state exactly (the API server reads bounds as float64).
MAX_SAFE_INT = 2**53 - 1
ENV_NAME = r"^[-._a-zA-Z][-._a-zA-Z0-9]*$"
# Extended resource names: a domain-prefixed name, e.g. rdma/hca_shared_devices_a.
RESOURCE_NAME = r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
# Label, annotation, nodeSelector and taint keys: [DNS subdomain prefix/]name, the name at most 63
# characters, alphanumeric at both ends (Kubernetes' IsQualifiedName).
QUALIFIED_NAME_RE = (r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                     r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")

# Environment variables that hold an object-store credential: never as a literal value in the spec
# (it would show in the JobSet, the pods and `kubectl get -o yaml`). AWS_CONTAINER_AUTHORIZATION_TOKEN is the
# token botocore sends to AWS_CONTAINER_CREDENTIALS_FULL_URI, AWS_BEARER_TOKEN_<SERVICE> a service's bearer
# token (botocore.utils.get_token_from_environment). docs/object-storage.md lists every variable boto3 and
# multi-storage-client read, and what is refused.
CREDENTIAL_ENV_RE = (r"^(AWS_ACCESS_KEY_ID|AWS_SECRET_ACCESS_KEY|AWS_SESSION_TOKEN|AWS_SECURITY_TOKEN|"
                     r"AWS_CONTAINER_AUTHORIZATION_TOKEN|AWS_BEARER_TOKEN_[A-Z0-9_]+)$")
# A URL with user info (scheme://user[:password]@host): a credential in the URL, in any variable.
URL_USERINFO_RE = r"^[A-Za-z][A-Za-z0-9+.-]*://[^/?#]*@"

# The environment the NVIDIA container runtime reads to choose what a container gets of the node's GPUs: which
# devices (NVIDIA_VISIBLE_DEVICES=all is every GPU of the node, whatever the pod requested), which driver
# capabilities and libraries, MIG configuration and monitoring, IMEX channels (nvidia-container-toolkit
# internal/config/image/cuda_image.go: EnvVarNvidiaVisibleDevices, EnvVarNvidiaDriverCapabilities,
# EnvVarNvidiaMigConfigDevices, EnvVarNvidiaMigMonitorDevices, EnvVarNvidiaImexChannels), and CUDA_VISIBLE_DEVICES,
# which the device plugin's allocation decides too. The device plugin sets them; no container of a job may.
GPU_DEVICE_ENV = ("NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES", "NVIDIA_MIG_CONFIG_DEVICES",
                  "NVIDIA_MIG_MONITOR_DEVICES", "NVIDIA_IMEX_CHANNELS", "CUDA_VISIBLE_DEVICES")
GPU_DEVICE_ENV_RE = r"^(" + "|".join(GPU_DEVICE_ENV) + r")$"
