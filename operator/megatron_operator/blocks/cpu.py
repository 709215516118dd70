"""spec.cpu and gpusPerNode 0: a MegatronJob on CPUs, to smoke-test a job before it takes GPUs.

The block's room: its schema, the rules that refuse what CPUs cannot run (each with its twin at the trainer's
start-up: megatron_trainer/config.py, CPU_REFUSALS), and its part of the render: the pod's resources, the
launcher's process count and the trainer's flags. Everything else of the JobSet renders as for GPUs: the
layout rules read the pod's process count (``values.procs``), which is gpusPerNode on GPUs and
``cpu.processesPerNode`` on CPUs.
"""

from __future__ import annotations

from pydantic import Field

from ..expr import fmt, lit
from ..vocab.api import ApiModel
from ..vocab.rule import Rule
from ..vocab.values import cp, f, has, on_cpu, precision

# --------------------------------------------------------------------------------------------
# Schema
# --------------------------------------------------------------------------------------------


class CpuSpec(ApiModel):
    """A CPU job (spec.gpusPerNode: 0): how many trainer processes each pod runs."""

    processes_per_node: int = Field(1, ge=1, le=64, description="Trainer processes per pod (the launcher's "
                                    "--nproc-per-node); each is one rank, on gloo. The layout rules count them as "
                                    "they count GPUs on a GPU job.")


# --------------------------------------------------------------------------------------------
# Admission rules (the trainer refuses the same at start-up: config.CPU_REFUSALS)
# --------------------------------------------------------------------------------------------

_CPU = " (gpusPerNode: 0 makes this a CPU job)"

RULES: list[Rule] = [
    Rule("cpu-block-needs-zero-gpus", "cpu",
         on_cpu, when=has("cpu"),
         message=fmt("spec.cpu: applies to CPU jobs only, and spec.gpusPerNode is ", f("gpusPerNode").str(),
                     "; remove spec.cpu, or set gpusPerNode: 0")),
    Rule("cpu-local-impl", "training.transformerImpl",
         f("training.transformerImpl").eq("local"), when=on_cpu & has("training.transformerImpl"),
         message=lit("spec.training.transformerImpl: Transformer Engine runs on CUDA only" + _CPU + "; set local or "
                     "omit it (CPU jobs default to local)")),
    Rule("cpu-no-fp8", "training.precision",
         precision.ne("fp8"), when=on_cpu,
         message=lit("spec.training.precision: fp8 GEMMs are Transformer Engine's, on CUDA only" + _CPU +
                     "; use bf16")),
    Rule("cpu-no-fp16", "training.precision",
         precision.ne("fp16"), when=on_cpu,
         message=lit("spec.training.precision: fp16 mixed precision is not verified on CPUs" + _CPU + "; use bf16")),
    Rule("cpu-no-context-parallel", "parallelism.context",
         cp.eq(1), when=on_cpu,
         message=lit("spec.parallelism.context: context parallelism needs Transformer Engine, on CUDA only" + _CPU +
                     "; use context: 1")),
    Rule("cpu-no-cuda-graph", "training.cudaGraph",
         f("training.cudaGraph").ne("fullIteration"), when=on_cpu,
         message=lit("spec.training.cudaGraph: CUDA graphs need CUDA" + _CPU + "; use auto or none (auto is none on "
                     "CPUs)")),
    Rule("cpu-no-efa", "resources.efaPerNode",
         f("resources.efaPerNode").eq(0), when=on_cpu,
         message=lit("spec.resources.efaPerNode: EFA carries NCCL's traffic, which a CPU job does not use (gloo runs "
                     "over the pod network)" + _CPU + "; remove efaPerNode")),
    Rule("cpu-no-gpu-type", "resources",
         ~has("resources.gpuType") & ~has("resources.gpuMemoryGiB"), when=on_cpu,
         message=lit("spec.resources: a CPU job has no GPU to size" + _CPU + "; remove gpuType and gpuMemoryGiB "
                     "(resources.memory sets the pods' memory)")),
]


# --------------------------------------------------------------------------------------------
# Render
# --------------------------------------------------------------------------------------------


def processes_per_node(gpus_per_node: int, cpu: CpuSpec | None) -> int:
    """The trainer processes of each pod: one per GPU, or spec.cpu.processesPerNode on a CPU job."""
    if gpus_per_node > 0:
        return gpus_per_node
    return cpu.processes_per_node if cpu is not None else 1


def flags(gpus_per_node: int) -> list[str]:
    """The trainer's flags a CPU job adds (its async-save flags are left out by the checkpoint flags' seam)."""
    return ["--device", "cpu"] if gpus_per_node == 0 else []


def saves_async(gpus_per_node: int) -> bool:
    """Whether the trainer saves in the background: not on CPUs (the writer pins host memory with CUDA)."""
    return gpus_per_node > 0
