"""Mixture-of-experts experts on grouped GEMMs for the local (Transformer-Engine-less) path.

Without Transformer Engine, megatron-core 0.19 builds a MoE layer's experts only as `SequentialMLP`
(`LocalSpecProvider.grouped_mlp_modules` ignores `moe_grouped_gemm`): a Python loop of one `MLP` per
expert, two GEMMs each, and a `.tolist()` device sync for the split sizes. `GroupedMLP` here holds every
local expert's weights in one 3-D tensor per layer (`weight1` [experts, fc1 rows, hidden], `weight2`
[experts, hidden, ffn]) and runs all experts' first layer in one `torch.nn.functional.grouped_mm` and
their second layer in another, with no host sync: the group boundaries (`offs`) are a cumulative sum on
the device.

Where grouped_mm cannot run (`grouped_mm_problem`: CUDA takes bf16 only; every operand's rows must be a
multiple of 16 bytes), the same module loops over its experts with `F.linear` on views of the same
weights. The math, the order of operations and the activation functions are `MLP.forward`'s for an
expert (per-token router probabilities applied after the activation, before the second GEMM), so the
outputs and gradients are SequentialMLP's (tests/trainer/test_moe_torch.py: within 1e-5 in fp32).

Groups unpadded by default: each expert's rows can be padded to a multiple of `align` rows (zero rows, their
outputs dropped) with index arithmetic on the device (`padded_rows`), because PyTorch's CUDA grouped GEMM
has asked for 16-byte aligned group boundaries in its weight-gradient form (torchtitan pads to 8 bf16
rows for it). On an H200 with torch 2.11 (tests/trainer/moe_gpu_check.py, 2026-11-28,
docs/benchmarks/moe.md) unpadded groups gave the same outputs and gradients as padded ones (both equal to
SequentialMLP's at the Qwen3-30B-A3B shape, idle experts' weight gradients zero) and were faster (1.96 vs
3.04 ms for 32 local experts; 31.2 vs 33.7 ms for Mixtral's 4), so `align` defaults to 1;
MEGATRON_TRAINER_MOE_GROUP_ALIGN=8 pads again where a kernel needs it.

Checkpoints: `sharded_state_dict` produces, for every expert, the very ShardedTensors SequentialMLP
produces (keys `...mlp.experts.experts.linear_fc1.weight` with the global expert index as an axis, the
SwiGLU halves split the same way, the same `_extra_state` objects, the same replica ids), built by the
same megatron-core helpers. A checkpoint either module writes loads into the other, and the optimizer's
state follows (each 3-D weight is one ShardedTensorFactory whose pieces are per-expert views). Only the
in-memory `state_dict()` differs (`experts.weight1` instead of `experts.local_experts.{i}.linear_fc1.weight`);
the trainer never writes that one.
"""

from __future__ import annotations

import re
from functools import partial

import torch
import torch.nn.functional as F
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensorFactory
from megatron.core.fusions.fused_bias_swiglu import weighted_bias_swiglu_impl
from megatron.core.tensor_parallel.layers import _initialize_affine_weight_cpu, _initialize_affine_weight_gpu
from megatron.core.tensor_parallel.utils import divide
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import (
    ensure_metadata_has_dp_cp_group,
    make_sharded_object_for_checkpoint,
)
from megatron.core.utils import make_sharded_tensor_for_checkpoint, make_tp_sharded_tensor_for_checkpoint

#: grouped_mm's kernels want every operand's row stride to be a multiple of 16 bytes.
ROW_ALIGN_BYTES = 16
_EXTRA_STATE = re.compile(r"local_experts\.\d+\.linear_fc[12]\._extra_state$")


def grouped_mm_fn():
    """torch.nn.functional.grouped_mm (torch >= 2.10), else torch._grouped_mm, else None."""
    return getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def grouped_mm_problem(dtype: torch.dtype, device_type: str, dims: tuple[int, ...]) -> str | None:
    """Why grouped_mm cannot run these experts (None: it can). `dims`: every GEMM's inner and outer size."""
    if grouped_mm_fn() is None:
        return f"torch {torch.__version__} has no grouped_mm"
    if device_type == "cuda" and dtype != torch.bfloat16:
        return f"grouped_mm on CUDA takes bf16 only, the experts are {str(dtype).removeprefix('torch.')}"
    if device_type not in ("cuda", "cpu"):
        return f"grouped_mm does not run on {device_type}"
    if dtype not in (torch.bfloat16, torch.float32):
        return f"grouped_mm takes bf16 or fp32, the experts are {str(dtype).removeprefix('torch.')}"
    size = torch.empty((), dtype=dtype).element_size()
    odd = sorted({d for d in dims if (d * size) % ROW_ALIGN_BYTES})
    if odd:
        return f"sizes {odd} are not multiples of {ROW_ALIGN_BYTES} bytes ({ROW_ALIGN_BYTES // size} elements)"
    return None


def default_align(dtype: torch.dtype, device_type: str) -> int:
    """Rows each expert's group is padded to by default: none (measured exact and faster unpadded on Hopper with
    torch 2.11; the module docstring). `dtype` and `device_type` stay in the signature for a kernel that needs it."""
    del dtype, device_type
    return 1


def padded_rows(counts: torch.Tensor, align: int, num_rows: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Groups of `counts` rows (one per expert, in order; `num_rows` = their sum, known to the host) padded to
    multiples of `align`, computed on the counts' device without a host sync.

    Returns (destination row of each input row in the padded buffer, int32 end offset of each padded group, rows
    of the buffer). The buffer holds every padding (num_rows + experts x (align - 1), rounded up to `align`) and
    the last group ends at its end: grouped_mm leaves rows past the last offset unwritten, in its output and in the
    input gradient it computes, so none are left; the last expert's extra rows are zeros with probability 0."""
    counts = counts.to(torch.int64)
    experts = counts.numel()
    padded = (counts + (align - 1)) // align * align
    start = torch.cumsum(counts, 0) - counts
    padded_start = torch.cumsum(padded, 0) - padded
    group = torch.repeat_interleave(torch.arange(experts, device=counts.device), counts, output_size=num_rows)
    dest = torch.arange(num_rows, device=counts.device) - start[group] + padded_start[group]
    buffer_rows = -(-(num_rows + experts * (align - 1)) // align) * align
    offs = torch.cumsum(padded, 0).to(torch.int32)
    offs[-1:] = buffer_rows
    return dest, offs, buffer_rows


class GroupedMLP(MegatronModule):
    """The local experts of one MoE layer on two grouped GEMMs (megatron-core's ExpertsInterface:
    forward(permuted tokens, tokens per expert, permuted probabilities) -> (output, None))."""

    def __init__(self, num_local_experts: int, config, pg_collection=None, name: str | None = None,
                 align: int | None = None):
        unsupported = [what for cond, what in (
            (config.fp8 or getattr(config, "fp4", None), "FP8/FP4"),
            (config.moe_latent_size is not None, "moe_latent_size"),
            (config.use_te_activation_func, "use_te_activation_func"),
            (config.moe_mlp_glu_interleave_size is not None, "moe_mlp_glu_interleave_size"),
            (getattr(config, "delay_wgrad_compute", False), "delay_wgrad_compute"),
            (getattr(config, "overlap_dispatch_backward_with_experts_wgrad", False),
             "overlap_dispatch_backward_with_experts_wgrad"),
            (getattr(config, "expert_gtp_remat_size", 1) > 1, "expert_gtp_remat_size > 1"),
            (config.bias_activation_fusion and config.add_bias_linear,
             "bias_activation_fusion with linear biases (Megatron's weighted fusions take no bias)"),
            (config.bias_activation_fusion and not (config.gated_linear_unit and config.activation_func is F.silu),
             "bias_activation_fusion other than SwiGLU (MLP.forward has no weighted fusion for it)"),
        ) if cond]
        if unsupported:
            raise ValueError(f"GroupedMLP experts do not support {', '.join(unsupported)}; "
                             "MEGATRON_TRAINER_MOE_EXPERTS=sequential runs Megatron's SequentialMLP")
        super().__init__(config=config)
        self.num_local_experts = num_local_experts
        self.ep_group, self.tp_group, self.dp_group = pg_collection.ep, pg_collection.expt_tp, pg_collection.expt_dp
        self.align = align
        tp, tp_rank = self.tp_group.size(), self.tp_group.rank()
        glu = config.gated_linear_unit
        hidden, ffn = config.hidden_size, config.moe_ffn_hidden_size
        fc1_out = ffn * (2 if glu else 1)
        self.ffn_per_rank = divide(ffn, tp)
        fc1_rows = divide(fc1_out, tp)
        self.fc1_stride = 2 if glu else 1  # MLP: each TP rank holds [gate rows ; up rows] of its part
        device = None if config.use_cpu_initialization else torch.cuda.current_device()
        empty = partial(torch.empty, dtype=config.params_dtype, device=device)
        self.weight1 = torch.nn.Parameter(empty(num_local_experts, fc1_rows, hidden))
        self.weight2 = torch.nn.Parameter(empty(num_local_experts, hidden, self.ffn_per_rank))
        bias = config.add_bias_linear
        self.bias1 = torch.nn.Parameter(empty(num_local_experts, fc1_rows)) if bias else None
        self.bias2 = torch.nn.Parameter(empty(num_local_experts, hidden)) if bias else None
        if config.perform_initialization:
            self._initialize(fc1_out, hidden, ffn, tp, tp_rank)
        # The attributes ColumnParallelLinear / RowParallelLinear give an expert's weights (layers.py): DDP and
        # the optimizer put them in the expert-parallel buffers when EP > 1 or ETP != TP.
        expert_groups = config.expert_model_parallel_size > 1 or \
            config.expert_tensor_parallel_size != config.tensor_model_parallel_size
        for param, dim, stride in ((self.weight1, 1, self.fc1_stride), (self.weight2, 2, 1),
                                   (self.bias1, 1, self.fc1_stride)):
            if param is not None:
                param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, dim, stride
        for param in (self.weight1, self.weight2, self.bias1, self.bias2):
            if param is not None:
                param.allreduce = not expert_groups
        if self.bias2 is not None:
            self.bias2.sequence_parallel = config.sequence_parallel
        self._register_load_state_dict_pre_hook(self._drop_extra_state)

    @torch.no_grad()
    def _initialize(self, fc1_out: int, hidden: int, ffn: int, tp: int, tp_rank: int) -> None:
        """SequentialMLP's initialisation, expert by expert in its order (fc1 then fc2), so the same seed
        gives the same weights."""
        c = self.config
        for i in range(self.num_local_experts):
            for weight, out_size, in_size, part, dim, stride, init in (
                    (self.weight1[i], fc1_out, hidden, self.weight1.shape[1], 0, self.fc1_stride, c.init_method),
                    (self.weight2[i], hidden, ffn, self.ffn_per_rank, 1, 1, c.output_layer_init_method)):
                if c.use_cpu_initialization:
                    _initialize_affine_weight_cpu(weight, out_size, in_size, part, dim, init, stride=stride,
                                                  params_dtype=c.params_dtype, rank=tp_rank, world_size=tp,
                                                  skip_set_tensor_parallel_attributes=True)
                else:
                    _initialize_affine_weight_gpu(weight, init, partition_dim=dim, stride=stride, is_expert=True)
        for bias in (self.bias1, self.bias2):
            if bias is not None:
                bias.zero_()

    # ------------------------------------------------------------------------------------------ forward
    def problem(self, x: torch.Tensor) -> str | None:
        """Why this forward loops over the experts instead of grouped_mm (None: it does not)."""
        return grouped_mm_problem(x.dtype, x.device.type, (self.config.hidden_size, self.weight1.shape[1],
                                                           self.ffn_per_rank))

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor, grouped: bool | None = None):
        """`grouped`: force grouped_mm (True) or the loop (False); None chooses (`problem`)."""
        x, probs = permuted_local_hidden_states, permuted_probs
        if self.config.moe_apply_probs_on_input:  # as SequentialMLP.forward
            assert self.config.moe_router_topk == 1, "`moe_apply_probs_on_input` only works with `moe_router_topk`=1."
            x = (probs.unsqueeze(-1) * x).to(x.dtype)
            probs = torch.ones_like(probs)
        counts = tokens_per_expert if torch.is_tensor(tokens_per_expert) else torch.tensor(tokens_per_expert)
        if grouped is None:
            grouped = self.problem(x) is None
        if grouped:
            return self._grouped(x, counts, probs), None
        return self._loop(x, counts, probs), None

    def _activation(self, h: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """MLP.forward's activation for an expert (per-token scale), on rows of any experts."""
        c = self.config
        if c.bias_activation_fusion:  # SwiGLU without bias, checked in __init__
            return weighted_bias_swiglu_impl(h, None, probs.unsqueeze(-1), c.activation_func_fp8_input_store)
        if c.gated_linear_unit:
            x_glu, x_linear = torch.chunk(h, 2, dim=-1)
            if (val := c.activation_func_clamp_value) is not None:
                x_glu = x_glu.clamp(min=None, max=val)
                x_linear = x_linear.clamp(min=-val, max=val)
            h = c.activation_func(x_glu) * (x_linear + c.glu_linear_offset)
        else:
            h = c.activation_func(h)
        return (h * probs.unsqueeze(-1)).to(h.dtype)

    def _loop(self, x: torch.Tensor, counts: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """One F.linear pair per expert on views of the 3-D weights (the fallback; splits need a host sync)."""
        outs, split = [], counts.tolist()
        for i, (xi, pi) in enumerate(zip(torch.split(x, split), torch.split(probs, split), strict=True)):
            h = F.linear(xi, self.weight1[i])
            if self.bias1 is not None:
                h = h + self.bias1[i]
            out = F.linear(self._activation(h, pi), self.weight2[i])
            if self.bias2 is not None:
                out = (out + self.bias2[i].unsqueeze(0) * pi.unsqueeze(-1)).to(out.dtype)  # MLP: out +=
            outs.append(out)
        return torch.cat(outs, dim=0) if outs else x.new_zeros((0, self.config.hidden_size))

    def _grouped(self, x: torch.Tensor, counts: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        gmm = grouped_mm_fn()
        rows = x.shape[0]
        counts = counts.to(device=x.device, non_blocking=True)
        align = self.align or default_align(x.dtype, x.device.type)
        if align > 1:
            dest, offs, buffer_rows = padded_rows(counts, align, rows)
            x = x.new_zeros((buffer_rows, x.shape[1])).index_copy(0, dest, x)
            probs = probs.new_zeros(buffer_rows).index_copy(0, dest, probs)
        else:
            offs = torch.cumsum(counts, 0, dtype=torch.int32)
        h = gmm(x, self.weight1.transpose(1, 2), offs=offs)
        group = None
        if self.bias1 is not None:  # each row's expert (offs[-1] is the last row)
            group = torch.bucketize(torch.arange(x.shape[0], device=x.device), offs, right=True)
            h = h + self.bias1[group]
        out = gmm(self._activation(h, probs), self.weight2.transpose(1, 2), offs=offs)
        if self.bias2 is not None:
            out = (out + self.bias2[group] * probs.unsqueeze(-1)).to(out.dtype)
        return out.index_select(0, dest) if align > 1 else out

    def backward_dw(self) -> None:
        """No delayed weight gradients (refused in __init__)."""

    # --------------------------------------------------------------------------------------- checkpoint
    def _drop_extra_state(self, state_dict, prefix, *args, **kwargs) -> None:
        """The `_extra_state` entries SequentialMLP's linear layers carry (None) come back from a load; this
        module has none of its own."""
        for key in [k for k in state_dict if k.startswith(prefix) and _EXTRA_STATE.match(k[len(prefix):])]:
            del state_dict[key]

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """SequentialMLP's checkpoint entries (experts.py, SequentialMLP.sharded_state_dict), one factory per 3-D
        parameter whose pieces are the per-expert views."""
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        if metadata.get("singleton_local_shards"):
            raise ValueError("GroupedMLP checkpoints do not support singleton_local_shards")
        dp_cp_group = metadata["dp_cp_group"]
        num_global = self.ep_group.size() * self.num_local_experts
        first = self.ep_group.rank() * self.num_local_experts
        tp_rank, dp_rank = self.tp_group.rank(), self.dp_group.rank()
        ckpt_prefix = f"{prefix}experts."
        out = {}
        for name, param, fc, tp_axis in (("weight1", self.weight1, "linear_fc1", 0), ("bias1", self.bias1, "linear_fc1", 0),
                                         ("weight2", self.weight2, "linear_fc2", 1), ("bias2", self.bias2, "linear_fc2", None)):
            if param is None:
                continue
            kind = "weight" if name.startswith("weight") else "bias"
            build = partial(self._build_expert_pieces, sharded_offsets=tuple(sharded_offsets), first=first,
                            num_global=num_global, tp_axis=tp_axis, dp_cp_group=dp_cp_group,
                            swiglu=fc == "linear_fc1" and self.config.gated_linear_unit)
            # TP-split tensors are unique per TP rank (replica (0, 0, DP)); the fc2 bias is replicated over TP
            replica = (0, 0 if tp_axis is not None else tp_rank, dp_rank)
            out[f"{prefix}{name}"] = ShardedTensorFactory(f"{ckpt_prefix}{fc}.{kind}", param, build,
                                                          self._merge_expert_pieces, replica)
        for i in range(self.num_local_experts):
            offsets = (*sharded_offsets, (len(sharded_offsets), first + i, num_global))
            for fc in ("linear_fc1", "linear_fc2"):
                key = f"{prefix}local_experts.{i}.{fc}._extra_state"
                obj = make_sharded_object_for_checkpoint(None, f"{ckpt_prefix}{fc}._extra_state", offsets,
                                                         replica_id=(0, tp_rank, dp_rank))
                assert isinstance(obj, ShardedObject)
                out[key] = obj
        return out

    def _build_expert_pieces(self, key: str, data: torch.Tensor, replica_id, flattened_range, *, sharded_offsets,
                             first: int, num_global: int, tp_axis: int | None, dp_cp_group, swiglu: bool) -> dict:
        """The per-expert ShardedTensors of a 3-D parameter (or of an optimizer state shaped like it)."""
        if flattened_range is not None:
            raise ValueError(f"{key}: GroupedMLP checkpoints do not support flattened ranges")
        groups = {"tp_group": self.tp_group, "dp_cp_group": dp_cp_group}
        pieces = {}
        for i in range(data.shape[0]):
            offsets = (*sharded_offsets, (len(sharded_offsets), first + i, num_global))
            if tp_axis is None:
                sh = make_sharded_tensor_for_checkpoint(data[i], key, prepend_offsets=offsets, replica_id=replica_id,
                                                        **groups)
            else:
                sh = make_tp_sharded_tensor_for_checkpoint(data[i], key, tp_axis, replica_id=replica_id,
                                                           prepend_offsets=offsets, **groups)
            if swiglu:  # MLP.sharded_state_dict: [gate ; up] saved as two halves of the TP-global tensor
                factory = apply_swiglu_sharded_factory(sh, offsets, False, tp_group=self.tp_group,
                                                       dp_group=dp_cp_group)
                pieces[f"{i}.gate"], pieces[f"{i}.up"] = factory.build_fn(key, data[i], replica_id, None)
            else:
                pieces[str(i)] = sh
        return pieces

    @staticmethod
    def _merge_expert_pieces(loaded: dict) -> torch.Tensor:
        """The inverse of _build_expert_pieces: the loaded pieces stacked back into [experts, ...]."""
        if "0.gate" in loaded:
            return torch.stack([torch.cat([loaded[f"{i}.gate"], loaded[f"{i}.up"]]) for i in range(len(loaded) // 2)])
        return torch.stack([loaded[str(i)] for i in range(len(loaded))])


def grouped_experts_spec(layer_spec, align: int | None = None):
    """`layer_spec` (a local GPT layer spec with a MoE layer) with GroupedMLP in place of SequentialMLP."""
    import dataclasses

    mlp = layer_spec.submodules.mlp  # megatron-core 0.19: partial(MoELayer, submodules=MoESubmodules(...))
    subs = mlp.keywords["submodules"]
    experts = partial(GroupedMLP, align=align)
    layer_spec.submodules.mlp = partial(mlp.func, *mlp.args,
                                        **{**mlp.keywords, "submodules": dataclasses.replace(subs, experts=experts)})
    return layer_spec


# ------------------------------------------------------------------------------------------ router metrics
#: The router losses megatron-core records (router.py), by --moe-router-load-balancing-type.
LOSS_NAMES = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss",
              "global_aux_loss": "global_load_balancing_loss"}


def router_loss_names(m) -> list[str]:
    """The router losses megatron-core records for model config `m` (config.ModelConfig)."""
    names = [LOSS_NAMES[m.moe_router_load_balancing_type]] if m.moe_aux_loss_coeff > 0 and \
        m.moe_router_load_balancing_type in LOSS_NAMES else []
    return names + (["z_loss"] if m.moe_z_loss_coeff is not None else [])


class _Capture:
    """Stands in for the TensorBoard writer of megatron-core's MoE metrics tracker: keeps its scalars."""

    def __init__(self):
        self.scalars: dict[str, float] = {}

    def add_scalar(self, name: str, value, iteration: int) -> None:
        self.scalars[name] = float(value)


class RouterMonitor:
    """Expert load and router losses of every MoE layer, reported at log time.

    A forward hook on each router adds the tokens it routed to each expert into one device tensor
    [layers, experts] (training forwards only: evaluation and the first pass of a full recompute run without
    grad, like Megatron's own expert-bias counts), so a step costs no host sync. `report` (collective, at
    log time) copies it to the host, sums it over ranks, and reduces megatron-core's tracker of the router
    losses (the load-balancing loss and the z-loss, each divided by its coefficient, as Megatron-LM logs them)."""

    def __init__(self, model: list, num_layers: int, num_experts: int, loss_names: list[str]):
        from megatron.core.transformer.moe.router import TopKRouter

        routers = [m for chunk in model for m in chunk.modules() if isinstance(m, TopKRouter)]
        device = routers[0].weight.device if routers else torch.device("cpu")
        self.num_layers, self.loss_names = num_layers, loss_names
        self.tokens = torch.zeros((num_layers, num_experts), dtype=torch.int64, device=device)
        self.micro_batches = 0  # training forwards of this rank's first MoE layer since the last report
        self._first = min(routers, key=lambda r: r.layer_number) if routers else None
        for router in routers:
            router.register_forward_hook(self._count)

    def _count(self, router, args, output) -> None:
        if not (router.training and torch.is_grad_enabled()):
            return
        with torch.no_grad():
            self.tokens[router.layer_number - 1] += output[1].sum(dim=0)
        if router is self._first:
            self.micro_batches += 1

    def report(self, cpu_group, iteration: int) -> dict | None:
        """Collective: the window's figures (the same on every rank), or None when it saw no training forward."""
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker

        micro = torch.tensor([self.micro_batches], dtype=torch.int64)
        torch.distributed.all_reduce(micro, op=torch.distributed.ReduceOp.MAX, group=cpu_group)
        tokens = self.tokens.to("cpu", copy=True)
        self.tokens.zero_()
        self.micro_batches = 0
        torch.distributed.all_reduce(tokens, group=cpu_group)
        if int(micro) == 0:
            return None
        capture = _Capture()
        if self.loss_names:
            get_moe_metrics_tracker().report(loss_scale=1.0 / int(micro), iteration=iteration, writer=capture,
                                             track_names=self.loss_names, force_initialize=True,
                                             num_layers=self.num_layers)
        # each token once: MoE at TP > 1 runs sequence parallel (config.py), each rank routing its own tokens
        return expert_load_figures(tokens) | {"losses": capture.scalars}


def expert_load_figures(tokens: torch.Tensor) -> dict:
    """Figures of a [layers, experts] token count (layers that routed nothing are left out): per expert its share of
    all routed tokens; the worst layer's busiest expert over that layer's mean (its index, from 0), how many (layer,
    expert) pairs got no token, and the assignments each layer routed (tokens x top-k)."""
    routed = tokens.sum(dim=1)
    used = tokens[routed > 0].to(torch.float64)
    if used.numel() == 0:
        return {"share": [], "max_over_mean": None, "worst_layer": None, "idle": 0, "routed": routed.tolist()}
    ratio = used.max(dim=1).values / used.mean(dim=1)
    layer = int(torch.nonzero(routed > 0)[int(ratio.argmax())])
    return {"share": (used.sum(dim=0) / used.sum()).tolist(), "max_over_mean": float(ratio.max()),
            "worst_layer": layer, "idle": int((used == 0).sum()), "routed": routed.tolist()}
