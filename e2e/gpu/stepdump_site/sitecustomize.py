"""Per-tensor digests of the first optimizer steps, for the `stepdump` scenario (e2e/gpu/mlm_compare.py).

Python imports this module at start-up from the first `sitecustomize` on sys.path: the suite puts this
folder first on ours' PYTHONPATH and copies the file into Megatron-LM's tree for its run (mlm_peer.sh
sets PYTHONPATH to that tree). It does nothing unless STEPDUMP_DIR is set.

With STEPDUMP_DIR set, torch's global optimizer hooks record, for each of the first STEPDUMP_STEPS
(default 3) optimizer steps of each rank:
- before the step, for every parameter of the GPT model (by name): the weights the step's forward used
  and the gradient Megatron's optimizer is about to apply (`main_grad`, after its clipping);
- the settings of each parameter group (lr, weight decay, betas, eps, ...);
- after the step, the optimizer's own (fp32) parameters, by group and position.
A digest is the tensor's dtype, element count, float64 sum and norm, and two integer sums of its bit
patterns (one weighted by position), so two tensors with the same digest are, short of a collision,
bit-identical. Written to STEPDUMP_DIR/rank<RANK>.json after every recorded step.
"""

from __future__ import annotations

import os

if os.environ.get("STEPDUMP_DIR"):
    import gc
    import json
    import sys

    _STEPS = int(os.environ.get("STEPDUMP_STEPS", "3"))
    _CHUNK = 1 << 24
    _state: dict = {"steps": [], "model": None}

    def _digest(t) -> dict:
        import torch

        flat = t.detach().reshape(-1)
        bits_dtype = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32,
                      torch.float64: torch.int64}.get(flat.dtype)
        bits_sum, weighted = 0, 0
        for start in range(0, flat.numel(), _CHUNK):
            part = flat[start:start + _CHUNK]
            bits = (part.view(bits_dtype) if bits_dtype is not None else part).to(torch.int64)
            pos = torch.arange(start, start + part.numel(), device=part.device, dtype=torch.int64) % 8191 + 1
            bits_sum += int(bits.sum())
            weighted += int((bits * pos).sum())
        as64 = flat.double()
        return {"dtype": str(flat.dtype).removeprefix("torch."), "numel": flat.numel(),
                "sum": float(as64.sum()), "norm": float(as64.norm()), "bits": bits_sum, "bits_pos": weighted}

    def _first_layer(model) -> int:
        """The global number of a model chunk's first transformer layer (0 if it has none)."""
        layers = getattr(getattr(model, "decoder", None), "layers", None)
        return getattr(layers[0], "layer_number", 0) if layers is not None and len(layers) else 0

    def _gpt_models() -> list:
        import torch

        if _state["model"] is None:
            # type() first: isinstance() on a dead weak proxy (gc lists them too) raises ReferenceError
            found = [o for o in gc.get_objects() if type(o).__name__ == "GPTModel" and isinstance(o, torch.nn.Module)]
            _state["model"] = sorted(found, key=_first_layer)  # virtual pipeline chunks in layer order, not gc's
        return _state["model"]

    def _write() -> None:
        rank = os.environ.get("RANK", "0")
        path = os.path.join(os.environ["STEPDUMP_DIR"], f"rank{rank}.json")
        os.makedirs(os.environ["STEPDUMP_DIR"], exist_ok=True)
        with open(path + ".tmp", "w") as f:
            json.dump({"rank": int(rank), "steps": _state["steps"]}, f)
        os.replace(path + ".tmp", path)

    def _guarded(hook):
        """A failing hook turns the recording off and says why; the training run itself goes on."""
        def run(optimizer, args, kwargs):
            if _state.get("failed"):
                return
            try:
                hook(optimizer, args, kwargs)
            except Exception as exc:
                _state["failed"] = True
                print(f"stepdump: recording stopped: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return run

    def _pre(optimizer, args, kwargs) -> None:
        if len(_state["steps"]) >= _STEPS:
            return
        models = _gpt_models()
        params, grads = {}, {}
        for i, model in enumerate(models):
            prefix = f"chunk{i}." if len(models) > 1 else ""
            for name, p in model.named_parameters():
                params[prefix + name] = _digest(p)
                g = getattr(p, "main_grad", None)
                if g is None:
                    g = p.grad
                if g is not None:
                    grads[prefix + name] = _digest(g)
        groups = [{k: (v if isinstance(v, (int, float, str, bool)) or v is None else str(v))
                   for k, v in g.items() if k != "params"} | {"numel": sum(p.numel() for p in g["params"])}
                  for g in optimizer.param_groups]
        _state["steps"].append({"models": len(models), "params_before": params, "grads": grads, "groups": groups})

    def _post(optimizer, args, kwargs) -> None:
        steps = _state["steps"]
        if not steps or "main_params_after" in steps[-1]:
            return
        steps[-1]["main_params_after"] = [[_digest(p) for p in g["params"]] for g in optimizer.param_groups]
        _write()

    try:
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        register_optimizer_step_pre_hook(_guarded(_pre))
        register_optimizer_step_post_hook(_guarded(_post))
    except Exception as exc:  # reported, never silent: the scenario then finds no dump and says so
        print(f"stepdump: hooks not installed: {type(exc).__name__}: {exc}", file=sys.stderr)
