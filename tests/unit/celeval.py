"""Evaluate a CRD's schema defaults and CEL rules in-process, the way the API server does.

``apply_defaults`` mirrors apiextensions' structural defaulting (a field with a ``default`` is set
when absent and its parent object exists; defaults are applied recursively, also inside defaulted
values). ``cel_errors`` evaluates every ``x-kubernetes-validations`` rule on every node of the
object with cel-python and returns the messages of the failed ones (messageExpression evaluated
too). The real API server's verdict on the same table is checked in e2e.
"""

from __future__ import annotations

import copy
import re
from typing import Any

import celpy


def apply_defaults(schema: dict[str, Any], obj: Any) -> Any:
    if isinstance(obj, dict) and schema.get("type") == "object":
        out = dict(obj)
        for key, sub in schema.get("properties", {}).items():
            if key not in out and "default" in sub:
                out[key] = copy.deepcopy(sub["default"])
            if key in out:
                out[key] = apply_defaults(sub, out[key])
        addl = schema.get("additionalProperties")
        if isinstance(addl, dict):
            out = {k: apply_defaults(addl, v) for k, v in out.items()}
        return out
    if isinstance(obj, list) and schema.get("type") == "array":
        return [apply_defaults(schema["items"], v) for v in obj]
    return obj


_ENV = celpy.Environment()
_CACHE: dict[str, Any] = {}


def _format(template: Any, args: Any) -> Any:
    """Kubernetes CEL's strings-extension format(), for the verbs our messages use (%d, %s, %%)."""
    out, i, values = [], 0, list(args)
    t = str(template)
    k = 0
    while k < len(t):
        c = t[k]
        if c == "%" and k + 1 < len(t):
            verb = t[k + 1]
            if verb == "%":
                out.append("%")
            elif verb == "d":
                out.append(str(int(values[i])))
                i += 1
            elif verb == "s":
                out.append(str(values[i]))
                i += 1
            else:
                raise ValueError(f"unsupported format verb %{verb}")
            k += 2
            continue
        out.append(c)
        k += 1
    if i != len(values):
        raise ValueError("too many arguments to format()")
    return celpy.celtypes.StringType("".join(out))


def _has_value(optional: Any) -> Any:
    """CEL's ``optional.hasValue()``; an optional is passed here as a list of zero or one values."""
    return celpy.celtypes.BoolType(len(optional) > 0)


def _value(optional: Any) -> Any:
    """CEL's ``optional.value()`` (an error when empty): the list's one value."""
    if len(optional) != 1:
        raise ValueError("optional.none() dereference")
    return optional[0]


_OPTIONAL_FIELD = re.compile(r"([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)\.\?([A-Za-z_][A-Za-z0-9_]*)\.orValue\(")


def without_optionals(expr: str) -> str:
    """``a.?b.orValue(d)`` (CEL's optional field selection, which cel-python does not parse) written as
    ``(has(a.b) ? a.b : d)``: the same value, by the definition of optional selection on a message or
    object (the generator writes only this form: ``expr.OrValue``)."""
    while m := _OPTIONAL_FIELD.search(expr):
        depth, i, quote = 1, m.end(), None
        while depth:  # the end of orValue's argument: its closing parenthesis, outside string literals
            c = expr[i]
            if quote:
                if c == "\\":
                    i += 1
                elif c == quote:
                    quote = None
            elif c in "\"'":
                quote = c
            elif c == "(":
                depth += 1
            elif c == ")":
                depth -= 1
            i += 1
        field = f"{m[1]}.{m[2]}"
        expr = f"{expr[:m.start()]}(has({field}) ? {field} : {expr[m.end():i - 1]}){expr[i:]}"
    return expr


def _last_index_of(items: Any, value: Any) -> Any:
    """Kubernetes CEL's lists library: list.lastIndexOf(x), -1 when absent."""
    return celpy.celtypes.IntType(max((i for i, item in enumerate(items) if item == value), default=-1))


def _program(expr: str) -> Any:
    if expr not in _CACHE:
        _CACHE[expr] = _ENV.program(_ENV.compile(without_optionals(expr)),
                                    functions={"format": _format, "hasValue": _has_value, "value": _value,
                                               "lastIndexOf": _last_index_of})
    return _CACHE[expr]


def evaluate(expr: str, self_value: Any, old_value: Any = None, optional_old_self: bool = False) -> Any:
    """``optional_old_self``: the rule's optionalOldSelf, so oldSelf is an optional (empty on create)."""
    activation = {"self": celpy.json_to_cel(self_value)}
    if optional_old_self:
        activation["oldSelf"] = celpy.celtypes.ListType([] if old_value is None else [celpy.json_to_cel(old_value)])
    elif old_value is not None:
        activation["oldSelf"] = celpy.json_to_cel(old_value)
    result = _program(expr).evaluate(activation)
    if isinstance(result, celpy.CELEvalError):
        raise RuntimeError(f"CEL error in {expr[:200]}...: {result}")
    return result


def cel_errors(schema: dict[str, Any], obj: Any, path: str = "", old: Any = None) -> list[str]:
    """Messages of every failed rule (transition rules only when ``old`` is given; rules with
    optionalOldSelf also without, as the API server does with CRDValidationRatcheting on)."""
    errors: list[str] = []
    for rule in schema.get("x-kubernetes-validations", []):
        uses_old = "oldSelf" in rule["rule"]
        optional = rule.get("optionalOldSelf", False)
        if uses_old and old is None and not optional:
            continue
        ok = evaluate(rule["rule"], obj, old if uses_old else None, optional)
        if not bool(ok):
            if "messageExpression" in rule:
                msg = str(evaluate(rule["messageExpression"], obj))
            else:
                msg = rule.get("message", rule["rule"])
            errors.append(msg)
    if isinstance(obj, dict) and schema.get("type") == "object":
        for key, sub in schema.get("properties", {}).items():
            if key in obj:
                sub_old = old.get(key) if isinstance(old, dict) else None
                errors += cel_errors(sub, obj[key], f"{path}.{key}", sub_old)
        addl = schema.get("additionalProperties")
        if isinstance(addl, dict):
            for key, value in obj.items():
                errors += cel_errors(addl, value, f"{path}.{key}")
    if isinstance(obj, list) and schema.get("type") == "array":
        for i, value in enumerate(obj):
            errors += cel_errors(schema["items"], value, f"{path}[{i}]")
    return errors
