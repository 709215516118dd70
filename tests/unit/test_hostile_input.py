"""No input hangs the CLI: hostile YAML through `validate`, `render` and `estimate`, each run as a
subprocess under a memory limit (RLIMIT_AS) and a time limit, must end with exit 1 and one-line
messages, never a traceback. A hypothesis test then throws generated YAML-ish text at the loader.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from factory import make_job
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from megatron_operator import manifest_yaml
from megatron_operator.manifest_yaml import InputError, load_documents

ROOT = Path(__file__).resolve().parents[2]
#: Per run: the CLI's whole budget of CPU time (user + system), Python start-up included (about 0.3 s of it). CPU
#: time, not wall time: on a loaded 2-core CI machine a run waits for a core (8.06 s of wall time once, 2026-11-28),
#: which says nothing about the input. The child also gets it as RLIMIT_CPU, so a run over it is killed.
TIME_LIMIT_S = 8.0
#: Per run: wall time before a run counts as hung (a wait that burns no CPU).
HANG_LIMIT_S = 60.0
#: Per run: the address space of the CLI process (Python with pydantic maps about 200 MiB).
MEMORY_LIMIT_BYTES = 768 * 1024 * 1024

JOB = yaml.safe_dump(make_job(), sort_keys=False)
HEAD = "apiVersion: megatron-operator.io/v1alpha1\nkind: MegatronJob\n"


def _laughs(levels: int = 9, width: int = 9) -> list[str]:
    """Anchors l0..l{levels-1}, each a list of `width` aliases to the one before: width**levels leaves."""
    lines = ["&l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    lines += [f"&l{i} [{', '.join([f'*l{i - 1}'] * width)}]" for i in range(1, levels)]
    return lines


def bomb_in_metadata() -> str:
    body = "".join(f"    a{i}: {line}\n" for i, line in enumerate(_laughs()))
    return JOB.replace("metadata:\n", f"metadata:\n  annotations:\n{body}", 1)


def bomb_in_extra_args() -> str:
    body = "".join(f"    - {line}\n" for line in _laughs())
    return JOB.replace("  training:\n", f"  training:\n    extraArgs:\n{body}", 1)


def bomb_under_unknown_key() -> str:
    return JOB + "lol:\n" + "".join(f"  k{i}: {line}\n" for i, line in enumerate(_laughs()))


def bomb_in_list_items() -> str:
    return "apiVersion: v1\nkind: List\nitems:\n" + "".join(f"- {line}\n" for line in _laughs())


def deep(kind: str, levels: int) -> str:
    return JOB + "extra: " + ("[" * levels + "]" * levels if kind == "flow" else "{a: " * levels + "1" + "}" * levels)


def deep_block(levels: int) -> str:
    return JOB + "extra:\n" + "".join("  " * (i + 1) + "a:\n" for i in range(levels)) + "  " * (levels + 1) + "1\n"


HOSTILE: dict[str, tuple[bytes | str, str]] = {
    # name: (content, a piece of the expected one-line message; "" for a valid job)
    "alias bomb in metadata": (bomb_in_metadata(), "YAML alias *l0 is not allowed"),
    "alias bomb in extraArgs": (bomb_in_extra_args(), "YAML alias *l0 is not allowed"),
    "alias bomb under an unknown key": (bomb_under_unknown_key(), "YAML alias *l0 is not allowed"),
    "alias bomb in a List's items": (bomb_in_list_items(), "YAML alias *l0 is not allowed"),
    "merge key from an alias": (JOB.replace("spec:\n", "base: &b {numNodes: 1}\nspec:\n  <<: *b\n", 1),
                                "line 8, column 7: YAML alias *b is not allowed"),
    "deep flow sequences": (deep("flow", 100_000), "nested deeper than 64 levels"),
    "deep flow mappings": (deep("map", 100_000), "nested deeper than 64 levels"),
    "deep block mappings": (deep_block(2000), "nested deeper than 64 levels"),
    "huge scalar": (JOB.replace("name: job", "name: " + "x" * 4_000_000, 1), "the limit is 262144"),
    "huge scalar in extraArgs": (JOB.replace("trainIters: 100", "extraArgs: ['" + "y" * 300_000 + "']", 1),
                                 "the limit is 262144"),
    "many documents": ("---\n".join([JOB] * 1500), "more than 1000 documents"),
    "many empty documents": ("---\n" * 2_000_000, "more than 1000 documents"),
    "many List items": (json.dumps({"apiVersion": "v1", "kind": "List", "items": [make_job()] * 1200}),
                        "more than 1000 objects"),
    "many values": (JOB + "extra: [" + ",".join(["1"] * 300_000) + "]\n", "more than 200000 values"),
    "many values in extraArgs": (JOB.replace("trainIters: 100", "extraArgs: [" + ",".join(["--x"] * 199_000)
                                             + "]", 1), "spec.training.extraArgs"),
    "long comment line": (JOB + "# " + "z" * 7_000_000 + "\n", ""),
    "long line of values": (JOB + "extra: [" + ",".join(["abcdefghij" * 20] * 35_000) + "]\n", "unknown field"),
    "too large": (JOB + "# " + "z" * 9_000_000 + "\n", "larger than 8 MiB"),
    "binary junk": (bytes(range(256)) * 4096, "not UTF-8 text"),
    "NUL bytes": (JOB + "\0" * 1000, "invalid YAML"),
    "control characters": (JOB.replace("job", "j\x07b", 1), "invalid YAML"),
    "unclosed flows": (JOB + "extra: [" * 50_000, "nested deeper than 64 levels"),
    "unclosed flow": (JOB + "extra: [1, 2\n", "invalid YAML"),
    "huge integer": (JOB.replace("numNodes: 2", "numNodes: " + "9" * 200_000, 1), "the limit is 64"),
    "huge hex integer": (JOB.replace("numNodes: 2", "numNodes: 0x" + "f" * 200_000, 1), "the limit is 64"),
    "huge base-60 integer": (JOB.replace("numNodes: 2", "numNodes: 1" + ":59" * 80_000, 1), "the limit is 64"),
    "huge float": (JOB.replace("numNodes: 2", "numNodes: 1." + "9" * 200_000, 1), "the limit is 64"),
    "impossible date": (JOB + "extra: 2001-02-30\n", "invalid YAML: day is out of range for month"),
    "impossible tagged timestamp": (JOB + "extra: !!timestamp 2001-99-99\n", "invalid YAML: month must be in"),
    "a Python tag": (JOB + "extra: !!python/object/apply:os.system ['true']\n", "invalid YAML"),
    "duplicate keys, many": (JOB + "".join(f"k: {i}\n" for i in range(3)), "duplicate key 'k'"),
    "non-string keys, many": (JOB + "extra: {" + ",".join(f"{i}: 1" for i in range(90_000)) + "}\n",
                              "is not a string"),
}


def _limits() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT_BYTES, MEMORY_LIMIT_BYTES))
    cpu = int(TIME_LIMIT_S) + 1  # whole seconds; the assertion below holds it to TIME_LIMIT_S
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_bounded(args: list[str], path: Path) -> tuple[subprocess.CompletedProcess, float]:
    """The CLI on `path` under the memory and CPU limits; (its result, the CPU seconds it used)."""
    before = _children_cpu_s()
    proc = subprocess.run([sys.executable, "-m", "megatron_operator", *args, str(path)], capture_output=True,
                          text=True, errors="replace", cwd=ROOT, timeout=HANG_LIMIT_S, preexec_fn=_limits,
                          env={"PYTHONPATH": f"{ROOT / 'operator'}:{ROOT / 'contract'}", "PATH": "/usr/bin:/bin"})
    return proc, _children_cpu_s() - before


@pytest.mark.parametrize("command", [["validate"], ["render"], ["estimate"]])
@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_yaml_ends_quickly_with_a_one_line_message(tmp_path, name, command):
    content, needle = HOSTILE[name]
    path = tmp_path / "hostile.yaml"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    proc, took_s = run_bounded(command, path)  # TimeoutExpired fails the test
    assert proc.returncode >= 0 and took_s < TIME_LIMIT_S, (proc.returncode, took_s)  # < 0: killed by RLIMIT_CPU
    if not needle:  # harmless however large: the job is checked as usual
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        return
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr and "MemoryError" not in proc.stderr, proc.stderr[-3000:]
    lines = proc.stderr.splitlines()
    assert lines and all(len(line) < 1000 for line in lines), [line[:200] for line in lines[:5]]
    assert len(lines) <= 20, lines[:25]
    assert needle in proc.stderr, proc.stderr[:2000]


def test_a_valid_job_still_passes_under_the_same_limits(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("---\n".join([JOB.replace("name: job", f"name: job{i}") for i in range(1000)]))
    proc, _ = run_bounded(["validate"], path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count(": valid") == 1000


def test_anchors_without_aliases_are_harmless():
    assert load_documents("a: &x 1\nb: 2\n") == [{"a": 1, "b": 2}]


def test_the_alias_message_names_line_and_column():
    with pytest.raises(InputError, match=r"^line 2, column 4: YAML alias \*x is not allowed: a MegatronJob has "
                                         r"no use for anchors and aliases; write the value out$"):
        load_documents("a: &x [1]\nb: *x\n")


# Text built from YAML's own punctuation, anchors and aliases, indentation and odd characters:
# whatever comes out, the loader returns documents or an InputError, within the caps.
_PIECES = st.sampled_from(["2001-02-30", "!!timestamp ", "!!binary ", "!!int ", "!!float ", "1:2:3", "&a ", "*a", "&b ", "*b", "<<: ", "[", "]", "{", "}", ", ", ": ", "- ", "\n", "  ",
                           "---\n", "...\n", "? ", "!!str ", "!!python/name:os.system ", "!x ", "|\n", ">-\n",
                           "'", '"', "#", "%YAML 1.1\n", "\t", "\ufeff", "\x00", "\x85", "key", "1", "1.5",
                           "null", "~", "true", "0x1F", "é"])
_TEXT = st.lists(st.one_of(_PIECES, st.text(max_size=5)), max_size=200).map("".join)


@settings(max_examples=400, deadline=2000, suppress_health_check=[HealthCheck.too_slow])
@given(_TEXT)
def test_loader_never_raises_anything_but_input_error(text):
    try:
        docs = load_documents(text)
    except InputError as exc:
        assert "\n" not in str(exc)
        return
    assert len(docs) <= manifest_yaml.MAX_OBJECTS
    assert_tree(docs)


def assert_tree(docs: list) -> None:
    """No container is reachable twice: the documents are trees, so walking them is linear in the text."""
    seen: set[int] = set()
    stack: list = list(docs)
    while stack:
        node = stack.pop()
        if isinstance(node, (dict, list)):
            assert id(node) not in seen, "a shared node: an alias was expanded"
            seen.add(id(node))
            stack += list(node.values()) if isinstance(node, dict) else node


@settings(max_examples=60, deadline=5000, suppress_health_check=[HealthCheck.too_slow])
@given(levels=st.integers(2, 12), width=st.integers(2, 12))
def test_every_alias_bomb_shape_is_refused_at_once(levels, width):
    text = "\n".join(f"k{i}: {line}" for i, line in enumerate(_laughs(levels, width))) + "\n"
    start = time.process_time()  # CPU time: a loaded machine's waits say nothing about the input
    with pytest.raises(InputError, match="YAML alias"):
        load_documents(text)
    assert time.process_time() - start < 1.0


# The operator's side: the API server has parsed the JSON (no aliases; at most 3 MiB per request)
# and pruned every field the CRD's structural schema does not declare, so an object is no deeper
# than the schema. validation.parse_job walks it iteratively and reports a bounded list.


def _schema_depth(schema: dict) -> int:
    children = [*schema.get("properties", {}).values(),
                *([schema["items"]] if isinstance(schema.get("items"), dict) else []),
                *([schema["additionalProperties"]] if isinstance(schema.get("additionalProperties"), dict) else [])]
    return 1 + max((_schema_depth(c) for c in children), default=0)


def test_api_objects_are_no_deeper_than_the_crd_schema_which_is_within_validations_bound():
    from megatron_operator.crd import build_crd
    from megatron_operator.validation import MAX_DEPTH

    crd = build_crd()
    text = json.dumps(crd)
    assert "x-kubernetes-preserve-unknown-fields" not in text  # nothing the schema does not declare is kept
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert _schema_depth(schema) < MAX_DEPTH


def test_a_manifest_with_a_problem_per_item_reports_a_bounded_list():
    from megatron_operator.validation import MAX_PROBLEMS, SpecError, parse_job

    doc = make_job()
    doc["spec"]["env"] = [{"name": i} for i in range(64)]  # at the schema's maxItems; no name is a string
    start = time.process_time()
    with pytest.raises(SpecError) as err:
        parse_job(doc)
    assert time.process_time() - start < 5
    assert len(err.value.problems) == MAX_PROBLEMS
    assert err.value.problems[-1].message.startswith("... and ")


# The same through the CLI process under its limits, on generated hostile files: alias bombs of any
# shape, nesting of any depth and style, long scalars, many documents, anywhere in a job.
_FRAGMENT = st.one_of(
    st.builds(lambda levels, width: "\n".join(f"  k{i}: {line}" for i, line in enumerate(_laughs(levels, width))),
              st.integers(2, 12), st.integers(2, 12)),
    st.builds(lambda depth, style: "  x: " + ("[" * depth + "]" * depth if style else "{a: " * depth + "1" + "}" * depth),
              st.integers(1, 50_000), st.booleans()),
    st.builds(lambda n, c: f"  x: {c * n}", st.integers(1, 600_000), st.sampled_from(["y", "9", "é", "\\t"])),
    st.builds(lambda n: "  x: [" + ",".join(["1"] * n) + "]", st.integers(1, 300_000)),
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(fragment=_FRAGMENT, where=st.sampled_from(["metadata", "spec", "training", "top"]),
       copies=st.integers(1, 1200))
def test_generated_hostile_files_end_within_the_limits(tmp_path, fragment, where, copies):
    anchor = {"metadata": "metadata:\n", "spec": "spec:\n", "training": "  training:\n", "top": None}[where]
    if anchor is None:
        doc = JOB + fragment.replace("  ", "", 1) + "\n"
    else:
        indent = "  " if where == "training" else ""
        doc = JOB.replace(anchor, anchor + "\n".join(indent + line for line in fragment.split("\n")) + "\n", 1)
    path = tmp_path / "generated.yaml"
    path.write_text("---\n".join([doc] * min(copies, max(1, 4_000_000 // len(doc)))))
    proc, took_s = run_bounded(["validate"], path)  # TimeoutExpired fails the test
    assert proc.returncode in (0, 1) and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert all(len(line) < 1000 for line in proc.stderr.splitlines())
    assert took_s < TIME_LIMIT_S
