"""Why a trainer pod failed, and which failures end the job at once (pure).

The trainer exits with a code of its own for failures a restart cannot fix (docs/trainer-contract.md,
"Exit codes"; the trainer's ``exitcodes.py`` holds the same table, checked by tests/test_contract.py).
The renderer turns them into failure-policy rules:

- each pod's Job: ``podFailurePolicy`` ``onExitCodes`` -> ``FailJob``. The Job controller then fails
  the Job with reason ``PodFailurePolicy`` and the message "Container trainer for pod NS/POD failed
  with exit code N matching FailJob rule at index I" (pkg/controller/job/pod_failure_policy.go);
- the JobSet: a ``FailJobSet`` rule on that reason *and* that message (``onJobFailureMessagePatterns``,
  JobSet >= 0.10), placed before the rule that restarts the gang for evictions (whose Job message says
  "has condition DisruptionTarget").

``PodFailure.from_pod`` reads what a failed pod left: its node, the container's exit code, reason
(OOMKilled, Error, ...) and termination message (the trainer's fatal error, or the log's last lines:
``terminationMessagePolicy: FallbackToLogsOnError``). The status keeps the latest one as
``status.lastFailure``, so it survives the gang's recreation.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

#: Exit code -> what it means. Keep in step with trainer_image/megatron_trainer/exitcodes.py.
NON_RETRIABLE_EXIT_CODES: dict[int, str] = {
    2: "bad command line or environment",
    3: "bad training data or tokenizer",
    4: "CUDA out of memory before the first iteration",
    5: "checkpoint cannot be resumed",
    7: "the object store refuses the checkpoint location (no such bucket, bad credentials, access denied)",
    8: "the checkpoint volume is full",
}
#: Exit codes that blame the node: retried, on another node (the node goes to status.avoidedNodes).
NODE_FAULT_EXIT_CODES: dict[int, str] = {
    6: "GPU hardware fault (uncorrectable ECC, NVLink, GPU lost) on this node",
}
#: DisruptionTarget reasons that blame the node: the taint manager evicted the pod for a NoExecute
#: taint (node not ready or unreachable), or the pod garbage collector deleted it with its node.
NODE_FAULT_DISRUPTIONS: dict[str, str] = {
    "DeletionByTaintManager": "node not ready or unreachable (NoExecute taint)",
    "DeletionByPodGC": "node gone",
}
#: A peer NCCL names in its error (kept in the trainer's termination message through torch's "Last
#: error:"): ncclSocketToString's "ADDRESS<PORT>" after "peer", e.g. NET/IB's "Got completion from
#: peer 10.4.0.7<43617> with status=12" or the socket transport's "Connection closed by remote peer
#: 10.4.0.7<43617>".
NCCL_PEER_RE = re.compile(r"\bpeer \[?([0-9A-Fa-f.:]+?)\]?<\d+>")
#: The name of the JobSet failure-policy rule that fails the JobSet on those codes ...
FAIL_RULE_NAME = "nonRetriableExitCode"
#: ... and the Job failure message it matches (RE2, anchored nowhere: the Job controller's wording).
FAIL_MESSAGE_PATTERN = "failed with exit code [0-9]+ matching FailJob rule"
#: JobSet's condition reason when a FailJobSet rule fired (sigs.k8s.io/jobset pkg/constants).
JOBSET_FAIL_ACTION_REASON = "FailJobSetFailurePolicyAction"
#: Characters of the termination message kept in the status and events.
MAX_LAST_LINES = 2000


@dataclass(frozen=True)
class PodFailure:
    """What one failed trainer container left behind."""

    pod: str
    node: str | None
    exit_code: int | None
    reason: str | None  # the container's terminated reason: Error, OOMKilled, ...
    message: str | None  # termination message: the trainer's fatal error or the log's last lines
    finished_at: str | None
    restart_attempt: int | None = None
    disruption: str | None = None  # DisruptionTarget "reason: message": evicted, preempted, node lost

    @property
    def retriable(self) -> bool:
        return self.exit_code not in NON_RETRIABLE_EXIT_CODES

    @property
    def node_fault(self) -> str | None:
        """Why this failure is the node's, not the job's (None: it is not): later attempts avoid the node."""
        if not self.node:
            return None
        if self.exit_code in NODE_FAULT_EXIT_CODES:
            return NODE_FAULT_EXIT_CODES[self.exit_code]
        if self.disruption:
            return NODE_FAULT_DISRUPTIONS.get(self.disruption.split(":", 1)[0])
        return None

    @classmethod
    def from_pod(cls, pod: dict[str, Any], container: str, restart_attempt: int | None) -> PodFailure | None:
        """The failure of ``container`` in a Failed pod; None when the pod did not fail."""
        status = pod.get("status") or {}
        if status.get("phase") != "Failed":
            return None
        term = None
        for cs in status.get("containerStatuses") or []:
            if cs.get("name") == container:
                term = (cs.get("state") or {}).get("terminated") or (cs.get("lastState") or {}).get("terminated")
        term = term or {}
        message = (term.get("message") or status.get("message") or "").strip()
        target = next((c for c in status.get("conditions") or []
                       if c.get("type") == "DisruptionTarget" and c.get("status") == "True"), None)
        return cls(
            pod=(pod.get("metadata") or {}).get("name", ""),
            node=(pod.get("spec") or {}).get("nodeName"),
            exit_code=term.get("exitCode"),
            reason=term.get("reason") or status.get("reason"),
            message=message[-MAX_LAST_LINES:] or None,
            finished_at=term.get("finishedAt"),
            restart_attempt=restart_attempt,
            disruption=f"{target.get('reason')}: {target.get('message')}" if target else None,
        )

    def nccl_peers(self) -> list[str]:
        """The peer addresses an NCCL error in the termination message names (first seen first)."""
        found: list[str] = []
        for addr in NCCL_PEER_RE.findall(self.message or ""):
            if addr not in found:
                found.append(addr)
        return found

    def meaning(self) -> str:
        if self.exit_code in NON_RETRIABLE_EXIT_CODES:
            return NON_RETRIABLE_EXIT_CODES[self.exit_code]
        if self.exit_code in NODE_FAULT_EXIT_CODES:
            return NODE_FAULT_EXIT_CODES[self.exit_code]
        if self.reason == "OOMKilled":
            return "killed for exceeding its memory limit"
        if self.exit_code is not None and self.exit_code > 128:
            return f"killed by signal {self.exit_code - 128}"
        return "error"

    def summary(self) -> str:
        """One line: pod, node, code and reason (the message follows in the status and event)."""
        where = f"pod {self.pod}" + (f" on node {self.node}" if self.node else "")
        code = f"exit code {self.exit_code}" if self.exit_code is not None else "no exit code"
        reason = f", {self.reason}" if self.reason else ""
        action = "not retried" if not self.retriable else "retried"
        if self.disruption:
            return f"{where} was disrupted ({self.disruption}): {code}{reason} (retried, not counted)"
        return f"{where} failed: {code}{reason} ({self.meaning()}; {action})"

    def describe(self) -> str:
        """The summary and the last lines the container left."""
        return self.summary() + (f":\n{self.message}" if self.message else "")

    def wire(self) -> dict[str, Any]:
        """``status.lastFailure`` (camelCase, unset fields left out)."""
        out = {"pod": self.pod, "node": self.node, "exitCode": self.exit_code, "reason": self.reason,
               "retriable": self.retriable, "message": self.message, "time": self.finished_at,
               "restartAttempt": self.restart_attempt, "disruption": self.disruption}
        return {k: v for k, v in out.items() if v is not None}

