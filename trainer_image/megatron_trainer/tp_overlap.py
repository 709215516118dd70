"""The forward all-reduce of a row-parallel linear layer, overlapped with its own GEMM (local path).

Without Transformer Engine, Megatron's `RowParallelLinear` (attention's output projection and the
MLP's second layer) runs its GEMM, then all-reduces the whole output across the tensor-parallel group
while nothing else runs: at TP=2 on the Llama-3-8B that is 512 all-reduces of 32 MiB per step, 81-104
ms of exposed NCCL time out of about 1600 ms (docs/benchmarks/megatron-lm.md#2026-11-26-third-session-nccl-overlap).
In the backward pass Megatron already overlaps its all-reduce with the weight-gradient GEMM.

`OverlappedRowParallelLinear` splits the forward GEMM along the sequence into `chunks` pieces and
starts each piece's all-reduce as soon as the piece is computed, so the all-reduce of one piece runs
while the next piece's GEMM does (CUDA_DEVICE_MAX_CONNECTIONS=1 keeps the launch order, as for
Megatron's own backward overlap); only the last piece's all-reduce is exposed. The backward pass is
Megatron's own (`LinearWithGradAccumulationAndAsyncCommunication.backward`, weight-gradient
accumulation fusion included): the all-reduce's gradient is the identity, so the output gradient is
what Megatron's backward expects. Parameters, their names and checkpoints are unchanged.

Used where it applies: tensor parallelism > 1, no sequence parallelism (with it the layer
reduce-scatters instead), a trainable weight, no CPU offloading, and a sequence length divisible by
`chunks`. Anything else takes Megatron's forward unchanged. Opt-in: MEGATRON_TRAINER_TP_OVERLAP_CHUNKS=N
(N > 1) sets `chunks`. On the Llama-3-8B at TP=2 on 2 x H200 it measured no gain (1614.3 ms with 2
pieces, 1615.8 with 4, 1608.0 without, one call). The profile's exposed NCCL time stayed at 85 ms while
both NCCL and GEMM kernel time rose: the pieces did overlap, but slowed each other. That fits cuBLAS's
GEMMs here being persistent kernels sized for every SM (docs/benchmarks/megatron-lm.md#2026-11-26-third-session-nccl-overlap).
Kept for A/B runs.

`sm_carveout` (MEGATRON_TRAINER_TP_OVERLAP_SM_CARVEOUT=N) leaves N streaming multiprocessors free during
the GEMM of every piece after the first, the pieces that run beside an all-reduce, so that NCCL's
kernel gets SMs at once instead of waiting for the GEMM's. It uses torch's experimental cuBLASLt SM
count target (`torch._C._set_sm_carveout_experimental`, with cuBLASLt preferred for those GEMMs only;
both settings are restored after each GEMM). Transformer Engine's overlap gives its communication a
fixed number of SMs the same way. Measured on the same 8B (one call): 2 pieces with 16 SMs left, 1618.0
ms against 1623.4 ms without the overlap, inside the spread; exposed NCCL time stayed at 62-87 ms. At
TP=2 a half-sequence all-reduce (about 0.1 ms) outlasts the attention projection's GEMM piece (about
0.05 ms), so little of it can hide.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from megatron.core.tensor_parallel.layers import (
    LinearWithGradAccumulationAndAsyncCommunication,
    RowParallelLinear,
    custom_fwd,
)

DEFAULT_CHUNKS = 2  # the class default; the trainer sets its own from the environment


@contextlib.contextmanager
def sm_carveout(sms: int):
    """cuBLASLt GEMMs inside leave `sms` SMs free (0: no change); the previous settings come back after."""
    if sms <= 0:
        yield
        return
    previous_lib = torch.backends.cuda.preferred_blas_library()
    previous = torch._C._get_sm_carveout_experimental()
    torch.backends.cuda.preferred_blas_library("cublaslt")  # the carve-out applies to cuBLASLt only
    torch._C._set_sm_carveout_experimental(sms)
    try:
        yield
    finally:
        torch._C._set_sm_carveout_experimental(previous)
        torch.backends.cuda.preferred_blas_library(previous_lib)


def carveout_problem(sms: int, device_sms: int | None) -> str | None:
    """Why `sms` cannot be left free on a GPU of `device_sms` SMs (None: it can, or the GPU is unknown);
    cuBLASLt would be asked for a GEMM on no SM at all otherwise."""
    if sms and device_sms is not None and sms >= device_sms:
        return (f"MEGATRON_TRAINER_TP_OVERLAP_SM_CARVEOUT={sms} leaves no SM for the GEMMs: this GPU has "
                f"{device_sms}; use fewer (e.g. 16)")
    return None


class _ChunkedMatmulAllReduce(LinearWithGradAccumulationAndAsyncCommunication):
    """Forward: out = all_reduce(input @ weight.T), one piece of the sequence at a time; backward:
    Megatron's (the same ctx fields as its forward sets)."""

    @staticmethod
    @custom_fwd
    def forward(ctx, input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,
                grad_output_buffer, wgrad_deferral_limit, tp_group, gtp_remat_size, chunks, carveout):
        # The fields Megatron's backward reads (megatron-core 0.19.2's forward sets the same ones).
        ctx.save_for_backward(input, weight)
        ctx.main_grad = weight.main_grad if gradient_accumulation_fusion and hasattr(weight, "main_grad") else None
        ctx.use_bias = bias is not None
        ctx.gradient_accumulation_fusion = gradient_accumulation_fusion
        ctx.allreduce_dgrad = allreduce_dgrad
        ctx.sequence_parallel = sequence_parallel
        ctx.wgrad_deferral_limit = wgrad_deferral_limit
        ctx.grad_output_buffer = grad_output_buffer
        ctx.tp_group = tp_group
        ctx.gtp_remat_size = gtp_remat_size
        out = torch.empty(*input.shape[:-1], weight.shape[0], dtype=input.dtype, device=input.device)
        pending = []
        for piece_in, piece_out in zip(input.chunk(chunks, dim=0), out.chunk(chunks, dim=0), strict=True):
            # every piece after the first runs beside the previous piece's all-reduce
            with sm_carveout(carveout if pending and input.is_cuda else 0):
                torch.matmul(piece_in, weight.t(), out=piece_out)
            pending.append(dist.all_reduce(piece_out, group=tp_group, async_op=True))
        for work in pending:
            work.wait()
        if bias is not None:
            out = out + bias
        return out

    @staticmethod
    def backward(ctx, grad_output):
        grads = LinearWithGradAccumulationAndAsyncCommunication.backward(ctx, grad_output)
        return (*grads, None, None)  # no gradient for `chunks` and `carveout`


class OverlappedRowParallelLinear(RowParallelLinear):
    """Megatron's RowParallelLinear with the forward all-reduce overlapped piece by piece (module doc)."""

    chunks: int = DEFAULT_CHUNKS
    sm_carveout: int = 0  # SMs the GEMM pieces beside an all-reduce leave free (module doc)

    def overlaps(self, input_: torch.Tensor) -> bool:
        return (self.chunks > 1 and self.tp_group is not None and self.tp_group.size() > 1
                and self.input_is_parallel and not self.sequence_parallel and not self.explicit_expert_comm
                and self.weight.requires_grad and getattr(self, "gtp_remat_size", 1) == 1
                and self.config._cpu_offloading_context is None and input_.shape[0] % self.chunks == 0)

    def forward(self, input_: torch.Tensor):
        if not self.overlaps(input_):
            return super().forward(input_)
        output_ = _ChunkedMatmulAllReduce.apply(input_, self.weight, None, self.gradient_accumulation_fusion, False,
                                                False, None, 0, self.tp_group, 1, self.chunks, self.sm_carveout)
        if not self.skip_bias_add:
            return (output_ + self.bias) if self.bias is not None else output_, None
        return output_, self.bias


def overlapped_row_parallel_linear(chunks: int, sm_carveout: int = 0) -> type[OverlappedRowParallelLinear]:
    """A subclass with `chunks` and `sm_carveout` fixed (a layer spec takes a class, not an instance)."""
    if chunks < 1:
        raise ValueError(f"tensor-parallel overlap chunks must be >= 1, got {chunks}")
    if sm_carveout < 0:
        raise ValueError(f"tensor-parallel overlap SM carve-out must be >= 0, got {sm_carveout}")
    name = f"OverlappedRowParallelLinear{chunks}" + (f"c{sm_carveout}" if sm_carveout else "")
    return type(name, (OverlappedRowParallelLinear,), {"chunks": chunks, "sm_carveout": sm_carveout})
