{{/* Chart name (nameOverride wins). */}}
{{- define "megatron-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full object name: <release>-<name>, or the release name when it already contains <name>. */}}
{{- define "megatron-operator.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "megatron-operator.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels on every object. */}}
{{- define "megatron-operator.labels" -}}
helm.sh/chart: {{ include "megatron-operator.chart" . }}
{{ include "megatron-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: megatron-operator
{{- end }}

{{/* The operator pod's selector (stable across upgrades: never add to it). */}}
{{- define "megatron-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "megatron-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end }}

{{- define "megatron-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "megatron-operator.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* repository[:tag|@digest]; the tag defaults to the chart's appVersion. */}}
{{- define "megatron-operator.imageRef" -}}
{{- if .image.digest }}
{{- printf "%s@%s" .image.repository .image.digest }}
{{- else }}
{{- printf "%s:%s" .image.repository (default .appVersion .image.tag) }}
{{- end }}
{{- end }}

{{/*
The operator's permissions, one list for the ClusterRole (cluster-wide) and the per-namespace
Roles. Every rule is a call the operator or kopf makes (operator/megatron_operator/kube.py,
handlers.py; kopf's watching and event posting); docs/install.md explains each one.
*/}}
{{- define "megatron-operator.rules" -}}
# Watch MegatronJobs. Never written but for their status: the operator has no create/update
# handlers (kopf stores nothing in the object) and no per-object timers or daemons (no finalizer).
- apiGroups: ["megatron-operator.io"]
  resources: ["megatronjobs"]
  verbs: ["list", "watch"]
# Status is server-side applied. "get" is not called, but every job's Role grants its trainer
# get+patch on its own status, and RBAC lets the operator grant only what it holds itself.
- apiGroups: ["megatron-operator.io"]
  resources: ["megatronjobs/status"]
  verbs: ["get", "patch"]
# Children carry ownerReferences with blockOwnerDeletion: the OwnerReferencesPermissionEnforcement
# admission plugin (where enabled) requires update on the owner's finalizers.
- apiGroups: ["megatron-operator.io"]
  resources: ["megatronjobs/finalizers"]
  verbs: ["update"]
# The JobSet of each job: created once, suspend patched, deleted on activeDeadlineSeconds;
# a label-selected watch feeds the status. "get" reads an existing JobSet of the same name on a
# create conflict (409): the operator uses it only if its controller is this MegatronJob.
- apiGroups: ["jobset.x-k8s.io"]
  resources: ["jobsets"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# Kueue's Workload of a queued JobSet (only when spec.queueName is set): its conditions give the
# status Kueue's own message; spec.active is how a job under Kueue is suspended and resumed.
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["workloads"]
  verbs: ["list", "patch"]
# Read-only, label-selected pod watch (phase, scheduling and image-pull problems for the status).
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "watch"]
# Each job's own identity: a ServiceAccount, a Role allowing get/patch on its own status, a RoleBinding.
# "get" on a create conflict (409): an existing object of that name is used only if this job controls it.
- apiGroups: [""]
  resources: ["serviceaccounts"]
  verbs: ["get", "create"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles", "rolebindings"]
  verbs: ["get", "create"]
# Events on MegatronJobs (Running, Stalled, JobSetRecreated, ...).
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- end }}
