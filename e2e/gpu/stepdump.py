"""The `stepdump` scenario's comparison (issue 29): where ours, run as Megatron-LM runs it, first computes
something else. The scenario itself (both runs, then this comparison per rank) is in mlm_compare.py.

    bash e2e/gpu/run_on_device.sh --gpus 1 --only stepdump --stepdump dp1:llama1b

Ours' `mlmlike` variant (unfused attention, eager, Megatron's unfused RoPE, torch AdamW's foreach kernels,
bf16 weight gradients then added) gives Megatron-LM's losses of iterations 1-2 to every printed digit and
differs from iteration 3 on (docs/benchmarks/megatron-lm.md#2026-11-26-mlmlike-3b-dp2). Megatron-LM's pretrain_gpt.py and ours then
run the same model, layout and data once more with stepdump_site/sitecustomize.py loaded, which records a
digest of every weight and every gradient before each of the first optimizer steps, each parameter group's
settings, and the optimizer's parameters after each step. Compared rank by rank, the first tensor whose
digest differs names where the two programs part: a gradient at step 1 names an op of the forward or the
backward, equal gradients with different updated parameters name the optimizer or its settings.

Found with it on 2 x H200 (docs/benchmarks/megatron-lm.md#2026-11-27-stepdump): the two programs part in three settings, the
unfused attention's softmax precision, the per-token loss and the gradient norm's reduction order. With
`--stepdump dp2:llama3b:oursconfig:mlmlikemt` (Megatron-LM given ours' first two, ours given Megatron-Core's
per-tensor norm) every weight, gradient and updated parameter of steps 1-3 is identical on every rank.
"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HOOK = REPO / "e2e" / "gpu" / "stepdump_site" / "sitecustomize.py"
DIGEST_KEYS = ("dtype", "numel", "bits", "bits_pos")  # equal in all four: the same bits, short of a collision


def same(a: dict, b: dict) -> bool:
    return all(a.get(k) == b.get(k) for k in DIGEST_KEYS)


def _rel(a: dict, b: dict) -> float | None:
    """|ours' norm - Megatron-LM's| / Megatron-LM's (None where Megatron-LM's norm is 0)."""
    return abs(a["norm"] - b["norm"]) / b["norm"] if b.get("norm") else None


def _round3(x: float | None) -> float | None:
    return None if x is None else float(f"{x:.3g}")


def _describe(name: str, a: dict, b: dict) -> dict:
    """One differing tensor: ours' and Megatron-LM's norms and their relative difference."""
    return {"name": name, "numel": a.get("numel"), "dtype": a.get("dtype"), "norm_ours": a.get("norm"),
            "norm_megatron_lm": b.get("norm"), "norm_rel_diff": _rel(a, b), "sum_diff": a.get("sum", 0) - b.get("sum", 0)}


def _compare_named(a: dict, b: dict, limit: int) -> dict:
    shared = [n for n in a if n in b]  # ours' order: the model's
    differ = [n for n in shared if not same(a[n], b[n])]
    differing = set(differ)
    return {"compared": len(shared), "differ": len(differ), "first": [_describe(n, a[n], b[n]) for n in differ[:limit]],
            # every differing tensor's relative norm difference (model order) and every equal one's name: where the
            # difference starts shows in which tensors stay equal (a backward pass runs from the last layer)
            "norm_rel_diff": {n: _round3(_rel(a[n], b[n])) for n in differ}, "equal": [n for n in shared if n not in differing],
            "only_ours": sorted(set(a) - set(b))[:limit], "only_megatron_lm": sorted(set(b) - set(a))[:limit]}


def _compare_groups(a: list[dict], b: list[dict]) -> list[dict]:
    """Parameter-group settings that differ: [{group, key, ours, megatron_lm}]."""
    out = []
    if len(a) != len(b):
        out.append({"group": None, "key": "count", "ours": len(a), "megatron_lm": len(b)})
    for i, (ga, gb) in enumerate(zip(a, b, strict=False)):
        for key in sorted(set(ga) | set(gb)):
            if ga.get(key) != gb.get(key):
                out.append({"group": i, "key": key, "ours": ga.get(key), "megatron_lm": gb.get(key)})
    return out


def _compare_positional(a: list[list[dict]], b: list[list[dict]], limit: int) -> dict:
    """The optimizer's own parameters after a step, by group and position (they carry no names)."""
    compared, differ = 0, []
    for g, (ga, gb) in enumerate(zip(a, b, strict=False)):
        for i, (x, y) in enumerate(zip(ga, gb, strict=False)):
            compared += 1
            if not same(x, y):
                differ.append(_describe(f"group {g} #{i}", x, y))
    shapes_equal = [len(x) for x in a] == [len(x) for x in b]
    return {"compared": compared, "differ": len(differ), "first": differ[:limit], "same_layout": shapes_equal}


def _differs(part: dict | list) -> bool:
    if isinstance(part, list):  # group settings
        return bool(part)
    return bool(part["differ"] or part.get("only_ours") or part.get("only_megatron_lm")
                or part.get("same_layout") is False)


def compare(ours: dict, mlm: dict, limit: int = 12) -> dict:
    """Two dumps of one rank (sitecustomize.py's JSON), step by step. `first_difference` names the first
    step and what differs there, in the order a step computes it: weights, gradients, group settings,
    updated parameters; None when every recorded step is the same bit for bit."""
    steps, first = [], None
    for k, (sa, sb) in enumerate(zip(ours.get("steps", []), mlm.get("steps", []), strict=False), start=1):
        step = {"step": k,
                "weights": _compare_named(sa.get("params_before", {}), sb.get("params_before", {}), limit),
                "grads": _compare_named(sa.get("grads", {}), sb.get("grads", {}), limit),
                "groups": _compare_groups(sa.get("groups", []), sb.get("groups", [])),
                "updated": _compare_positional(sa.get("main_params_after", []), sb.get("main_params_after", []), limit)}
        steps.append(step)
        if first is None:
            what = next((w for w in ("weights", "grads", "groups", "updated") if _differs(step[w])), None)
            first = {"step": k, "what": what} if what else None
    recorded = (len(ours.get("steps", [])), len(mlm.get("steps", [])))
    return {"steps_recorded": {"ours": recorded[0], "megatron_lm": recorded[1]}, "first_difference": first,
            "steps": steps}

