"""Warnings: specs the API server admits and that may still not run as meant (pure).

Not refusals: whether a node with enough GPUs exists, or whether the memory limit is meant to hold
/dev/shm, depends on the cluster. ``megatron-operator validate`` prints them; the operator emits
each as a Warning event when it creates the job's children.
"""

from __future__ import annotations

import json

from .render import render_jobset, shm_size
from .rules import Problem
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
    return out


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
