"""The MegatronJob CRD, generated from the pydantic models (pure).

A strict converter from pydantic's JSON Schema to a Kubernetes *structural* OpenAPI v3 schema:
``$ref``/``$defs`` inlined, ``Optional`` fields simply not required (nulls are refused, see
``spec.py``), JSON-Schema-2020 ``exclusiveMinimum`` turned into the OpenAPI 3.0 form, defaults
(including ``default_factory``) emitted so the API server defaults exactly as the models do, and
every construct the API server would reject (``additionalProperties: false`` beside
``properties``, ``const``, unions other than int-or-string) refused with an error instead of being
passed through. Cross-field rules come from ``rules.py`` as CEL ``x-kubernetes-validations``.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
from typing import Any

import yaml
from pydantic import BaseModel

from . import rules
from .expr import All, Expr, Field, Filter, Var
from .spec import API_VERSION, GROUP, KIND, PLURAL, VERSION, MegatronJobSpec, MegatronJobStatus
from .vocab.api import model_in

CRD_NAME = f"{PLURAL}.{GROUP}"

# spec fields that may change on a live MegatronJob (everything else feeds the JobSet).
MUTABLE_SPEC_FIELDS = ("suspend", "activeDeadlineSeconds")
# spec fields that may change while the job is suspended (spec.suspend true before and after the change): a layout
# change at the same GPU count (TP/PP/CP/EP/VPP; DP follows). The operator then creates the JobSet again, and the
# trainer resumes from the last checkpoint under the new layout (its optimizer state is saved fully reshardable).
RESHAPE_WHILE_SUSPENDED = ("parallelism",)

# Lists keyed by a field (server-side apply merges them per key); all other lists are atomic.
LIST_MAP_KEYS = {("spec", "env"): ["name"], ("status", "conditions"): ["type"]}

_ALLOWED_KEYS = {
    "type", "properties", "required", "items", "description", "default", "enum", "minimum", "maximum",
    "exclusiveMinimum", "exclusiveMaximum", "minLength", "maxLength", "pattern", "minItems", "maxItems",
    "additionalProperties", "format", "maxProperties", "minProperties",
}


class CrdConversionError(ValueError):
    """The model uses a construct that has no structural-schema equivalent."""


def _resolve(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, dict):
        if "$ref" in node:
            name = node["$ref"].rsplit("/", 1)[-1]
            merged = {**copy.deepcopy(defs[name]), **{k: v for k, v in node.items() if k != "$ref"}}
            return _resolve(merged, defs)
        return {k: _resolve(v, defs) for k, v in node.items()}
    if isinstance(node, list):
        return [_resolve(v, defs) for v in node]
    return node


def _strip_null(node: dict[str, Any]) -> dict[str, Any]:
    """``anyOf: [X, {type: null}]`` -> X (optional, not nullable)."""
    variants = node.get("anyOf")
    if not variants:
        return node
    non_null = [v for v in variants if v.get("type") != "null"]
    if len(non_null) == 1 and len(non_null) < len(variants):
        rest = {k: v for k, v in node.items() if k != "anyOf"}
        return {**non_null[0], **rest}
    return node


def _convert(node: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any]:
    node = _strip_null(dict(node))
    node.pop("title", None)
    where = ".".join(path) or "<root>"
    if node.get("x-kubernetes-int-or-string"):
        variants = node.pop("anyOf", [])
        out: dict[str, Any] = {"x-kubernetes-int-or-string": True}
        for v in variants:  # the string branch's pattern, the int branch's bounds (each ignored for the other)
            for key in ("pattern", "maxLength", "minimum", "maximum"):
                if key in v:
                    out[key] = v[key]
        if "description" in node:
            out["description"] = node["description"]
        return out
    if "anyOf" in node or "oneOf" in node or "allOf" in node:
        raise CrdConversionError(f"{where}: unions are not structural; use a single type")
    if "const" in node:
        if node.get("type") not in (None, "string"):
            raise CrdConversionError(f"{where}: const is only supported for strings")
        node["enum"] = [node.pop("const")]
        node.setdefault("type", "string")
    key_schema = node.pop("propertyNames", None)
    pattern_props = node.pop("patternProperties", None)
    if pattern_props:  # dict[str with pattern, V]: values as additionalProperties, keys checked by CEL
        if len(pattern_props) != 1 or "additionalProperties" in node:
            raise CrdConversionError(f"{where}: only one key pattern is supported")
        ((key_pattern, value_schema),) = pattern_props.items()
        node["additionalProperties"] = value_schema
        key_schema = {**(key_schema or {}), "pattern": key_pattern}
    unknown = set(node) - _ALLOWED_KEYS
    if unknown:
        raise CrdConversionError(f"{where}: unsupported schema keys {sorted(unknown)}")
    out = {}
    typ = node.get("type")
    if typ is None:
        raise CrdConversionError(f"{where}: every node needs a type")
    out["type"] = typ
    if "description" in node:
        out["description"] = node["description"]
    for key in ("enum", "minimum", "maximum", "minLength", "maxLength", "pattern", "minItems", "maxItems",
                "maxProperties", "minProperties", "format", "default"):
        if key in node and node[key] is not None:  # default None means "omitted", never a null default
            out[key] = node[key]
    # JSON Schema 2020-12 numeric exclusive bounds -> OpenAPI 3.0 booleans
    for ex, base in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if ex in node:
            out[base] = node[ex]
            out[ex] = True
    if typ == "object":
        props = node.get("properties")
        addl = node.get("additionalProperties")
        if props is not None:
            out["properties"] = {k: _convert(v, path + (k,)) for k, v in props.items()}
            if node.get("required"):
                out["required"] = list(node["required"])
            # extra="forbid" gives additionalProperties: false, which the API server refuses beside
            # properties; unknown fields are pruned there (and refused by kubectl's strict validation).
        elif isinstance(addl, dict):
            out["additionalProperties"] = _convert(addl, path + ("*",))
            if key_schema:  # no structural equivalent of propertyNames: check the keys with CEL
                key_rules = _key_rules(key_schema, where)
                # Inside an immutable field: create-only, except under a list item, where the API server has no
                # oldSelf (an atomic list's items are not correlated with the old object's).
                if path[:1] == ("spec",) and len(path) > 1 and path[1] not in MUTABLE_SPEC_FIELDS \
                        and path[1] not in RESHAPE_WHILE_SUSPENDED and "[]" not in path:
                    key_rules = [create_only(r) for r in key_rules]
                out["x-kubernetes-validations"] = key_rules
        elif addl is False or addl is None:
            out["properties"] = {}
        else:
            raise CrdConversionError(f"{where}: free-form objects are not allowed")
    elif typ == "array":
        out["items"] = _convert(node["items"], path + ("[]",))
        keys = LIST_MAP_KEYS.get(path)
        if keys:
            out["x-kubernetes-list-type"] = "map"
            out["x-kubernetes-list-map-keys"] = keys
        else:
            out["x-kubernetes-list-type"] = "atomic"
    return out


def _field_defaults(model: type[BaseModel]) -> dict[str, Any]:
    """Defaults from ``default_factory`` (JSON Schema omits them), as wire values."""
    out = {}
    for name, info in model.model_fields.items():
        if info.default_factory is not None:
            value = info.default_factory()  # type: ignore[call-arg]
            if isinstance(value, BaseModel):
                value = value.model_dump(by_alias=True, exclude_none=True, mode="json")
            out[info.alias or name] = value
    return out


def _apply_factory_defaults(schema: dict[str, Any], model: type[BaseModel]) -> None:
    props = schema.get("properties", {})
    defaults = _field_defaults(model)
    for name, info in model.model_fields.items():
        key = info.alias or name
        if key not in props:
            continue
        if key in defaults:
            props[key]["default"] = defaults[key]
        sub = model_in(info.annotation)
        if sub is not None:
            node = props[key]["items"] if props[key].get("type") == "array" else props[key]
            _apply_factory_defaults(node, sub)


def _key_rules(key_schema: dict[str, Any], where: str) -> list[dict[str, str]]:
    out = []
    unknown = set(key_schema) - {"maxLength", "pattern", "type"}
    if unknown:
        raise CrdConversionError(f"{where}: unsupported key constraints {sorted(unknown)}")
    if "maxLength" in key_schema:
        n = key_schema["maxLength"]
        out.append({"rule": f"self.all(k, size(k) <= {n})", "message": f"keys must be at most {n} characters"})
    if "pattern" in key_schema:
        pat = key_schema["pattern"]
        out.append({"rule": f"self.all(k, k.matches({json.dumps(pat)}))", "message": f"keys must match {pat}"})
    return out


def _schema_for(model: type[BaseModel], path: tuple[str, ...]) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True, mode="validation")
    defs = raw.pop("$defs", {})
    resolved = _resolve(raw, defs)
    schema = _convert(resolved, path)
    _apply_factory_defaults(schema, model)
    return schema


def immutable_message(key: str) -> str:
    return (f"spec.{key} is immutable: it shapes the running JobSet; create a new MegatronJob "
            f"(it can resume from the same checkpoint.path) instead")


def reshape_message(key: str) -> str:
    return (f"spec.{key} may change only while the job is suspended: set spec.suspend: true, change spec.{key} "
            f"in a later update (spec.suspend still true), then set spec.suspend: false; the job resumes from its "
            f"last checkpoint under the new layout")


def add_immutability_rules(spec_schema: dict[str, Any]) -> list[dict[str, str]]:
    """Make every spec field but the mutable ones immutable: ``self == oldSelf`` on the field's own node, and for
    a field that may be absent (neither required nor defaulted) ``has(self.x) == has(oldSelf.x)`` on spec, since
    a rule on the field's node does not run when the field is added or removed. Adds the node rules to
    ``spec_schema`` and returns the spec-level presence rules.

    A refused change reads as a spec-level ``self.x == oldSelf.x`` would: the same message at the same path
    (``spec.x``), one error per field. On the field's node the rule does not look ``x`` up among spec's
    properties, which on the API server rebuilds the schemas of all of them (twice per lookup); every write
    runs these rules, a status write included (issue 30,
    docs/benchmarks/operator-latency.md#2026-11-27-cel-validator-allocations)."""
    presence = []
    required = set(spec_schema.get("required", []))
    for key in RESHAPE_WHILE_SUSPENDED:  # on spec: the rule reads spec.suspend too
        prop = spec_schema["properties"][key]
        same = (f"self.{key} == oldSelf.{key}" if key in required or "default" in prop else
                f"has(self.{key}) == has(oldSelf.{key}) && (!has(self.{key}) || self.{key} == oldSelf.{key})")
        presence.append({"rule": f"{same} || (oldSelf.suspend && self.suspend)", "message": reshape_message(key),
                         "fieldPath": f".{key}", "reason": "FieldValueForbidden"})
    for key in sorted(immutable_spec_fields(spec_schema)):
        prop = spec_schema["properties"][key]
        prop.setdefault("x-kubernetes-validations", []).append(
            {"rule": "self == oldSelf", "message": immutable_message(key), "reason": "FieldValueForbidden"})
        if key not in required and "default" not in prop:
            presence.append({"rule": f"has(self.{key}) == has(oldSelf.{key})", "message": immutable_message(key),
                             "fieldPath": f".{key}", "reason": "FieldValueForbidden"})
    return presence


def spec_fields_read(*exprs: Expr) -> set[str] | None:
    """The top-level spec fields that the expressions read through ``self``, or None when that cannot
    be proven (a ``Field`` on another root than ``self`` or a comprehension variable in scope, a free
    ``Var``, a node that is not a dataclass of known parts).

    A comprehension's variable (``All``/``Filter``) ranges over a list or map that is itself read
    through ``self``, so what it reaches is inside that field."""
    out: set[str] = set()

    def walk(node: Any, bound: frozenset[str]) -> bool:
        if isinstance(node, (str, int, float, bool)) or node is None:
            return True
        if isinstance(node, tuple):
            return all(walk(v, bound) for v in node)
        if not isinstance(node, Expr) or not dataclasses.is_dataclass(node):
            return False
        if isinstance(node, Field):
            if node.root == "self":
                out.add(node.path.split(".")[0])
                return True
            return node.root in bound
        if isinstance(node, Var):
            return node.name in bound
        if isinstance(node, (All, Filter)):
            return walk(node.items, bound) and walk(node.pred, bound | {node.var})
        return all(walk(getattr(node, f.name), bound) for f in dataclasses.fields(node))

    return out if all(walk(e, frozenset()) for e in exprs) else None


def is_create_only(rule: rules.Rule, immutable: set[str]) -> bool:
    """True when the rule (its condition AND its message) reads only spec fields that the immutability
    rules keep equal on every update: then it holds on an update exactly when it held at create."""
    read = spec_fields_read(rule.condition(), rule.message)
    return read is not None and read <= immutable


def create_only(cel_rule: dict[str, Any]) -> dict[str, Any]:
    """The same rule, evaluated only where there is no old object (create).

    With ``optionalOldSelf: true`` the API server binds ``oldSelf`` as an optional: empty on create,
    set on an update where the node has an old value (apiextensions-apiserver
    pkg/apiserver/schema/cel/validation.go). Such a rule is evaluated at create only while the
    CRDValidationRatcheting feature gate is on (beta and on by default in Kubernetes 1.30-1.32, GA
    and locked on from 1.33); docs/install.md says what happens where it is off."""
    if "oldSelf" in cel_rule["rule"]:
        raise CrdConversionError(f"already a transition rule: {cel_rule['rule'][:80]}")
    return {**cel_rule, "rule": f"oldSelf.hasValue() || ({cel_rule['rule']})", "optionalOldSelf": True}


def immutable_spec_fields(spec: dict[str, Any]) -> set[str]:
    """The top-level spec fields that an immutability rule keeps equal on every update."""
    return set(spec["properties"]) - set(MUTABLE_SPEC_FIELDS) - set(RESHAPE_WHILE_SUSPENDED)


def while_suspended(cel_rule: dict[str, Any]) -> dict[str, Any]:
    """A rule that reads only immutable fields and fields that change only while the job is suspended: checked at
    create and on the updates of a job that was suspended (the only ones that can change such a field), not on the
    others (the status writes of a running job among them; issue 30's create-only rules, widened)."""
    if "oldSelf" in cel_rule["rule"]:
        raise CrdConversionError(f"already a transition rule: {cel_rule['rule'][:80]}")
    return {**cel_rule, "rule": f"(oldSelf.hasValue() && !oldSelf.value().suspend) || ({cel_rule['rule']})",
            "optionalOldSelf": True}


def spec_schema() -> dict[str, Any]:
    """spec, with its rules. A rule that reads only immutable fields is a create-only rule: on an
    update (the operator's status writes included: a status update validates the whole object with
    every rule) the immutability rules already guarantee that those fields are the ones that passed at
    create, so it is not evaluated again (issue 30: most of a status write's CEL time)."""
    schema = _schema_for(MegatronJobSpec, ("spec",))
    immutable = immutable_spec_fields(schema)
    reshapeable = immutable | set(RESHAPE_WHILE_SUSPENDED)
    spec_rules = [create_only(r.to_cel()) if is_create_only(r, immutable)
                  else while_suspended(r.to_cel()) if is_create_only(r, reshapeable) else r.to_cel()
                  for r in rules.SPEC_RULES]
    schema["x-kubernetes-validations"] = spec_rules + add_immutability_rules(schema)
    return schema


def status_schema() -> dict[str, Any]:
    return _schema_for(MegatronJobStatus, ("status",))


PRINTER_COLUMNS = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase", "description": "Job phase"},
    {"name": "GPUs", "type": "integer", "jsonPath": ".status.worldSize", "description": "GPUs in the job"},
    {"name": "TP/PP/DP", "type": "string", "jsonPath": ".status.layout",
     "description": "Tensor / pipeline / data parallel sizes"},
    {"name": "Iteration", "type": "integer", "jsonPath": ".status.progress.iteration",
     "description": "Completed training iterations"},
    {"name": "Restarts", "type": "integer", "jsonPath": ".status.restarts", "description": "Gang restarts"},
    {"name": "Loss", "type": "number", "jsonPath": ".status.progress.loss", "priority": 1},
    {"name": "MFU", "type": "number", "jsonPath": ".status.progress.mfu", "priority": 1},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def build_crd() -> dict[str, Any]:
    """The CustomResourceDefinition object."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": CRD_NAME, "labels": {"app.kubernetes.io/name": "megatron-operator"}},
        "spec": {
            "group": GROUP,
            "names": {
                "kind": KIND, "listKind": f"{KIND}List", "plural": PLURAL, "singular": KIND.lower(),
                "shortNames": ["mj", "mjob"], "categories": ["all", "megatron"],
            },
            "scope": "Namespaced",
            "versions": [{
                "name": VERSION,
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "additionalPrinterColumns": PRINTER_COLUMNS,
                "schema": {"openAPIV3Schema": {
                    "type": "object",
                    "description": "MegatronJob runs one Megatron-Core pretraining job as a JobSet.",
                    "required": ["spec"],
                    "properties": {
                        "apiVersion": {"type": "string"},
                        "kind": {"type": "string"},
                        "metadata": {"type": "object"},
                        "spec": spec_schema(),
                        "status": status_schema(),
                    },
                    "x-kubernetes-validations": [rules.NAME_RULE,
                                                 *(create_only(r.to_cel()) for r in rules.OBJECT_RULES)],
                }},
            }],
        },
    }


class _Dumper(yaml.SafeDumper):
    pass


# Scalars that YAML 1.2 readers (kubectl, Go's sigs.k8s.io/yaml) take for numbers, booleans or null
# but PyYAML (YAML 1.1) would write unquoted, e.g. "1e-05": quote them so they stay strings.
_YAML12_NON_STRING = re.compile(
    r"^([-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?|[-+]?\.(inf|Inf|INF)|\.(nan|NaN|NAN)"
    r"|0x[0-9a-fA-F]+|0o[0-7]+|true|True|TRUE|false|False|FALSE|null|Null|NULL|~|yes|no|on|off|y|n)$")


def _str_presenter(dumper: yaml.SafeDumper, data: str) -> yaml.Node:
    if "\n" in data:
        return dumper.represent_scalar("tag:yaml.org,2002:str", data, style="|")
    if _YAML12_NON_STRING.match(data):
        return dumper.represent_scalar("tag:yaml.org,2002:str", data, style="'")
    return dumper.represent_scalar("tag:yaml.org,2002:str", data)


_Dumper.add_representer(str, _str_presenter)


def to_yaml(obj: Any) -> str:
    return yaml.dump(obj, Dumper=_Dumper, sort_keys=False, width=100000, default_flow_style=False)


def crd_yaml() -> str:
    header = (f"# Generated by `megatron-operator crd` from operator/megatron_operator/spec.py and rules.py.\n"
              f"# Do not edit: change the models and regenerate (a test fails on drift).\n"
              f"# API version {API_VERSION}\n")
    return header + to_yaml(build_crd())
