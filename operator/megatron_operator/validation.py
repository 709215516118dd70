"""Turn a manifest (a dict from YAML or the API server) into a validated MegatronJob, or into a
list of problems that each name a field path and say how to fix it. Never a traceback."""

from __future__ import annotations

import difflib
from typing import Any

from pydantic import BaseModel, ValidationError

from .rules import Problem
from .spec import API_VERSION, KIND, MegatronJob
from .vocab.api import model_in

_UNION_TAGS = {"int", "str", "constrained-str", "float", "bool", "dict[str,str]", "list[str]"}


#: Problems reported per object; the rest are counted in one last line (a hostile manifest can have
#: a problem per list item, and the operator puts them into the job's status).
MAX_PROBLEMS = 20


class SpecError(ValueError):
    """A manifest that is not a valid MegatronJob."""

    def __init__(self, problems: list[Problem]):
        if len(problems) > MAX_PROBLEMS:
            problems = [*problems[:MAX_PROBLEMS - 1],
                        Problem("", f"... and {len(problems) - MAX_PROBLEMS + 1} more problems", "too-many-problems")]
        self.problems = problems
        super().__init__("; ".join(p.message for p in problems))


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The pydantic model that owns the field at ``loc`` (for 'did you mean')."""
    model: type[BaseModel] | None = MegatronJob
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        if model is None:
            return None
        field = next((f for n, f in model.model_fields.items() if (f.alias or n) == part), None)
        if field is None:
            return None
        model = model_in(field.annotation)
    return model


def _path(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in _UNION_TAGS or str(part).startswith("function-"):
            continue
        else:
            out += ("." if out else "") + shorten(str(part), 64)
    return out


def problems_from(exc: ValidationError) -> list[Problem]:
    problems: list[Problem] = []
    seen: set[str] = set()
    for err in exc.errors():
        loc = tuple(err["loc"])
        path = _path(loc)
        typ = err["type"]
        if typ == "megatron_rules":
            for p in err["ctx"]["problems"]:
                problems.append(Problem(p["field"], p["message"], p["rule"]))
            continue
        if typ == "extra_forbidden":
            model = _model_at(loc)
            known = sorted((f.alias or n) for n, f in model.model_fields.items()) if model else []
            close = difflib.get_close_matches(str(loc[-1]), known, n=1)
            hint = f"; did you mean {close[0]}?" if close else (f"; known fields: {', '.join(known)}" if known else "")
            msg = f"{path}: unknown field{hint}"
        elif typ == "missing":
            msg = f"{path}: required"
        elif typ == "null_field":
            msg = f"{path}: {err['msg']}" if path else err["msg"]
        elif loc and loc[-1] in _UNION_TAGS:
            msg = f"{path}: must be an integer or a quantity such as 8, 500m or 64Gi"
        else:
            value = err.get("input")
            shown = f" (got {shorten(repr(value))})" if isinstance(value, (int, float, str, bool)) else ""
            msg = f"{path}: {err['msg']}{shown}"
        if msg not in seen:
            seen.add(msg)
            problems.append(Problem(path, msg, typ))
    return problems


# Deeper than any MegatronJob can be (its deepest field is 5 levels down); bounds the work on hostile input.
MAX_DEPTH = 32
# Values echoed in messages are cut to this many characters.
MAX_ECHO = 80


def shorten(text: str, limit: int = MAX_ECHO) -> str:
    """``text``, cut to ``limit`` characters with the number of characters left out."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more characters)"


def shape_problems(doc: Any) -> list[Problem]:
    """What no Kubernetes object can be (checked before the models, without recursion): nesting
    deeper than MAX_DEPTH, map keys that are not strings (JSON has none; YAML allows ``1: x``)."""
    problems: list[Problem] = []
    stack: list[tuple[Any, str, int]] = [(doc, "", 0)]
    while stack and len(problems) < 10:
        node, path, depth = stack.pop()
        if depth > MAX_DEPTH:
            problems.append(Problem(path, f"{path}: nested deeper than {MAX_DEPTH} levels", "too-deep"))
            continue
        if isinstance(node, dict):
            for key, value in node.items():
                if len(problems) >= 10:
                    break
                if not isinstance(key, str):
                    problems.append(Problem(path, f"{path or 'the object'}: key {shorten(repr(key))} is not a "
                                                  f"string; quote it", "non-string-key"))
                else:
                    stack.append((value, f"{path}.{shorten(key, 64)}" if path else shorten(key, 64), depth + 1))
        elif isinstance(node, list):
            stack += [(value, f"{path}[{i}]", depth + 1) for i, value in enumerate(node)]
    return problems


def integral_floats_as_ints(doc: Any) -> Any:
    """A copy with 2.0 as 2: the API server takes an integral float for an integer field (and stores
    the integer); the models are strict otherwise ("2" and true are not integers)."""
    if isinstance(doc, float) and doc.is_integer():
        return int(doc)
    if isinstance(doc, dict):
        return {k: integral_floats_as_ints(v) for k, v in doc.items()}
    if isinstance(doc, list):
        return [integral_floats_as_ints(v) for v in doc]
    return doc


def parse_job(doc: Any) -> MegatronJob:
    """A validated MegatronJob, or SpecError listing every problem."""
    if not isinstance(doc, dict):
        raise SpecError([Problem("", f"not a Kubernetes object (got {type(doc).__name__})", "not-an-object")])
    if problems := shape_problems(doc):
        raise SpecError(problems)
    doc = integral_floats_as_ints(doc)
    if doc.get("kind") != KIND or doc.get("apiVersion") != API_VERSION:
        raise SpecError([Problem("kind", f"{doc.get('apiVersion')}/{doc.get('kind')} is not a {API_VERSION} "
                                         f"{KIND}", "not-a-megatronjob")])
    try:
        return MegatronJob.model_validate(doc)
    except ValidationError as exc:
        raise SpecError(problems_from(exc)) from None


def looks_like_megatronjob(doc: Any) -> bool:
    """A document meant as a MegatronJob (its group, or a kind like it), whatever its typos."""
    if not isinstance(doc, dict):
        return False
    group = str(doc.get("apiVersion") or "").split("/")[0]
    kind = str(doc.get("kind") or "").lower()
    return group == API_VERSION.split("/")[0] or "megatron" in kind or (
        not doc.get("apiVersion") and isinstance(doc.get("spec"), dict) and "numNodes" in doc["spec"])


def is_megatronjob(doc: Any) -> bool:
    return isinstance(doc, dict) and doc.get("kind") == KIND and str(doc.get("apiVersion", "")).startswith(
        API_VERSION.split("/")[0] + "/")
