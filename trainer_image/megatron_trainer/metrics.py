"""Prometheus metrics of the trainer (served by global rank 0 only: one target per job).

No torch. prometheus-client is a dependency of the trainer image; without it the metrics are a no-op.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

_GAUGES = {
    "iteration": "Completed training iterations.",
    "train_iters": "Iterations the job trains for.",
    "loss": "Last logged language-model loss (last pipeline stage).",
    "tokens_per_second": "Training tokens per second, whole job.",
    "tflops_per_gpu": "Model TFLOP/s per GPU (Megatron-LM 0.19 FLOPs formula).",
    "mfu": "Model FLOPs utilisation: TFLOP/s per GPU over the dense bf16 peak.",
    "checkpoint_save_blocked_seconds": "Seconds the training loop was blocked by the last checkpoint save.",
    "checkpoint_save_seconds": "Seconds from the start of the last save until it was published (async included).",
    "checkpoint_load_seconds": "Seconds the resume load took.",
    "last_checkpoint_iteration": "Iteration of the newest published checkpoint.",
    "restarts": "Gang restarts seen (MEGATRON_RESTART_ATTEMPT).",
    # MoE models (moe.RouterMonitor), over the iterations since the last log line
    "moe_load_balancing_loss": "MoE load-balancing loss over its coefficient, mean over layers and micro-batches.",
    "moe_z_loss": "MoE router z-loss over its coefficient, mean over layers and micro-batches.",
    "moe_expert_load_max_over_mean": "MoE: the busiest expert's tokens over the mean, in the most imbalanced layer "
                                     "(1 = balanced; top-k x experts / k when one expert takes every token).",
    "moe_idle_experts": "MoE: (layer, expert) pairs routed no token.",
    "moe_expert_token_share": "MoE: share of all routed tokens that went to the expert (label expert), over the layers.",
}
#: The label names of the gauges that have labels.
_LABELS = {"moe_expert_token_share": ("expert",)}


class Metrics:
    """Named gauges; `set(name, value)` is a no-op when disabled."""

    def __init__(self, port: int, enabled: bool):
        self._gauges = {}
        self.port = None
        if not enabled or port <= 0:
            return
        try:
            from prometheus_client import CollectorRegistry, Gauge, start_http_server
        except ImportError:
            log.warning("prometheus-client is not installed: metrics disabled")
            return
        registry = CollectorRegistry()
        for name, doc in _GAUGES.items():
            self._gauges[name] = Gauge(f"megatron_trainer_{name}", doc, _LABELS.get(name, ()), registry=registry)
        try:
            start_http_server(port, registry=registry)
            self.port = port
        except OSError as e:
            log.warning("metrics: cannot listen on port %d: %s", port, e)
            self._gauges = {}

    def set(self, name: str, value: float | None, **labels: str) -> None:
        gauge = self._gauges.get(name)
        if gauge is not None and value is not None:
            (gauge.labels(**labels) if labels else gauge).set(value)
