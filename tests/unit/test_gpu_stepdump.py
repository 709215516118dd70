"""The stepdump scenario's comparison (e2e/gpu/stepdump.py): which tensor of which step first differs
between ours' and Megatron-LM's dumps. The hook that writes the dumps is checked with torch in
tests/trainer/test_torch_paths.py."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "e2e" / "gpu"))
import mlm_compare as MC
import stepdump as SD


def _d(bits: int, norm: float = 1.0, numel: int = 4, dtype: str = "float32") -> dict:
    return {"dtype": dtype, "numel": numel, "sum": float(bits), "norm": norm, "bits": bits, "bits_pos": 3 * bits}


def _dump(steps: int = 3) -> dict:
    out = []
    for k in range(steps):
        out.append({"models": 1,
                    "params_before": {"embedding.weight": _d(10 + k, dtype="bfloat16"), "decoder.norm.weight": _d(20 + k)},
                    "grads": {"embedding.weight": _d(30 + k), "decoder.norm.weight": _d(40 + k)},
                    "groups": [{"lr": 1e-4 * k, "weight_decay": 0.1, "numel": 8}, {"lr": 1e-4 * k, "weight_decay": 0.0,
                                                                                   "numel": 4}],
                    "main_params_after": [[_d(50 + k)], [_d(60 + k)]]})
    return {"rank": 0, "steps": out}


def test_identical_dumps_have_no_first_difference():
    r = SD.compare(_dump(), _dump())
    assert r["first_difference"] is None
    assert r["steps_recorded"] == {"ours": 3, "megatron_lm": 3}
    assert [s["grads"]["compared"] for s in r["steps"]] == [2, 2, 2]
    assert all(s["updated"]["compared"] == 2 and s["updated"]["differ"] == 0 for s in r["steps"])


def test_a_gradient_that_differs_at_step_two_is_named_with_its_norms():
    ours = _dump()
    ours["steps"][1]["grads"]["decoder.norm.weight"] = _d(77, norm=1.001)
    ours["steps"][1]["main_params_after"][1][0] = _d(99)
    r = SD.compare(ours, _dump())
    assert r["first_difference"] == {"step": 2, "what": "grads"}
    first = r["steps"][1]["grads"]["first"][0]
    assert first["name"] == "decoder.norm.weight" and first["numel"] == 4
    assert abs(first["norm_rel_diff"] - 1e-3) < 1e-9
    assert r["steps"][1]["updated"]["first"][0]["name"] == "group 1 #0"
    assert r["steps"][1]["grads"]["norm_rel_diff"] == {"decoder.norm.weight": 0.001}
    assert r["steps"][1]["grads"]["equal"] == ["embedding.weight"]
    assert r["steps"][0]["grads"]["differ"] == 0


def test_same_norm_but_other_bits_counts_as_a_difference():
    ours = _dump()
    ours["steps"][0]["params_before"]["embedding.weight"]["bits_pos"] += 1  # elements moved, sums alike
    assert SD.compare(ours, _dump())["first_difference"] == {"step": 1, "what": "weights"}


def test_group_settings_and_missing_tensors_are_reported():
    ours, mlm = _dump(), _dump()
    ours["steps"][0]["groups"][1]["weight_decay"] = 0.1
    r = SD.compare(ours, mlm)
    assert r["first_difference"] == {"step": 1, "what": "groups"}
    assert r["steps"][0]["groups"] == [{"group": 1, "key": "weight_decay", "ours": 0.1, "megatron_lm": 0.0}]
    ours = _dump()
    del ours["steps"][2]["grads"]["embedding.weight"]
    r = SD.compare(ours, mlm)
    assert r["first_difference"] == {"step": 3, "what": "grads"}
    assert r["steps"][2]["grads"]["only_megatron_lm"] == ["embedding.weight"]


def test_a_shorter_dump_is_compared_as_far_as_it_goes():
    mlm = _dump()
    ours = copy.deepcopy(mlm)
    ours["steps"] = ours["steps"][:1]
    r = SD.compare(ours, mlm)
    assert r["steps_recorded"] == {"ours": 1, "megatron_lm": 3} and len(r["steps"]) == 1


def test_suite_knows_the_scenario_and_its_default():
    import suite as S

    assert S.SCENARIOS["stepdump"].run is MC.scenario_stepdump
    assert "mlmlike" in MC.THREEWAY_VARIANTS and "dp1" in MC.THREEWAY and "llama1b" in MC.MODELS


def test_unknown_layout_is_an_error_not_a_traceback():
    r = MC.scenario_stepdump({"stepdump": "tp9:llama1b,dp2:llama1b", "gpus": 1})
    assert r["ok"] is False
    assert "unknown --stepdump" in r["tp9:llama1b"]["error"]
    assert "needs 2 GPUs" in r["dp2:llama1b"]["error"]
    r = MC.scenario_stepdump({"stepdump": "dp1:llama1b:nosuch", "gpus": 1})
    assert "unknown --stepdump dp1:llama1b:nosuch" in r["dp1:llama1b:nosuch"]["error"]
