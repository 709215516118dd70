"""Warnings: specs the API server admits and that may still not run as meant (pure).

Not refusals: whether a node with enough GPUs exists, or whether the memory limit is meant to hold
/dev/shm, depends on the cluster. ``megatron-operator validate`` prints them; the operator emits
each as a Warning event when it creates the job's children.
"""

from __future__ import annotations

import json

from .render import render_jobset, shm_size
from .rules import Problem, derived_layout, resolved_model
from .settings import Settings
from .spec import MegatronJob
from .vocab.quantity import quantity_bytes


def spec_warnings(job: MegatronJob, settings: Settings | None = None) -> list[str]:
    settings = settings or Settings()
    spec = job.spec
    out: list[str] = []
    tp, gpn = spec.parallelism.tensor, spec.processes_per_node
    if tp > gpn and spec.on_cpu:
        out.append(f"spec.parallelism.tensor: {tp} > spec.cpu.processesPerNode {gpn}: each tensor-parallel group's "
                   f"{tp // gpn} pods are kept on one node (pod affinity), as on GPUs")
    elif tp > gpn:
        out.append(f"spec.parallelism.tensor: {tp} > spec.gpusPerNode {gpn}: each tensor-parallel group's "
                   f"{tp // gpn} pods must share one node with at least {tp} GPUs (pod affinity); on nodes with "
                   f"fewer GPUs they stay Pending (Unschedulable). Usual layouts keep tensor <= GPUs per node")
    shm = quantity_bytes(shm_size(spec, settings))
    memory = quantity_bytes(spec.resources.memory) if spec.resources.memory is not None else None
    if shm is not None and memory is not None and shm > memory:
        out.append(f"spec.resources.shmSize: /dev/shm ({shm_size(spec, settings)}) is larger than the pod's memory "
                   f"limit spec.resources.memory ({spec.resources.memory}); memory-backed /dev/shm counts against "
                   f"that limit, so filling it gets the pod OOM-killed; raise memory or lower shmSize")
    if (moe := moe_microbatch_warning(job)) is not None:
        out.append(moe)
    return out


#: Local expert weights per token of a micro-batch above which a MoE job at microBatchSize 1 is warned. Megatron's DDP
#: adds every local expert's bf16 gradient into its fp32 main_grad once per micro-batch, whatever few tokens each
#: expert got. Measured (docs/benchmarks/moe.md, issue 60's levers, 1 x H200): the Qwen3-30B-A3B shape at 8 layers and
#: EP1 holds 4.8 B expert weights, 1.18 M per token at micro-batch 1 x seq 4096; micro-batch 2 (590 k) was 1.44x
#: faster, micro-batch 4 (295 k) 1.68x, with the same global batch.
MOE_EXPERT_WEIGHTS_PER_TOKEN_WARN = 500_000


def moe_microbatch_warning(job: MegatronJob) -> str | None:
    """A MoE job whose local experts' weights per micro-batch token are large, at microBatchSize 1 with more than one
    micro-batch a step: the per-micro-batch gradient accumulation over them dominates the step."""
    spec = job.spec
    if not spec.model.num_experts or spec.training.micro_batch_size != 1:
        return None
    doc = job.model_dump(by_alias=True, exclude_none=True, mode="json")["spec"]
    m, layout = resolved_model(doc), derived_layout(doc)
    if not m.get("numExperts") or (layout.get("numMicrobatches") or 0) < 2:
        return None
    matrices = 3 if m.get("activation") == "swiglu" else 2
    local = m["numExperts"] // layout["expert"]
    weights = m["numLayers"] * local * matrices * m["hiddenSize"] * (m.get("moeFfnHiddenSize") or m["ffnHiddenSize"]) \
        // (layout.get("expertTensor") or 1) // layout["pipeline"]
    per_token = weights / m["seqLength"]
    if per_token < MOE_EXPERT_WEIGHTS_PER_TOKEN_WARN:
        return None
    return (f"spec.training.microBatchSize: 1 with {layout['numMicrobatches']} micro-batches a step: each GPU holds "
            f"{weights / 1e9:.1f} B expert weights ({local} expert{'s' if local != 1 else ''} a layer at spec.parallelism.expert "
            f"{layout['expert']}), whose gradients are accumulated once per micro-batch of {m['seqLength']} tokens; "
            f"a larger microBatchSize (or expert parallelism) pays that fewer times for the same global batch "
            f"(1.68x at 4 on the Qwen3-30B-A3B shape at EP1, docs/benchmarks/moe.md); check the memory with "
            f"`megatron-operator estimate`")


# etcd refuses objects over 1.5 MiB; leave room for the JobSet's status and managedFields.
MAX_JOBSET_BYTES = 1024 * 1024


def size_problems(job: MegatronJob, settings: Settings | None = None) -> list[Problem]:
    """The rendered JobSet must be storable. The spec rule tensor-groups-fit-one-jobset bounds the
    number of replicated jobs; large env values and pod annotations repeat in each of them."""
    size = len(json.dumps(render_jobset(job, settings or Settings(), owner_uid="0" * 36)))
    if size <= MAX_JOBSET_BYTES:
        return []
    return [Problem("spec", f"spec: the JobSet would be {size / 2**20:.1f} MiB, more than the {MAX_JOBSET_BYTES // 2**20} "
                    f"MiB an object may have (etcd stores at most 1.5 MiB); spec.env and spec.podMetadata are "
                    f"repeated in each of its replicated jobs: shorten them (e.g. a ConfigMap through valueFrom) "
                    f"or use tensor <= gpusPerNode (one replicated job)", "jobset-size")]
