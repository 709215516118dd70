"""The cluster admin's guardrails (pure): what a MegatronJob may ask for on this cluster.

Set through the operator's settings (Helm values under ``guardrails``); every one is off by default.
A job that breaks one is refused like an invalid spec (phase Failed, reason InvalidSpec, condition
InvalidSpec naming the field and the rule), before any child is created. The API server cannot see
these settings; docs/install.md shows how to enforce the same at admission with a
ValidatingAdmissionPolicy.
"""

from __future__ import annotations

from .rules import Problem
from .settings import Settings
from .spec import MegatronJob


def _listed(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def guardrail_problems(job: MegatronJob, settings: Settings) -> list[Problem]:
    spec = job.spec
    out: list[Problem] = []

    def refuse(field: str, message: str, rule: str) -> None:
        out.append(Problem(field, f"{field}: {message}", f"guardrail-{rule}"))

    if spec.image and (registries := _listed(settings.allowed_image_registries)):
        if not any(spec.image.startswith(r.rstrip("/") + "/") for r in registries):
            refuse("spec.image", f"this cluster runs images only from {', '.join(registries)}; use one of them "
                   "(or omit spec.image for the operator's default)", "image-registry")
    if spec.priority_class_name and (classes := _listed(settings.allowed_priority_classes)):
        if spec.priority_class_name not in classes:
            refuse("spec.priorityClassName", f"{spec.priority_class_name} is not allowed here; use one of "
                   f"{', '.join(classes)} or omit it", "priority-class")
    if keys := _listed(settings.allowed_toleration_keys):
        for t in spec.resources.tolerations:
            if (t.key or "") not in keys:
                refuse("spec.resources.tolerations", f"toleration key {t.key or '(empty: every taint)'} is not "
                       f"allowed here; allowed keys: {', '.join(keys)}", "toleration-key")
    if keys := _listed(settings.allowed_node_selector_keys):
        for k in spec.resources.node_selector:
            if k not in keys:
                refuse("spec.resources.nodeSelector", f"{k} is not allowed here; allowed keys: {', '.join(keys)}",
                       "node-selector-key")
    grace = spec.termination_grace_period_seconds
    if settings.max_termination_grace_period_s and grace and grace > settings.max_termination_grace_period_s:
        refuse("spec.terminationGracePeriodSeconds", f"{grace} is above this cluster's maximum "
               f"{settings.max_termination_grace_period_s}", "grace-period")
    if settings.require_queue_name and not spec.queue_name:
        refuse("spec.queueName", "this cluster admits jobs through Kueue only; set spec.queueName to your "
               "LocalQueue", "queue-name")
    if settings.deny_secret_env and any(e.value_from and e.value_from.secret_key_ref for e in spec.env):
        refuse("spec.env", "Secret references (valueFrom.secretKeyRef) are not allowed here", "secret-env")
    if settings.deny_image_pull_secrets and spec.image_pull_secrets:
        refuse("spec.imagePullSecrets", "not allowed here; the cluster provides image pull credentials",
               "image-pull-secrets")
    denied = _listed(settings.denied_metadata_keys)
    meta = spec.pod_metadata
    for where, keys in (("spec.podMetadata.labels", meta.labels), ("spec.podMetadata.annotations", meta.annotations)):
        for k in keys:
            if any(k.lower().startswith(d.lower()) for d in denied):
                refuse(where, f"{k} is denied on this cluster (denied key prefixes: {', '.join(denied)})",
                       "metadata-key")
    return out
