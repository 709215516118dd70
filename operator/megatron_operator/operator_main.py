"""``megatron-operator run``: check the cluster, then hand over to kopf."""

from __future__ import annotations

import argparse
import logging
import os
import sys

#: Threads that write job statuses (controller.StatusWriter). Few on purpose: in a burst, statuses
#: queue and coalesce instead of crowding out the JobSet controller's and the scheduler's requests.
STATUS_WRITE_THREADS = 2


def run_operator(args: argparse.Namespace) -> int:
    if args.kubeconfig:
        os.environ["KUBECONFIG"] = args.kubeconfig  # kopf's own login reads only the environment

    from .settings import Settings

    try:
        settings = Settings.from_env(metrics_port=args.metrics_port,
                                     namespaces=",".join(args.namespace) if args.namespace else None)
    except ValueError as exc:
        print(f"megatron-operator: bad setting: {exc}", file=sys.stderr)
        return 2

    import kopf
    from kubernetes.config import ConfigException

    from .controller import Controller
    from .kube import Kube, TransientError, load_config
    from .metrics import Metrics

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    metrics = Metrics()
    try:
        kube = Kube(load_config(args.kubeconfig), on_request=metrics.api_request)
        missing = kube.missing_apis()
    except (ConfigException, FileNotFoundError) as exc:
        print(f"megatron-operator: no cluster configuration: {exc}", file=sys.stderr)
        return 1
    except TransientError as exc:
        print(f"megatron-operator: cannot reach the API server: {exc}", file=sys.stderr)
        return 1
    if missing:
        for m in missing:
            print(f"megatron-operator: missing {m}", file=sys.stderr)
        print("megatron-operator: install JobSet (https://jobset.sigs.k8s.io) and the MegatronJob CRD "
              "(helm install ... --set crds.enabled=true, or kubectl apply --server-side -f crds/) first",
              file=sys.stderr)
        return 1

    from . import handlers  # noqa: F401  (registers the handlers)

    memo = kopf.Memo(controller=Controller(kube, settings, metrics, status_threads=STATUS_WRITE_THREADS),
                     metrics_port=settings.metrics_port,
                     metrics_host=settings.metrics_host)
    namespaces = settings.watched_namespaces()
    try:
        kopf.run(
            clusterwide=not namespaces,
            namespaces=namespaces,
            standalone=True,  # one active operator, no peering objects (docs/operations.md)
            memo=memo,
        )
    except Exception:
        # A watched API that goes away (JobSet uninstalled, its CRD deleted and re-created) ends
        # kopf's watch with a 404. Exit with the reason, so that the Deployment restarts the
        # operator; at start-up it refuses to run until the API is back (above).
        gone = _missing_apis(kube)
        if not gone:
            raise
        for m in gone:
            print(f"megatron-operator: {m} went away while the operator ran; exiting (restarted by its "
                  f"Deployment, it waits for the API to come back)", file=sys.stderr)
        return 1
    return 0


def _missing_apis(kube) -> list[str]:
    try:
        return kube.missing_apis()
    except Exception:  # the API server itself is unreachable: not this case
        return []
