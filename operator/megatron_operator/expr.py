"""A tiny expression language that is evaluated in Python AND compiled to CEL.

Every admission rule of a MegatronJob is written once with these nodes (see ``rules.py``). The
same tree is evaluated natively by the pydantic models (operator, CLI) and rendered as a CEL
``x-kubernetes-validations`` rule for the API server, so the two cannot drift: a test runs one
table of specs through both (the CEL through an in-process CEL interpreter, and later through the
real API server).

Semantics follow CEL on Kubernetes objects: ``self`` is the object the rule is attached to; a
field that is absent (no default) makes ``has()`` false and reading it an error. Python
evaluation mirrors that: reading an absent field raises ``Missing``. Integers only for arithmetic
(CEL's ``/`` on ints truncates toward zero; every operand here is positive, so ``//`` matches).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import re2  # the API server's regex engine: Python's re lets "$" match before a trailing newline


class Missing(LookupError):
    """A rule read a field that is absent; the rule is malformed (it must guard with Has)."""


class Expr:
    """Base node. Operators build new nodes, so rules read like arithmetic."""

    def cel(self) -> str:  # pragma: no cover - abstract
        raise NotImplementedError

    def eval(self, env: dict[str, Any]) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    # arithmetic
    def __add__(self, o: Any) -> Expr:
        return Bin("+", self, lit(o))

    def __radd__(self, o: Any) -> Expr:
        return Bin("+", lit(o), self)

    def __sub__(self, o: Any) -> Expr:
        return Bin("-", self, lit(o))

    def __mul__(self, o: Any) -> Expr:
        return Bin("*", self, lit(o))

    def __rmul__(self, o: Any) -> Expr:
        return Bin("*", lit(o), self)

    def __floordiv__(self, o: Any) -> Expr:
        return Bin("/", self, lit(o))

    def __mod__(self, o: Any) -> Expr:
        return Bin("%", self, lit(o))

    # comparisons (== and != are deliberately methods: dataclass equality stays structural)
    def eq(self, o: Any) -> Expr:
        return Bin("==", self, lit(o))

    def ne(self, o: Any) -> Expr:
        return Bin("!=", self, lit(o))

    def __lt__(self, o: Any) -> Expr:
        return Bin("<", self, lit(o))

    def __le__(self, o: Any) -> Expr:
        return Bin("<=", self, lit(o))

    def __gt__(self, o: Any) -> Expr:
        return Bin(">", self, lit(o))

    def __ge__(self, o: Any) -> Expr:
        return Bin(">=", self, lit(o))

    # logic
    def __and__(self, o: Any) -> Expr:
        return Bin("&&", self, lit(o))

    def __or__(self, o: Any) -> Expr:
        return Bin("||", self, lit(o))

    def __invert__(self) -> Expr:
        return Not(self)

    def str(self) -> Expr:
        """CEL ``string(x)`` of an int."""
        return Str(self)


def lit(v: Any) -> Expr:
    return v if isinstance(v, Expr) else Lit(v)


@dataclass(frozen=True, eq=False)
class Lit(Expr):
    value: Any

    def cel(self) -> str:
        v = self.value
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, int):
            return str(v)
        if isinstance(v, str):
            return json.dumps(v)  # a JSON string literal is a valid CEL string literal
        raise TypeError(f"unsupported literal {v!r}")

    def eval(self, env: dict[str, Any]) -> Any:
        return self.value


@dataclass(frozen=True, eq=False)
class Field(Expr):
    """``self.a.b.c`` (path relative to the rule's object)."""

    path: str
    root: str = "self"

    def cel(self) -> str:
        return f"{self.root}.{self.path}"

    def eval(self, env: dict[str, Any]) -> Any:
        cur = env[self.root]
        for part in self.path.split("."):
            if not isinstance(cur, dict) or part not in cur:
                raise Missing(f"{self.root}.{self.path}")
            cur = cur[part]
        return cur


@dataclass(frozen=True, eq=False)
class Has(Expr):
    """CEL ``has(self.a.b)``: true when the last field is present (its parents must exist)."""

    field: Field

    def cel(self) -> str:
        return f"has({self.field.cel()})"

    def eval(self, env: dict[str, Any]) -> Any:
        parent_path, _, last = self.field.path.rpartition(".")
        parent = Field(parent_path, self.field.root).eval(env) if parent_path else env[self.field.root]
        if not isinstance(parent, dict):
            raise Missing(self.field.cel())
        return last in parent


_PY_BIN: dict[str, Callable[[Any, Any], Any]] = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
    "/": lambda a, b: _int_div(a, b),
    "%": lambda a, b: _int_mod(a, b),
    "==": lambda a, b: a == b,
    "!=": lambda a, b: a != b,
    "<": lambda a, b: a < b,
    "<=": lambda a, b: a <= b,
    ">": lambda a, b: a > b,
    ">=": lambda a, b: a >= b,
}


def _int_div(a: int, b: int) -> int:
    if b == 0:
        raise ZeroDivisionError("division by zero in a rule")
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b >= 0) else -q  # CEL truncates toward zero


def _int_mod(a: int, b: int) -> int:
    if b == 0:
        raise ZeroDivisionError("modulus by zero in a rule")
    return a - b * _int_div(a, b)


@dataclass(frozen=True, eq=False)
class Bin(Expr):
    op: str
    left: Expr
    right: Expr

    def cel(self) -> str:
        return f"({self.left.cel()} {self.op} {self.right.cel()})"

    def eval(self, env: dict[str, Any]) -> Any:
        if self.op == "&&":  # short-circuit, as CEL does for guards
            return bool(self.left.eval(env)) and bool(self.right.eval(env))
        if self.op == "||":
            return bool(self.left.eval(env)) or bool(self.right.eval(env))
        return _PY_BIN[self.op](self.left.eval(env), self.right.eval(env))


@dataclass(frozen=True, eq=False)
class Not(Expr):
    inner: Expr

    def cel(self) -> str:
        return f"!{self.inner.cel()}"

    def eval(self, env: dict[str, Any]) -> Any:
        return not self.inner.eval(env)


@dataclass(frozen=True, eq=False)
class Cond(Expr):
    """CEL ``c ? a : b``; only the chosen branch is evaluated."""

    test: Expr
    then: Expr
    other: Expr

    def cel(self) -> str:
        return f"({self.test.cel()} ? {self.then.cel()} : {self.other.cel()})"

    def eval(self, env: dict[str, Any]) -> Any:
        return self.then.eval(env) if self.test.eval(env) else self.other.eval(env)


def cond(test: Expr, then: Any, other: Any) -> Expr:
    return Cond(test, lit(then), lit(other))


@dataclass(frozen=True, eq=False)
class Str(Expr):
    inner: Expr

    def cel(self) -> str:
        return f"string({self.inner.cel()})"

    def eval(self, env: dict[str, Any]) -> Any:
        v = self.inner.eval(env)
        if isinstance(v, bool) or not isinstance(v, (int, str)):
            raise TypeError(f"string() of {v!r}: rules only stringify ints and strings")
        return str(v)


@dataclass(frozen=True, eq=False)
class Lookup(Expr):
    """A map literal indexed by a key expression: ``{"a": 1, "b": 2}[key]``."""

    table: tuple[tuple[str, Any], ...]
    key: Expr

    def cel(self) -> str:
        body = ", ".join(f"{json.dumps(k)}: {lit(v).cel()}" for k, v in self.table)
        return f"{{{body}}}[{self.key.cel()}]"

    def eval(self, env: dict[str, Any]) -> Any:
        k = self.key.eval(env)
        for key, value in self.table:
            if key == k:
                return value
        raise Missing(f"no entry {k!r} in lookup table")


def lookup(table: dict[str, Any], key: Expr) -> Expr:
    return Lookup(tuple(table.items()), key)


@dataclass(frozen=True, eq=False)
class StartsWith(Expr):
    """CEL ``s.startsWith(prefix)``."""

    inner: Expr
    prefix: Expr

    def cel(self) -> str:
        return f"{self.inner.cel()}.startsWith({self.prefix.cel()})"

    def eval(self, env: dict[str, Any]) -> Any:
        return self.inner.eval(env).startswith(self.prefix.eval(env))


@dataclass(frozen=True, eq=False)
class Matches(Expr):
    """CEL ``s.matches(re)`` (RE2, unanchored like ``re.search``: anchor the pattern yourself)."""

    inner: Expr
    pattern: str

    def cel(self) -> str:
        return f"{self.inner.cel()}.matches({json.dumps(self.pattern)})"

    def eval(self, env: dict[str, Any]) -> Any:
        return re2.search(self.pattern, self.inner.eval(env)) is not None


@dataclass(frozen=True, eq=False)
class Var(Expr):
    """A comprehension variable (inside All/Exists)."""

    name: str

    def cel(self) -> str:
        return self.name

    def eval(self, env: dict[str, Any]) -> Any:
        return env[self.name]


@dataclass(frozen=True, eq=False)
class Let(Expr):
    """``value`` evaluated once and named ``var`` inside the boolean ``body``: CEL ``[value].all(var, body)``,
    the one-element comprehension that ``cel.bind`` expands to (Kubernetes' CEL environment has no
    ``cel.bind``). Used only for values that cannot fail to evaluate (see ``bind_shared``)."""

    var: str
    value: Expr
    body: Expr

    def cel(self) -> str:
        return f"[{self.value.cel()}].all({self.var}, {self.body.cel()})"

    def eval(self, env: dict[str, Any]) -> Any:
        return bool(self.body.eval({**env, self.var: self.value.eval(env)}))


@dataclass(frozen=True, eq=False)
class OrValue(Expr):
    """A field's value, else ``default`` when it is absent: CEL ``a.?b.orValue(default)`` (Kubernetes enables
    CEL's optional types). The same value as ``has(a.b) ? a.b : default``, for one field lookup instead of
    two: on the API server each lookup in a CRD object rebuilds the schemas of all its sibling properties
    (see ``bind_shared``). ``optionals`` writes it."""

    field: Field
    default: Expr

    def cel(self) -> str:
        parent, _, last = self.field.path.rpartition(".")
        base = f"{self.field.root}.{parent}" if parent else self.field.root
        return f"{base}.?{last}.orValue({self.default.cel()})"

    def eval(self, env: dict[str, Any]) -> Any:
        return self.field.eval(env) if Has(self.field).eval(env) else self.default.eval(env)


def optionals(expr: Expr) -> Expr:
    """``expr`` with every ``has(x) ? x : d`` written as ``OrValue(x, d)``."""
    def fn(n: Expr) -> Expr | None:
        if (isinstance(n, Cond) and isinstance(n.test, Has) and isinstance(n.then, Field)
                and (n.test.field.root, n.test.field.path) == (n.then.root, n.then.path)):
            return OrValue(n.then, optionals(n.other))
        return None
    return transform(expr, fn)


def transform(node: Expr, fn: Callable[[Expr], Expr | None]) -> Expr:
    """The tree with every node for which ``fn`` returns a replacement replaced (top-down: a replaced node's
    children are not visited); unchanged subtrees are the same objects."""
    new = fn(node)
    if new is not None:
        return new
    changes: dict[str, Any] = {}
    for fld in dataclasses.fields(node):  # type: ignore[arg-type]
        v = getattr(node, fld.name)
        if isinstance(v, Expr):
            nv: Any = transform(v, fn)
        elif isinstance(v, tuple) and v and all(isinstance(x, Expr) for x in v):
            nv = tuple(transform(x, fn) for x in v)
            nv = v if all(a is b for a, b in zip(nv, v, strict=True)) else nv
        else:
            continue
        if nv is not v:
            changes[fld.name] = nv
    return dataclasses.replace(node, **changes) if changes else node  # type: ignore[type-var]


def _walk(node: Expr):
    yield node
    for fld in dataclasses.fields(node):  # type: ignore[arg-type]
        v = getattr(node, fld.name)
        if isinstance(v, Expr):
            yield from _walk(v)
        elif isinstance(v, tuple):
            for x in v:
                if isinstance(x, Expr):
                    yield from _walk(x)


def bind_shared(expr: Expr, shared: dict[str, Expr]) -> Expr:
    """``expr`` with each of the ``shared`` subexpressions (found by identity) that it evaluates more than once
    computed once, in a ``Let`` named after its key, outside the places that use it.

    The Kubernetes API server's CEL adapter resolves every field access of a CRD object by building a map
    of all the sibling properties' schemas (apiextensions' ``Structural.Properties``, twice per access), so
    a rule's cost grows with how often it reads a field, not only with what it computes. The rules share
    a few derived values (``rules.MODEL_VALUES``: a model field, else its preset's, else a default), and a
    long rule spells some of them several times. The values given here must never fail to evaluate
    (guarded by ``has``, on required objects): a ``Let`` evaluates them even where the rule would have
    short-circuited."""
    ids = {id(e): name for name, e in shared.items()}
    counts: dict[int, int] = {}
    for node in _walk(expr):
        if id(node) in ids:
            counts[id(node)] = counts.get(id(node), 0) + 1
    bound = [e for e in shared.values() if counts.get(id(e), 0) >= 2]
    if not bound:
        return expr
    bound_ids = {id(e) for e in bound}
    # Outer lets first: a value that another bound value contains is bound outside it.
    inside = {id(e): {id(n) for n in _walk(e) if n is not e and id(n) in bound_ids} for e in bound}
    order: list[Expr] = []
    while len(order) < len(bound):
        for e in bound:
            if e not in order and inside[id(e)] <= {id(o) for o in order}:
                order.append(e)

    def to_var(keep: Expr | None) -> Callable[[Expr], Expr | None]:
        return lambda n: Var(ids[id(n)]) if id(n) in bound_ids and n is not keep else None

    out = transform(expr, to_var(None))
    for e in reversed(order):
        out = Let(ids[id(e)], transform(e, to_var(e)), out)
    return out


def rebase(expr: Expr, prefix: str, var: str) -> Expr:
    """``expr`` reading ``self.<prefix>.x`` as ``<var>.x``, inside ``Let(var, self.<prefix>, ...)`` when it
    reads more than one such field (``self.<prefix>`` must be a required object). Each read of
    ``self.<prefix>.x`` resolves ``<prefix>`` among the rule object's properties first; the bound object does
    not."""
    def hit(n: Expr) -> bool:
        return isinstance(n, Field) and n.root == "self" and n.path.startswith(prefix + ".")

    if sum(1 for n in _walk(expr) if hit(n)) < 2:
        return expr
    # A list under the prefix that the rule iterates (or indexes, or measures) is read through self: in the bound
    # object the API server's cost estimator no longer sees the list's maxItems and its strings' maxLength, and
    # estimated such a rule (a filter over spec.training.extraArgs) at more than 100x its budget (issue 52's
    # extraArgs rules on Kubernetes 1.36.3).
    listed = {id(n.items) for n in _walk(expr) if isinstance(n, (All, Filter, Size, Index, At, LastIndexOf))}
    # and a list searched with `in` (spec.model.moeLayerFreq: `1 in` it, estimated at more than 100x through the
    # bound object on Kubernetes 1.36.3, 2026-12-02)
    listed |= {id(n.container) for n in _walk(expr) if isinstance(n, In)}
    if any(hit(n) and id(n) in listed for n in _walk(expr)):
        return expr
    body = transform(expr, lambda n: Field(n.path[len(prefix) + 1:], var) if hit(n) else None)
    return Let(var, Field(prefix), body)


def bind_field(expr: Expr, within: str, path: str, var: str, absent: Any) -> Expr:
    """Inside the ``Let`` named ``within``: ``<within>.<path>`` read once, as ``var`` (``absent`` when the field
    is absent), when the rule reads it or tests it with ``has`` three times or more. ``has(<within>.<path>)``
    becomes ``var != absent``: ``absent`` must be a value the field can never hold (the schema forbids it)."""
    def hit(n: Expr) -> bool:
        fld = n.field if isinstance(n, Has) else n
        return isinstance(fld, Field) and (fld.root, fld.path) == (within, path)

    def to_var(n: Expr) -> Expr | None:
        if isinstance(n, Has) and hit(n):
            return Bin("!=", Var(var), lit(absent))
        return Var(var) if hit(n) else None

    def fn(n: Expr) -> Expr | None:
        if isinstance(n, Let) and n.var == within:
            if sum(1 for x in _walk(n.body) if isinstance(x, Field) and hit(x)) < 3:  # a has() holds a Field too
                return n
            return Let(within, n.value, Let(var, OrValue(Field(path, within), lit(absent)), transform(n.body, to_var)))
        return None

    return transform(expr, fn)


@dataclass(frozen=True, eq=False)
class All(Expr):
    """CEL ``list.all(x, pred)``."""

    items: Expr
    var: str
    pred: Expr

    def cel(self) -> str:
        return f"{self.items.cel()}.all({self.var}, {self.pred.cel()})"

    def eval(self, env: dict[str, Any]) -> Any:
        return all(self.pred.eval({**env, self.var: item}) for item in self.items.eval(env))


@dataclass(frozen=True, eq=False)
class Filter(Expr):
    """CEL ``list.filter(x, pred)``."""

    items: Expr
    var: str
    pred: Expr

    def cel(self) -> str:
        return f"{self.items.cel()}.filter({self.var}, {self.pred.cel()})"

    def eval(self, env: dict[str, Any]) -> Any:
        return [item for item in self.items.eval(env) if self.pred.eval({**env, self.var: item})]


@dataclass(frozen=True, eq=False)
class Size(Expr):
    """CEL ``list.size()``."""

    items: Expr

    def cel(self) -> str:
        return f"{self.items.cel()}.size()"

    def eval(self, env: dict[str, Any]) -> Any:
        return len(self.items.eval(env))


@dataclass(frozen=True, eq=False)
class Index(Expr):
    """``list[i]`` with a literal index."""

    items: Expr
    index: int

    def cel(self) -> str:
        return f"{self.items.cel()}[{self.index}]"

    def eval(self, env: dict[str, Any]) -> Any:
        return self.items.eval(env)[self.index]


@dataclass(frozen=True, eq=False)
class At(Expr):
    """``list[i]`` with a computed index (the caller guards it: out of range is a CEL error)."""

    items: Expr
    index: Expr

    def cel(self) -> str:
        return f"{self.items.cel()}[{self.index.cel()}]"

    def eval(self, env: dict[str, Any]) -> Any:
        items, i = self.items.eval(env), self.index.eval(env)
        if not 0 <= i < len(items):
            raise Missing(self.cel())
        return items[i]


@dataclass(frozen=True, eq=False)
class In(Expr):
    """CEL ``x in c``: ``x`` is an element of the list ``c``, or a key of the map ``c``."""

    value: Expr
    container: Expr

    def cel(self) -> str:
        return f"({self.value.cel()} in {self.container.cel()})"

    def eval(self, env: dict[str, Any]) -> Any:
        return self.value.eval(env) in self.container.eval(env)


@dataclass(frozen=True, eq=False)
class Get(Expr):
    """CEL ``m[k]`` on a map with a computed key (the caller guards it with ``In``: a missing key is an error)."""

    mapping: Expr
    key: Expr

    def cel(self) -> str:
        return f"{self.mapping.cel()}[{self.key.cel()}]"

    def eval(self, env: dict[str, Any]) -> Any:
        m, k = self.mapping.eval(env), self.key.eval(env)
        if not isinstance(m, dict) or k not in m:
            raise Missing(self.cel())
        return m[k]


@dataclass(frozen=True, eq=False)
class LastIndexOf(Expr):
    """Kubernetes CEL's lists-library ``list.lastIndexOf(x)``: the last position of ``x``, or -1."""

    items: Expr
    value: Expr

    def cel(self) -> str:
        return f"{self.items.cel()}.lastIndexOf({self.value.cel()})"

    def eval(self, env: dict[str, Any]) -> Any:
        items, value = self.items.eval(env), self.value.eval(env)
        return max((i for i, item in enumerate(items) if item == value), default=-1)


@dataclass(frozen=True, eq=False)
class Attr(Expr):
    """``expr.name`` on a map-valued expression."""

    inner: Expr
    name: str

    def cel(self) -> str:
        return f"{self.inner.cel()}.{self.name}"

    def eval(self, env: dict[str, Any]) -> Any:
        v = self.inner.eval(env)
        if not isinstance(v, dict) or self.name not in v:
            raise Missing(self.cel())
        return v[self.name]


@dataclass(frozen=True, eq=False)
class Format(Expr):
    """CEL's strings-extension ``"... %d ... %s".format([args])``.

    Messages use this rather than ``"..." + string(n)``: the API server's cost estimator treats the
    size of ``string(int)`` as unbounded, so any concatenation with it is refused as too expensive
    (measured on kube-apiserver 1.36.3), while ``format`` has a bounded estimate.
    """

    template: str
    args: tuple[Expr, ...]

    def cel(self) -> str:
        return f"{json.dumps(self.template)}.format([{', '.join(a.cel() for a in self.args)}])"

    def eval(self, env: dict[str, Any]) -> Any:
        values = []
        for a in self.args:
            v = a.eval(env)
            if isinstance(v, bool):
                raise TypeError("rules never format booleans")
            values.append(v)
        return self.template % tuple(values)


def fmt(*parts: Any) -> Expr:
    """A message from parts: literal strings, ``x.str()`` for ints (%d), other string expressions (%s)."""
    template, args = "", []
    for p in parts:
        if isinstance(p, str) or (isinstance(p, Lit) and isinstance(p.value, str)):
            template += (p if isinstance(p, str) else p.value).replace("%", "%%")
        elif isinstance(p, Str):
            template += "%d"
            args.append(p.inner)
        else:
            template += "%s"
            args.append(lit(p))
    if not args:
        return Lit(template.replace("%%", "%"))
    return Format(template, tuple(args))
