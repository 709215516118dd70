"""Work-arounds for Megatron-Core 0.19.2 on the Transformer-Engine-less path (each cites the bug)."""

from __future__ import annotations

import torch


def patch_fully_reshardable_load_with_torch_adam(optimizer) -> int:
    """Let a `fully_reshardable` distributed-optimizer checkpoint load into torch.optim.AdamW.

    Without TE/apex, Megatron uses torch's AdamW, whose per-parameter state holds a tensor `step`.
    `DistributedOptimizer.load_parameter_state_from_fully_reshardable` (distrib_optimizer.py ~2390)
    drops `step` from the tensors it passes on, and `_set_main_param_and_optimizer_states`
    (~1216) then indexes every state key: KeyError 'step' (seen on 2 x H200, 2026-11-21). `step`
    itself is restored from the param groups by `load_state_dict`, so the missing keys are filled
    with the current tensors (a copy onto itself). Returns the number of optimizers patched.
    """
    patched = 0
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        original = getattr(opt, "_set_main_param_and_optimizer_states", None)
        if original is None or not isinstance(inner, torch.optim.Optimizer) \
                or not type(inner).__module__.startswith("torch.optim"):
            continue

        def set_states(model_param, tensors, _opt=opt, _original=original):
            group_index, group_order = _opt.model_param_group_index_map[model_param]
            main_param = _opt.optimizer.param_groups[group_index]["params"][group_order]
            tensors = dict(tensors)
            for key, value in _opt.optimizer.state.get(main_param, {}).items():
                if key not in tensors and isinstance(value, torch.Tensor):
                    tensors[key] = value
            return _original(model_param, tensors)

        opt._set_main_param_and_optimizer_states = set_states
        patched += 1
    return patched
