"""Warnings: specs the API server admits and that may still not run as meant (pure).

Not refusals: whether a node with enough GPUs exists, or whether the memory limit is meant to hold
/dev/shm, depends on the cluster. ``megatron-operator validate`` prints them; the operator emits
each as a Warning event when it creates the job's children.
"""

from __future__ import annotations

import json
import re

from .render import render_jobset, shm_size
from .rules import Problem
from .settings import Settings
from .spec import MegatronJob

_SUFFIX = {"": 1, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15,
           "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50}
_QUANTITY = re.compile(r"([0-9]+(?:\.[0-9]+)?)(m|k|Ki|M|Mi|G|Gi|T|Ti|P|Pi)?")


def quantity_bytes(value: int | str) -> float | None:
    """A Kubernetes quantity as a number (bytes for memory); None if it is not one."""
    if isinstance(value, int):
        return float(value)
    m = _QUANTITY.fullmatch(value)
    return float(m.group(1)) * _SUFFIX[m.group(2) or ""] if m else None


def spec_warnings(job: MegatronJob, settings: Settings | None = None) -> list[str]:
    settings = settings or Settings()
    spec = job.spec
    out: list[str] = []
    tp, gpn = spec.parallelism.tensor, spec.gpus_per_node
    if tp > gpn:
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
