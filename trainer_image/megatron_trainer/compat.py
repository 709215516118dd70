"""Work-arounds for Megatron-Core 0.19.2 without apex, most of them also without Transformer Engine (each cites the bug)."""

from __future__ import annotations

import functools

import torch


def patch_distopt_state_load_for_torch_adam(optimizer) -> int:
    """Let a distributed-optimizer checkpoint load into torch.optim.AdamW with its `step` intact.

    Without TE/apex, Megatron uses torch's AdamW, whose per-parameter state holds a tensor `step`.
    `DistributedOptimizer.load_state_dict` restores `step` from the checkpoint's param groups, then
    hands the loaded tensors of each parameter to `_set_main_param_and_optimizer_states`
    (distrib_optimizer.py ~1216, 0.19.2), which copies every state key it finds there. Two bugs:

    - `fully_reshardable` (`load_parameter_state_from_fully_reshardable`, ~2390) drops `step` from
      those tensors, and the copy indexes it: KeyError 'step' (2 x H200, 2026-11-21).
    - `dp_reshardable` keeps `step` among them as a LocalNonpersistentObject captured when the
      sharded state dict for loading was built, i.e. the step of the optimizer *before* the load
      (1, after `checkpoint._materialize_optimizer_state`). The copy puts it over the checkpoint's
      step: every resume restarted AdamW's bias correction at step 1, so the first resumed
      iteration matched the uninterrupted run and the second departed (the deterministic resume
      test on 2 x H200, 2026-11-23).

    The patch never takes `step` from those tensors: the one `load_state_dict` restored stays (a
    copy onto itself); other missing keys are filled likewise. Returns the number of optimizers patched.
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
            tensors = {k: v for k, v in tensors.items() if k != "step"}
            for key, value in _opt.optimizer.state.get(main_param, {}).items():
                if key not in tensors and isinstance(value, torch.Tensor):
                    tensors[key] = value
            return _original(model_param, tensors)

        opt._set_main_param_and_optimizer_states = set_states
        patched += 1
    return patched


def torch_optimizer_states(optimizer):
    """The per-parameter state dicts of each torch optimizer inside a Megatron (chained) optimizer,
    one list per torch optimizer."""
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if isinstance(inner, torch.optim.Optimizer):
            yield list(inner.state.values())


def adam_steps(optimizer) -> set[float]:
    """The distinct torch-AdamW `step` values of this rank's parameters (one value when all is well)."""
    return {float(state["step"].item()) for states in torch_optimizer_states(optimizer) for state in states
            if isinstance(state.get("step"), torch.Tensor)}


def unshare_adam_steps(optimizer) -> int:
    """Give every parameter its own torch.optim.AdamW `step` tensor after a checkpoint load.

    Without TE/apex, `DistributedOptimizer.load_state_dict` (distrib_optimizer.py ~1024-1032, 0.19)
    puts ONE `step` tensor into every parameter's state, and torch's `Optimizer.load_state_dict`
    keeps it as it is (no copy for `step` unless capturable/fused). AdamW then increments that shared
    tensor once per parameter (`_foreach_add_(state_steps, 1)`), so from the first step after a
    resume the bias correction uses step + number of parameters instead of step + 1: the resumed run
    departs from the uninterrupted one at its second iteration (found by the bit-identical resume test,
    2 x H200, 2026-11-23). Returns the number of state entries given their own tensor.
    """
    fixed = 0
    for states in torch_optimizer_states(optimizer):
        seen: set[int] = set()
        for state in states:
            step = state.get("step")
            if isinstance(step, torch.Tensor):
                if id(step) in seen:
                    state["step"] = step.detach().clone()
                    fixed += 1
                seen.add(id(state["step"]))
    return fixed


def _foreach_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """Drop-in for `amp_C.multi_tensor_l2norm` that stays on the device.

    Megatron-Core's fallback (`utils.local_multi_tensor_l2_norm`) builds a host tensor from one CUDA
    scalar per gradient, i.e. one device->host sync per parameter tensor every step (~300 for a
    24-layer GPT): the GPU idles while the host re-queues work after each. This computes the same
    fp32 norm with `torch._foreach_norm` and no sync.
    """
    tensors = [t for t in tensor_lists[0] if t.numel()]
    if not tensors:
        return torch.zeros(1, dtype=torch.float, device="cuda"), None
    norms = torch._foreach_norm(tensors, 2.0, dtype=torch.float32)
    return torch.linalg.vector_norm(torch.stack(norms)).reshape(1), None


def _foreach_scale(chunk_size, noop_flag, tensor_lists, scale):
    """Drop-in for `amp_C.multi_tensor_scale` (dst = src * scale) with grouped foreach kernels."""
    src, dst = tensor_lists[0], tensor_lists[1]
    if not src:
        return
    if all(s is d for s, d in zip(src, dst, strict=True)):
        torch._foreach_mul_(dst, scale)
    else:
        torch._foreach_copy_(dst, torch._foreach_mul(src, scale))


def patch_multi_tensor_fallbacks() -> list[str]:
    """Swap Megatron-Core's per-tensor, host-syncing multi-tensor fallbacks (used when neither
    Transformer Engine nor apex is importable) for the foreach versions above. Patches only the
    module globals that still hold the fallbacks; returns which."""
    import importlib

    from megatron.core import utils

    targets = {"megatron.core.optimizer.clip_grads": {"l2_norm_impl": (utils.local_multi_tensor_l2_norm, _foreach_l2_norm),
                                                      "multi_tensor_scale_impl": (utils.local_multi_tensor_scale, _foreach_scale)},
               "megatron.core.optimizer.optimizer": {"multi_tensor_scale_impl": (utils.local_multi_tensor_scale, _foreach_scale)}}
    patched = []
    for module_name, names in targets.items():
        module = importlib.import_module(module_name)
        for name, (fallback, replacement) in names.items():
            if getattr(module, name, None) is fallback:
                setattr(module, name, replacement)
                patched.append(f"{module_name}.{name}")
    return patched


class TorchWgradAccumulation:
    """Stand-in for apex's `fused_weight_gradient_mlp_cuda`: the weight gradient is accumulated
    into the fp32 `main_grad` by the GEMM itself (cuBLAS with beta = 1 and an fp32 output from
    bf16/fp16 inputs, `torch.addmm(..., out_dtype=torch.float32)`, torch >= 2.8 on CUDA).

    Without it, the local path computes each weight gradient in bf16, then Megatron's DDP hook adds
    it to `main_grad` in a separate fp32 kernel: 7 % of a Llama-3-8B step at TP=2 on 2 x H200
    (`unrolled_elementwise_kernel<add<float>>`, 124 ms of 1.81 s; torch.profiler, 2026-11-26).
    Same contract as apex's functions (megatron/core/tensor_parallel/layers.py, 0.19.2):
    main_grad += grad_output^T @ total_input, both 2-D [tokens, features].
    """

    @staticmethod
    def wgrad_gemm_accum_fp32(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
        torch.addmm(main_grad, grad_output.t(), total_input, torch.float32, out=main_grad)

    @staticmethod
    def wgrad_gemm_accum_fp16(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
        torch.addmm(main_grad, grad_output.t(), total_input, out=main_grad)


def wgrad_accumulation_fusion_check(device: torch.device | str = "cuda") -> str | None:
    """None if `TorchWgradAccumulation` works here (bf16 inputs, fp32 accumulator updated in place,
    same result as the unfused bf16 GEMM + fp32 add within bf16 rounding), else why not."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        gen = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(256, 96, device=device, generator=gen).bfloat16()
        g = torch.randn(256, 64, device=device, generator=gen).bfloat16()
        acc = torch.randn(64, 96, device=device, generator=gen)
        want = acc + (g.float().t() @ x.float())
        before = acc.data_ptr()
        TorchWgradAccumulation.wgrad_gemm_accum_fp32(x, g, acc)
        if acc.data_ptr() != before or acc.dtype != torch.float32:
            return "torch.addmm(out_dtype=float32, out=main_grad) did not update main_grad in place"
        err = (acc - want).abs().max().item()
        if not err < 1e-2:
            return f"torch.addmm(out_dtype=float32) differs from the fp32 reference by {err:.3g}"
    except (TypeError, RuntimeError) as e:  # an older torch: no out_dtype, or no fp32 output for these inputs
        return f"torch.addmm(out_dtype=float32) unavailable: {type(e).__name__}: {str(e)[:200]}"
    return None


def patch_wgrad_accumulation_fusion() -> str:
    """Give Megatron-Core's own linear layers weight-gradient accumulation fusion: every linear on the local
    path, and on the Transformer Engine path the output layer (GPTModel's output_layer is Megatron-Core's
    ColumnParallelLinear on both specs; TE's layers fuse in their own GEMMs).

    Returns "apex" when apex's extension is installed (nothing to do), "torch" when the stand-in
    was installed, or "off: <reason>" when neither works (the trainer then keeps the fusion off, TE's
    layers too: one TransformerConfig serves both). Must run before the model is built:
    ColumnParallelLinear/RowParallelLinear refuse `gradient_accumulation_fusion` when the module-level
    flag says the extension is missing (the TE path's first crash in issue 59).
    """
    from megatron.core.tensor_parallel import layers

    if getattr(layers, "_grad_accum_fusion_available", False) and \
            getattr(layers, "fused_weight_gradient_mlp_cuda", None) is not TorchWgradAccumulation:
        return "apex"
    reason = wgrad_accumulation_fusion_check()
    if reason is not None:
        return f"off: {reason}"
    layers.fused_weight_gradient_mlp_cuda = TorchWgradAccumulation
    layers._grad_accum_fusion_available = True
    return "torch"


def use_fused_adamw(optimizer, devices: tuple[str, ...] = ("cuda",)) -> int:
    """Run torch.optim.AdamW (Megatron's optimizer without TE/apex) as its fused CUDA kernel.

    Megatron-Core builds torch's AdamW with the default implementation, which on CUDA is the foreach
    one: eight passes over the fp32 parameters, gradients and moments (lerp, mul, addcmul, sqrt,
    div, add, addcdiv, the weight-decay mul). That was 94 ms of a 1.68 s Llama-3-8B step at TP=2 on
    2 x H200 (torch.profiler, 2026-11-26); the fused kernel reads and writes each tensor once. Same
    update rule; torch keeps `step` on the parameter's device for the fused kernel, so existing step
    counters (a loaded checkpoint's) are moved there. Idempotent: the checkpointer calls it again
    after a load, whose param groups come from the checkpoint. Only where every parameter is on one of
    `devices` (CUDA; the CPU tests pass "cpu", where torch has a fused kernel too). Returns the number
    of torch optimizers switched.
    """
    switched = 0
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, (torch.optim.AdamW, torch.optim.Adam)):
            continue
        params = [p for g in inner.param_groups for p in g["params"]]
        if not params or not all(p.device.type in devices and p.is_floating_point() for p in params):
            continue
        for group in inner.param_groups:
            group["fused"], group["foreach"] = True, False
        for param, state in inner.state.items():
            step = state.get("step")
            if isinstance(step, torch.Tensor) and (step.device != param.device or step.dtype != torch.float32):
                state["step"] = step.to(device=param.device, dtype=torch.float32)
        switched += 1
    return switched


def compile_unfused_rope(exact: bool = True) -> bool:
    """Compile Megatron-Core's unfused RoPE (`rope_utils._apply_rotary_pos_emb_bshd`) with torch.compile.

    Without Transformer Engine the rotary embedding runs as separate kernels per call: cos and sin of
    the frequencies, the rotate-half `chunk`/`neg`/`cat`, two multiplies, an add and a final `cat` with
    the (empty) pass-through part; `cat` alone was 27 ms of a 1.64 s Llama-3-8B step at TP=2 on
    2 x H200 (torch.profiler, 2026-11-26). Compiled, each call is one or two fused kernels: about
    -60 ms per step there (docs/benchmarks/megatron-lm.md#2026-11-26-second-session-sp-rope). On by default
    (MEGATRON_TRAINER_COMPILE_ROPE=0 keeps it
    eager); the trainer applies it only without packed SFT, which applies RoPE per sequence, whose
    varying lengths would recompile.
    `exact` (the default; MEGATRON_TRAINER_COMPILE_ROPE=1 turns it off) compiles with Inductor's
    `emulate_precision_casts`: each intermediate that eager rounds to bf16 (the two products, the sum) is rounded
    there too, where the plain compiled kernel keeps them in fp32 and rounds once. On H200 the output and the
    input's gradient were bit-identical to eager with it, and differed in 32 % of the elements without it
    (bench/rope_numerics.py, the GPU suite's `rope` scenario; Inductor's CPU backend ignores the option).
    Returns False if it was compiled already."""
    from megatron.core.models.common.embeddings import rope_utils

    current = rope_utils._apply_rotary_pos_emb_bshd
    if getattr(current, "_megatron_trainer_compiled", False):
        return False
    options = {"emulate_precision_casts": True} if exact else None
    compiled = torch.compile(current, dynamic=False, options=options)
    compiled._megatron_trainer_compiled = True
    rope_utils._apply_rotary_pos_emb_bshd = compiled
    return True


def compile_rms_norms(modules) -> int:
    """Run every torch.nn.RMSNorm in `modules` (the model chunks) through one torch.compile'd
    `F.rms_norm`. Without Transformer Engine the norms are torch's RMSNorm (megatron_trainer.norm);
    compiled, the forward and backward of each norm are one or two fused kernels. The module and its
    parameter names stay as they are (checkpoints are unchanged): only the instance's `forward` is
    replaced. Returns the number of norms switched (0 on a second call)."""
    global _COMPILED_RMS_NORM
    if _COMPILED_RMS_NORM is None:
        _COMPILED_RMS_NORM = torch.compile(torch.nn.functional.rms_norm, dynamic=False)
    switched = 0
    for chunk in modules:
        for module in chunk.modules():
            if isinstance(module, torch.nn.RMSNorm) and not getattr(module, "_megatron_trainer_compiled", False):
                module.forward = functools.partial(_rms_norm_forward, module)
                module._megatron_trainer_compiled = True
                switched += 1
    return switched


_COMPILED_RMS_NORM = None


def _rms_norm_forward(module: torch.nn.RMSNorm, x: torch.Tensor) -> torch.Tensor:
    return _COMPILED_RMS_NORM(x, module.normalized_shape, module.weight, module.eps)
