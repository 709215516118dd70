"""Turn a manifest (a dict from YAML or the API server) into a validated MegatronJob, or into a
list of problems that each name a field path and say how to fix it. Never a traceback."""

from __future__ import annotations

import difflib
from typing import Any

from pydantic import BaseModel, ValidationError

from .rules import Problem
from .spec import API_VERSION, KIND, MegatronJob, model_in

_UNION_TAGS = {"int", "str", "constrained-str", "float", "bool", "dict[str,str]", "list[str]"}


class SpecError(ValueError):
    """A manifest that is not a valid MegatronJob."""

    def __init__(self, problems: list[Problem]):
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
            out += ("." if out else "") + str(part)
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
            shown = f" (got {value!r})" if isinstance(value, (int, float, str, bool)) else ""
            msg = f"{path}: {err['msg']}{shown}"
        if msg not in seen:
            seen.add(msg)
            problems.append(Problem(path, msg, typ))
    return problems


def parse_job(doc: Any) -> MegatronJob:
    """A validated MegatronJob, or SpecError listing every problem."""
    if not isinstance(doc, dict):
        raise SpecError([Problem("", f"not a Kubernetes object (got {type(doc).__name__})", "not-an-object")])
    if doc.get("kind") != KIND or doc.get("apiVersion") != API_VERSION:
        raise SpecError([Problem("kind", f"{doc.get('apiVersion')}/{doc.get('kind')} is not a {API_VERSION} "
                                         f"{KIND}", "not-a-megatronjob")])
    try:
        return MegatronJob.model_validate(doc)
    except ValidationError as exc:
        raise SpecError(problems_from(exc)) from None


def is_megatronjob(doc: Any) -> bool:
    return isinstance(doc, dict) and doc.get("kind") == KIND and str(doc.get("apiVersion", "")).startswith(
        API_VERSION.split("/")[0] + "/")
