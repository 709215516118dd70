"""Shared values computed once in the generated CEL (expr.Let, bind_shared, rebase) and optional field selection
(expr.OrValue, optionals): the same verdicts, fewer field reads. The CEL side of every rule is checked on the whole spec table by test_spec_rules (cel-python on
the generated CRD) and at the real API server in e2e; here the transformations themselves."""

from __future__ import annotations

import copy
import re

import pytest
from celeval import apply_defaults, evaluate, without_optionals
from megatron_operator import crd
from megatron_operator.expr import (
    Field,
    Filter,
    Has,
    Let,
    OrValue,
    Size,
    Var,
    bind_field,
    bind_shared,
    cond,
    lookup,
    optionals,
    rebase,
)
from megatron_operator.rules import SPEC_RULES
from spec_table import CASES

ROOT = crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
def cel_eval(text: str, spec: dict):
    return evaluate(text, spec)  # celeval compiles each rule once and rewrites optional selection


def test_let_is_a_one_element_comprehension_in_cel_and_a_binding_in_python():
    e = Let("v_x", Field("a.b") * 2, Var("v_x").eq(8) & (Var("v_x") > 1))
    assert e.cel() == "[(self.a.b * 2)].all(v_x, ((v_x == 8) && (v_x > 1)))"
    assert e.eval({"self": {"a": {"b": 4}}}) is True and e.eval({"self": {"a": {"b": 3}}}) is False
    assert bool(cel_eval(e.cel(), {"a": {"b": 4}})) is True and bool(cel_eval(e.cel(), {"a": {"b": 3}})) is False


def test_a_value_read_twice_is_bound_once_and_one_read_once_is_left_alone():
    twice = cond(Has(Field("m.n")), Field("m.n"), 0)
    once = cond(Has(Field("m.k")), Field("m.k"), 1)
    expr = ((twice > 0) & (twice < 10)) | (once.eq(1))
    out = bind_shared(expr, {"v_n": twice, "v_k": once})
    assert isinstance(out, Let) and out.var == "v_n" and out.value is twice
    text = out.cel()
    assert text.count("self.m.n") == 2  # has() and the read, once, in the binding
    assert text.count("self.m.k") == 2 and "v_k" not in text
    for spec in ({"m": {"n": 5, "k": 1}}, {"m": {"n": 50}}, {"m": {}}, {"m": {"k": 2}}):
        env = {"self": spec}
        assert out.eval(env) == expr.eval(env)
        assert bool(cel_eval(text, spec)) == bool(expr.eval(env)), spec


def test_a_value_inside_another_bound_value_is_bound_outside_it():
    heads = cond(Has(Field("m.h")), Field("m.h"), 4)
    groups = cond(Has(Field("m.g")), Field("m.g"), heads)
    expr = (groups > 0) & ((heads % groups).eq(0)) & (groups <= heads)
    out = bind_shared(expr, {"v_groups": groups, "v_heads": heads})
    assert out.var == "v_heads" and out.body.var == "v_groups"  # heads outside: groups' value reads it
    assert "v_heads" in out.body.value.cel() and "self.m.h" not in out.body.cel()
    for spec in ({"m": {}}, {"m": {"h": 8, "g": 2}}, {"m": {"h": 8, "g": 3}}, {"m": {"g": 8}}):
        assert bool(cel_eval(out.cel(), spec)) == expr.eval({"self": spec}), spec


def test_rebase_reads_the_object_once_and_has_follows():
    expr = Has(Field("model.a")) & (Field("model.b") > Field("parallelism.t"))
    out = rebase(expr, "model", "v_model")
    assert out.cel() == "[self.model].all(v_model, (has(v_model.a) && (v_model.b > self.parallelism.t)))"
    spec = {"model": {"a": 1, "b": 3}, "parallelism": {"t": 2}}
    assert out.eval({"self": spec}) is True and bool(cel_eval(out.cel(), spec)) is True
    assert rebase(Field("model.a") > 1, "model", "v_model").cel() == "(self.model.a > 1)"  # one read: unchanged


def test_rebase_leaves_a_rule_that_iterates_a_list_under_the_prefix_reading_it_through_self():
    """Bound through a one-element list, the list loses its maxItems and its strings their maxLength in the API
    server's cost estimate: a filter over spec.training.extraArgs was estimated at more than 100x its budget
    (Kubernetes 1.36.3) and the CRD was refused."""
    given = Size(Filter(Field("training.extraArgs"), "x", Var("x").eq("--a"))) > 0
    expr = given & Field("training.distributedOptimizer")
    assert rebase(expr, "training", "v_training") is expr
    assert "[self.training]" not in rebase(expr, "training", "v_training").cel()
    scalars = (Field("training.lr") > 0) & Field("training.distributedOptimizer")
    assert rebase(scalars, "training", "v_training").cel().startswith("[self.training].all(v_training, ")


def test_rebase_leaves_a_rule_that_searches_a_list_under_the_prefix_with_in_reading_it_through_self():
    """The same for `x in list`: moe-layer-freq-has-moe-layer (`1 in` spec.model.moeLayerFreq, maxItems 1024) was
    estimated at more than 100x its budget through [self.model].all(v_model, ...) by Kubernetes 1.36.3 and the whole
    CRD refused (2026-12-02); read through self it is accepted."""
    from megatron_operator.expr import In, lit

    expr = In(lit(1), Field("model.moeLayerFreq")) & (Field("model.numExperts") > 0)
    assert rebase(expr, "model", "v_model") is expr
    text = str(ROOT["properties"]["spec"]["x-kubernetes-validations"])
    assert "in v_model.moeLayerFreq" not in text and "in self.model.moeLayerFreq" in text


def test_or_value_is_cel_optional_selection_and_has_in_python():
    e = OrValue(Field("a.b"), Field("a.c") * 2)
    assert e.cel() == "self.a.?b.orValue((self.a.c * 2))"
    assert OrValue(Field("b", "v_a"), Var("d")).cel() == "v_a.?b.orValue(d)"
    for spec, want in (({"a": {"b": 5, "c": 1}}, 5), ({"a": {"c": 3}}, 6)):
        assert e.eval({"self": spec}) == want
        assert cel_eval(e.cel(), spec) == want


def test_optionals_rewrites_only_a_test_of_the_field_it_then_reads():
    same = cond(Has(Field("m.n")), Field("m.n"), cond(Has(Field("m.k")), Field("m.k"), 1))
    out = optionals(same)
    assert out.cel() == "self.m.?n.orValue(self.m.?k.orValue(1))"
    other = cond(Has(Field("m.n")), Field("m.k"), 0)  # tests one field, reads another: left alone
    assert optionals(other) is other
    for spec in ({"m": {"n": 5}}, {"m": {"k": 2}}, {"m": {}}):
        assert out.eval({"self": spec}) == same.eval({"self": spec}) == cel_eval(out.cel(), spec)


def test_a_field_tested_and_read_three_times_is_read_once_with_a_marker_for_absent():
    preset = Field("p", "v_m")
    table = {"a": 1, "b": 2}
    value = cond(Has(preset), lookup(table, preset), 0)
    body = (value > 0) & cond(Has(Field("n", "v_m")), Field("n", "v_m"), value).eq(1)
    expr = Let("v_m", Field("m"), body)
    out = bind_field(expr, "v_m", "p", "v_p", "")
    assert out.body.var == "v_p" and out.body.value.cel() == 'v_m.?p.orValue("")'
    assert "v_m.p" not in out.body.body.cel() and 'v_p != ""' in out.cel()
    for spec in ({"m": {"p": "a"}}, {"m": {"p": "b", "n": 1}}, {"m": {}}, {"m": {"n": 1}}):
        assert out.eval({"self": spec}) == expr.eval({"self": spec}) == bool(cel_eval(out.cel(), spec)), spec
    once = Let("v_m", Field("m"), value > 0)  # read twice (has and the lookup's key): left alone
    assert bind_field(once, "v_m", "p", "v_p", "") is once


def test_the_cel_python_harness_rewrites_optional_selection_outside_string_literals():
    text = 'v_m.?n.orValue((x ? {"a)": 1}["a)"] : 0)) > 0 && self.d.?mock.orValue(false)'
    assert without_optionals(text) == ('(has(v_m.n) ? v_m.n : (x ? {"a)": 1}["a)"] : 0)) > 0 && '
                                       '(has(self.d.mock) ? self.d.mock : false)')


@pytest.mark.parametrize("case_id,doc,rule", CASES, ids=[c[0] for c in CASES])
def test_every_rule_as_generated_decides_as_the_plain_rule(case_id, doc, rule):
    """Python evaluation of each rule's generated form (bindings and rebasing) against the plain rule, on
    every spec of the table (the CEL text of both through cel-python is test_spec_rules' job and this one's
    for the rules that changed)."""
    spec = apply_defaults(ROOT, copy.deepcopy(doc))["spec"]
    env = {"self": spec}
    for r in SPEC_RULES:
        plain, generated = r.condition(), r.cel_condition()
        assert generated.eval(env) == plain.eval(env), r.name
        if generated is not plain:
            assert bool(cel_eval(generated.cel(), spec)) == bool(plain.eval(env)), r.name


def test_the_generated_rules_read_fewer_fields_through_the_spec():
    """Each `self.x.y` read resolves x among the spec's properties first; the generated rules do that once per
    object and rule. A guard against a change that silently undoes the bindings."""
    plain = sum(len(re.findall(r"\bself\.", r.condition().cel())) for r in SPEC_RULES)
    generated = sum(len(re.findall(r"\bself\.", r.cel_condition().cel())) for r in SPEC_RULES)
    assert generated < plain / 2, (plain, generated)
