"""The admission rules, through the pydantic models and through the generated CEL."""

from __future__ import annotations

import copy

import pytest
from celeval import apply_defaults, cel_errors
from factory import make_job
from megatron_operator import crd
from megatron_operator.rules import OBJECT_RULES, SPEC_RULES
from megatron_operator.validation import SpecError, parse_job
from spec_table import CASES, SCHEMA_CASES

ROOT = crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
RULE_NAMES = {r.name for r in SPEC_RULES + OBJECT_RULES}


def python_problems(doc):
    try:
        parse_job(doc)
        return []
    except SpecError as exc:
        return exc.problems


def test_table_is_large_and_covers_every_rule():
    assert len(CASES) >= 40
    assert len({c[0] for c in CASES}) == len(CASES), "duplicate case ids"
    broken = {rule for _, _, rule in CASES if rule}
    assert broken <= RULE_NAMES
    assert broken == RULE_NAMES, f"rules without an invalid case: {sorted(RULE_NAMES - broken)}"


@pytest.mark.parametrize("case_id,doc,rule", CASES, ids=[c[0] for c in CASES])
def test_models_and_cel_agree(case_id, doc, rule):
    problems = python_problems(doc)
    assert [p.rule for p in problems] == ([rule] if rule else []), [p.message for p in problems]

    defaulted = apply_defaults(ROOT, copy.deepcopy(doc))
    cel = cel_errors(ROOT, defaulted)
    assert cel == [p.message for p in problems]


@pytest.mark.parametrize("case_id,doc,rule", [c for c in CASES if c[2] is None], ids=[c[0] for c in CASES if c[2] is None])
def test_crd_defaults_equal_model_defaults(case_id, doc, rule):
    """The API server's defaulting (from the CRD) yields exactly the spec the models produce."""
    job = parse_job(doc)
    assert apply_defaults(ROOT, copy.deepcopy(doc))["spec"] == job.spec.wire()


def test_messages_name_field_numbers_and_fix():
    problems = python_problems(make_job(training__globalBatchSize=100))
    assert problems[0].message == (
        "spec.training.globalBatchSize: 100 is not divisible by microBatchSize 2 x data parallel 4 = 8; "
        "use a multiple of 8 such as 96 or 104")
    assert problems[0].field == "spec.training.globalBatchSize"


def test_message_hint_when_batch_below_multiple():
    problems = python_problems(make_job(training__globalBatchSize=6))
    assert problems[0].message.endswith("use a multiple of 8 such as 8 or 16")


def test_every_invalid_case_message_starts_with_its_field():
    for case_id, doc, _rule in CASES:
        for p in python_problems(doc):
            assert p.message.startswith(p.field + ":") or p.message.startswith(p.field.rsplit(".", 1)[0]), case_id


def test_several_problems_are_all_reported():
    doc = make_job(training__globalBatchSize=100, model__hiddenSize=1000)
    rules = {p.rule for p in python_problems(doc)}
    assert rules == {"global-batch-divisible", "hidden-divisible-by-heads"}
    assert len(cel_errors(ROOT, apply_defaults(ROOT, doc))) == 2


def test_name_rule_in_cel():
    doc = make_job(metadata={"name": "a" * 41})
    assert any("at most 40 characters" in e for e in cel_errors(ROOT, apply_defaults(ROOT, doc)))
    assert python_problems(doc)[0].field == "metadata.name"


@pytest.mark.parametrize("field,old,new,allowed", [
    ("numNodes", 2, 4, False),
    ("suspend", False, True, True),
    ("activeDeadlineSeconds", None, 3600, True),
    ("checkpoint", None, {"pvc": "c"}, False),
    ("training", {"trainIters": 100}, {"trainIters": 200}, False),
    ("init", None, {"huggingFace": {"pvc": "m", "path": "a"}}, False),
    ("init", {"huggingFace": {"pvc": "m", "path": "a"}}, {"huggingFace": {"pvc": "m", "path": "b"}}, False),
    ("export", {"huggingFace": {"pvc": "m", "path": "a"}}, None, False),
])
def test_immutability_transition_rules(field, old, new, allowed):
    spec_schema = ROOT["properties"]["spec"]
    old_doc = make_job() if old is None else make_job(**{field: old})
    new_doc = make_job() if new is None else make_job(**{field: new})
    if field == "training":
        old_doc = make_job(training={**make_job()["spec"]["training"], **old})
        new_doc = make_job(training={**make_job()["spec"]["training"], **new})
    old_spec = apply_defaults(ROOT, old_doc)["spec"]
    new_spec = apply_defaults(ROOT, new_doc)["spec"]
    errors = cel_errors(spec_schema, new_spec, old=old_spec)
    immut = [e for e in errors if "immutable" in e]
    assert (not immut) == allowed, errors


def _changed(v):
    """A different value of the same JSON type."""
    if isinstance(v, bool):
        return not v
    if isinstance(v, int):
        return v + 1
    if isinstance(v, str):
        return v + "x"
    if isinstance(v, list):
        return [*v, "x"]
    return {**v, "changed": 1}


@pytest.mark.parametrize("field", sorted(crd.immutable_spec_fields(ROOT["properties"]["spec"])))
def test_each_immutable_field_changed_added_or_removed_gives_its_one_error(field):
    """The rule on the field's own node (a change) and, for a field that may be absent, the presence rule on
    spec (added, removed): exactly one error, the field's message."""
    spec_schema = ROOT["properties"]["spec"]
    base = apply_defaults(ROOT, make_job())["spec"]
    want = [crd.immutable_message(field)]
    old = {**base, field: base.get(field, "before")}
    assert cel_errors(spec_schema, {**old, field: _changed(old[field])}, old=old) == want
    assert cel_errors(spec_schema, old, old=old) == []
    optional = field not in spec_schema.get("required", []) and "default" not in spec_schema["properties"][field]
    if optional:
        without = {k: v for k, v in old.items() if k != field}
        assert cel_errors(spec_schema, without, old=old) == want  # removed
        assert cel_errors(spec_schema, old, old=without) == want  # added


def test_every_rule_is_documented():
    from pathlib import Path

    doc = (Path(__file__).parents[2] / "docs" / "validation.md").read_text()
    missing = [r.name for r in SPEC_RULES + OBJECT_RULES if f"`{r.name}`" not in doc]
    assert not missing, f"document these rules in docs/validation.md: {missing}"


@pytest.mark.parametrize("case_id,doc,server_says", SCHEMA_CASES, ids=[c[0] for c in SCHEMA_CASES])
def test_schema_level_refusals_in_the_models_and_the_crd(case_id, doc, server_says):
    """What the schema (not a spec rule) refuses, the models refuse too; the CRD's schema (checked
    with jsonschema, plus the CEL rule on the object for metadata.name) refuses it as well."""
    import jsonschema

    assert python_problems(doc), f"the models accept {case_id}"
    defaulted = apply_defaults(ROOT, copy.deepcopy(doc))
    schema_errors = list(jsonschema.Draft4Validator(ROOT).iter_errors(defaulted))
    assert schema_errors or cel_errors(ROOT, defaulted), f"the CRD accepts {case_id}"


def test_re2_semantics_in_python():
    from megatron_operator.expr import Matches, Var
    m = Matches(Var("s"), "^--save$")
    assert m.eval({"s": "--save"}) and not m.eval({"s": "--save\n"})  # Python's re would say yes


def test_the_crd_schema_check_accepts_every_valid_case():
    """The control for the test above: the same jsonschema check finds nothing in the valid table."""
    import jsonschema

    for case_id, doc, rule in CASES:
        if rule is None:
            errors = list(jsonschema.Draft4Validator(ROOT).iter_errors(apply_defaults(ROOT, copy.deepcopy(doc))))
            assert not errors, (case_id, [e.message for e in errors])


def test_what_spec_pod_has_no_field_for_is_refused_by_the_models_and_absent_from_the_crd():
    """Host namespaces, another ServiceAccount, projected tokens, hostPath-like sources other than hostPath, a
    container's root user: no field, so nothing a guardrail could be talked out of (the API server prunes
    unknown fields, and kubectl's strict field validation refuses them)."""
    pod_schema = ROOT["properties"]["spec"]["properties"]["pod"]
    assert set(pod_schema["properties"]) == {"volumes", "volumeMounts", "initContainers", "affinity",
                                             "topologySpreadConstraints"}
    volume = pod_schema["properties"]["volumes"]["items"]["properties"]
    assert set(volume) - {"name"} == {"persistentVolumeClaim", "configMap", "secret", "emptyDir", "csi", "image",
                                      "hostPath"}
    container = pod_schema["properties"]["initContainers"]["items"]["properties"]
    assert not {"serviceAccountName", "ports", "stdin", "livenessProbe"} & set(container)
    assert container["securityContext"]["properties"]["runAsUser"]["minimum"] == 1
    assert "runAsNonRoot" not in container["securityContext"]["properties"]
    for pod, field in (({"hostNetwork": True}, "hostNetwork"), ({"hostPID": True}, "hostPID"),
                       ({"serviceAccountName": "admin"}, "serviceAccountName"),
                       ({"volumes": [{"name": "t", "projected": {"sources": []}}]}, "projected"),
                       ({"initContainers": [{"name": "a", "image": "b", "serviceAccountName": "x"}]},
                        "serviceAccountName")):
        problems = python_problems(make_job(pod=pod))
        assert [p.rule for p in problems] == ["extra_forbidden"] and field in problems[0].field, problems
