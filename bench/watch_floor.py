#!/usr/bin/env python3
"""The least that watching the operator's three resources costs in Python: a floor for the operator's CPU per
watch event (issue 30; a benchmark helper, not part of the operator).

Opens the operator's three watches: MegatronJobs in every namespace, and JobSets and pods with the operator's
label selector (names.MANAGED_SELECTOR). It uses aiohttp, kopf's HTTP client, decodes each event line with
json.loads, and keeps per-job indexes as the operator's index functions do: metadata without managedFields,
plus the spec and status of a job, a JobSet's status, and the operator's own `PodView` of a pod. No kopf, no
handlers, no status writes.

`bench/operator_latency.py --watch-floor` runs it beside the operator during the `ours` bursts. Each SIGUSR1
makes it write `{"events": {resource: n}, "cpu_s": s}` to --out (events received and its own CPU so far), so
the benchmark reads both at the start and the end of its window; it writes one reading at start-up, once it
handles SIGUSR1. SIGTERM ends it.

    python bench/watch_floor.py --kubeconfig <run dir>/kubeconfig --out <file>
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import ssl
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import kubernetes

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "operator"), str(ROOT / "contract")]

from megatron_operator.names import (  # noqa: E402
    GROUP,
    JOBSET_GROUP,
    JOBSET_PLURAL,
    JOBSET_VERSION,
    LABEL_JOB_NAME,
    MANAGED_SELECTOR,
    PLURAL,
    VERSION,
)
from megatron_operator.status import PodView  # noqa: E402

# resource -> (path, label selector)
WATCHES = {
    "megatronjobs": (f"/apis/{GROUP}/{VERSION}/{PLURAL}", None),
    "jobsets": (f"/apis/{JOBSET_GROUP}/{JOBSET_VERSION}/{JOBSET_PLURAL}", MANAGED_SELECTOR),
    "pods": ("/api/v1/pods", MANAGED_SELECTOR),
}


def slim(metadata: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in metadata.items() if k != "managedFields"}


def index_entry(resource: str, obj: dict[str, Any]) -> tuple[tuple[str, str], Any]:
    meta = obj.get("metadata") or {}
    ns = meta.get("namespace", "")
    if resource == "megatronjobs":
        return (ns, meta.get("name")), {"metadata": slim(meta), "spec": dict(obj.get("spec") or {}),
                                        "status": dict(obj.get("status") or {})}
    if resource == "jobsets":
        return (ns, meta.get("name")), {"metadata": slim(meta), "status": dict(obj.get("status") or {})}
    return (ns, (meta.get("labels") or {}).get(LABEL_JOB_NAME)), PodView.from_pod(obj)


class WatchFloor:
    def __init__(self, kubeconfig: str):
        loader = kubernetes.config.kube_config._get_kube_config_loader(filename=kubeconfig)
        config = kubernetes.client.Configuration()
        loader.load_and_set(config)
        self.host = config.host
        self.ssl = ssl.create_default_context(cafile=config.ssl_ca_cert)
        if config.cert_file:
            self.ssl.load_cert_chain(config.cert_file, config.key_file)
        token = (config.api_key or {}).get("authorization")
        self.headers = {"Authorization": token} if token else {}
        self.events = {name: 0 for name in WATCHES}
        self.indexes: dict[str, dict] = {name: {} for name in WATCHES}

    async def watch(self, session: aiohttp.ClientSession, resource: str) -> None:
        path, selector = WATCHES[resource]
        params = {"watch": "true", "allowWatchBookmarks": "false", "timeoutSeconds": "3600"}
        if selector:
            params["labelSelector"] = selector
        while True:
            async with session.get(self.host + path, params=params, ssl=self.ssl, headers=self.headers,
                                   timeout=aiohttp.ClientTimeout(total=None, sock_read=None)) as resp:
                resp.raise_for_status()
                async for line in resp.content:
                    if not line.strip():
                        continue
                    event = json.loads(line)
                    obj = event.get("object") or {}
                    if event.get("type") == "ERROR":
                        break
                    self.events[resource] += 1
                    key, entry = index_entry(resource, obj)
                    if event.get("type") == "DELETED":
                        self.indexes[resource].pop(key, None)
                    else:
                        self.indexes[resource][key] = entry

    async def run(self) -> None:
        async with aiohttp.ClientSession() as session:
            await asyncio.gather(*(self.watch(session, r) for r in WATCHES))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kubeconfig", required=True)
    ap.add_argument("--out", required=True, help="written on each SIGUSR1: events received and CPU seconds so far")
    args = ap.parse_args()
    floor = WatchFloor(args.kubeconfig)
    out = Path(args.out)

    def report() -> None:
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps({"events": dict(floor.events), "cpu_s": time.process_time(), "pid": os.getpid()}))
        tmp.replace(out)

    loop = asyncio.new_event_loop()
    loop.add_signal_handler(signal.SIGUSR1, report)
    task = loop.create_task(floor.run())
    loop.add_signal_handler(signal.SIGTERM, task.cancel)
    report()  # the first reading says that SIGUSR1 is handled from now on
    try:
        loop.run_until_complete(task)
    except asyncio.CancelledError:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
