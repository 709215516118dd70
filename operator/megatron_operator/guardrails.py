"""The cluster admin's guardrails (pure): what a MegatronJob may ask for on this cluster.

Set through the operator's settings (Helm values under ``guardrails``); every one is off by default.
They are enforced twice, from the one table below (``GUARDRAILS``: the core's, then each block's, blocks/):

- at admission, by the chart's ValidatingAdmissionPolicy (templates/guardrails-policy.yaml, written
  by scripts/gen-chart-guardrails.py from ``GUARDRAILS``): ``kubectl apply`` of a job that breaks
  one is refused by the API server;
- by the operator, the second line (a policy switched off, a job stored before a guardrail was
  tightened): the job is refused like an invalid spec (phase Failed, reason InvalidSpec, condition
  InvalidSpec naming the field and the rule), before any child is created.

Each guardrail's message is one template. The operator fills it with Python, the policy with a CEL
``messageExpression`` generated from the same template, so the two cannot say different things
(tests/unit/test_chart.py evaluates the rendered policy against the operator on a table of jobs).
"""

from __future__ import annotations

import re
from collections.abc import Iterator

from . import blocks
from .settings import Settings
from .spec import MegatronJob
from .vocab.guardrail import Guardrail, Violation, listed, lower_ascii, registry_ok
from .vocab.rule import Problem


def _metadata(where: str) -> Guardrail:
    keys = f"spec.podMetadata.{where}"
    return Guardrail(
        "metadata-key", f"spec.podMetadata.{where}", "deniedMetadataKeys",
        "{item} is denied on this cluster (denied key prefixes: {limit})",
        f"!has(spec.podMetadata) || !has({keys}) || "
        f"{keys}.all(k, !LIMIT.exists(d, k.lowerAscii().startsWith(d.lowerAscii())))",
        f"{keys}.filter(k, LIMIT.exists(d, k.lowerAscii().startsWith(d.lowerAscii())))[0]")


_TOLERATION_KEYS = "spec.resources.tolerations.map(t, has(t.key) ? t.key : '')"

GUARDRAILS: tuple[Guardrail, ...] = (
    Guardrail("image-registry", "spec.image", "allowedImageRegistries",
              "this cluster runs images only from {limit}; use one of them (or omit spec.image for the "
              "operator's default)",
              "!has(spec.image) || spec.image == '' || "
              "LIMIT.exists(r, spec.image.startsWith(r.endsWith('/') ? r : r + '/'))"),
    Guardrail("priority-class", "spec.priorityClassName", "allowedPriorityClasses",
              "{item} is not allowed here; use one of {limit} or omit it",
              "!has(spec.priorityClassName) || spec.priorityClassName == '' || spec.priorityClassName in LIMIT",
              "spec.priorityClassName"),
    Guardrail("toleration-key", "spec.resources.tolerations", "allowedTolerationKeys",
              "toleration key {item} is not allowed here; allowed keys: {limit}",
              f"!has(spec.resources) || !has(spec.resources.tolerations) || {_TOLERATION_KEYS}.all(k, k in LIMIT)",
              f"{_TOLERATION_KEYS}.filter(k, !(k in LIMIT)).map(k, k == '' ? '(empty: every taint)' : k)[0]"),
    Guardrail("node-selector-key", "spec.resources.nodeSelector", "allowedNodeSelectorKeys",
              "{item} is not allowed here; allowed keys: {limit}",
              "!has(spec.resources) || !has(spec.resources.nodeSelector) || "
              "spec.resources.nodeSelector.all(k, k in LIMIT)",
              "spec.resources.nodeSelector.filter(k, !(k in LIMIT))[0]"),
    Guardrail("grace-period", "spec.terminationGracePeriodSeconds", "maxTerminationGracePeriodSeconds",
              "{item} is above this cluster's maximum {limit}",
              "!has(spec.terminationGracePeriodSeconds) || spec.terminationGracePeriodSeconds <= LIMIT",
              "string(spec.terminationGracePeriodSeconds)"),
    Guardrail("queue-name", "spec.queueName", "requireQueueName",
              "this cluster admits jobs through Kueue only; set spec.queueName to your LocalQueue",
              "has(spec.queueName) && spec.queueName != ''"),
    Guardrail("secret-env", "spec.env", "denySecretEnv",
              "Secret references (valueFrom.secretKeyRef) are not allowed here",
              "!has(spec.env) || !spec.env.exists(e, has(e.valueFrom) && has(e.valueFrom.secretKeyRef))"),
    Guardrail("image-pull-secrets", "spec.imagePullSecrets", "denyImagePullSecrets",
              "not allowed here; the cluster provides image pull credentials",
              "!has(spec.imagePullSecrets) || size(spec.imagePullSecrets) == 0"),
    _metadata("labels"),
    _metadata("annotations"),
)


# The blocks' guardrails (blocks/: spec.checkpoint.objectStore, spec.pod, spec.logging.wandb) after the core's;
# the order of the table is the order of the chart's policy
GUARDRAILS += (*blocks.object_store.GUARDRAILS, *blocks.pod.GUARDRAILS, *blocks.wandb.GUARDRAILS)

_BY_FIELD = {r.field: r for r in GUARDRAILS}


def _violations(job: MegatronJob, settings: Settings) -> Iterator[Violation]:
    """(guardrail, item, limit) for every entry of the job that breaks one."""
    spec = job.spec
    g = _BY_FIELD
    if spec.image and (registries := listed(settings.allowed_image_registries)):
        if not registry_ok(spec.image, registries):
            yield g["spec.image"], "", ", ".join(registries)
    if spec.priority_class_name and (classes := listed(settings.allowed_priority_classes)):
        if spec.priority_class_name not in classes:
            yield g["spec.priorityClassName"], spec.priority_class_name, ", ".join(classes)
    if keys := listed(settings.allowed_toleration_keys):
        for t in spec.resources.tolerations:
            if (t.key or "") not in keys:
                yield g["spec.resources.tolerations"], t.key or "(empty: every taint)", ", ".join(keys)
    if keys := listed(settings.allowed_node_selector_keys):
        for k in spec.resources.node_selector:
            if k not in keys:
                yield g["spec.resources.nodeSelector"], k, ", ".join(keys)
    grace, limit = spec.termination_grace_period_seconds, settings.max_termination_grace_period_s
    if limit and grace is not None and grace > limit:
        yield g["spec.terminationGracePeriodSeconds"], str(grace), str(limit)
    if settings.require_queue_name and not spec.queue_name:
        yield g["spec.queueName"], "", ""
    if settings.deny_secret_env and any(e.value_from and e.value_from.secret_key_ref for e in spec.env):
        yield g["spec.env"], "", ""
    if settings.deny_image_pull_secrets and spec.image_pull_secrets:
        yield g["spec.imagePullSecrets"], "", ""
    denied = listed(settings.denied_metadata_keys)
    for where, keys in (("labels", spec.pod_metadata.labels), ("annotations", spec.pod_metadata.annotations)):
        for k in keys:
            if any(lower_ascii(k).startswith(lower_ascii(d)) for d in denied):
                yield g[f"spec.podMetadata.{where}"], k, ", ".join(denied)
    # the blocks'
    yield from blocks.object_store.guardrail_violations(spec.checkpoint.object_store if spec.checkpoint else None,
                                                        settings)
    yield from blocks.pod.guardrail_violations(spec.pod, settings)
    yield from blocks.wandb.guardrail_violations(spec.logging.wandb, settings)


def guardrail_problems(job: MegatronJob, settings: Settings) -> list[Problem]:
    return [Problem(r.field, f"{r.field}: " + r.message.format(item=item, limit=limit), f"guardrail-{r.rule}")
            for r, item, limit in _violations(job, settings)]


# --- the same rules as CEL, for the chart's ValidatingAdmissionPolicy -------------------------------


def cel_string(text: str) -> str:
    """``text`` as a CEL string literal."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def cel_expression(rule: Guardrail, limit: str) -> str:
    """``rule.allowed`` with the value's CEL literal ``limit`` (a list or a number)."""
    return _cel(rule.allowed, limit)


def cel_message(rule: Guardrail, limit: str, limit_text: str) -> str:
    """A CEL expression for the operator's message; ``limit_text`` is a CEL string literal of the value
    as the message shows it (a list joined by ", ")."""
    parts: list[str] = []
    for literal, name in re.findall(r"([^{]*)(?:\{(item|limit)\}|$)", f"{rule.field}: {rule.message}"):
        if literal:
            parts.append(cel_string(literal))
        if name == "item":
            parts.append(f"({_cel(rule.item, limit)})")
        elif name == "limit":
            parts.append(limit_text)
    return " + ".join(parts)


def _cel(expr: str, limit: str) -> str:
    return re.sub(r"\bLIMIT\b", limit, re.sub(r"(?<![\w.])spec\b", "object.spec", expr))
