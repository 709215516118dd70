"""``Rule`` (one admission rule, Python and CEL at once), ``Problem`` (a violated one), and the helpers rules
are built from.

A rule is written once in the ``expr`` language and used twice: evaluated in Python by the pydantic models
(operator and CLI) and emitted as a CEL rule on ``spec`` in the CRD (API server). Messages name the field
path, the numbers and a fix.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ..expr import (
    All,
    Attr,
    Expr,
    Field,
    Filter,
    Has,
    Index,
    Lit,
    Matches,
    Size,
    Var,
    bind_field,
    bind_shared,
    cond,
    fmt,
    optionals,
    rebase,
)
from .patterns import QUALIFIED_NAME_RE
from .values import MODEL_VALUES, f, model_parallel, world


@dataclass(frozen=True)
class Rule:
    """``check`` must hold whenever ``when`` holds; else ``message`` (a string expression)."""

    name: str
    field: str  # the field the error is reported on, relative to spec (CEL fieldPath)
    check: Expr
    message: Expr
    when: Expr | None = None

    def condition(self) -> Expr:
        return self.check if self.when is None else (~self.when) | self.check

    def cel_condition(self) -> Expr:
        """``condition()`` as the API server evaluates it: each shared model value a rule reads more than once
        computed once, and ``self.model``, ``self.parallelism``, ``self.training``, ``self.data`` and
        ``self.resources`` (required or defaulted objects) resolved once (``expr.bind_shared``, ``expr.rebase``);
        ``has(x) ? x : d`` as ``x.?f.orValue(d)`` and the preset read once (``expr.optionals``,
        ``expr.bind_field``). The same verdicts for less CEL work:
        the API server's cost per field read grows with the number of sibling properties."""
        out = bind_shared(self.condition(), {**{f"v_{name}": e for name, e in MODEL_VALUES.items()},
                                             "v_world": world, "v_modelParallel": model_parallel})
        for prefix, var in (("model", "v_model"), ("parallelism", "v_parallelism"), ("training", "v_training"),
                            ("data", "v_data"), ("resources", "v_resources")):
            out = rebase(out, prefix, var)
        # the preset is a schema enum: "" can never be one
        return optionals(bind_field(out, "v_model", "preset", "v_preset", ""))

    def to_cel(self) -> dict[str, str]:
        out = {"rule": self.cel_condition().cel()}
        if isinstance(self.message, Lit):
            out["message"] = self.message.value
        else:
            out["messageExpression"] = self.message.cel()
        return {**out, "fieldPath": "." + self.field, "reason": "FieldValueInvalid"}


@dataclass(frozen=True)
class Problem:
    """One violated rule, as the CLI and the operator report it."""

    field: str  # full path, e.g. spec.training.globalBatchSize
    message: str
    rule: str

    def as_dict(self) -> dict[str, str]:
        return {"field": self.field, "message": self.message, "rule": self.rule}


# --------------------------------------------------------------------------------------------
# Helpers rules are built from
# --------------------------------------------------------------------------------------------


def all_of(exprs: Iterable[Expr]) -> Expr:
    out: Expr = Lit(True)
    for e in exprs:
        out = out & e
    return out


def any_of(exprs: Iterable[Expr]) -> Expr:
    first, *rest = exprs
    for e in rest:
        first = first | e
    return first


def multiple_hint(value: Expr, m: Expr) -> Expr:
    """' such as 96 or 128': the multiples of m around value (or m and 2m below it)."""
    lower = (value // m) * m
    return cond(lower > 0, fmt(" such as ", lower.str(), " or ", (lower + m).str()),
                fmt(" such as ", m.str(), " or ", (m * 2).str()))


def count_present(var: str, names: Iterable[str]) -> Expr:
    """How many of the fields ``names`` the comprehension variable ``var`` has."""
    out: Expr = Lit(0)
    for n in names:
        out = out + cond(Has(Field(n, var)), 1, 0)
    return out


def first_attr(items: Expr, var: str, bad: Expr, attr: str = "name") -> Expr:
    """``attr`` of the first of ``items`` for which ``bad`` holds (for a message: guard with the rule's check)."""
    return Attr(Index(Filter(items, var, bad), 0), attr)


def unique_by(items: Expr, var: str, attr: str) -> Expr:
    """``var``'s ``attr`` is given by exactly one of ``items``."""
    return Size(Filter(items, "x", Field(attr, "x").eq(Field(attr, var)))).eq(1)


def no_literal_env(name: str, names_re: str, what: str, secret_field: str) -> Rule:
    """spec.env may not give a variable whose name matches `names_re` a literal value: it is `what`, a secret."""
    literal = lambda e: Matches(Field("name", e), names_re) & Has(Field("value", e))  # noqa: E731
    return Rule(name, "env", All(f("env"), "e", ~literal("e")),
                message=fmt("spec.env: ", Attr(Index(Filter(f("env"), "e", literal("e")), 0), "name"),
                            f" holds {what} as a literal value, which shows in the pods and in `kubectl get -o "
                            f"yaml`; put it in a Secret: {secret_field}"))


def qualified_keys_rule(name: str, field: str, what: str) -> Rule:
    """Every key of the map at ``field`` is a Kubernetes qualified name (labels, annotations, node selectors)."""
    keys = f(field)
    return Rule(name, field, All(keys, "k", Matches(Var("k"), QUALIFIED_NAME_RE)),
                message=fmt(f"spec.{field}: ", Index(Filter(keys, "k", ~Matches(Var("k"), QUALIFIED_NAME_RE)), 0),
                            f" is not a valid {what}; use [prefix/]name: name at most 63 characters of letters, "
                            "digits, '-', '_' and '.', starting and ending with a letter or digit; prefix a DNS "
                            "subdomain (lower case)"))
