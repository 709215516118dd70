"""Create-only CEL rules (issue 30): a spec rule that reads only immutable fields is evaluated at
create and skipped on updates (status writes included), where the immutability rules already keep
those fields as they were when the rule passed."""

from __future__ import annotations

import copy
import re

import pytest
from celeval import apply_defaults, cel_errors
from factory import make_job
from megatron_operator import crd
from megatron_operator.expr import All, Field, Has, Lit, Var, cond, fmt
from megatron_operator.rules import SPEC_RULES, Rule
from spec_table import CASES

ROOT = crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
SPEC = ROOT["properties"]["spec"]
IMMUTABLE = crd.immutable_spec_fields(SPEC)
RESHAPE = set(crd.RESHAPE_WHILE_SUSPENDED)
PREFIX = "oldSelf.hasValue() || ("
SUSPENDED_PREFIX = "(oldSelf.hasValue() && !oldSelf.value().suspend) || ("


def test_immutable_fields_are_every_spec_field_but_the_mutable_ones():
    assert IMMUTABLE == set(SPEC["properties"]) - set(crd.MUTABLE_SPEC_FIELDS) - RESHAPE
    assert set(crd.MUTABLE_SPEC_FIELDS) | RESHAPE <= set(SPEC["properties"])
    assert RESHAPE == {"parallelism"}  # a layout change at the same GPU count; numNodes/gpusPerNode stay


def test_fields_read_follow_self_and_comprehension_variables():
    rule = All(Field("env"), "e", Has(Field("value", "e")) | Field("numNodes").eq(1))
    assert crd.spec_fields_read(rule) == {"env", "numNodes"}
    assert crd.spec_fields_read(Field("model.numLayers"), Lit("x")) == {"model"}
    assert crd.spec_fields_read(fmt("a ", Field("suspend"))) == {"suspend"}
    # not provable: a root that is neither self nor a bound variable, a free variable
    assert crd.spec_fields_read(Field("numNodes", "oldSelf")) is None
    assert crd.spec_fields_read(Field("value", "e")) is None
    assert crd.spec_fields_read(Var("k")) is None


def test_a_rule_that_reads_a_mutable_field_in_its_condition_or_message_is_evaluated_always():
    plain = Rule("t", "numNodes", Field("numNodes") > 0, Lit("m"))
    assert crd.is_create_only(plain, IMMUTABLE)
    in_check = Rule("t", "numNodes", cond(Field("suspend"), True, Field("numNodes") > 0), Lit("m"))
    in_when = Rule("t", "numNodes", Field("numNodes") > 0, Lit("m"), when=Has(Field("activeDeadlineSeconds")))
    in_message = Rule("t", "numNodes", Field("numNodes") > 0, fmt("m ", Field("activeDeadlineSeconds").str()))
    unknown_root = Rule("t", "numNodes", Field("numNodes", "oldSelf") > 0, Lit("m"))
    for r in (in_check, in_when, in_message, unknown_root):
        assert not crd.is_create_only(r, IMMUTABLE)
        assert "optionalOldSelf" not in r.to_cel()


def _without_string_literals(cel: str) -> str:
    return re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', '""', cel)


def test_generated_create_only_rules_read_only_immutable_fields():
    """An independent check on the CEL text the API server gets: every `self.x` of a create-only
    rule (condition and message) names an immutable field; the others keep their form."""
    create_only = while_suspended = 0
    for v in SPEC["x-kubernetes-validations"]:
        if v.get("optionalOldSelf"):
            prefix = SUSPENDED_PREFIX if v["rule"].startswith(SUSPENDED_PREFIX) else PREFIX
            assert v["rule"].startswith(prefix) and v["rule"].endswith(")")
            text = _without_string_literals(v["rule"].removeprefix(prefix) + " " + v.get("messageExpression", ""))
            assert "oldSelf" not in text
            roots = {r[1:] for r in re.findall(r"\bself\b(\.[A-Za-z_]\w*)?", text)}
            if prefix == PREFIX:  # create-only: immutable fields alone
                create_only += 1
                assert roots and "" not in roots and roots <= IMMUTABLE, v["rule"][:120]
            else:  # checked again on the updates of a suspended job: it reads a field that may change then
                while_suspended += 1
                assert roots & RESHAPE and "" not in roots and roots <= IMMUTABLE | RESHAPE, v["rule"][:120]
        else:  # only the transition rules
            assert "immutable" in v.get("message", "") or "only while the job is suspended" in v.get("message", ""), \
                v["rule"][:120]
    assert create_only and while_suspended
    assert create_only + while_suspended == len(SPEC_RULES)  # every layout rule reads only those fields


def test_key_rules_inside_immutable_fields_are_create_only():
    found = []

    def walk(node, path):
        if isinstance(node, dict):
            for v in node.get("x-kubernetes-validations", []):
                found.append((path, v))
            for k, sub in node.items():
                if k != "x-kubernetes-validations":
                    walk(sub, path + (k,))
    walk(SPEC["properties"], ())
    immutability = [(path, v) for path, v in found if len(path) == 1 and v["rule"] == "self == oldSelf"]
    assert sorted(path[0] for path, _ in immutability) == sorted(IMMUTABLE)  # one on each immutable field
    key_rules = [(path, v) for path, v in found if (path, v) not in immutability]
    assert key_rules
    for path, v in key_rules:
        assert path[0] in IMMUTABLE, path
        if "items" in path:  # under a list item the API server has no oldSelf (atomic lists are not correlated)
            assert "oldSelf" not in v["rule"] and "optionalOldSelf" not in v, path
        else:
            assert v.get("optionalOldSelf") is True and v["rule"].startswith(PREFIX), path
    assert any("items" in path for path, _ in key_rules) and any("items" not in path for path, _ in key_rules)
    assert not any(path[0] in RESHAPE for path, _ in found)  # no node rule keeps spec.parallelism equal


def test_the_name_rule_on_the_object_is_evaluated_always_the_object_rules_at_create():
    assert ROOT["x-kubernetes-validations"] == [crd.rules.NAME_RULE] + [
        crd.create_only(r.to_cel()) for r in crd.rules.OBJECT_RULES]
    assert all(v["rule"].startswith(PREFIX) and v["optionalOldSelf"] for v in ROOT["x-kubernetes-validations"][1:])


def test_create_only_refuses_a_rule_that_is_already_a_transition_rule():
    with pytest.raises(crd.CrdConversionError):
        crd.create_only({"rule": "self.x == oldSelf.x"})


@pytest.mark.parametrize("case_id,doc,rule", [c for c in CASES if c[2]], ids=[c[0] for c in CASES if c[2]])
def test_at_create_refused_and_on_update_not_evaluated(case_id, doc, rule):
    """At create the rule refuses the spec (test_spec_rules checks the message); on an update of the
    same spec (a status write; suspend) it is not evaluated, as on the API server."""
    job = apply_defaults(ROOT, copy.deepcopy(doc))
    job = {**job, "spec": {**job["spec"], "suspend": False}}  # a running job's updates
    if rule in {r.name for r in crd.rules.OBJECT_RULES}:  # a rule on the whole object (it reads metadata.name)
        schema, value = ROOT, job
        suspended = {**job, "spec": {**job["spec"], "suspend": True}}
    else:
        schema, value = SPEC, job["spec"]
        suspended = {**value, "suspend": True}
    assert cel_errors(schema, value)
    assert cel_errors(schema, value, old=value) == []
    assert cel_errors(schema, suspended, old=value) == []


def test_parallelism_changes_while_suspended_and_only_then():
    spec = apply_defaults(ROOT, make_job())["spec"]
    tp = spec["parallelism"]["tensor"]
    other = {**spec["parallelism"], "tensor": tp * 2 if spec["gpusPerNode"] % (tp * 2) == 0 else 1}
    assert other != spec["parallelism"]
    suspended = {**spec, "suspend": True}
    # while suspended, before and after: accepted, and the layout rules check the new layout
    assert cel_errors(SPEC, {**suspended, "parallelism": other}, old=suspended) == []
    bad = {**suspended, "parallelism": {**other, "tensor": 3}}
    assert cel_errors(SPEC, bad, old=suspended) and all("only while" not in e for e in cel_errors(SPEC, bad,
                                                                                                  old=suspended))
    # a running job, or one resumed in the same update: refused, saying how
    for new, old in (({**spec, "parallelism": other}, spec), ({**spec, "parallelism": other}, suspended),
                     ({**suspended, "parallelism": other}, spec)):
        errors = cel_errors(SPEC, new, old=old)
        assert errors and any("spec.parallelism may change only while the job is suspended" in e for e in errors)


def test_an_update_of_a_valid_job_changing_suspend_passes_and_an_immutable_change_is_refused():
    spec = apply_defaults(ROOT, make_job())["spec"]
    assert cel_errors(SPEC, spec) == []
    assert cel_errors(SPEC, {**spec, "suspend": True, "activeDeadlineSeconds": 60}, old=spec) == []
    errors = cel_errors(SPEC, {**spec, "numNodes": spec["numNodes"] * 3}, old=spec)
    assert errors and all("immutable" in e for e in errors)
