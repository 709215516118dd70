#!/usr/bin/env python3
"""Where kube-apiserver's CPU goes during a burst: its own Go CPU profile, cut into categories (issue 30).

Issue 30 asks, where a target is missed, for the remaining difference as a measured fact. The API server is
most of it (docs/benchmarks/operator-latency.md#2026-11-25-start-up-cost): ours costs it 130-142 ms of CPU per
job against the peer's 72-92. Request
counts and per-request costs (crd_write_cost.py) explain part of it; this module measures the rest where it
happens. `operator_latency.py --apiserver-profile DIR` records kube-apiserver's `/debug/pprof/profile` in
5 s pieces from the first create until the burst settled, merges them (`go tool pprof -proto`) into
`DIR/<system>-<jobs>.pb.gz`, and stores `breakdown()`'s figures in the burst's result.

Each sample's stack is read from the leaf towards the root. It belongs to the first frame that names a
subsystem (CEL, managed fields, the CRD schema's validation, the watch cache with the encoding of watch
events, etcd's storage layer with the decoding of stored objects, admission, authorization, authentication,
audit, the /metrics page); a stack with none of them is counted by the kind of work
at its leaf (JSON, protobuf, gRPC, compression, TLS and HTTP, the garbage collector, other). The request
filters that wrap every request (authentication, authorization, tracing) name no subsystem: only the
authenticator and authorizer themselves do. So "CEL" includes the JSON
conversions and allocations CEL makes, and "JSON" is the JSON work no named subsystem asked for.

    .venv/bin/python bench/apiserver_profile.py DIR/ours-100.pb.gz DIR/peer-100.pb.gz --jobs 100
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

#: Subsystems, looked for from the leaf towards the root: the first frame that matches names the sample.
SUBSYSTEMS: tuple[tuple[str, str], ...] = (
    ("CEL", r"github\.com/google/cel-go|k8s\.io/apiserver/pkg/cel|/schema/cel\b|/schema/cel\.|validation\.celValidator"),
    ("managed fields", r"sigs\.k8s\.io/structured-merge-diff|/util/managedfields|/endpoints/handlers/fieldmanager"),
    ("CRD schema validation, pruning, defaulting",
     r"k8s\.io/kube-openapi/pkg/validation|apiextensions-apiserver/pkg/apiserver/schema|"
     r"apiextensions-apiserver/pkg/apiserver/validation"),
    ("watch cache and watch dispatch", r"k8s\.io/apiserver/pkg/storage/cacher"),
    ("etcd storage layer", r"k8s\.io/apiserver/pkg/storage/etcd3|go\.etcd\.io/etcd"),
    ("admission", r"k8s\.io/apiserver/pkg/admission|k8s\.io/kubernetes/plugin/pkg/admission"),
    ("authorization", r"k8s\.io/apiserver/pkg/authorization|plugin/pkg/auth/authorizer|/authorizer/rbac"),
    ("authentication", r"k8s\.io/apiserver/pkg/authentication|crypto/x509"),
    ("audit", r"k8s\.io/apiserver/pkg/audit"),
    # The benchmark reads the API server's /metrics before and after each window (and every 3 s while it
    # waits for the writes to settle): the text encoding and gzip of that page are the benchmark's own cost.
    ("/metrics page (the benchmark's own readings)",
     r"prometheus/client_golang/prometheus/promhttp|prometheus/common/expfmt|component-base/metrics\.HandlerWithReset"),
)
#: Kinds of work at the leaf, for stacks no subsystem claimed.
KINDS: tuple[tuple[str, str], ...] = (
    ("JSON", r"encoding/json|sigs\.k8s\.io/json|json-iterator|serializer/json|unstructured\.|utiljson"),
    ("protobuf", r"gogo/protobuf|google\.golang\.org/protobuf|serializer/protobuf|"
                 r"k8s\.io/api/.*\.(Marshal|Unmarshal|Size)|k8s\.io/apimachinery/pkg/apis/meta/v1\.\(.*\)\.(Marshal|Unmarshal|Size)"),
    ("gRPC", r"google\.golang\.org/grpc"),
    ("compression", r"^compress/"),
    ("TLS, HTTP", r"^crypto/|^net/http|golang\.org/x/net/http2|^net\.|^internal/poll|^syscall"),
    ("garbage collector", r"^runtime\.(gcBgMarkWorker|bgsweep|bgscavenge|gcDrain|markroot|scanobject|gcAssistAlloc)"),
)
CATEGORIES = tuple(c for c, _ in SUBSYSTEMS) + tuple(c for c, _ in KINDS) + ("other",)
_SUB = [(c, re.compile(p)) for c, p in SUBSYSTEMS]
_KIND = [(c, re.compile(p)) for c, p in KINDS]
_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_VALUE = re.compile(r"^\s*([0-9.]+)(ns|us|µs|ms|s|m|h)\s+(\S.*)$")
PIECE_S = 5  # seconds per /debug/pprof/profile request


def parse_traces(text: str) -> list[tuple[float, list[str]]]:
    """`go tool pprof -traces` output -> [(seconds, [leaf frame, ..., root frame])]."""
    samples: list[tuple[float, list[str]]] = []
    frames: list[str] = []
    value = None
    for line in text.splitlines():
        if line.startswith("-----------+"):
            if value is not None and frames:
                samples.append((value, frames))
            frames, value = [], None
            continue
        m = _VALUE.match(line)
        if m and value is None and not frames:
            value = float(m.group(1)) * _UNITS[m.group(2)]
            frames.append(m.group(3).strip())
        elif value is not None and line.strip():
            frames.append(line.strip())
    if value is not None and frames:
        samples.append((value, frames))
    return samples


def categorize(frames: list[str]) -> str:
    """The category of one stack (leaf first); see the module's docstring."""
    for kinds in (_SUB, _KIND):  # a runtime leaf (malloc, memmove) counts for the work that called it
        for frame in frames:
            for name, rx in kinds:
                if rx.search(frame):
                    return name
    return "other"


def breakdown(samples: list[tuple[float, list[str]]]) -> dict[str, float]:
    """CPU seconds per category."""
    out = dict.fromkeys(CATEGORIES, 0.0)
    for seconds, frames in samples:
        out[categorize(frames)] += seconds
    return out


def go_binary() -> str:
    go = shutil.which("go")
    if not go:
        raise SystemExit("apiserver_profile.py: `go` (for `go tool pprof`) is not on PATH")
    return go


def profile_breakdown(path: Path) -> dict[str, float]:
    proc = subprocess.run([go_binary(), "tool", "pprof", "-traces", str(path)], capture_output=True, text=True,
                          check=False, timeout=600)
    if proc.returncode != 0:
        raise RuntimeError(f"go tool pprof -traces {path} failed (rc={proc.returncode}): {proc.stderr[-500:]}")
    return breakdown(parse_traces(proc.stdout))


class Recorder:
    """kube-apiserver's CPU profile over a window, in PIECE_S pieces (the endpoint answers after `seconds`),
    merged into one file when stopped."""

    def __init__(self, kubectl: list[str], out: Path):
        self.kubectl = kubectl  # the kubectl command line with its --kubeconfig
        self.out = out
        self.pieces: list[Path] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def start(self) -> None:
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            piece = self.out.with_name(f"{self.out.name}.piece{len(self.pieces):03d}")
            with open(piece, "wb") as f:
                proc = subprocess.run([*self.kubectl, "get", "--raw", f"/debug/pprof/profile?seconds={PIECE_S}"],
                                      stdout=f, stderr=subprocess.PIPE, check=False, timeout=PIECE_S + 60)
            if proc.returncode == 0 and piece.stat().st_size:
                self.pieces.append(piece)
            else:
                self.errors.append(proc.stderr.decode(errors="replace")[-300:])
                piece.unlink(missing_ok=True)
                time.sleep(1)

    def stop(self) -> Path | None:
        """Wait for the piece in flight, merge the pieces into `out` (None when there were none)."""
        self._stop.set()
        self._thread.join(timeout=PIECE_S + 90)
        if not self.pieces:
            return None
        with open(self.out, "wb") as f:
            proc = subprocess.run([go_binary(), "tool", "pprof", "-proto", *map(str, self.pieces)], stdout=f,
                                  stderr=subprocess.PIPE, check=False, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"merging {len(self.pieces)} profiles failed: {proc.stderr.decode()[-500:]}")
        for p in self.pieces:
            p.unlink(missing_ok=True)
        return self.out


def table(rows: dict[str, dict[str, float]], jobs: int) -> str:
    """Markdown: categories x profiles, in ms of CPU per job."""
    names = list(rows)
    lines = [f"| category (ms per job) | {' | '.join(names)} |", "|---|" + "---|" * len(names)]
    for cat in CATEGORIES:
        if any(rows[n][cat] for n in names):
            lines.append(f"| {cat} | " + " | ".join(f"{1000 * rows[n][cat] / jobs:.1f}" for n in names) + " |")
    lines.append("| total | " + " | ".join(f"**{1000 * sum(rows[n].values()) / jobs:.1f}**" for n in names) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("profiles", nargs="+", help="merged kube-apiserver CPU profiles (.pb.gz)")
    ap.add_argument("--jobs", type=int, required=True, help="jobs in each profile's burst (for ms per job)")
    args = ap.parse_args()
    rows = {Path(p).name.removesuffix(".pb.gz"): profile_breakdown(Path(p)) for p in args.profiles}
    print(table(rows, args.jobs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
