"""Predicted peak GPU memory per GPU for a MegatronJob ("will it fit?"), pure arithmetic.

The rank with the largest footprint is estimated: the first pipeline stage (it holds the most
in-flight micro-batches and the input embedding), or the last one when the output layer and the
loss dominate. Terms, in bytes:

- weights / gradients / optimizer: parameters per tensor x pipeline shard (experts over expert x
  expert-tensor parallel), with Megatron's mixed-precision layout: 2-byte bf16/fp16 weights, fp32
  gradient buffer (``grad_reduce_in_fp32``), and 12 bytes of fp32 master weights + Adam moments,
  divided by the data-parallel size (data x context) with the distributed optimizer; the experts'
  optimizer state by the expert-data-parallel size instead (world / (expertTensor x expert x
  pipeline), Megatron 0.19's expert grid), the router (replicated over TP) with the dense part;
- activations: per layer and micro-batch after Korthikanti et al. 2022, "Reducing Activation
  Recomputation in Large Transformer Models" (sequence split by context parallelism; divided by
  TP where sequence parallelism or TP splits them; the s x s score term only for unfused
  attention; selective and full recomputation), times the micro-batches in flight on the first
  stage (1F1B: min(PP, micro-batches); interleaved: x (1 + (PP-1)/(PP x VPP))); Q and the attention
  output heads x kvChannels wide (wider than hidden in Qwen3), and with RoPE the rotated Q and K, which
  attention keeps as new tensors;
- mixture of experts (``_moe_layer_bytes``): the routed top-k copies of each token through the experts' MLPs
  (even routing assumed; a capacity factor below 1 drops the rest, padding to capacity fills every expert to
  it), the router's fp32 logits and probabilities, and one layer's transient at a time: the larger of the token
  dispatcher's buffers (all-gather: the expert group's tokens; all-to-all: the send and receive buffers) and
  the backward of the SwiGLU experts' activation (router-dtype intermediates per routed row, 18 bytes per row
  and FFN column with an fp32 router); shared experts as one dense MLP of moeSharedExpertIntermediateSize
  split over TP (weights and activations);
- output layer and loss: bf16 logits plus their fp32 copy in the cross-entropy (vocabulary split
  by TP);
- other: a fixed allowance for the allocator's workspaces.

It predicts ``torch.cuda.max_memory_allocated()``; the fit check adds what the allocator never
sees (CUDA context, NCCL buffers, fragmentation) as ``RESERVED_OVERHEAD_GIB``. The constants were
checked against measured runs: dense models in docs/benchmarks/memory-estimator.md#2026-11-21-predicted-vs-measured
(tests/unit/test_memory_calibration.py), mixture of experts and the RoPE term in
docs/benchmarks/moe.md#2026-11-28-memory-estimate-moe (tests/unit/test_memory_moe_calibration.py: five MoE runs
within 10 %, six dense Llama runs within 1 %). ``CALIBRATED_MOE_TERMS`` says what the MoE runs covered,
``UNCALIBRATED_MOE_TERMS`` what they did not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from .presets import GPU_MEMORY_GIB
from .rules import derived_layout, resolved_model
from .spec import MegatronJob
from .vocab.quantity import quantity_bytes

GIB = 1024**3
# Memory the PyTorch allocator does not count: CUDA context (~0.5 GiB), NCCL channels and
# buffers, cuBLAS/cuDNN handles, and the caching allocator's fragmentation.
RESERVED_OVERHEAD_GIB = 3.0
# Allocations that persist after the first step beyond weights, gradients and optimizer state (cuBLAS
# workspaces and the like): measured 0.06-0.07 GiB on every shape.
WORKSPACE_GIB = 0.07
#: A CPU job's process before its model state: the interpreter, torch, Megatron-Core and gloo, as resident memory.
#: Measured: 0.70 GiB after building a 2-layer Llama and 0.82 GiB peak, per process, with --device cpu (2 ranks,
#: TP 2, 2026-12-01); the model there is a few MB, so nearly all of it is the runtime.
CPU_PROCESS_BASE_GIB = 0.8
# Bytes per s x s score element and head that Megatron's unfused attention keeps per layer (fp32
# softmax output + bf16 probabilities), and the transient of one layer's backward (score gradients).
UNFUSED_SCORE_BYTES = 6
UNFUSED_BACKWARD_BYTES = 6
# Bytes per logit on the last stage: the bf16 logits and the fp32 copy of the vocab-parallel cross
# entropy (measured: 6.0-6.1 bytes per logit on two model shapes).
LOGITS_BYTES = 6
# torch.optim.AdamW (Megatron's fallback without Transformer Engine or apex) allocates a full-size
# fp32 temporary per optimizer-shard parameter during its foreach step; the fused Adam of TE/apex does
# not, nor does torch's fused AdamW, which the trainer uses since 2026-11-26. Kept until the records
# that set it (m03, m04) are re-measured with the fused kernel: until then it errs on the safe side.
TORCH_ADAM_STEP_BYTES = 4
#: The MoE terms five measured runs checked (2026-11-28, 2 and 4 x H200, the trainer's grouped-GEMM experts on the
#: local path: docs/benchmarks/moe.md#2026-11-28-memory-estimate-moe; tests/unit/test_memory_moe_calibration.py):
#: every estimate within 10 % of the largest rank's peak. estimate() lists them in Estimate.details["calibrated"].
CALIBRATED_MOE_TERMS = (
    "expert weights, fp32 gradients and unsharded optimizer state at expert data parallel 1, sharded by EP "
    "(2 and 4) and at TP 2 x EP 2 by expert TP 2; the dense part's optimizer state over DP 2 and 4",
    "routed activations of dropless top-2 (8 experts of FFN 14336) and top-8 (128 experts of FFN 768) SwiGLU "
    "experts, routing assumed even, with the all-to-all dispatcher and an fp32 router",
    "the SwiGLU experts' backward transient (18 bytes per routed row and FFN column, fp32 router)",
    "MoE at TP 2 with sequence parallelism (expert TP = TP, the all-to-all dispatcher's TP all-gather)",
    "Qwen3's attention: Q and its output heads x kvChannels wide (QK norm keeps nothing more); RoPE's rotated Q "
    "and K (also checked on six dense Llama runs)",
)
#: The MoE terms no measured run has checked yet. estimate() lists them in Estimate.details["uncalibrated"] for a
#: MoE model.
UNCALIBRATED_MOE_TERMS = (
    "routing imbalance: routing is assumed even; dropless routing gives a busy rank more rows (the measured "
    "ranks of one run differed by up to 0.8 GiB, and the busiest rank is what must fit)",
    "expert optimizer state sharded over expert data parallel > 1 (world / (expertTensor x expert x pipeline))",
    "shared experts: a dense MLP's weights and activations per MoE layer (and Qwen2-MoE's gate on it)",
    "capacity factor and padding to capacity (token dropping)",
    "the all-gather dispatcher's buffers (only all-to-all was measured)",
    "expert TP other than TP, TP > 2, PP / VPP / CP and recomputation with experts",
    "GeLU experts, a router in the activations' dtype or fp64, and the Transformer Engine path",
    "router: fp32 logits and probabilities per token and expert (included, too small to check at 8 and 128 "
    "experts)",
)
# Bytes per token and expert the router keeps: fp32 logits and fp32 probabilities (router.py computes both).
ROUTER_BYTES = 8
# Bytes of one router probability by spec.model.moeRouterDtype (unset: the activations' dtype).
ROUTER_DTYPE_BYTES = {"fp32": 4, "fp64": 8}


@dataclass(frozen=True)
class Estimate:
    """Bytes per GPU by category, for the rank with the largest footprint."""

    weights: float
    gradients: float
    optimizer: float
    activations: float
    other: float
    stage: str
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations + self.other

    def breakdown_gib(self) -> dict[str, float]:
        return {k: round(getattr(self, k) / GIB, 2) for k in
                ("weights", "gradients", "optimizer", "activations", "other")}


@dataclass(frozen=True)
class FitReport:
    estimate: Estimate
    capacity_gib: float | None
    #: A CPU job (gpusPerNode 0): the estimate is host memory, per process, and the capacity the pod's memory.
    cpu_processes: int | None = None

    @property
    def per_gpu_gib(self) -> float:
        return self.estimate.total / GIB

    @property
    def per_pod_gib(self) -> float:
        """A CPU job's pod: each process's model state and activations plus its runtime (CPU_PROCESS_BASE_GIB)."""
        return (self.cpu_processes or 0) * (self.per_gpu_gib + CPU_PROCESS_BASE_GIB)

    @property
    def fits(self) -> bool | None:
        if self.capacity_gib is None:
            return None
        if self.cpu_processes:
            return self.per_pod_gib <= self.capacity_gib
        return self.per_gpu_gib + RESERVED_OVERHEAD_GIB <= self.capacity_gib

    def summary(self) -> str:
        if self.cpu_processes:
            b = self.estimate.breakdown_gib()
            where = (f"{'fits' if self.fits else 'does NOT fit'} in the pod's {self.capacity_gib:.1f} GiB "
                     "(spec.resources.memory)" if self.capacity_gib is not None else
                     "(set spec.resources.memory for the fit check)")
            return (f"CPU job: predicted peak host memory {self.per_pod_gib:.1f} GiB per pod ({self.cpu_processes} "
                    f"x ({self.per_gpu_gib:.2f} GiB + {CPU_PROCESS_BASE_GIB} GiB runtime)) {where} (weights "
                    f"{b['weights']}, gradients {b['gradients']}, optimizer {b['optimizer']}, activations "
                    f"{b['activations']}, other {b['other']} GiB a process)")
        need = self.per_gpu_gib + RESERVED_OVERHEAD_GIB
        verdict = "fits" if self.fits else "does NOT fit"
        b = self.estimate.breakdown_gib()
        return (f"predicted peak {self.per_gpu_gib:.1f} GiB per GPU (+{RESERVED_OVERHEAD_GIB:.0f} GiB CUDA/NCCL "
                f"overhead = {need:.1f} GiB) {verdict} in {self.capacity_gib:.1f} GiB "
                f"(weights {b['weights']}, gradients {b['gradients']}, optimizer {b['optimizer']}, "
                f"activations {b['activations']}, other {b['other']} GiB; {self.estimate.stage} stage); "
                f"to reduce it raise tensor/pipeline parallelism, enable recompute or the distributed "
                f"optimizer, or lower microBatchSize")

    def as_json(self) -> dict[str, Any]:
        if self.cpu_processes:
            return {"perProcessGiB": round(self.per_gpu_gib, 2), "processesPerPod": self.cpu_processes,
                    "processRuntimeGiB": CPU_PROCESS_BASE_GIB, "perPodGiB": round(self.per_pod_gib, 2),
                    "breakdown": self.estimate.breakdown_gib(), "capacityGiB": self.capacity_gib, "fits": self.fits,
                    "stage": self.estimate.stage}
        return {"perGpuGiB": round(self.per_gpu_gib, 2), "breakdown": self.estimate.breakdown_gib(),
                "overheadGiB": RESERVED_OVERHEAD_GIB, "capacityGiB": self.capacity_gib, "fits": self.fits,
                "stage": self.estimate.stage}

    def table(self) -> str:
        if self.cpu_processes:
            rows = [(f"{k} (a process)", v) for k, v in self.estimate.breakdown_gib().items()]
            rows.append(("+ runtime (interpreter, torch, gloo)", CPU_PROCESS_BASE_GIB))
            rows.append((f"= host memory per pod ({self.cpu_processes} processes)", round(self.per_pod_gib, 2)))
            lines = [f"  {k:<40} {v:>9.2f} GiB" for k, v in rows]
            lines.append("  pod memory unknown: set spec.resources.memory for the fit check" if self.capacity_gib is None
                         else f"  {'pod memory (spec.resources.memory)':<40} {self.capacity_gib:>9.2f} GiB -> "
                              f"{'fits' if self.fits else 'does NOT fit'}")
            lines.append(f"  (a CPU job: host memory; largest footprint: {self.estimate.stage} pipeline stage)")
            return "\n".join(lines)
        rows = [(k, v) for k, v in self.estimate.breakdown_gib().items()]
        rows.append(("= predicted peak (allocated)", round(self.per_gpu_gib, 2)))
        rows.append(("+ CUDA context / NCCL / fragmentation", RESERVED_OVERHEAD_GIB))
        lines = [f"  {k:<40} {v:>9.2f} GiB" for k, v in rows]
        if self.capacity_gib is None:
            lines.append("  GPU memory unknown: set spec.resources.gpuType or gpuMemoryGiB for the fit check")
        else:
            lines.append(f"  {'GPU memory':<40} {self.capacity_gib:>9.2f} GiB -> "
                         f"{'fits' if self.fits else 'does NOT fit'}")
        lines.append(f"  (largest footprint: {self.estimate.stage} pipeline stage)")
        return "\n".join(lines)


def padded_vocab(vocab: int, tp: int, divisible_by: int = 128) -> int:
    m = divisible_by * tp
    return int(math.ceil(vocab / m) * m)


def _mlp_params(h: int, ffn: int, swiglu: bool, bias: bool) -> int:
    """One MLP's parameters: fc1 (two halves with SwiGLU), fc2, and their biases."""
    return (3 if swiglu else 2) * h * ffn + ((2 * ffn if swiglu else ffn) + h if bias else 0)


def _swiglu_backward_bytes(act_bytes: int, probs_bytes: int) -> int:
    """Bytes per routed row and expert-FFN column that the backward of a SwiGLU expert allocates above what the
    forward kept (megatron-core's ``weighted_swiglu_back``, the router's probabilities fused into the activation):
    the fp32 (router dtype) gradient of both halves (2 x probs), ``swiglu(y)`` again (act), the incoming gradient
    cast to the router dtype (probs; no copy when it is already that dtype) and their product (probs). The
    gradient times the probabilities (probs) is freed before the second product; fc2's input, which the forward
    kept, is freed as the same-sized incoming gradient arrives. fp32 router (the measured case): 18 bytes."""
    cast = probs_bytes if probs_bytes != act_bytes else 0
    return 2 * probs_bytes + act_bytes + cast + probs_bytes


def _moe_layer_bytes(tokens: float, h: int, moe_ffn: int, experts: int, topk: int, ep: int, etp: int, swiglu: bool,
                     dispatcher: str, act_bytes: int, capacity_factor: float = 0.0,
                     pad_to_capacity: bool = False, probs_bytes: int = 2) -> tuple[float, float]:
    """A MoE layer's activations on one GPU: (kept for the backward, transient while the layer runs). ``tokens``:
    the tokens of this rank's sequence slice (s x b / TP: a MoE layer at TP > 1 runs sequence parallel).
    Checked on five measured runs (docs/benchmarks/moe.md#2026-11-28-memory-estimate-moe); what those did not
    cover is in UNCALIBRATED_MOE_TERMS.

    With routing even, the EP ranks of an expert group share their tokens' top-k copies evenly: each receives
    its own tokens x topk, times ETP (an expert-tensor group runs every token of its ranks through its slice
    of each expert). Kept: the experts' input rows, fc1's output (the activation's input, two halves with SwiGLU)
    and fc2's input (megatron-core's MLP, per expert), and the router's fp32 logits and probabilities. Transient,
    the larger of: the dispatcher's buffers - all-gather: the hidden states of the whole ETP x EP group, then the
    permuted rows; all-to-all: the permuted rows sent and received - and, for SwiGLU experts, the backward of the
    activation (``_swiglu_backward_bytes`` per row and FFN column; ``probs_bytes``: the router's dtype, 4 with
    moeRouterDtype fp32, else the activations'). A capacity factor (0: none) keeps each expert to that factor
    of its even share (router.py, apply_router_token_dropping): below 1 the rest is dropped; with padding to
    capacity every expert gets exactly its capacity, above 1 more rows than dropless."""
    rows = tokens * topk * etp
    if capacity_factor:
        rows *= capacity_factor if pad_to_capacity else min(1.0, capacity_factor)
    kept = act_bytes * rows * (h + ((2 if swiglu else 1) + 1) * moe_ffn / etp) + ROUTER_BYTES * tokens * experts
    if dispatcher == "alltoall":
        transient = act_bytes * h * 2 * rows
    else:
        transient = act_bytes * h * (tokens * ep * etp + rows)
    if swiglu:
        transient = max(transient, _swiglu_backward_bytes(act_bytes, probs_bytes) * rows * moe_ffn / etp)
    return kept, transient


def estimate(job: MegatronJob) -> Estimate:
    wire = job.spec.wire()
    m = resolved_model(wire)
    lay = derived_layout(wire)
    tr = job.spec.training
    tp, pp, cp, dp = lay["tensor"], lay["pipeline"], lay["context"], lay["data"]
    ep, etp = lay["expert"], lay["expertTensor"]
    vpp = job.spec.parallelism.virtual_pipeline or 1
    # Sequence parallelism left to its default is decided by the trainer (on with Transformer Engine, off
    # on the local path, --sequence-parallel-auto): counted off, the larger of the two.
    sp = job.spec.parallelism.sequence_parallel is True  # admission refuses it without TP > 1
    h, a, L = m["hiddenSize"], m["numAttentionHeads"], m["numLayers"]
    g, ffn = m["numQueryGroups"], m["ffnHiddenSize"]
    s_full, b = m["seqLength"], tr.micro_batch_size
    s = s_full / cp  # each context-parallel rank holds a slice of the sequence
    v = padded_vocab(m["vocabSize"], tp)
    swiglu = m["activation"] == "swiglu"
    bias = m["addBiasLinear"]
    experts = m["numExperts"] or 0
    # MoE at TP > 1 runs sequence parallel whatever was asked (the trainer turns it on: megatron-core's MoE layer)
    sp = sp or (experts > 0 and tp > 1)
    moe_ffn = m["moeFfnHiddenSize"]
    shared_ffn = m["moeSharedExpertIntermediateSize"] if experts else 0  # 0: no shared experts
    head_dim = m["kvChannels"] or h / a  # kvChannels: heads sized apart from hidden / heads (Qwen3)
    q = a * head_dim
    kv = g * head_dim
    act_bytes = 2  # bf16/fp16 activations (fp8 keeps bf16 activations between layers)

    # ---- parameters per GPU -------------------------------------------------------------------
    attn_params = (h * (q + 2 * kv) + q * h + ((q + 2 * kv) + h if bias else 0)
                   + (q + 2 * kv if m["addQkvBias"] and not bias else 0))
    mlp_one = _mlp_params(h, ffn, swiglu, bias)
    norm_params = (2 if m["normalization"] == "LayerNorm" else 1) * h * 2
    # a MoE layer: the router (experts x hidden, replicated over TP) is dense; the experts split over EP x ETP
    # and so are the shared experts (one dense MLP split over TP, shared_experts.py)
    dense_per_layer = attn_params / tp + norm_params + (h * experts if experts else mlp_one / tp)
    if shared_ffn:
        dense_per_layer += _mlp_params(h, shared_ffn, swiglu, bias) / tp
        if m["moeSharedExpertGate"]:  # its gate: 1 x hidden, whole on every TP rank
            dense_per_layer += h
    expert_per_layer = experts * _mlp_params(h, moe_ffn, swiglu, bias) / (ep * etp) if experts else 0.0
    layers_per_stage = L / pp
    embed = v * h / tp + (m["maxPositionEmbeddings"] * h if m["positionEmbedding"] == "learned_absolute" else 0)
    output = v * h / tp if (m["untieEmbeddings"] or pp > 1) else 0  # tied + PP>1: a copy on the last stage
    final_norm = h * 2
    last_extra = output + final_norm
    first_extra = embed + (last_extra if pp == 1 else 0)
    dense_first = layers_per_stage * dense_per_layer + first_extra
    dense_last = layers_per_stage * dense_per_layer + last_extra
    expert_params = layers_per_stage * expert_per_layer

    # ---- bytes per parameter ------------------------------------------------------------------
    weight_b, grad_b, opt_b = 2.0, 4.0, 12.0
    dist = tr.distributed_optimizer
    dense_opt_div = dp * cp if dist else 1  # shards over the data-parallel group with context
    expert_dp = max(1, lay["world"] // (etp * ep * pp))
    expert_opt_div = expert_dp if dist else 1

    def static(dense: float) -> tuple[float, float, float]:
        w = (dense + expert_params) * weight_b
        gr = (dense + expert_params) * grad_b
        op = dense * opt_b / dense_opt_div + expert_params * opt_b / expert_opt_div
        return w, gr, op

    # ---- activations per layer per micro-batch (bytes) ----------------------------------------
    # What autograd keeps alive with dropout 0 (no masks: torch's dropout with p=0 saves nothing):
    # 32 sbh per GPT layer at TP=1 (Korthikanti's 34 sbh without the two dropout masks).
    sbh = s * b * h
    split = tp if sp else 1  # sequence parallel also splits the norm and linear-input regions
    replicated = act_bytes * 4 * sbh / split  # inputs of: attention norm, QKV, MLP norm, fc1
    qkv = act_bytes * s * b * (q + 2 * kv) / tp  # Q, K, V (heads x kvChannels wide) kept for attention's backward
    attn_out = act_bytes * s * b * q / tp  # attention output = input of the output projection
    # RoPE writes the rotated Q and K as new tensors, which attention keeps beside the QKV output (V is a view of
    # it); the rotation keeps only cos and sin. Measured: docs/benchmarks/moe.md#2026-11-28-memory-estimate-moe.
    rope = act_bytes * s * b * (q + kv) / tp if m["positionEmbedding"] == "rope" else 0.0
    scores = UNFUSED_SCORE_BYTES * (a / tp) * s * s * b if tr.attention_backend == "unfused" else 0.0
    lse = 4 * s * b * a / tp if tr.attention_backend != "unfused" else 0.0  # flash's fp32 log-sum-exp
    moe_transient = 0.0
    if experts:
        mlp, moe_transient = _moe_layer_bytes(tokens=s * b / tp, h=h, moe_ffn=moe_ffn, experts=experts,
                                              topk=m["moeRouterTopk"], ep=ep, etp=etp, swiglu=swiglu,
                                              dispatcher=m["moeTokenDispatcherType"], act_bytes=act_bytes,
                                              capacity_factor=m["moeExpertCapacityFactor"],
                                              pad_to_capacity=m["moePadExpertInputToCapacity"],
                                              probs_bytes=ROUTER_DTYPE_BYTES.get(job.spec.model.moe_router_dtype,
                                                                                 act_bytes))
        # shared experts: every token through a dense MLP (its input is the MLP norm's output, counted above)
        mlp += act_bytes * ((2 if swiglu else 1) + 1) * s * b * shared_ffn / tp
        if shared_ffn and m["moeSharedExpertGate"]:  # its gate keeps the ungated output and the token's score
            mlp += act_bytes * (sbh / split + s * b)
    else:
        mlp = act_bytes * ((2 if swiglu else 1) + 1) * s * b * ffn / tp  # activation input + fc2 input
    full_layer = replicated + qkv + attn_out + rope + scores + lse + mlp
    backward_scores = UNFUSED_BACKWARD_BYTES * (a / tp) * s * s * b if scores else 0.0
    if tr.recompute == "full":
        per_layer = act_bytes * sbh / split  # only each layer's input is kept ...
        recompute_peak = full_layer + backward_scores  # ... one layer is rebuilt at a time in the backward
    elif tr.recompute == "selective":
        per_layer = full_layer - scores  # the attention core is recomputed from Q, K, V
        recompute_peak = scores + backward_scores
    else:
        per_layer = full_layer
        recompute_peak = backward_scores
    # one MoE layer's dispatcher buffers or experts' backward at a time; summed with the loss's logits below like
    # the dense transients, although the experts' backward runs after the logits are freed: the safe side
    recompute_peak += moe_transient

    num_micro = lay["numMicrobatches"]
    if pp == 1:
        in_flight = 1.0
    elif vpp > 1:
        in_flight = min(num_micro, pp) * (1 + (pp - 1) / (pp * vpp))
    else:
        in_flight = float(min(pp, num_micro))
    # Output layer and loss (last stage): the final norm's input and output, the bf16 logits and the
    # fp32 logits of the vocab-parallel cross entropy.
    head = act_bytes * 2 * sbh / split + s * b * v / tp * LOGITS_BYTES
    stage0_acts = per_layer * layers_per_stage * in_flight + recompute_peak
    last_acts = per_layer * layers_per_stage + recompute_peak + head
    if pp == 1:
        stage0_acts += head

    torch_adam = tr.transformer_impl == "local"  # no TE in the image: Megatron falls back to torch AdamW

    def other(dense: float, acts: float) -> float:
        """Workspaces, plus the optimizer step's temporaries where they exceed the activation peak
        (activations are freed before the step)."""
        shard = dense / dense_opt_div + expert_params / expert_opt_div
        step = TORCH_ADAM_STEP_BYTES * shard if torch_adam else 0.0
        return WORKSPACE_GIB * GIB + max(0.0, step - acts)

    moe_details = {"expertParamsPerGpu": expert_params, "expertDataParallel": expert_dp,
                   "calibrated": list(CALIBRATED_MOE_TERMS),
                   "uncalibrated": list(UNCALIBRATED_MOE_TERMS)} if experts else {}
    w0, g0, o0 = static(dense_first)
    first = Estimate(w0, g0, o0, stage0_acts, other(dense_first, stage0_acts), "first" if pp > 1 else "only",
                     {"paramsPerGpu": dense_first + expert_params, "inFlight": in_flight,
                      "perLayerActivationBytes": per_layer, **moe_details})
    if pp == 1:
        return first
    w1, g1, o1 = static(dense_last)
    last = Estimate(w1, g1, o1, last_acts, other(dense_last, last_acts), "last",
                    {"paramsPerGpu": dense_last + expert_params, "inFlight": 1,
                     "perLayerActivationBytes": per_layer, **moe_details})
    return first if first.total >= last.total else last


#: Bytes one parameter takes in a checkpoint: bf16 weights (fp8 keeps bf16 parameters here), the fp32 main copy
#: and Adam's two fp32 moments, with the distributed optimizer or without.
CHECKPOINT_BYTES_PER_PARAM = 2 + 4 + 8


def model_parameters(job: MegatronJob) -> int:
    """Parameters of the whole model (every TP/PP/EP shard once; the vocabulary padded as this layout pads it)."""
    wire = job.spec.wire()
    m = resolved_model(wire)
    tp = derived_layout(wire)["tensor"]
    h, a, L = m["hiddenSize"], m["numAttentionHeads"], m["numLayers"]
    g, ffn = m["numQueryGroups"], m["ffnHiddenSize"]
    head_dim = m["kvChannels"] or h / a
    q, kv = a * head_dim, g * head_dim
    bias, swiglu, experts = m["addBiasLinear"], m["activation"] == "swiglu", m["numExperts"] or 0
    attn = (h * (q + 2 * kv) + q * h + ((q + 2 * kv) + h if bias else 0)
            + (q + 2 * kv if m["addQkvBias"] and not bias else 0))
    mlp_one = _mlp_params(h, ffn, swiglu, bias)
    mlp = experts * _mlp_params(h, m["moeFfnHiddenSize"], swiglu, bias) + h * experts if experts else mlp_one
    if experts and m["moeSharedExpertIntermediateSize"]:
        mlp += _mlp_params(h, m["moeSharedExpertIntermediateSize"], swiglu, bias) + (h if m["moeSharedExpertGate"]
                                                                                   else 0)
    norms = (2 if m["normalization"] == "LayerNorm" else 1) * h * 2
    v = padded_vocab(m["vocabSize"], tp)
    embed = v * h + (m["maxPositionEmbeddings"] * h if m["positionEmbedding"] == "learned_absolute" else 0)
    output = v * h if m["untieEmbeddings"] else 0
    final_norm = (2 if m["normalization"] == "LayerNorm" else 1) * h
    return int(L * (attn + mlp + norms) + embed + output + final_norm)


def checkpoint_bytes(job: MegatronJob) -> int:
    """The size of one checkpoint (all ranks): weights, fp32 main copy and Adam moments. On a 4 x H100 run the
    7B GPT of the GPU suite (6.72 B parameters) wrote 94.06 GB per save; this gives 94.1 GB."""
    return model_parameters(job) * CHECKPOINT_BYTES_PER_PARAM


def capacity_gib(job: MegatronJob) -> float | None:
    r = job.spec.resources
    if job.spec.on_cpu:  # the pod's memory limit (its request too: the operator sets both)
        memory = quantity_bytes(r.memory) if r.memory is not None else None
        return memory / GIB if memory is not None else None
    if r.gpu_memory_gib is not None:
        return r.gpu_memory_gib
    if r.gpu_type is not None:
        return GPU_MEMORY_GIB[r.gpu_type]
    return None


def fit_report(job: MegatronJob, always: bool = False) -> FitReport | None:
    """The estimate and verdict; None when the check is off (memoryFit: Ignore) unless ``always``."""
    if job.spec.resources.memory_fit == "Ignore" and not always:
        return None
    return FitReport(estimate(job), capacity_gib(job),
                     cpu_processes=job.spec.processes_per_node if job.spec.on_cpu else None)
