"""``Guardrail``: one of the cluster admin's rules (guardrails.py collects them), and the helpers of its
Python twin."""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Guardrail:
    """One admission rule. In ``allowed`` and ``item`` (CEL), ``LIMIT`` stands for the Helm value
    (a list of strings, or a number) and ``spec`` for ``object.spec``."""

    rule: str  #: Problem.rule is ``guardrail-<rule>``
    field: str  #: the field the message names
    value: str  #: the Helm value under ``guardrails`` (and, in snake case, the Settings field)
    message: str  #: after "<field>: "; {item}: the offending entry, {limit}: the value (a list joined by ", ")
    allowed: str  #: CEL, true when the job keeps the guardrail
    item: str = ""  #: CEL, the offending entry the message names (the first one, where there are several)
    #: Enforced whatever the value, an empty list included (it then allows nothing; the message shows "none"):
    #: for the allow-lists of what is refused by default (volume types, privileged images).
    always: bool = False


#: (guardrail, item, limit): an entry of a job that breaks a guardrail, as a Python twin yields it.
Violation = tuple[Guardrail, str, str]


def lower_ascii(text: str) -> str:
    """CEL's lowerAscii(): only A-Z change, so Python and the API server compare keys alike."""
    return re.sub("[A-Z]", lambda m: m.group().lower(), text)


def listed(value: str) -> list[str]:
    """A comma-separated setting as a list."""
    return [v.strip() for v in value.split(",") if v.strip()]


def registry_ok(image: str, registries: list[str]) -> bool:
    """``image`` is under one of ``registries`` (an entry ending in '/' as is, else with its '/')."""
    return any(image.startswith(r if r.endswith("/") else r + "/") for r in registries)
