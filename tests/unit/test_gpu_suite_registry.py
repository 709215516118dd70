"""The GPU suite's layout (e2e/gpu): suite.py is the registry and command line, harness.py what the scenario
families share, and each family a module of its own. Here: --list and --help work without torch and show
every scenario the suite had before the families were split out, in the same order; no module imports the
registry and the modules import no circle; each family documents its own scenarios."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "e2e" / "gpu"))
import suite as S

GPU = Path(S.__file__).parent

# suite.py's SCENARIOS before the split (354c8a8), in its order: the default --only runs them so.
BEFORE_THE_SPLIT = ["probe", "indexed", "layouts", "resume", "sigterm", "reshard", "bench", "memory", "perf", "pods",
                    "preempt", "tensorboard", "deterministic", "detcost", "objbench", "threeway", "collectives",
                    "rope", "disk", "hf_logits", "hf_train", "hf_bench", "hf_pods", "hf_store", "sft_reverse",
                    "sft_bench", "sft_pods", "sft_sigterm", "stepdump"]
SCALE = ["goodput", "diskfull"]  # issue 49's family (scale.py), added after the split
MOE = ["moe_qwen3", "moe_mixtral", "moe_levers", "moe_resume"]  # issue 50's family (moe.py), issue 60's levers
LATER = ["hf_moe_logits", "sft_moe"]  # issue 50's scenarios in hf.py and sft.py: after ORDER, by family
TE = ["te_paths", "te_bench", "te_hf_logits", "te_fp8"]  # issue 59's family (te.py), last in FAMILIES
NOW = BEFORE_THE_SPLIT + SCALE + MOE + LATER + TE
FAMILIES = ["correctness", "performance", "mlm_compare", "scale", "moe", "hf", "sft", "te"]


def run_suite_without_torch(*argv: str) -> subprocess.CompletedProcess:
    """suite.py as `python3 e2e/gpu/suite.py ARGV` runs it, with every `import torch` failing."""
    code = ("import runpy, sys\nsys.modules['torch'] = None\n"
            f"sys.argv = [{str(GPU / 'suite.py')!r}, *{list(argv)!r}]\n"
            f"sys.path.insert(0, {str(GPU)!r})\n"
            f"runpy.run_path({str(GPU / 'suite.py')!r}, run_name='__main__')")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


def test_list_shows_every_scenario_of_before_the_split_in_its_order_without_torch():
    p = run_suite_without_torch("--list")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert [line.split()[0] for line in lines] == NOW
    assert all(len(line.split(maxsplit=1)) == 2 for line in lines)  # each with its line
    assert list(S.SCENARIOS) == NOW  # the default --only


def test_help_needs_no_torch_and_names_every_family_module():
    p = run_suite_without_torch("--help")
    assert p.returncode == 0, p.stderr
    assert "--list" in p.stdout and "--only" in p.stdout
    assert all(f"{family}.py" in p.stdout for family in FAMILIES + ["harness"])


def test_the_registry_holds_exactly_the_families():
    assert [getattr(f, "__name__", None) for f in S.FAMILIES] == FAMILIES  # none left out by a failed import


@pytest.mark.parametrize("name", FAMILIES)
def test_each_family_documents_and_defines_its_own_scenarios(name):
    family = importlib.import_module(name)
    assert family.SCENARIOS
    for scenario_name, scenario in family.SCENARIOS.items():
        assert S.SCENARIOS[scenario_name] is scenario
        assert scenario.run.__module__ == name, f"{scenario_name} is defined in {scenario.run.__module__}"
        assert scenario.summary and "\n" not in scenario.summary
        assert f"\n  {scenario_name} " in family.__doc__, f"{name}.py's docstring does not describe {scenario_name}"


def local_imports(path: Path, local: set[str]) -> set[str]:
    """The e2e/gpu modules a file imports, at module level or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found & local


def test_no_module_imports_the_registry_and_no_import_circle():
    files = {p.stem: p for p in GPU.glob("*.py")}
    graph = {name: local_imports(path, set(files)) for name, path in files.items()}
    assert [name for name, deps in graph.items() if "suite" in deps] == []
    assert graph["harness"] & set(FAMILIES) == set(), "the harness imports a family"
    for family in FAMILIES:
        assert graph[family] & (set(FAMILIES) - {family}) == set(), f"{family} imports another family"
        assert "harness" in graph[family]

    def visit(name: str, path: tuple[str, ...]) -> None:
        assert name not in path, f"import circle: {' -> '.join(path + (name,))}"
        for dep in graph[name]:
            visit(dep, path + (name,))

    for name in graph:
        visit(name, ())


def test_a_scenario_name_in_two_families_is_refused():
    one = SimpleNamespace(__name__="one", SCENARIOS={"x": S.Scenario(lambda ctx: {"ok": True}, "x")})
    with pytest.raises(ValueError, match="'x' is in two families"):
        S.registry([one, one], ())


def test_a_new_familys_scenarios_run_after_the_named_order():
    new = SimpleNamespace(__name__="newfamily", SCENARIOS={"example": S.Scenario(lambda ctx: {"ok": True}, "x")})
    assert list(S.registry([*S.FAMILIES, new], S.ORDER)) == NOW + ["example"]


STATE = ("WORK", "LOGS", "DEADLINE", "OURS_EXTRA", "STORE", "STORE_BUCKET")


def test_the_suites_state_lives_in_the_harness_alone():
    """WORK, LOGS, DEADLINE, OURS_EXTRA and STORE are assigned in harness.py only; every module that has them holds
    the harness's own objects (main's DEADLINE[0] = ... and --ours-extra reach every family)."""
    harness = importlib.import_module("harness")
    for path in GPU.glob("*.py"):
        assigned = {t.id for node in ast.parse(path.read_text()).body if isinstance(node, (ast.Assign, ast.AnnAssign))
                    for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                    if isinstance(t, ast.Name)}
        assert path.stem == "harness" or not assigned & set(STATE), f"{path.name} assigns {assigned & set(STATE)}"
    for name in ["suite", *FAMILIES]:
        module = importlib.import_module(name)
        for var in STATE:
            if hasattr(module, var):
                assert getattr(module, var) is getattr(harness, var), f"{name}.{var} is a copy"


def test_a_scenario_is_skipped_with_its_reason_on_too_few_gpus_or_too_little_time():
    two = S.Scenario(lambda ctx: {"ok": True}, "needs TP=2", 100, min_gpus=2)
    assert S.skip_reason(two, 1, 1, 10_000) == "needs 2 GPUs, this call has 1"
    assert S.skip_reason(two, 2, 1, 10_000) is None
    assert S.skip_reason(two, 2, 3, 250) == "deadline (needs ~300 s)"
    assert S.skip_reason(two, 2, 3, 300) is None
    assert S.skip_reason(None, 1, 1, 59) == "deadline (needs ~60 s)"


def test_the_hf_scenarios_with_fixed_tp2_and_pp2_layouts_say_they_need_two_gpus():
    # hf_logits on a 1-GPU call hung at its TP=2 step until the call's timeout (2026-11-28, call 1)
    for name in ("hf_logits", "hf_train", "hf_bench", "hf_pods", "hf_store"):
        assert S.SCENARIOS[name].min_gpus == 2, name
    listed = run_suite_without_torch("--list").stdout.splitlines()
    assert any(line.startswith("hf_logits") and line.endswith("[2+ GPUs]") for line in listed)
    assert any(line.startswith("layouts") and "GPUs]" not in line for line in listed)
