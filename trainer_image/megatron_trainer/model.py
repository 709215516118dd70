"""GPTModel construction: Transformer Engine spec when importable, else the local spec with SDPA attention."""

from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .config import TrainerConfig, takes_te_path
from .exitcodes import ExitCode, Refusal
from .flops import padded_vocab_size
from .te_path import TeKernels, TePlan

log = logging.getLogger(__name__)


@dataclass
class ModelPath:
    """Which implementation runs (said at start-up)."""

    transformer_impl: str  # "transformer_engine" | "local"
    attention: str  # e.g. "TE's fused attention (cuDNN) ...", "SDPA (cudnn>flash>efficient)", "Megatron DotProductAttention"
    # weight-gradient accumulation fusion of Megatron-Core's own linear layers (every layer on the local path, the
    # output layer on the TE path): "torch" (compat.TorchWgradAccumulation), "apex", or "off: <reason>"; set by the
    # trainer before the model is built. TE's layers follow it (they fuse in their own GEMMs), so that one
    # TransformerConfig serves both.
    wgrad_fusion: str = "off: not checked"
    # the Transformer Engine path as it runs here (te_path.plan: TE's attention kernel, fused RoPE); set by
    # plan_te_path before the model is built, None on the local path
    te: TePlan | None = None
    # pieces of a row-parallel layer's forward GEMM whose all-reduces overlap the next piece's GEMM
    # (tp_overlap.py); 1 = Megatron's forward. Set by the trainer before the model is built.
    tp_overlap_chunks: int = 1
    tp_overlap_sm_carveout: int = 0  # SMs those pieces' GEMMs leave to NCCL (tp_overlap.py)
    # SDPA under --deterministic-mode: "flash" (flash kernel, deterministic backward) or "math"
    # (MEGATRON_TRAINER_DETERMINISTIC_ATTENTION; "": no SDPA under --deterministic-mode, so neither applies). Set by the
    # trainer before the model is built; math when not set.
    deterministic_attention: str = "math"
    # MoE experts on the local path (moe_experts_path): "" for a dense model, "grouped" (moe.GroupedMLP) or
    # "sequential" (Megatron's SequentialMLP); set by the trainer before the model is built.
    moe_experts: str = ""
    moe_group_align: int = 0  # MEGATRON_TRAINER_MOE_GROUP_ALIGN (0: moe.default_align)
    moe_experts_note: str = ""  # how the grouped experts run, for describe()

    def describe(self) -> str:
        text = f"transformer_impl={self.transformer_impl}, attention={self.attention}, " \
               f"wgrad accumulation fusion={self.wgrad_fusion}"
        if self.transformer_impl != "local":
            if self.te is not None and not self.te.rope_fusion:
                text += ", RoPE unfused (no fused RoPE in this Transformer Engine)"
            return text
        if self.moe_experts:
            text += f", MoE experts={self.moe_experts_note or self.moe_experts}"
        if self.tp_overlap_chunks > 1:
            text += f", TP forward all-reduce overlapped in {self.tp_overlap_chunks} pieces"
            if self.tp_overlap_sm_carveout:
                text += f" ({self.tp_overlap_sm_carveout} SMs left to NCCL)"
        return text


def tp_overlap_chunks(cfg: TrainerConfig, path: ModelPath, requested: int) -> int:
    """Pieces for tp_overlap.OverlappedRowParallelLinear: `requested` (MEGATRON_TRAINER_TP_OVERLAP_CHUNKS)
    on the local path at TP > 1 without sequence parallelism, for dense models; else 1 (Megatron's)."""
    p = cfg.parallel
    if path.transformer_impl != "local" or p.tensor == 1 or p.sequence_parallel or cfg.model.num_experts:
        return 1
    return max(1, requested)


def deterministic_attention(cfg: TrainerConfig, path: ModelPath, requested: str) -> str:
    """The SDPA attention under --deterministic-mode: `requested` (MEGATRON_TRAINER_DETERMINISTIC_ATTENTION, flash or
    math) where SDPA runs under it (the local path without --attention-backend unfused); else "" (it does not apply)."""
    t = cfg.training
    if t.deterministic_mode and path.transformer_impl == "local" and t.attention_backend not in ("unfused", "local"):
        return requested
    return ""


def apply_deterministic_attention(cfg: TrainerConfig, path: ModelPath, requested: str, was_set: bool) -> str | None:
    """Sets path.deterministic_attention and, where it applies, the attention's description; returns a log line
    where a set MEGATRON_TRAINER_DETERMINISTIC_ATTENTION does not apply, else None."""
    path.deterministic_attention = deterministic_attention(cfg, path, requested)
    if path.deterministic_attention == "flash":
        path.attention = "SDPA (flash>efficient>math, deterministic backward: --deterministic-mode)"
    elif path.deterministic_attention == "math":
        path.attention = "SDPA (math: --deterministic-mode, MEGATRON_TRAINER_DETERMINISTIC_ATTENTION=math)"
    elif was_set:
        return (f"MEGATRON_TRAINER_DETERMINISTIC_ATTENTION={requested} ignored: it applies to the local path's SDPA "
                "attention under --deterministic-mode")
    return None


def moe_experts_path(cfg: TrainerConfig, path: ModelPath, requested: str, align: int) -> None:
    """Sets path.moe_experts (MEGATRON_TRAINER_MOE_EXPERTS on the local path for MoE models; the Transformer Engine
    path keeps its own experts) and says how the grouped GEMMs will run for this model's dtype and sizes."""
    m, t = cfg.model, cfg.training
    if not m.num_experts or path.transformer_impl != "local":
        path.moe_experts = ""
        return
    path.moe_experts, path.moe_group_align = requested, align
    if requested == "sequential":
        path.moe_experts_note = "SequentialMLP (MEGATRON_TRAINER_MOE_EXPERTS=sequential)"
        return
    import torch

    from .moe import default_align, grouped_mm_problem

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[t.precision]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    expert_tp = cfg.parallel.expert_tensor or cfg.parallel.tensor
    ffn = m.effective_moe_ffn_hidden_size // expert_tp
    problem = grouped_mm_problem(dtype, device, (m.hidden_size, ffn * (2 if m.swiglu else 1), ffn))
    if problem:
        path.moe_experts_note = f"GroupedMLP looping over its experts ({problem})"
    else:
        rows = align or default_align(dtype, device)
        path.moe_experts_note = "GroupedMLP on grouped_mm" + (f" (groups padded to {rows} rows)" if rows > 1 else "")


def te_available() -> bool:
    try:
        from megatron.core.extensions.transformer_engine import HAVE_TE
    except Exception:  # any import failure means no TE
        return False
    return bool(HAVE_TE)


def choose_path(cfg: TrainerConfig, have_te: bool) -> ModelPath:
    """The implementation for this run; a Refusal (exit 2, one line) when the job needs TE and TE is missing."""
    t, p = cfg.training, cfg.parallel
    needs_te = [why for cond, why in ((p.context > 1, "--context-parallel-size > 1"),
                                      (t.fp8_format is not None, "--fp8-format")) if cond]
    packed = cfg.data.sft_packing
    if takes_te_path(cfg, have_te):
        return ModelPath("transformer_engine", f"TE DotProductAttention ({t.attention_backend})")
    if t.transformer_impl == "transformer_engine" and have_te and packed:
        # TE's attention runs with a causal mask type and ignores an explicit mask, so packed samples would
        # attend to each other; its packed (THD) format is not wired here. The local path honours the mask.
        log.warning("--sft-packing: packed samples are kept apart by an attention mask, which Transformer "
                    "Engine's attention ignores: running the local (Megatron-Core + SDPA) path instead")
    if needs_te:
        raise Refusal(ExitCode.BAD_ARGUMENTS,
                      f"{', '.join(needs_te)} need(s) Transformer Engine, which is not importable here")
    if t.transformer_impl == "transformer_engine" and not (have_te and packed):
        log.warning("!!! --transformer-impl transformer_engine asked for, but Transformer Engine is not "
                    "importable: FALLING BACK to the local (Megatron-Core only) implementation !!!")
    if t.attention_backend in ("unfused", "local"):
        return ModelPath("local", "Megatron DotProductAttention (unfused, materialises s x s)")
    order = {"flash": "cudnn>flash>efficient", "fused": "cudnn>flash>efficient", "auto": "torch default"}
    if t.deterministic_mode:
        return ModelPath("local", "SDPA (math: --deterministic-mode)")
    return ModelPath("local", f"SDPA ({order[t.attention_backend]})")


def plan_te_path(cfg: TrainerConfig, path: ModelPath, kernels: TeKernels, environ) -> list[str]:
    """On the Transformer Engine path: TE's attention kernel and fused RoPE as they run on this machine
    (te_path.plan; a Refusal, exit 2, where no kernel here serves the request) into `path`; returns the
    start-up notes (defaults switched off here). Nothing on the local path."""
    if path.transformer_impl != "transformer_engine":
        return []
    from .te_path import plan

    path.te = plan(cfg, kernels, environ)
    path.attention = path.te.attention
    return list(path.te.notes)


def fusion_flags(cfg: TrainerConfig, path: ModelPath) -> dict[str, bool]:
    """The fusion fields of TransformerConfig, each on only where its kernel exists on this path (pure).

    Torch-only fusions are on (Megatron-LM's defaults); TE's (masked softmax, RoPE) on the TE path only, RoPE where
    this TE has it (path.te); weight-gradient accumulation where Megatron-Core's own linears can fuse it
    (path.wgrad_fusion "torch" or "apex"): ColumnParallelLinear, the output layer on both paths, raises at
    construction otherwise (tensor_parallel/layers.py, "gradient_accumulation_fusion set to True but the custom
    CUDA extension fused_weight_gradient_mlp_cuda module is not found"). An expert's MLP fuses only SwiGLU without
    bias (mlp.py: its weighted fusions take the router's per-token probabilities and no bias; GeLU has none)."""
    m, t = cfg.model, cfg.training
    local = path.transformer_impl == "local"
    gelu_fusable = not m.swiglu and m.add_bias_linear
    return dict(
        bias_activation_fusion=not t.no_bias_activation_fusion and (
            (m.swiglu and not m.add_bias_linear) if m.num_experts else (m.swiglu or gelu_fusable)),
        bias_dropout_fusion=not t.no_bias_dropout_fusion,
        masked_softmax_fusion=not local and not t.no_masked_softmax_fusion,
        apply_rope_fusion=not local and m.position_embedding_type == "rope" and not t.no_rope_fusion
        and path.te is not None and path.te.rope_fusion,
        gradient_accumulation_fusion=not t.no_gradient_accumulation_fusion and path.wgrad_fusion in ("torch", "apex"),
        persist_layer_norm=False,
    )


def missing_fusion_kernels(flags: dict[str, bool], wgrad_kernel: bool, fused_rope: bool) -> list[str]:
    """The fusions in `flags` whose kernel Megatron-Core will not find, each with the flag that turns it off (pure):
    `wgrad_kernel` is megatron.core.tensor_parallel.layers._grad_accum_fusion_available (apex's extension or the
    trainer's stand-in), `fused_rope` rope_utils.fused_apply_rotary_pos_emb is not None. Megatron-Core raises on
    each while the model is built, which would be a retried crash; the trainer refuses them at start-up instead."""
    missing = []
    if flags.get("gradient_accumulation_fusion") and not wgrad_kernel:
        missing.append("weight-gradient accumulation fusion needs apex's fused_weight_gradient_mlp_cuda or the "
                       "trainer's torch stand-in, neither of which is installed (--no-gradient-accumulation-fusion)")
    if flags.get("apply_rope_fusion") and not fused_rope:
        missing.append("RoPE fusion needs Transformer Engine's fused RoPE, which Megatron-Core does not find "
                       "(--no-rope-fusion)")
    return missing


def refuse_missing_fusion_kernels(flags: dict[str, bool]) -> None:
    """A Refusal (exit 2) when a fusion about to be asked of Megatron-Core has no kernel here (missing_fusion_kernels)."""
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.tensor_parallel import layers

    missing = missing_fusion_kernels(flags, bool(getattr(layers, "_grad_accum_fusion_available", False)),
                                     getattr(rope_utils, "fused_apply_rotary_pos_emb", None) is not None)
    if missing:
        raise Refusal(ExitCode.BAD_ARGUMENTS, "; ".join(missing))


def transformer_config(cfg: TrainerConfig, path: ModelPath):
    """Megatron-Core TransformerConfig from the trainer config."""
    from megatron.core.transformer.enums import AttnBackend
    from megatron.core.transformer.transformer_config import TransformerConfig

    m, p, t = cfg.model, cfg.parallel, cfg.training
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[t.precision]
    local = path.transformer_impl == "local"
    if not local and path.te is None:
        raise ValueError("the Transformer Engine path's kernels are not planned: call model.plan_te_path first")
    kwargs = dict(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.effective_num_query_groups,
        ffn_hidden_size=m.effective_ffn_hidden_size,
        normalization=m.normalization,
        layernorm_epsilon=m.norm_epsilon,
        kv_channels=m.kv_channels,
        qk_layernorm=m.qk_layernorm,
        add_qkv_bias=m.add_qkv_bias,
        gated_linear_unit=m.swiglu,
        activation_func=F.silu if m.swiglu else F.gelu,
        add_bias_linear=m.add_bias_linear,
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
        init_method_std=m.init_method_std,
        bf16=t.bf16,
        fp16=t.fp16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        **p.megatron_sizes(),
        sequence_parallel=p.sequence_parallel,
        recompute_granularity=t.recompute_granularity,
        recompute_method=t.recompute_method,
        recompute_num_layers=t.recompute_num_layers,
        num_moe_experts=m.num_experts,
        moe_router_topk=m.moe_router_topk if m.num_experts else 2,
        **moe_kwargs(cfg),
        **fusion_flags(cfg, path),
        # Loss: sum over tokens, divided by the global token count (finalize_model_grads).
        calculate_per_token_loss=True,
        deallocate_pipeline_outputs=True,
        transformer_impl=path.transformer_impl,
        attention_backend=AttnBackend.local if local else AttnBackend[path.te.attention_backend],
        deterministic_mode=t.deterministic_mode,
        use_cpu_initialization=t.device == "cpu",  # Megatron's GPU initialisation draws from the CUDA generator
    )
    if t.fp8_format:
        kwargs.update(fp8=t.fp8_format, fp8_recipe=t.fp8_recipe)
    return TransformerConfig(**kwargs)


def moe_kwargs(cfg: TrainerConfig) -> dict:
    """The MoE fields of TransformerConfig (none for a dense model)."""
    m = cfg.model
    if not m.num_experts:
        return {}
    return dict(moe_ffn_hidden_size=m.effective_moe_ffn_hidden_size, moe_router_pre_softmax=m.moe_router_pre_softmax,
                moe_router_load_balancing_type=m.moe_router_load_balancing_type,
                moe_aux_loss_coeff=m.moe_aux_loss_coeff, moe_z_loss_coeff=m.moe_z_loss_coeff,
                moe_router_dtype=m.moe_router_dtype, moe_token_dispatcher_type=m.moe_token_dispatcher_type,
                moe_shared_expert_intermediate_size=m.moe_shared_expert_intermediate_size,
                moe_shared_expert_gate=m.moe_shared_expert_gate,
                moe_router_score_function=m.moe_router_score_function,
                moe_router_enable_expert_bias=m.moe_router_enable_expert_bias,
                moe_router_bias_update_rate=m.moe_router_bias_update_rate,
                moe_router_force_load_balancing=m.moe_router_force_load_balancing,
                moe_expert_capacity_factor=m.moe_expert_capacity_factor, moe_token_drop_policy=m.moe_token_drop_policy,
                moe_pad_expert_input_to_capacity=m.moe_pad_expert_input_to_capacity)


def layer_spec(cfg: TrainerConfig, path: ModelPath):
    m, t = cfg.model, cfg.training
    if path.transformer_impl == "transformer_engine":
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

        return get_gpt_layer_with_transformer_engine_spec(num_experts=m.num_experts,
                                                          fp8=t.fp8_format, qk_layernorm=m.qk_layernorm)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    from .norm import TorchNorm

    spec = get_gpt_layer_local_spec(num_experts=m.num_experts, normalization=m.normalization,
                                    qk_layernorm=m.qk_layernorm)
    # torch norms that allow sequence parallelism (Megatron's WrappedTorchNorm refuses it)
    spec.submodules.input_layernorm = TorchNorm
    spec.submodules.pre_mlp_layernorm = TorchNorm
    if m.qk_layernorm:  # per-head norms (hidden size = head dim); their TP grads are summed by finalize_model_grads
        spec.submodules.self_attention.submodules.q_layernorm = TorchNorm
        spec.submodules.self_attention.submodules.k_layernorm = TorchNorm
    if t.attention_backend not in ("unfused", "local"):
        from .attention import make_sdpa_attention

        backend = t.attention_backend
        if t.deterministic_mode:  # no non-deterministic kernels: determinism.py
            backend = "flashdet" if path.deterministic_attention == "flash" else "math"
        spec.submodules.self_attention.submodules.core_attention = make_sdpa_attention(backend)
    if path.tp_overlap_chunks > 1:
        from .tp_overlap import overlapped_row_parallel_linear

        row = overlapped_row_parallel_linear(path.tp_overlap_chunks, path.tp_overlap_sm_carveout)
        spec.submodules.self_attention.submodules.linear_proj = row
        mlp = spec.submodules.mlp  # megatron-core 0.19: a partial of MLP.as_mlp_submodule(submodules=...)
        if isinstance(mlp, functools.partial):
            subs = dataclasses.replace(mlp.keywords["submodules"], linear_fc2=row)
            spec.submodules.mlp = functools.partial(mlp.func, *mlp.args, **{**mlp.keywords, "submodules": subs})
        else:
            mlp.submodules.linear_fc2 = row
    if path.moe_experts == "grouped":
        from .moe import grouped_experts_spec

        grouped_experts_spec(spec, align=path.moe_group_align or None)
    return spec


def block_spec(layer, tconfig, path: ModelPath, vp_stage: int | None):
    """The decoder block of one pipeline chunk. On the local path the final norm is TorchNorm too
    (Megatron would pick WrappedTorchNorm for a bare layer spec)."""
    if path.transformer_impl != "local":
        return layer
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    from .norm import TorchNorm

    return TransformerBlockSubmodules(layer_specs=[layer] * get_num_layers_to_build(tconfig, vp_stage=vp_stage),
                                      layer_norm=TorchNorm)


def build_model(cfg: TrainerConfig, tconfig, path: ModelPath, vocab_size: int, ddp: bool = True):
    """One GPTModel chunk per virtual pipeline stage, each in Float16Module and Megatron DDP."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.module import Float16Module

    m, t, p = cfg.model, cfg.training, cfg.parallel
    spec = layer_spec(cfg, path)
    padded = padded_vocab_size(vocab_size, m.make_vocab_size_divisible_by, p.tensor)
    num_chunks = p.virtual_pipeline or 1
    chunks = []
    for vp in range(num_chunks):
        vp_stage = vp if p.virtual_pipeline else None
        chunk = GPTModel(
            config=tconfig,
            transformer_layer_spec=block_spec(spec, tconfig, path, vp_stage),
            vocab_size=padded,
            max_sequence_length=m.max_position_embeddings or m.seq_length,
            pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
            share_embeddings_and_output_weights=not m.untie_embeddings_and_output_weights,
            position_embedding_type=m.position_embedding_type,
            rotary_base=m.rotary_base,
            rope_scaling=m.use_rope_scaling,
            rope_scaling_factor=m.rope_scaling_factor,
            vp_stage=vp_stage,
        )
        if not tconfig.use_cpu_initialization:
            chunk.cuda(torch.cuda.current_device())
        if t.bf16 or t.fp16:
            chunk = Float16Module(tconfig, chunk)
        chunks.append(chunk)
    if not ddp:
        return chunks, padded
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=t.overlap_grad_reduce,
        overlap_param_gather=t.overlap_param_gather,
        use_distributed_optimizer=t.use_distributed_optimizer,
        check_for_nan_in_grad=False,
    )
    wrapped = [DistributedDataParallel(config=tconfig, ddp_config=ddp_config, module=chunk,
                                       # Megatron-LM: only the first chunk uses bucketing (training.py)
                                       disable_bucketing=(i > 0))
               for i, chunk in enumerate(chunks)]
    return wrapped, padded


def wire_model_hooks(cfg: TrainerConfig, tconfig, model: list, optimizer) -> None:
    """The hooks the pipeline schedules call (Megatron-LM training.py ~3530)."""
    from megatron.core.distributed import finalize_model_grads

    t = cfg.training
    tconfig.grad_scale_func = optimizer.scale_loss
    tconfig.finalize_model_grads_func = finalize_model_grads
    if t.overlap_grad_reduce:
        funcs = [m.no_sync for m in model]
        tconfig.no_sync_func = funcs[0] if len(model) == 1 else funcs
        grad_sync = [m.start_grad_sync for m in model]
        tconfig.grad_sync_func = grad_sync[0] if len(model) == 1 else grad_sync
    # overlap_param_gather: the DDP forward pre-hooks gather params (align_param_gather stays off,
    # Megatron-LM's default), so no param_sync_func.


def count_parameters(model: list) -> int:
    """Parameters held by this rank."""
    return sum(p.numel() for chunk in model for p in chunk.parameters())
