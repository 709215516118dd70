#!/usr/bin/env python3
"""GPU end-to-end suite for the trainer: one command per device call, any GPU count.

    python3 e2e/gpu/suite.py --out $OUT --gpus 2 --only layouts,resume,sigterm,bench,memory

Scenarios (each launches `torchrun ... -m megatron_trainer <Megatron-LM flags>`; pods, preempt and
tensorboard run the rendered pods' own command, `python -m megatron_trainer.launch ...`):
  probe      torch/torchrun facts (SIGTERM forwarding and its SIGKILL timeout), Megatron-LM's own
             parser on a rendered command line, SDPA backends vs unfused attention
  indexed    preprocess JSONL -> .bin/.idx (no torch), read back with Megatron's IndexedDataset
  layouts    train with TP=N, PP=N, DP=N (N = --gpus; for 8 GPUs also TP2xPP2xDP2): loss falls.
             The DP layout trains on the preprocessed real data (HF tokenizer, blend of two prefixes)
  resume     kill -9 a rank mid-run, restart: resumes from the last checkpoint, later losses match
             the uninterrupted run
  sigterm    SIGTERM to torchrun: all ranks agree, checkpoint, exit 0; restart resumes from it
  reshard    resume a TP=N checkpoint under PP=N and DP=N (optimizer saved fully reshardable)
  bench      GPT 1.35B vs ../shared/bench/mcore_peer.py and, when .run/mlm is carried, Megatron-LM's
             pretrain_gpt.py (same model, same call): tokens/s/GPU,
             MFU (the peer's formula for both), peak memory, blocked time per async save, kill -9
             during an async save -> the previous complete checkpoint is used, start -> first
             resumed iteration
  memory     peak memory of many configurations (calibration data for the memory estimator)
  pods       issue 13: `megatron-operator render` on e2e/gpu/jobs (3 jobs); every pod's command and env
             verbatim, as uid 1000 in its own mount namespace (e2e/gpu/pods.py); SIGTERM past the
             checkpoint of 10 -> checkpoint, exit 0 -> restart resumes, trains to the end, exit 0
  preempt    issue 13: a rendered pod whose final save takes > 30 s: SIGTERM -> the launcher waits the
             pod's grace period -> complete checkpoint, exit 0 -> restart resumes from it
  tensorboard  issue 17: the pp2 job of `pods` alone (spec.logging.tensorboard): Megatron-LM's scalar
             names read back from the event files with tensorboard's reader, lm loss = the log lines
  deterministic  issue 17: --deterministic-mode at TP, PP, DP = N: kill -9 at 25, resume from 20, losses
             of 21-40 bit-identical to the uninterrupted run
  detcost    issue 17: the speed cost of --deterministic-mode on the benchmark model at TP=N
  threeway   issue 17: ours / Megatron-LM's pretrain_gpt.py (.run/mlm_peer.sh, source in .run/mlm) / the
             guides' loop, one layout per call (--threeway dp1|tp2|dp2|pp2), benchmark model
  hf_logits, hf_train, hf_bench  issue 27: Hugging Face import/export (e2e/gpu/hf.py): logits against
             transformers at TP=1/TP=2/PP=2 in fp32 and bf16 and bit-identical round trips; train 20
             iterations from HF and export, export-only under another layout, resume without the HF
             directory; a Llama-3.2-1B-architecture model: HF start vs torch_dist resume, RSS, export time
  sft_reverse, sft_bench  issue 28: supervised fine-tuning (e2e/gpu/sft.py): a tiny HF Llama fine-tuned on
             digit-reversal conversations, exported, transformers `generate` >= 90 % exact on held-out
             prompts, the validation loss = transformers' answer-only loss; pretraining vs SFT padded vs
             SFT packed throughput on a Llama-3.2-1B-shaped model; sft_pods: e2e/gpu/jobs/sft-tiny.yaml's
             rendered pods verbatim (SIGTERM, resume, export)
  objbench   issue 33: the same model saving every 10 iterations to local disk and to the object store
             (--object-store): blocked time per async save, time to publish, bytes/s
  collectives  issue 29: the TP=2 collectives of Llama-3-8B timed alone (e2e/gpu/collectives.py), with
             NCCL's protocol choice (its log kept) and with each NCCL_PROTO forced
  rope       issue 29: Megatron's unfused RoPE on one GPU, eager against torch.compile with and without
             Inductor's emulate_precision_casts: differing elements (output, input gradient) and time
             (bench/rope_numerics.py; needs only megatron-core)
  stepdump   issue 29: Megatron-LM's pretrain_gpt.py and ours run as it runs (threeway's `mlmlike`) with
             a digest of every weight, gradient and updated parameter at the first optimizer steps
             (e2e/gpu/stepdump.py): the first tensor where the two programs differ (--stepdump dp1:llama1b)
  perf       ours at TP=N under performance variants (PERF_VARIANTS) and the peer: iteration time,
             MFU ratio, optional torch.profiler traces; the variants' first losses must agree

--object-store: checkpoints of layouts/resume/sigterm/deterministic go to an S3 server on loopback
(versitygw, .run/versitygw.gz, built by `e2e/cluster/cluster.py build versitygw`) through
multi-storage-client (its wheels in .whl), as s3://suite/<run>; credentials from a shared-credentials
file (AWS_SHARED_CREDENTIALS_FILE), as in the pods (docs/object-storage.md).

Results: $OUT/results.json, $OUT/table.txt, $OUT/logs.tar.gz. A compact table is printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tarfile
import threading
import time
import traceback
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "trainer_image"))  # megatron_trainer's torch-free helpers (flops, ckpt_layout, config)
sys.path.insert(0, str(Path(__file__).resolve().parent))  # pods.py
ITER_RE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?elapsed time per iteration \(ms\): ([0-9.]+).*?"
                     r"lm loss: ([0-9.E+-]+).*?mem GiB \(alloc/peak\): ([0-9.]+)/([0-9.]+)")
SCHEDULED_RE = re.compile(r"async save of iteration (\d+) scheduled \(loop blocked ([0-9.]+) s, of which ([0-9.]+) s")
RESUMED_RE = re.compile(r"resumed from (\S+) \(iteration (\d+), ([^,]+)")
STOPPING_RE = re.compile(r"stopping at iteration (\d+) \((\w[\w-]*)\)")
STARTUP_RE = re.compile(r"process start -> first (?:resumed )?iteration done: ([0-9.]+) s")
PEER_RE = re.compile(r"RESULT iter_ms=([0-9.]+) tok/s/gpu=([0-9.]+) MFU=([0-9.]+)% peak_mem_GiB=([0-9.]+)")
PEER_CKPT_RE = re.compile(r"ckpt save ([0-9.]+)s load ([0-9.]+)s")

# Model shapes. "gpt1b" is the benchmark model: the peer's GPTModel defaults (LayerNorm, GeLU 4h MLP,
# biases, learned positions, untied output layer).
MODELS = {
    "small": dict(layers=8, hidden=512, heads=8, ffn=2048, seq=512, vocab=8192, mbs=4),
    "gpt1b": dict(layers=24, hidden=2048, heads=16, ffn=8192, seq=2048, vocab=32768, mbs=4),
    "mem_s4k": dict(layers=12, hidden=1536, heads=12, ffn=6144, seq=4096, vocab=32768, mbs=4),
    # 7B-class, same architecture family as the peer's model (so the peer runs it too): issue 8's scale run.
    "gpt7b": dict(layers=32, hidden=4096, heads=32, ffn=16384, seq=2048, vocab=32768, mbs=1),
    # Llama architecture (issue 29): RMSNorm, SwiGLU, RoPE (base 500k), GQA (8 KV groups), no biases, untied
    # embeddings; sizes of Llama-3.2-1B / -3B / Llama-3-8B (the operator's llama3-8b preset), random weights.
    "llama1b": dict(layers=16, hidden=2048, heads=32, groups=8, ffn=8192, seq=4096, vocab=128256, mbs=1, arch="llama"),
    "llama3b": dict(layers=28, hidden=3072, heads=24, groups=8, ffn=8192, seq=4096, vocab=128256, mbs=1, arch="llama"),
    "llama3b_s2k": dict(layers=28, hidden=3072, heads=24, groups=8, ffn=8192, seq=2048, vocab=128256, mbs=1, accum=4,
                        arch="llama"),  # Megatron-LM's unfused attention at 4096 does not fit one 80 GB GPU
    "llama8b": dict(layers=32, hidden=4096, heads=32, groups=8, ffn=14336, seq=4096, vocab=128256, mbs=1, accum=8,
                    arch="llama"),  # 8 micro-batches of 4096 tokens per step
    "llama8b_s2k": dict(layers=32, hidden=4096, heads=32, groups=8, ffn=14336, seq=2048, vocab=128256, mbs=1,
                        accum=8, arch="llama"),  # what fits 2 x H100 80 GB at TP=2 with Adam and no recompute
    # The small model's size with the Llama architecture: RoPE (compiled, rounded as eager), RMSNorm, SwiGLU and
    # GQA in runs short enough for the deterministic/resume scenarios at every layout in one device call.
    "llama_small": dict(layers=8, hidden=512, heads=8, groups=4, ffn=1408, seq=512, vocab=8192, mbs=4, arch="llama"),
}


def llama_flags(m: dict) -> list[str]:
    """The architecture flags of a Llama model, the same for ours and Megatron-LM's pretrain_gpt.py."""
    if m.get("arch") != "llama":
        return []
    return ["--normalization", "RMSNorm", "--norm-epsilon", "1e-05", "--position-embedding-type", "rope",
            "--rotary-base", "500000", "--swiglu", "--group-query-attention", "--num-query-groups", str(m["groups"]),
            "--disable-bias-linear"]


def throughput_fields(model: str, gbs: int, iter_ms: float, gpus: int) -> dict:
    """MFU (named by its formula, see model_flops) and tokens/s/GPU of one loop's median iteration."""
    from megatron_trainer import flops

    m = MODELS[model]
    thr = flops.throughput(model_flops(model, gbs), gbs * m["seq"], iter_ms / 1000, gpus)
    formula = "megatron" if m.get("arch") == "llama" else "classic"
    return {f"mfu_pct_{formula}": round(100 * thr["mfu"], 2), "tokens_per_s_per_gpu": round(thr["tokens_per_s_per_gpu"])}


def model_flops(model: str, gbs: int) -> float:
    """FLOPs of one iteration: Megatron-LM 0.19's formula (SwiGLU's third matrix, GQA's smaller K/V, the
    causal s^2 term halved) for Llama models; the classic formula (the peers') for the GPT models."""
    from megatron_trainer import flops

    m = MODELS[model]
    if m.get("arch") == "llama":
        return flops.megatron_flops_per_iteration(gbs, m["seq"], m["layers"], m["hidden"], m["heads"], m["groups"],
                                                  m["ffn"], flops.padded_vocab_size(m["vocab"], 128, 1), swiglu=True)
    return flops.classic_flops_per_iteration(gbs, m["seq"], m["layers"], m["hidden"], m["vocab"])

WORK = Path(os.environ.get("SUITE_WORK", "/tmp/suite"))
OURS_EXTRA: list[str] = []  # --ours-extra: appended to every trainer command line
LOGS = WORK / "logs"
DEADLINE = [float("inf")]
# Runs in flight stop this long after --deadline-s at the latest (a hung run once used up a whole
# device call and nothing came back): keep --deadline-s at least a minute under the call's limit.
OVERRUN_S = 30.0


def bounded(timeout: float) -> float:
    """A wait, cut so that no run outlasts the suite's deadline by more than OVERRUN_S."""
    return max(1.0, min(timeout, DEADLINE[0] + OVERRUN_S - time.monotonic()))


def model_args(name: str) -> list[str]:
    m = MODELS[name]
    return ["--num-layers", str(m["layers"]), "--hidden-size", str(m["hidden"]),
            "--num-attention-heads", str(m["heads"]), "--ffn-hidden-size", str(m["ffn"]),
            "--seq-length", str(m["seq"]), "--max-position-embeddings", str(m["seq"]),
            "--vocab-size", str(m["vocab"]), "--normalization", "LayerNorm",
            "--position-embedding-type", "learned_absolute", "--untie-embeddings-and-output-weights", *llama_flags(m)]


# Suite-only marker in a variant's flags: leave out the --sequence-parallel-auto the operator renders at TP > 1.
NO_SP = "--no-sequence-parallel"


def trainer_args(model="small", tp=1, pp=1, mbs=4, gbs=None, iters=40, attn="flash", lr="1e-3",
                 warmup=5, dist_opt=True, extra=(), data=None, save=None, save_interval=None,
                 async_save=True) -> list[str]:
    """A command line shaped like the operator's rendering (docs/trainer-contract.md; the flags that
    change what runs are checked against render.megatron_args in tests/unit/test_gpu_suite_args.py).
    The operator renders --sequence-parallel-auto at TP > 1 by default (spec.parallelism.sequenceParallel
    unset, transformerImpl transformer_engine: on where the trainer runs TE, off on the local path), so
    this does too, unless `extra` holds NO_SP or --sequence-parallel (forced on)."""
    args = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
            "--context-parallel-size", "1", "--expert-model-parallel-size", "1", *model_args(model),
            "--transformer-impl", "transformer_engine", "--attention-backend", attn,
            "--micro-batch-size", str(mbs), "--global-batch-size", str(gbs or mbs),
            "--train-iters", str(iters), "--lr", lr, "--min-lr", f"{float(lr) / 10:g}",
            "--lr-decay-style", "cosine", "--lr-warmup-iters", str(warmup), "--lr-decay-iters", str(iters),
            "--weight-decay", "0.1", "--clip-grad", "1.0", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
            "--bf16", "--seed", "1234", "--log-interval", "1", "--eval-iters", "0"]
    if dist_opt:
        args.append("--use-distributed-optimizer")
    if tp > 1 and NO_SP not in extra and "--sequence-parallel" not in extra:
        args.append("--sequence-parallel-auto")
    extra = [a for a in extra if a != NO_SP]
    if data is None:
        args += ["--mock-data", "--tokenizer-type", "NullTokenizer"]
    else:
        args += ["--data-path", *data["blend"], "--split", "969,30,1", "--tokenizer-type", "HuggingFaceTokenizer",
                 "--tokenizer-model", data["tokenizer"], "--data-cache-path", data["cache"]]
    if save:
        args += ["--save", save, "--load", save, "--save-interval", str(save_interval or iters),
                 "--ckpt-format", "torch_dist", "--exit-signal-handler"]
        if async_save:
            args += ["--async-save", "--use-persistent-ckpt-worker"]
        if save.startswith("s3://"):
            args += ["--object-store-endpoint", STORE["endpoint"], "--object-store-region", "us-east-1"]
    return args + list(extra) + OURS_EXTRA


def free_port() -> int:
    """A free port below Linux's ephemeral range (32768-60999). A port the kernel hands out for port 0 is
    an ephemeral one, and between this check and the trainer's bind an outgoing connection (NCCL,
    gloo, the object store's client) can take it: the metrics port was "already in use" once (2 x H200,
    2026-11-26)."""
    import random

    for _ in range(200):
        port = random.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-31999")


class Run:
    """One torchrun launch with its log; helpers to wait for log lines, signal and parse."""

    def __init__(self, name: str, nproc: int, args: list[str], env: dict | None = None, gpus: str | None = None,
                 module: bool = True, script: str | None = None):
        self.name = name
        self.log_path = LOGS / f"{name}.log"
        LOGS.mkdir(parents=True, exist_ok=True)
        target = ["-m", "megatron_trainer"] if module else [script]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc-per-node={nproc}",
               "--max-restarts=0", f"--master-port={free_port()}", *target, *args]
        full_env = dict(os.environ, PYTHONUNBUFFERED="1", MEGATRON_METRICS_PORT="0")
        if gpus is not None:
            full_env["CUDA_VISIBLE_DEVICES"] = gpus
        full_env.update(env or {})
        self._log = open(self.log_path, "w")
        self._log.write("$ " + " ".join(cmd) + "\n")
        self._log.flush()
        self.started = time.monotonic()
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO, env=full_env,
                                     start_new_session=True)

    def text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for(self, pattern: re.Pattern, timeout: float):
        end = time.monotonic() + bounded(timeout)
        while time.monotonic() < end:
            m = pattern.search(self.text())
            if m:
                return m
            if self.proc.poll() is not None:
                return pattern.search(self.text())
            time.sleep(0.05)
        return None

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(bounded(timeout))
        except subprocess.TimeoutExpired:
            self.kill_tree()
            return -999

    def _tree(self):
        import psutil

        try:
            return [psutil.Process(self.proc.pid)] + psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def worker(self, rank: int):
        """The rank's process: a direct child of the torchrun agent (its own children are helpers)."""
        import psutil

        try:
            children = psutil.Process(self.proc.pid).children()
        except psutil.NoSuchProcess:
            return None
        for p in children:
            try:
                if p.environ().get("RANK") == str(rank):
                    return p
            except Exception:
                continue
        return None

    def kill_rank(self, rank: int) -> bool:
        p = self.worker(rank)
        if p is None:
            return False
        p.send_signal(signal.SIGKILL)
        return True

    def kill_tree(self) -> None:
        for p in reversed(self._tree()):
            try:
                p.send_signal(signal.SIGKILL)
            except Exception:
                pass

    def sigterm(self) -> None:
        os.kill(self.proc.pid, signal.SIGTERM)  # the agent: what the kubelet signals in the pod

    def close(self) -> None:
        self._log.close()

    # parsing
    def losses(self) -> dict[int, float]:
        return {int(m.group(1)): float(m.group(3)) for m in ITER_RE.finditer(self.text())}

    def iteration_ms(self) -> dict[int, float]:
        return {int(m.group(1)): float(m.group(2)) for m in ITER_RE.finditer(self.text())}

    def summary(self) -> dict | None:
        found = trainer_summaries(self.text())
        return found[-1] if found else None


def trainer_summaries(text: str) -> list[dict]:
    """Every TRAINER_SUMMARY object in a log, in order, also where two ranks' lines ran together."""
    found, decoder = [], json.JSONDecoder()
    for part in text.split("TRAINER_SUMMARY ")[1:]:
        try:
            found.append(decoder.raw_decode(part)[0])
        except ValueError:
            continue
    return found


def check(cond: bool, what: str, failures: list[str]) -> None:
    if not cond:
        failures.append(what)


def loss_falls(losses: dict[int, float], margin: float = 0.3) -> bool:
    its = sorted(losses)
    if len(its) < 10:
        return False
    first = statistics.mean(losses[i] for i in its[:5])
    last = statistics.mean(losses[i] for i in its[-5:])
    return last < first - margin


def compare(ref: dict[int, float], got: dict[int, float], start: int, rel_tol: float) -> dict:
    common = [i for i in sorted(got) if i >= start and i in ref]
    diffs = [abs(got[i] - ref[i]) / max(abs(ref[i]), 1e-6) for i in common]
    return {"iterations": [common[0], common[-1]] if common else None, "count": len(common),
            "max_rel_diff": max(diffs) if diffs else None, "ok": bool(common) and max(diffs) <= rel_tol}


#: --object-store (issue 33): the S3 server on loopback, its endpoint and bucket; empty: local disk.
STORE: dict = {}
STORE_BUCKET = "suite"


def start_object_store() -> dict:
    """versitygw on loopback serving WORK/s3, a bucket, and the credentials file every run reads."""
    import gzip

    sys.path.insert(0, str(REPO / "tests" / "trainer"))
    import s3server

    binary = WORK / "versitygw"
    with gzip.open(REPO / ".run" / "versitygw.gz") as src, open(binary, "wb") as dst:
        shutil.copyfileobj(src, dst)
    binary.chmod(0o755)
    server = s3server.start(WORK / "s3", str(binary))
    server.make_bucket(STORE_BUCKET)
    os.environ["AWS_SHARED_CREDENTIALS_FILE"] = str(server.credentials_file(WORK / "s3-credentials"))
    os.environ["AWS_CONFIG_FILE"] = str(WORK / "no-aws-config")
    STORE.update(endpoint=server.endpoint, server=server)
    return {"endpoint": server.endpoint, "root": str(server.root)}


def ckpt_loc(path: str) -> str:
    """Where a run's checkpoints go: the local directory, or s3://suite/<its name> with --object-store."""
    return f"s3://{STORE_BUCKET}/{Path(path).name}" if STORE else path


def store_bytes(prefix: str) -> int:
    import boto3

    srv = STORE["server"]
    s3 = boto3.client("s3", endpoint_url=srv.endpoint, region_name="us-east-1",
                      aws_access_key_id=srv.access_key, aws_secret_access_key=srv.secret_key)
    pages = s3.get_paginator("list_objects_v2").paginate(Bucket=STORE_BUCKET, Prefix=prefix)
    return sum(o["Size"] for page in pages for o in page.get("Contents", []))


def ckpt_state(root) -> dict:
    from megatron_trainer import ckpt_layout

    root = str(root)
    if root.startswith("s3://"):
        from megatron_trainer import objstore

        root = objstore.configure(root, STORE["endpoint"], "us-east-1", profile="suite")
    return {"tracker": ckpt_layout.read_tracker(root),
            "checkpoints": {e.iteration: e.complete for e in ckpt_layout.list_checkpoints(root)}}


# ----------------------------------------------------------------------------------------------- scenarios
def scenario_probe(ctx) -> dict:
    import torch

    out = {"torch": torch.__version__, "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}
    run_py = Path(torch.__file__).parent / "distributed" / "run.py"
    api_py = Path(torch.__file__).parent / "distributed" / "elastic" / "multiprocessing" / "api.py"
    launcher_py = Path(torch.__file__).parent / "distributed" / "launcher" / "api.py"
    out["torchrun_has_shutdown_timeout_flag"] = "shutdown-timeout" in run_py.read_text()
    out["torchrun_env_TORCH_ELASTIC_SHUTDOWN_TIMEOUT"] = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" in launcher_py.read_text()
    m = re.search(r"def _close\(self, death_sig: signal\.Signals, timeout: int = (\d+)\)", api_py.read_text())
    out["pcontext_close_default_timeout_s"] = int(m.group(1)) if m else None
    out["worker_signal_uses_killpg"] = "os.killpg(self.proc.pid, death_sig)" in (
        Path(torch.__file__).parent / "distributed/elastic/multiprocessing/subprocess_handler/subprocess_handler.py"
    ).read_text()
    # Megatron-LM's own parser on a representative rendered command line.
    rendered = trainer_args("gpt1b", tp=2, pp=1, mbs=4, gbs=64, iters=1000, save="/checkpoints/job",
                            save_interval=100) + ["--recompute-granularity", "full", "--recompute-method",
                                                  "uniform", "--recompute-num-layers", "1"]
    code = ("import sys, json\nsys.argv=['pretrain_gpt.py']+json.loads(sys.argv[1])\n"
            "from megatron.training.arguments import parse_args\n"
            "a=parse_args(ignore_unknown_args=False)\n"
            "print('MEGATRON_LM_PARSED', a.tensor_model_parallel_size, a.num_layers, a.async_save, a.attention_backend)")
    p = subprocess.run([sys.executable, "-c", code, json.dumps(rendered)], capture_output=True, text=True, timeout=120)
    (LOGS / "megatron_lm_parse.log").write_text(p.stdout + p.stderr)
    out["megatron_lm_parse_args"] = "ok: " + p.stdout.strip().splitlines()[-1] if p.returncode == 0 and \
        "MEGATRON_LM_PARSED" in p.stdout else f"failed rc={p.returncode}: {p.stderr.strip().splitlines()[-1:]}"
    # Our parser on the same line.
    from megatron_trainer.config import parse_args

    parse_args(rendered)
    out["our_parse_args"] = "ok"
    out["attention_ms_fwd_bwd_b4_h16_s2048_d128"] = attention_bench()
    return {"ok": out["megatron_lm_parse_args"].startswith("ok"), **out}


def attention_bench() -> dict:
    import torch
    import torch.nn.functional as F
    from collectives import cuda_median_ms
    from torch.nn.attention import SDPBackend, sdpa_kernel

    b, h, s, d = 4, 16, 2048, 128
    q, k, v = (torch.randn(s, b, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16)

    def sdpa(backend):
        def f():
            with sdpa_kernel([backend]):
                o = F.scaled_dot_product_attention(q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3),
                                                   v.permute(1, 2, 0, 3), is_causal=True)
            o.backward(grad)
        return f

    def unfused():
        qq, kk, vv = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        scores = torch.matmul(qq, kk.transpose(-1, -2)) * d ** -0.5
        mask = torch.triu(torch.ones(s, s, dtype=torch.bool, device="cuda"), 1)
        p = torch.softmax(scores.float().masked_fill(mask, float("-inf")), -1).bfloat16()
        torch.matmul(p, vv).backward(grad)

    out = {}
    for name, fn in (("flash", sdpa(SDPBackend.FLASH_ATTENTION)), ("cudnn", sdpa(SDPBackend.CUDNN_ATTENTION)),
                     ("efficient", sdpa(SDPBackend.EFFICIENT_ATTENTION)), ("unfused_torch", unfused)):
        try:
            out[name] = round(cuda_median_ms(fn, warmup=3, timed=10), 3)
        except Exception as e:
            out[name] = f"unavailable: {type(e).__name__}"
    return out


def scenario_indexed(ctx) -> dict:
    """Preprocess with our torch-free writer; Megatron's IndexedDataset must read the same tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    root = WORK / "data"
    shutil.rmtree(root, ignore_errors=True)
    (root / "tok").mkdir(parents=True)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa", "lambda", "mu", "nu", "xi", "omicron", "pi", "rho", "sigma"]
    import random

    rnd = random.Random(0)
    docs = {name: [" ".join(rnd.choice(words) for _ in range(rnd.randint(50, 400))) for _ in range(1500)]
            for name in ("a", "b")}
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(docs["a"][:200], trainers.BpeTrainer(vocab_size=512, special_tokens=["<unk>", "<|endoftext|>"]))
    tok.save(str(root / "tok" / "tokenizer.json"))
    (root / "tok" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    prefixes = []
    for name, texts in docs.items():
        (root / f"{name}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        p = subprocess.run([sys.executable, "-m", "megatron_trainer", "preprocess", "--input", str(root / f"{name}.jsonl"),
                            "--output-prefix", str(root / name), "--tokenizer-model", str(root / "tok"), "--append-eod"],
                           capture_output=True, text=True, cwd=REPO, timeout=300)
        (LOGS / f"preprocess_{name}.log").write_text(p.stdout + p.stderr)
        if p.returncode != 0:
            return {"ok": False, "error": p.stderr[-500:]}
        prefixes.append(str(root / f"{name}_text_document"))
    from megatron.core.datasets.indexed_dataset import IndexedDataset
    from megatron_trainer.indexed import read_indexed_dataset
    from megatron_trainer.tokenizer import LocalTokenizer

    ds = IndexedDataset(prefixes[0])
    mine = read_indexed_dataset(prefixes[0])
    lt = LocalTokenizer(root / "tok")
    same = len(ds) == len(docs["a"]) and all((ds[i] == mine.sequence(i)).all() for i in range(len(ds)))
    roundtrip = lt.detokenize(list(ds[7][:-1])) == docs["a"][7] and int(ds[7][-1]) == lt.eod
    ctx["data"] = {"blend": ["0.4", prefixes[0], "0.6", prefixes[1]], "tokenizer": str(root / "tok"),
                   "cache": str(WORK / "data-cache")}
    return {"ok": same and roundtrip, "documents": len(ds), "megatron_reads_same_tokens": same,
            "detokenized_roundtrip": roundtrip, "dtype": str(ds.index.dtype)}


def layouts_for(gpus: int) -> list[tuple[str, int, int]]:
    """(name, TP, PP); DP is what is left."""
    if gpus == 1:
        return [("dp1", 1, 1)]
    out = [(f"tp{gpus}", gpus, 1), (f"pp{gpus}", 1, gpus), (f"dp{gpus}", 1, 1)]
    if gpus >= 4:
        out.append((f"tp2pp2dp{gpus // 4}", 2, 2))
    return out


LAYOUT_RE = re.compile(r"^(?:tp(\d+))?(?:pp(\d+))?(?:vpp(\d+))?(?:dp(\d+))?$")


def parse_layout(name: str, gpus: int) -> tuple[int, int, int | None]:
    """'tp2pp2vpp2dp2' / 'pp2' / 'dp8' -> (TP, PP, VPP); DP must fill the GPUs."""
    m = LAYOUT_RE.match(name)
    if not m or not name:
        raise ValueError(f"bad layout {name!r}")
    tp, pp = int(m.group(1) or 1), int(m.group(2) or 1)
    vpp = int(m.group(3)) if m.group(3) else None
    dp = int(m.group(4)) if m.group(4) else gpus // (tp * pp)
    if tp * pp * dp != gpus:
        raise ValueError(f"layout {name!r} does not fill {gpus} GPUs")
    return tp, pp, vpp


def reference_run(ctx, name: str, tp: int, pp: int, data=None, extra=(), vpp: int | None = None,
                  env: dict | None = None) -> dict:
    """A 40-iteration run with async checkpoints every 10: the uninterrupted reference."""
    gpus = ctx["gpus"]
    dp = gpus // (tp * pp)
    model = ctx.get("model", "small")
    mbs = MODELS[model]["mbs"]
    save = ckpt_loc(str(WORK / "ckpt" / f"ref_{name}"))
    shutil.rmtree(save, ignore_errors=True)
    extra = list(extra) + (["--num-virtual-stages-per-pipeline-rank", str(vpp)] if vpp else [])
    args = trainer_args(model, tp=tp, pp=pp, mbs=mbs, gbs=mbs * dp * (2 * pp if pp > 1 else 1), iters=40,
                        save=save, save_interval=10, data=data, extra=extra,
                        lr="1e-3" if model == "small" else "3e-4")
    env = {"MEGATRON_CHECKPOINT_KEEP": "3", "MEGATRON_METRICS_PORT": str(free_port()), **(env or {})}
    run = Run(f"ref_{name}", gpus, args, env=env)
    scraped = {}

    def scrape():
        url = f"http://127.0.0.1:{env['MEGATRON_METRICS_PORT']}/metrics"
        while run.proc.poll() is None:
            try:
                scraped["text"] = urllib.request.urlopen(url, timeout=1).read().decode()
            except Exception:
                pass
            time.sleep(0.5)

    threading.Thread(target=scrape, daemon=True).start()
    rc = run.wait(600)
    run.close()
    losses = run.losses()
    failures: list[str] = []
    state = ckpt_state(save)
    check(rc == 0, f"rc={rc}", failures)
    check(sorted(losses) == list(range(1, 41)), "missing iterations", failures)
    check(loss_falls(losses), "loss did not fall", failures)
    check(state["tracker"] == 40, f"tracker {state['tracker']}", failures)
    check(state["checkpoints"] == {20: True, 30: True, 40: True}, f"retention keep=3: {state['checkpoints']}", failures)
    metrics = scraped.get("text", "")
    check("megatron_trainer_iteration" in metrics, "metrics not served", failures)
    ctx.setdefault("refs", {})[name] = {"losses": losses, "args": args, "save": save, "tp": tp, "pp": pp,
                                        "mbs": mbs, "gbs": mbs * dp * (2 * pp if pp > 1 else 1)}
    summary = run.summary() or {}
    return {"ok": not failures, "failures": failures, "layout": f"TP{tp} PP{pp} DP{dp}",
            "loss_first": losses.get(1), "loss_last": losses.get(40), "checkpoints": state,
            "blocked_s": [(s["blocked_s"], s.get("waited_for_previous_s")) for s in summary.get("checkpoint_saves", [])],
            "metrics_sample": [ln for ln in metrics.splitlines() if ln.startswith("megatron_trainer_")][:12],
            "path": summary.get("path"), "sdpa_kernel": sdpa_kernel(run.text())}


def scenario_layouts(ctx) -> dict:
    results = {}
    names = sorted(ctx["layouts"]) if ctx["layouts"] else [n for n, _, _ in layouts_for(ctx["gpus"])]
    for name in names:
        tp, pp, vpp = parse_layout(name, ctx["gpus"])
        data = ctx.get("data") if name.startswith("dp") else None
        # The reshard source saves its optimizer fully reshardable (TP/PP may change on resume).
        reshardable = name == ctx.get("reshard_from", f"tp{ctx['gpus']}")
        results[name] = reference_run(ctx, name, tp, pp, data=data, vpp=vpp,
                                      extra=["--dist-ckpt-optim-fully-reshardable"] if reshardable else [])
        if data:
            results[name]["data"] = "real .bin/.idx blend, HF tokenizer"
    return {"ok": all(r["ok"] for r in results.values()), **results}


def scenario_resume(ctx) -> dict:
    """kill -9 one rank at iteration 25 (checkpoints every 10), then the gang; restart from 20."""
    out = {}
    for name, ref in ctx.get("refs", {}).items():
        if ctx["resume_on"] and name not in ctx["resume_on"]:
            continue
        save = ckpt_loc(str(WORK / "ckpt" / f"kill_{name}"))
        shutil.rmtree(save, ignore_errors=True)
        args = [save if a == ref["save"] else a for a in ref["args"]]
        run = Run(f"kill_{name}", ctx["gpus"], args)
        failures: list[str] = []
        hit = run.wait_for(re.compile(r"iteration\s+25/"), 240)
        check(hit is not None, "never reached iteration 25", failures)
        victim = ctx["gpus"] - 1
        killed = run.kill_rank(victim)
        time.sleep(3)  # the pod of the dead rank fails; JobSet then replaces the whole gang
        run.kill_tree()
        run.wait(60)
        run.close()
        before = ckpt_state(save)
        complete = [it for it, ok in before["checkpoints"].items() if ok]
        expected = max(complete) if complete else None
        last_logged = max(run.losses(), default=0)
        again = Run(f"kill_{name}_restart", ctx["gpus"], args)
        rc = again.wait(300)
        again.close()
        resumed = RESUMED_RE.search(again.text())
        # The uninterrupted trajectory is the killed run itself up to the kill: the restart redoes
        # iterations expected+1 .. last_logged from the checkpoint and must reproduce them.
        cmp = compare(run.losses(), again.losses(), (expected or 0) + 1, rel_tol=0.01)
        cmp_ref = compare(ref["losses"], again.losses(), (expected or 0) + 1, rel_tol=0.02)
        check(killed, "rank not found to kill", failures)
        check(expected is not None and expected < last_logged, f"no complete checkpoint before the kill: {before}",
              failures)
        check(rc == 0, f"restart rc={rc}", failures)
        check(resumed is not None and expected is not None and int(resumed.group(2)) == expected,
              f"resumed {resumed.group(2) if resumed else None}, newest complete {expected}", failures)
        check(cmp["ok"], f"losses differ {cmp}", failures)
        out[name] = {"ok": not failures, "failures": failures, "killed_rank": victim,
                     "last_logged_iteration_before_kill": last_logged,
                     "checkpoints_after_kill": before, "resumed_iteration": resumed.group(2) if resumed else None,
                     "compare_with_killed_run": cmp, "compare_with_reference_run": cmp_ref}
    return {"ok": bool(out) and all(r["ok"] for r in out.values()), **out}


def scenario_sigterm(ctx) -> dict:
    out = {}
    for name, ref in ctx.get("refs", {}).items():
        if ctx["gpus"] > 1 and "pp" not in name:
            continue  # on several GPUs: the pipeline layout (stages must agree across the p2p schedule)
        save = ckpt_loc(str(WORK / "ckpt" / f"term_{name}"))  # s3://suite/term_<layout> with --object-store
        shutil.rmtree(save, ignore_errors=True)
        args = [save if a == ref["save"] else a for a in ref["args"]]
        run = Run(f"sigterm_{name}", ctx["gpus"], args)
        failures: list[str] = []
        check(run.wait_for(re.compile(r"iteration\s+15/"), 240) is not None, "never reached 15", failures)
        t0 = time.monotonic()
        run.sigterm()
        run.wait(90)
        exit_s = time.monotonic() - t0
        run.close()
        text = run.text()
        stop = STOPPING_RE.search(text)
        stopped_at = int(stop.group(1)) if stop else None
        state = ckpt_state(save)
        check(stop is not None and stop.group(2) == "signal", "no 'stopping ... (signal)'", failures)
        check("megatron_trainer: exit 0 (signal)" in text, "rank 0 did not exit 0", failures)
        check(stopped_at is not None and state["tracker"] == stopped_at and state["checkpoints"].get(stopped_at),
              f"checkpoint {state}", failures)
        again = Run(f"sigterm_{name}_restart", ctx["gpus"], args)
        rc = again.wait(300)
        again.close()
        resumed = RESUMED_RE.search(again.text())
        cmp = compare(ref["losses"], again.losses(), (stopped_at or 0) + 1, rel_tol=0.02)
        check(rc == 0 and resumed is not None and stopped_at is not None and int(resumed.group(2)) == stopped_at,
              f"restart rc={rc} resumed={resumed.group(2) if resumed else None}", failures)
        check(cmp["ok"], f"losses differ {cmp}", failures)
        out[name] = {"ok": not failures, "failures": failures, "stopped_at": stopped_at,
                     "sigterm_to_exit_s": round(exit_s, 2), "checkpoint": state, "compare_after_resume": cmp}
    return {"ok": bool(out) and all(r["ok"] for r in out.values()), **out}


def scenario_reshard(ctx) -> dict:
    """Resume the reshard source's iteration-20 checkpoint under other TP/PP/DP layouts."""
    gpus = ctx["gpus"]
    src_name = ctx.get("reshard_from") or f"tp{gpus}"
    ref = ctx.get("refs", {}).get(src_name)
    if ref is None:
        return {"ok": False, "failures": [f"no reference run {src_name}"]}
    targets = ctx.get("reshard_to") or [f"pp{gpus}", f"dp{gpus}"]
    out = {}
    src = Path(ref["save"])
    model = ctx.get("model", "small")
    for name in targets:
        tp, pp, vpp = parse_layout(name, gpus)
        dst = WORK / "ckpt" / f"reshard_to_{name}"
        shutil.rmtree(dst, ignore_errors=True)
        dst.mkdir(parents=True)
        shutil.copytree(src / "iter_0000020", dst / "iter_0000020", copy_function=os.link)  # hard links: no copy
        (dst / "latest_checkpointed_iteration.txt").write_text("20\n")
        dp = gpus // (tp * pp)
        # Same global batch (same samples per step) as the source run.
        mbs = min(ref["mbs"], ref["gbs"] // dp)
        extra = ["--num-virtual-stages-per-pipeline-rank", str(vpp)] if vpp else []
        args = trainer_args(model, tp=tp, pp=pp, mbs=mbs, gbs=ref["gbs"], iters=40, save=str(dst), save_interval=10,
                            extra=extra, lr="1e-3" if model == "small" else "3e-4")
        run = Run(f"reshard_{src_name}_to_{name}", gpus, args)
        rc = run.wait(600)
        run.close()
        resumed = RESUMED_RE.search(run.text())
        cmp = compare(ref["losses"], run.losses(), 21, rel_tol=0.05)
        failures: list[str] = []
        check(rc == 0, f"rc={rc}", failures)
        check(resumed is not None and resumed.group(2) == "20", "did not resume from 20", failures)
        check(cmp["ok"], f"loss does not continue {cmp}", failures)
        out[name] = {"ok": not failures, "failures": failures, f"compare_with_{src_name}_run": cmp,
                     "loss_21": run.losses().get(21), "ref_loss_21": ref["losses"].get(21)}
    return {"ok": all(r["ok"] for r in out.values()), **out}


def run_peer(name: str, gpus: int, model: str, tp: int, ckpt: Path | None = None) -> dict:
    """The peer (../shared/bench/mcore_peer.py, MODE=bf16, 20 iterations) on the same model and GPUs;
    with `ckpt`, its synchronous save/load of the model too."""
    m = MODELS[model]
    peer = Run(name, gpus, [], module=False, script=str(REPO / ".run" / "mcore_peer.py"),
               env={"TP": str(tp), "LAYERS": str(m["layers"]), "HIDDEN": str(m["hidden"]), "HEADS": str(m["heads"]),
                    "SEQ": str(m["seq"]), "MBS": str(m["mbs"]), "ITERS": "20", "MODE": "bf16",
                    "CKPT": str(ckpt) if ckpt else "", **({"CUDA_DEVICE_MAX_CONNECTIONS": "1"} if tp > 1 else {})})
    rc = peer.wait(300)
    peer.close()
    pm = PEER_RE.search(peer.text())
    if not pm:
        return {"rc": rc, "error": peer.text()[-800:]}
    pc = PEER_CKPT_RE.search(peer.text())
    out = {"iter_ms": float(pm.group(1)), "tokens_per_s_per_gpu": float(pm.group(2)), "mfu_pct": float(pm.group(3)),
           "peak_mem_gib": float(pm.group(4)), "rc": rc}
    if ckpt:
        out.update({"sync_save_s": float(pc.group(1)) if pc else None, "load_s": float(pc.group(2)) if pc else None})
    return out


def ours_throughput(model: str, dp: int, gpus: int, iter_ms: float, peer: dict) -> dict:
    """Our tokens/s/GPU and MFU by the peer's formula, and the MFU ratio to the peer where it ran."""
    from megatron_trainer import flops

    m = MODELS[model]
    classic = flops.classic_flops_per_iteration(m["mbs"] * dp, m["seq"], m["layers"], m["hidden"], m["vocab"])
    thr = flops.throughput(classic, m["mbs"] * dp * m["seq"], iter_ms / 1000, gpus)
    out = {"tokens_per_s_per_gpu": round(thr["tokens_per_s_per_gpu"]), "mfu_pct_peer_formula": round(100 * thr["mfu"], 2)}
    if "mfu_pct" in peer:
        out["mfu_ratio_ours_over_peer"] = round(100 * thr["mfu"] / peer["mfu_pct"], 3)
    return out


def bench_layouts(gpus: int) -> list[tuple[str, int]]:
    """(name, TP): the peer covers TP x DP layouts only."""
    if gpus == 1:
        return [("dp1", 1)]
    if gpus == 2:
        return [("tp2", 2), ("dp2", 1)]
    return [(f"tp2dp{gpus // 2}", 2), (f"dp{gpus}", 1)]


def scenario_bench(ctx) -> dict:
    import torch

    gpus = ctx["gpus"]
    model = ctx.get("bench_model", "gpt1b")
    m = MODELS[model]
    mb = m["mbs"]
    out = {}
    for name, tp in bench_layouts(gpus):
        if ctx["bench_on"] and name not in ctx["bench_on"]:
            continue
        dp = gpus // tp
        res: dict = {"layout": f"TP{tp} DP{dp}", "gpus": gpus}
        # --- the peer: its own loop, same model, sync save of the model only (its CKPT mode)
        peer_ckpt = WORK / "ckpt" / f"peer_{name}"
        shutil.rmtree(peer_ckpt, ignore_errors=True)
        peer_ckpt.mkdir(parents=True)
        res["peer"] = run_peer(f"bench_peer_{name}", gpus, model, tp, ckpt=peer_ckpt)
        shutil.rmtree(peer_ckpt, ignore_errors=True)
        res["megatron_lm"] = mlm_second_peer(f"bench_mlm_{name}", gpus, model, tp, mb * dp)
        # --- ours: async save at 12, kill -9 while the save of 24 is in flight, restart from 12
        save = WORK / "ckpt" / f"bench_{name}"
        shutil.rmtree(save, ignore_errors=True)
        extra = list(DP_OVERLAP) if dp > 1 else []
        variant = ctx.get("bench_variant") or "foreach"
        if variant == "auto":  # the fastest variant the perf scenario measured
            timed = {k: v["median_iter_ms"] for k, v in ctx.get("perf", {}).items()
                     if isinstance(v, dict) and v.get("median_iter_ms") and v.get("rc") == 0}
            variant = min(timed, key=timed.get) if timed else "foreach"
        v_env, v_extra = variant_for(variant, tp)
        if "--cuda-graph-impl" in v_extra:  # the trainer refuses param-gather overlap with a full-iteration graph
            extra = [a for a in extra if a != "--overlap-param-gather"]
        res["variant"] = {"name": variant, "env": v_env, "extra": v_extra}
        args = trainer_args(model, tp=tp, mbs=mb, gbs=mb * dp, iters=36, lr="3e-4", warmup=4, save=str(save),
                            save_interval=12, extra=extra + v_extra)
        ours_env = {**({"CUDA_DEVICE_MAX_CONNECTIONS": "1"} if tp > 1 else {}), **v_env}
        ours = Run(f"bench_ours_{name}", gpus, args, env=ours_env)
        hit = ours.wait_for(re.compile(r"async save of iteration 24 scheduled"), 400)
        if hit:
            ours.kill_tree()
        ours.wait(60)
        ours.close()
        text = ours.text()
        ms = ours.iteration_ms()
        steady = [ms[i] for i in sorted(ms) if 4 <= i <= 24]
        blocked = [(int(a), round(float(b) - float(c), 3), float(c)) for a, b, c in SCHEDULED_RE.findall(text)]
        peaks = [float(x.group(5)) for x in ITER_RE.finditer(text)]
        after_kill = ckpt_state(save)
        res["ours"] = {"killed_during_async_save_of_24": bool(hit), "median_iter_ms": statistics.median(steady) if steady else None,
                       "async_save_blocked_s": blocked, "peak_mem_gib_rank_logging": max(peaks) if peaks else None,
                       "checkpoints_after_kill": after_kill}
        # The restart is the real command (async worker warm-up included); it is stopped after a few
        # resumed iterations, so no further checkpoint is written.
        again = Run(f"bench_ours_{name}_restart", gpus, args, env=ours_env)
        reached = again.wait_for(re.compile(r"iteration\s+16/"), 400)
        again.kill_tree()
        again.wait(60)
        rc2 = 0 if reached else -1
        again.close()
        resumed = RESUMED_RE.search(again.text())
        load_m = re.search(r"resumed from .* in ([0-9.]+) s", again.text())
        peaks2 = [float(x.group(5)) for x in ITER_RE.finditer(again.text())]
        startup = STARTUP_RE.search(again.text())
        # The restart redoes 13..16 from the checkpoint of 12: the killed run logged them already.
        redo = compare(ours.losses(), again.losses(), 13, rel_tol=0.01)
        res["ours"].update({
            "redo_13_16_vs_killed_run": redo,
            "restart_rc": rc2, "resumed_from": int(resumed.group(2)) if resumed else None,
            "resume_reason": resumed.group(3) if resumed else None,
            "startup_to_first_resumed_iteration_s": float(startup.group(1)) if startup else None,
            "load_s": float(load_m.group(1)) if load_m else None,
            "peak_alloc_gib_logging_rank_after_resume": max(peaks2) if peaks2 else None})
        if res["ours"]["median_iter_ms"]:
            thr = ours_throughput(model, dp, gpus, res["ours"]["median_iter_ms"], res["peer"])
            ratio = thr.pop("mfu_ratio_ours_over_peer", None)
            res["ours"].update(thr)
            if ratio is not None:
                res["mfu_ratio_ours_over_peer"] = ratio
        res["ours_speedup_vs_megatron_lm"] = ratio_vs_mlm(res["ours"]["median_iter_ms"], res["megatron_lm"])
        failures: list[str] = []
        check("mfu_ratio_ours_over_peer" in res, "no ratio", failures)
        check("not_run" in res["megatron_lm"] or res["ours_speedup_vs_megatron_lm"] is not None,
              f"Megatron-LM did not run: {res['megatron_lm'].get('error', '')[-200:]}", failures)
        check(bool(hit), "kill during async save not reached", failures)
        check(after_kill["tracker"] == 12 and after_kill["checkpoints"].get(24) is False,
              f"after kill: {after_kill}", failures)
        check(res["ours"]["resumed_from"] == 12, f"resumed from {res['ours']['resumed_from']}", failures)
        check(rc2 == 0, f"restart rc={rc2}", failures)
        check(redo["ok"], f"redone iterations differ from the killed run: {redo}", failures)
        res["ok"], res["failures"] = not failures, failures
        out[name] = res
        shutil.rmtree(save, ignore_errors=True)
        torch.cuda.empty_cache()
    return {"ok": all(r["ok"] for r in out.values()), **out}


# Performance variants of ours for `perf` (env, extra flags). "old" is the configuration of the
# first benchmark (Megatron's host-syncing multi-tensor fallbacks, no sequence parallelism).
PERF_VARIANTS = {
    "old": ({"MEGATRON_TRAINER_FOREACH_OPS": "0"}, []),
    "foreach": ({}, []),
    "sp": ({}, ["--sequence-parallel"]),
    "sp_conn8": ({"CUDA_DEVICE_MAX_CONNECTIONS": "8"}, ["--sequence-parallel"]),
    "conn8": ({"CUDA_DEVICE_MAX_CONNECTIONS": "8"}, []),
    "graph": ({}, ["--cuda-graph-impl", "full_iteration"]),
    "graph_sp": ({}, ["--cuda-graph-impl", "full_iteration", "--sequence-parallel"]),
}


def variant_for(name: str, tp: int) -> tuple[dict, list[str]]:
    """A PERF_VARIANTS entry for a layout (sequence parallelism only where TP > 1)."""
    env, extra = PERF_VARIANTS[name]
    extra = [a for a in extra if tp > 1 or a != "--sequence-parallel"]
    return dict(env), extra if "--sequence-parallel" in extra else extra + [NO_SP]


def scenario_perf(ctx) -> dict:
    """Iteration time of ours at TP=N under several variants and the peer, same model, same call.

    No checkpoints; 26 iterations, median of 4-20; variants in --perf-profile are profiled over
    iteration 22 (traces and operator tables in the logs archive). Losses of the first iterations are
    compared across variants: they compute the same thing, so they must agree within bf16 noise.
    """
    gpus = ctx["gpus"]
    tp = ctx.get("perf_tp") or gpus
    dp = gpus // tp
    model = ctx.get("bench_model", "gpt1b")
    m = MODELS[model]
    mb = m["mbs"]
    out: dict = {"layout": f"TP{tp} DP{dp}", "model": model, "peer": run_peer(f"perf_peer_tp{tp}", gpus, model, tp),
                 "megatron_lm": mlm_second_peer(f"perf_mlm_tp{tp}", gpus, model, tp, mb * dp)}
    failures: list[str] = []
    first_losses = {}
    for name in ctx.get("perf_variants") or list(PERF_VARIANTS):
        env, extra = variant_for(name, tp)
        if name in (ctx.get("perf_profile") or ()):
            env["MEGATRON_TRAINER_PROFILE"] = f"22:22:{LOGS / ('profile_' + name)}"
        args = trainer_args(model, tp=tp, mbs=mb, gbs=mb * dp, iters=26, lr="3e-4", warmup=4, extra=extra)
        run = Run(f"perf_{name}", gpus, args, env=env)
        rc = run.wait(300)
        run.close()
        ms = run.iteration_ms()
        steady = [ms[i] for i in sorted(ms) if 4 <= i <= 20]
        res = {"rc": rc, "env": env, "extra": extra}
        if steady:
            median = statistics.median(steady)
            res.update({"median_iter_ms": median, **ours_throughput(model, dp, gpus, median, out["peer"]),
                        "ours_speedup_vs_megatron_lm": ratio_vs_mlm(median, out["megatron_lm"])})
        peaks = [float(x.group(5)) for x in ITER_RE.finditer(run.text())]
        res["peak_mem_gib_logging_rank"] = max(peaks) if peaks else None
        losses = run.losses()
        first_losses[name] = [losses.get(i) for i in range(1, 6)]
        res["losses_1_5"] = first_losses[name]
        check(rc == 0 and bool(steady), f"{name}: rc={rc}", failures)
        out[name] = res
    check("not_run" in out["megatron_lm"] or "iter_ms" in out["megatron_lm"],
          f"Megatron-LM did not run: {out['megatron_lm'].get('error', '')[-200:]}", failures)
    ref = first_losses.get("old") or next(iter(first_losses.values()), None)
    for name, got in first_losses.items():
        ok = ref is not None and None not in got and None not in ref and \
            all(abs(a - b) <= 0.02 * abs(b) for a, b in zip(got, ref, strict=True))
        check(ok, f"{name}: losses 1-5 {got} differ from {ref}", failures)
    out["ok"], out["failures"] = not failures, failures
    ctx["perf"] = out
    return out


# Memory calibration: (name, gpus, model, tp, pp, mbs, gbs, attn, recompute, dist_opt)
MEMORY_CONFIGS = [
    ("m01_1g_flash_mbs4", 1, "gpt1b", 1, 1, 4, 4, "flash", None, True),
    ("m02_1g_unfused_mbs4", 1, "gpt1b", 1, 1, 4, 4, "unfused", None, True),
    ("m03_1g_full_recompute", 1, "gpt1b", 1, 1, 4, 4, "flash", "full", True),
    ("m04_1g_mbs1_nodistopt", 1, "gpt1b", 1, 1, 1, 1, "flash", None, False),
    ("m05_1g_s4k_unfused_mbs4", 1, "mem_s4k", 1, 1, 4, 4, "unfused", None, True),
    ("m06_1g_s4k_unfused_selective", 1, "mem_s4k", 1, 1, 4, 4, "unfused", "selective", True),
    ("m07_1g_s4k_flash_mbs8", 1, "mem_s4k", 1, 1, 8, 8, "flash", None, True),
    ("m08_2g_tp2_flash", 2, "gpt1b", 2, 1, 4, 4, "flash", None, True),
    ("m09_2g_pp2_mbs2_gbs16", 2, "gpt1b", 1, 2, 2, 16, "flash", None, True),
    ("m10_2g_dp2_distopt", 2, "gpt1b", 1, 1, 4, 8, "flash", None, True),
    ("m11_2g_dp2_nodistopt", 2, "gpt1b", 1, 1, 4, 8, "flash", None, False),
    ("m12_2g_tp2_s4k_unfused_selective", 2, "mem_s4k", 2, 1, 4, 4, "unfused", "selective", True),
]


def memory_run(cfg, gpus_visible: str) -> dict:
    name, gpus, model, tp, pp, mbs, gbs, attn, recompute, dist_opt = cfg
    extra = []
    if recompute == "full":
        extra = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
    elif recompute == "selective":
        extra = ["--recompute-granularity", "selective"]
    args = trainer_args(model, tp=tp, pp=pp, mbs=mbs, gbs=gbs, iters=4, attn=attn, lr="3e-4", warmup=1,
                        dist_opt=dist_opt, extra=extra)
    run = Run(f"memory_{name}", gpus, args, gpus=gpus_visible)
    rc = run.wait(300)
    run.close()
    s = run.summary() or {}
    oom = "OutOfMemoryError" in run.text()
    m = MODELS[model]
    record = {"name": name, "rc": rc, "oom": oom, "gpus": gpus,
              "model": {"num_layers": m["layers"], "hidden_size": m["hidden"], "num_attention_heads": m["heads"],
                        "ffn_hidden_size": m["ffn"], "seq_length": m["seq"], "vocab_size": m["vocab"],
                        "normalization": "LayerNorm", "activation": "gelu", "position_embedding": "learned_absolute",
                        "untie_embeddings": True, "add_bias_linear": True},
              "parallel": {"tensor": tp, "pipeline": pp, "data": gpus // (tp * pp), "context": 1,
                           "sequence_parallel": False},
              "training": {"micro_batch_size": mbs, "global_batch_size": gbs,
                           "num_microbatches": gbs // (mbs * (gpus // (tp * pp))), "precision": "bf16",
                           "recompute": recompute or "none", "attention_backend": attn,
                           "transformer_impl": "local (no Transformer Engine)", "distributed_optimizer": dist_opt,
                           "optimizer": "adam (torch AdamW fallback, fp32 main params + 2 fp32 states)",
                           "grad_reduce_in_fp32": True},
              "iterations": s.get("iterations_run"),
              "memory_per_rank": s.get("memory_per_rank"),
              "max_peak_allocated_gib": s.get("max_peak_allocated_gib"),
              "max_peak_reserved_gib": max((r["peak_reserved_gib"] for r in s.get("memory_per_rank") or []),
                                           default=None)}
    return record


def scenario_memory(ctx) -> dict:
    gpus = ctx["gpus"]
    todo = [c for c in MEMORY_CONFIGS if c[1] <= gpus and c[0] in ctx["memory_names"]]
    results = []
    # Single-GPU configurations run side by side, one per GPU; larger ones alone.
    singles = [c for c in todo if c[1] == 1]
    multis = [c for c in todo if c[1] > 1]
    while singles:
        if time.monotonic() > DEADLINE[0] - 60:
            results += [{"name": c[0], "skipped": "time"} for c in singles]
            break
        batch, singles = singles[:gpus], singles[gpus:]
        threads, outs = [], [None] * len(batch)

        visible = os.environ.get("CUDA_VISIBLE_DEVICES", all_gpus(gpus)).split(",")

        def work(i, c, outs=outs, visible=visible):
            outs[i] = memory_run(c, visible[i])

        for i, c in enumerate(batch):
            t = threading.Thread(target=work, args=(i, c))
            t.start()
            threads.append(t)
        for t in threads:
            t.join()
        results += outs
        ctx["memory_records"] = results
        flush_outputs(ctx["out_dir"], ctx.get("results", {}), ctx)
    for c in multis:
        if time.monotonic() > DEADLINE[0] - 60:
            results.append({"name": c[0], "skipped": "time"})
            continue
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", all_gpus(gpus)).split(",")
        results.append(memory_run(c, ",".join(visible[:c[1]])))
        ctx["memory_records"] = results
        flush_outputs(ctx["out_dir"], ctx.get("results", {}), ctx)
    ctx["memory_records"] = results
    ok = all(r.get("rc") == 0 or r.get("oom") for r in results if "skipped" not in r)
    return {"ok": ok, "records": [{k: r.get(k) for k in ("name", "rc", "oom", "max_peak_allocated_gib",
                                                          "max_peak_reserved_gib")} for r in results]}


# ---------------------------------------------------------------- rendered pods, verbatim (issue 13)
POD_JOBS = ("kubeflow-tp2", "pp2-checkpoint", "real-data-2node")


def _pod_setup(ctx) -> tuple:
    """PVC directories, the image's environment and whether pods get their own mount namespaces."""
    import pods as P

    if "pod_setup" not in ctx:
        ns_ok, ns_msg = P.can_namespace()
        ckpt = P.PVC_ROOT / "checkpoints"
        ckpt.mkdir(parents=True, exist_ok=True)
        os.chown(ckpt, 1000, 1000)  # the pod's fsGroup (1000) owns the volume
        ctx["pod_setup"] = (P.image_env(), ns_ok, ns_msg)
    return ctx["pod_setup"]


def _pod_log(pods) -> dict:
    return {"pod0_command": pods[0].command(), "pod0_env": pods[0].env(), "gpus": [p.gpus for p in pods]}


def _no_pod_processes(uid: int, timeout: float = 15.0) -> list[int]:
    """Processes of the pods' user still alive (the launcher must leave none)."""
    import psutil

    end = time.monotonic() + timeout
    while True:
        left = [p.pid for p in psutil.process_iter(["uids", "status"])
                if p.info["uids"] and p.info["uids"].real == uid and p.info["status"] != psutil.STATUS_ZOMBIE]
        if not left or time.monotonic() > end:
            return left
        time.sleep(0.2)


def _start_pods(jobset, attempt: int, gpus: int, tag: str, image: dict, ns_ok: bool) -> list:
    import pods as P

    pods = P.pods_of(jobset, attempt, gpus)
    for i, p in enumerate(pods):
        p.start(LOGS / f"pods_{jobset['metadata']['name']}_{tag}_pod{i}.log", image, ns_ok)
    return pods


def pods_job(ctx, job_file: Path) -> dict:
    """Start 1: train, SIGTERM every pod past the checkpoint of 10 -> checkpoint, exit 0. Start 2 (a
    JobSet restart): resume from it, train to the end, exit 0. Loss falls over the whole run."""
    import pods as P

    image, ns_ok, _ = _pod_setup(ctx)
    jobset = P.render(job_file)
    name = jobset["metadata"]["name"]
    P.map_host(P.master_address(jobset))
    pod_spec = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    grace = pod_spec["terminationGracePeriodSeconds"]
    uid = pod_spec["securityContext"]["runAsUser"]
    save = P.PVC_ROOT / "checkpoints" / name
    shutil.rmtree(save, ignore_errors=True)
    failures: list[str] = []
    first = _start_pods(jobset, 0, ctx["gpus"], "start1", image, ns_ok)
    out = {"pods": len(first), **_pod_log(first)}
    hit = P.wait_log(first, re.compile(r"iteration\s+(1[2-9]|2\d)/"), bounded(300))
    check(hit is not None, "start 1 never reached iteration 12", failures)
    t0 = time.monotonic()
    for p in first:
        p.sigterm()
    rcs1 = P.wait_all(first, bounded(max(grace - 20, 10)))
    if any(rc is None for rc in rcs1):  # still running near the end of the grace period: say where
        out["stack_dumps_sent"] = sum(p.dump_stacks() for p in first)
        rcs1 = P.wait_all(first, bounded(50))
    out["sigterm_to_exit_s"] = round(time.monotonic() - t0, 1)
    for p in first:
        p.kill_tree()
    text1 = "".join(p.text() for p in first)
    stop = STOPPING_RE.search(text1)
    stopped_at = int(stop.group(1)) if stop else None
    state1 = ckpt_state(save)
    check(rcs1 == [0] * len(first), f"start 1 exit codes {rcs1}", failures)
    check(stop is not None and stop.group(2) == "signal", "start 1: no 'stopping ... (signal)'", failures)
    check(stopped_at is not None and state1["tracker"] == stopped_at and bool(state1["checkpoints"].get(stopped_at)),
          f"start 1 checkpoint {state1}", failures)
    left = _no_pod_processes(uid)
    check(not left, f"start 1 left processes {left}", failures)
    second = _start_pods(jobset, 1, ctx["gpus"], "start2", image, ns_ok)
    rcs2 = P.wait_all(second, bounded(300))
    for p in second:
        p.kill_tree()
    text2 = "".join(p.text() for p in second)
    resumed = RESUMED_RE.search(text2)
    state2 = ckpt_state(save)
    losses = {**P.losses_of(first), **P.losses_of(second)}
    train_iters = int(pods_arg(first[0].command(), "--train-iters"))
    check(rcs2 == [0] * len(second), f"start 2 exit codes {rcs2}", failures)
    check(resumed is not None and stopped_at is not None and int(resumed.group(2)) == stopped_at,
          f"start 2 resumed from {resumed.group(2) if resumed else None}, expected {stopped_at}", failures)
    check(sorted(losses) == list(range(1, train_iters + 1)), f"iterations logged {sorted(losses)}", failures)
    check(loss_falls(losses), "loss did not fall", failures)
    check(state2["tracker"] == train_iters, f"start 2 checkpoint {state2}", failures)
    left = _no_pod_processes(uid)
    check(not left, f"start 2 left processes {left}", failures)
    cmd = first[0].command()
    if "--tensorboard-dir" in cmd:  # the event files, read back from the checkpoint PVC
        # /checkpoints is the PVC "checkpoints" (the jobs' claim), i.e. PVC_ROOT/checkpoints here
        tb = read_tensorboard(P.PVC_ROOT / "checkpoints" / pods_arg(cmd, "--tensorboard-dir").removeprefix("/checkpoints/"))
        tb_loss = tb.get("lm loss", {})
        check(set(TB_TAGS) <= set(tb), f"tensorboard tags missing: {sorted(set(TB_TAGS) - set(tb))}", failures)
        check(sorted(tb_loss) == list(range(1, train_iters + 1)), f"tensorboard lm loss steps {sorted(tb_loss)}",
              failures)
        check(all(abs(tb_loss[i] - losses[i]) <= 1e-5 * abs(losses[i]) for i in tb_loss if i in losses),
              "tensorboard lm loss differs from the log lines", failures)
        out["tensorboard"] = {"files": tb.pop("_files"), "tags": sorted(tb),
                              "lm_loss_first_last": [tb_loss.get(1), tb_loss.get(train_iters)]}
    out.update({"ok": not failures, "failures": failures, "exit_codes": [rcs1, rcs2], "stopped_at": stopped_at,
                "resumed_from": resumed.group(2) if resumed else None, "checkpoints": state2,
                "loss_first": losses.get(1), "loss_last": losses.get(train_iters)})
    return out


TB_TAGS = ("lm loss", "lm loss vs samples", "learning-rate", "batch-size", "grad-norm", "world-size",
           "iteration-time", "throughput", "mem-allocated-bytes", "mem-max-allocated-bytes", "mem-reserved-bytes")


def read_tensorboard(path: Path) -> dict:
    """Every scalar of every event file under `path` (tensorboard's own reader): {tag: {step: value}}."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    out: dict = {"_files": sorted(p.name for p in path.glob("events.out.tfevents.*"))}
    for f in sorted(path.glob("events.out.tfevents.*")):
        for event in EventFileLoader(str(f)).Load():
            for v in event.summary.value:
                value = v.simple_value if v.HasField("simple_value") else None
                if value is None and v.HasField("tensor"):
                    from tensorboard.util import tensor_util

                    value = float(tensor_util.make_ndarray(v.tensor))
                out.setdefault(v.tag, {})[int(event.step)] = value
    return out


def scenario_tensorboard(ctx) -> dict:
    """issue 17: the rendered pp2 job with spec.logging.tensorboard, both starts; event files read back."""
    _pod_setup(ctx)
    r = pods_job(ctx, REPO / "e2e" / "gpu" / "jobs" / "pp2-checkpoint.yaml")
    check("tensorboard" in r, "no --tensorboard-dir rendered", r.setdefault("failures", []))
    r["ok"] = not r["failures"]
    return r


def summary_losses(log: Path) -> dict[int, float]:
    """The exact losses (TRAINER_SUMMARY) of a run: the log line has 7 significant digits only. With
    PP, rank 0 prints a summary too (no losses): the ranks' summaries are merged."""
    found: dict = {}
    for summary in trainer_summaries(log.read_text(errors="replace")):
        found.update(summary.get("losses", {}))
    return {int(k): float(v) for k, v in found.items()}


def scenario_deterministic(ctx) -> dict:
    """issue 17: --deterministic-mode at TP, PP and DP (async checkpoints every 10): kill -9 a rank at
    iteration 25, restart -> resumes from the newest complete checkpoint -> every later loss is
    bit-identical (==) to the uninterrupted run's. --deterministic-attention math runs every run of it with
    MEGATRON_TRAINER_DETERMINISTIC_ATTENTION=math (the default: flash)."""
    gpus = ctx["gpus"]
    det_env = ctx.get("det_env", {})
    out: dict = {"env": det_env}
    layouts = [(n, tp, pp) for n, tp, pp in layouts_for(gpus) if n in (f"tp{gpus}", f"pp{gpus}", f"dp{gpus}")
               and (ctx["layouts"] is None or n in ctx["layouts"])]
    for name, tp, pp in layouts:
        ref_name = f"det_{name}"
        out[name] = r = reference_run(ctx, ref_name, tp, pp, extra=["--deterministic-mode"], env=det_env)
        ref = ctx["refs"][ref_name]
        exact_ref = summary_losses(LOGS / f"ref_{ref_name}.log")
        save = ckpt_loc(str(WORK / "ckpt" / f"detkill_{name}"))
        shutil.rmtree(save, ignore_errors=True)
        args = [save if a == ref["save"] else a for a in ref["args"]]
        run = Run(f"detkill_{name}", gpus, args, env=det_env)
        hit = run.wait_for(re.compile(r"iteration\s+25/"), 240)
        killed = run.kill_rank(gpus - 1)
        time.sleep(3)
        run.kill_tree()
        run.wait(60)
        run.close()
        complete = [it for it, ok in ckpt_state(save)["checkpoints"].items() if ok]
        expected = max(complete) if complete else None  # 20, or 10 if the save of 20 was still in flight
        again = Run(f"detkill_{name}_restart", gpus, args, env=det_env)
        rc = again.wait(300)
        again.close()
        resumed = RESUMED_RE.search(again.text())
        exact = summary_losses(again.log_path)
        later = sorted(i for i in exact if resumed and i > int(resumed.group(2)))
        differing = [(i, exact[i], exact_ref.get(i)) for i in later if exact[i] != exact_ref.get(i)]
        failures = r["failures"]
        check(hit is not None and killed, "kill at 25 not done", failures)
        check(rc == 0 and resumed is not None and expected is not None and int(resumed.group(2)) == expected,
              f"restart rc={rc} resumed={resumed.group(2) if resumed else None}, newest complete {expected}", failures)
        check(expected is not None and later == list(range(expected + 1, 41)), f"resumed iterations {later}",
              failures)
        check(not differing, f"not bit-identical: {differing[:3]}", failures)
        adam_step = re.search(r"optimizer resumes at AdamW step ([0-9.e+]+)", again.text())
        check(adam_step is not None and resumed is not None and float(adam_step.group(1)) == int(resumed.group(2)),
              f"AdamW step after the load {adam_step.group(1) if adam_step else None}, resumed iteration "
              f"{resumed.group(2) if resumed else None}", failures)
        warned = sorted(set(re.findall(r"(\w+) does not have a deterministic implementation", again.text())))
        r.update({"ok": not failures, "resumed_from": resumed.group(2) if resumed else None,
                  "compared_iterations": [later[0], later[-1]] if later else None, "bit_identical": not differing,
                  "first_differences": differing[:3], "ops_without_deterministic_kernel": warned,
                  "adam_step_after_load": adam_step.group(1) if adam_step else None})
    out["ok"] = all(out[n]["ok"] for n, _, _ in layouts) and bool(layouts)
    return out


# --deterministic-mode with SDPA's math attention instead of the flash kernel's deterministic backward, the default
# from 38e7422. Before it math was the default, and detcost's runs were default, deterministic (math) and
# deterministic_flash.
MATH_DETERMINISTIC_ENV = {"MEGATRON_TRAINER_DETERMINISTIC_ATTENTION": "math"}
# detcost's runs: name -> (flags, environment)
DETCOST_VARIANTS = {"default": ([], {}), "deterministic": (["--deterministic-mode"], {}),
                    "deterministic_math": (["--deterministic-mode"], MATH_DETERMINISTIC_ENV)}


def scenario_objbench(ctx) -> dict:
    """issue 33: one model, async saves every 10 iterations (4 saves in 40 iterations, keep 1), to local
    disk and to the object store on loopback (the server writes to the same disk): blocked time per
    save, seconds from the save's start to its publication, checkpoint bytes / that time."""
    if not STORE:
        return {"ok": False, "error": "needs --object-store"}
    gpus, model = ctx["gpus"], ctx.get("objbench_model", "gpt1b")
    mbs = MODELS[model]["mbs"]
    out: dict = {"model": model, "layout": f"TP{gpus}"}
    failures: list[str] = []
    for target in ("local", "s3"):
        local = str(WORK / "ckpt" / f"objbench_{target}")
        shutil.rmtree(local, ignore_errors=True)
        save = local if target == "local" else f"s3://{STORE_BUCKET}/objbench_{target}"
        args = trainer_args(model, tp=gpus, mbs=mbs, gbs=mbs, iters=40, save=save, save_interval=10,
                            lr="3e-4")
        run = Run(f"objbench_{target}", gpus, args, env={"MEGATRON_CHECKPOINT_KEEP": "1"})
        rc = run.wait(400)
        run.close()
        summary = run.summary() or {}
        saves = summary.get("checkpoint_saves", [])
        if target == "local":
            size = sum(f.stat().st_size for f in (Path(local) / "iter_0000040").rglob("*") if f.is_file())
        else:
            size = store_bytes(f"objbench_{target}/iter_0000040/")
        periodic = [x for x in saves if x.get("async")]
        totals = [x["total_s"] for x in periodic if x.get("total_s")]
        out[target] = {"rc": rc, "checkpoint_bytes": size, "saves": saves,
                       "median_blocked_s": statistics.median([x["blocked_s"] for x in periodic]) if periodic else None,
                       "median_publish_s": statistics.median(totals) if totals else None,
                       "bytes_per_s": round(size / statistics.median(totals)) if totals and size else None,
                       "state": ckpt_state(save)}
        shutil.rmtree(local, ignore_errors=True)  # disk: the store's copy lands on the same disk next
        check(rc == 0, f"{target}: rc={rc}", failures)
        check(len(totals) >= 3, f"{target}: {len(totals)} async saves published", failures)
    out.update(ok=not failures, failures=failures)
    return out


def sdpa_kernel(log_text: str) -> str | None:
    """The SDPA kernel the trainer logged at its first attention forward (attention.first_eligible), e.g.
    FLASH_ATTENTION; None where SDPA did not run on a GPU."""
    found = re.search(r"SDPA kernel \(first forward, layer \d+\): (\w+)", log_text)
    return found.group(1) if found else None


def scenario_detcost(ctx) -> dict:
    """issue 17: what --deterministic-mode costs: the benchmark model at TP=N, default vs deterministic (the flash
    kernel's deterministic backward) vs deterministic with SDPA's math attention, 12 iterations each, median
    iteration time of 4-12, same call."""
    gpus = ctx["gpus"]
    model, tp = ctx.get("bench_model", "gpt1b"), gpus
    mb = MODELS[model]["mbs"]
    cost: dict = {"model": model, "layout": f"TP{tp}"}
    for variant, (extra, env) in DETCOST_VARIANTS.items():
        run = Run(f"detcost_{variant}", gpus, trainer_args(model, tp=tp, mbs=mb, gbs=mb, iters=12, lr="3e-4",
                                                           warmup=2, extra=extra),
                  env={**env, **({"CUDA_DEVICE_MAX_CONNECTIONS": "1"} if tp > 1 else {})})
        rc = run.wait(300)
        run.close()
        ms = run.iteration_ms()
        steady = [ms[i] for i in sorted(ms) if 4 <= i <= 12]
        text, losses = run.text(), run.losses()  # the log read once each
        attention = re.search(r"attention=(SDPA \([^)]*\)|[^,]+)", text)
        cost[variant] = {"rc": rc, "median_iter_ms": statistics.median(steady) if steady else None,
                         "losses_1_3": [losses.get(i) for i in (1, 2, 3)],
                         "attention": attention.group(1) if attention else None, "sdpa_kernel": sdpa_kernel(text)}
    n = cost["default"]["median_iter_ms"]
    for variant, key in (("deterministic", "slowdown"), ("deterministic_math", "slowdown_math")):
        d = cost[variant]["median_iter_ms"]
        cost[key] = round(d / n, 3) if d and n else None
    cost["ok"] = cost["slowdown"] is not None and cost["slowdown_math"] is not None
    return cost


NCCL_PROTOS = ("", "Simple", "LL128", "LL")  # "": NCCL's own choice
COLLECTIVES_RE = re.compile(r"^COLLECTIVES (\{.*\})$", re.M)
NCCL_CHOICE_RE = re.compile(r"NCCL INFO .*(?:\bAlgo\b|\bproto|P2P|NVLS|NVL|via |Ring|Tree|Channel 00).*", re.I)


def dd_write(path: Path, gib: int, direct: bool) -> dict:
    """Sequential write of `gib` GiB of zeros with dd, O_DIRECT or buffered and flushed (conv=fdatasync)."""
    flag = ["oflag=direct"] if direct else ["conv=fdatasync"]
    t0 = time.monotonic()
    p = subprocess.run(["dd", "if=/dev/zero", f"of={path}", "bs=64M", f"count={gib * 16}", *flag],
                       capture_output=True, text=True, timeout=bounded(180))
    seconds = time.monotonic() - t0
    path.unlink(missing_ok=True)
    return {"rc": p.returncode, "gib": gib, "seconds": round(seconds, 2),
            "gb_per_s": round(gib * 2**30 / seconds / 1e9, 3) if p.returncode == 0 else None,
            "dd": (p.stderr.strip().splitlines() or [""])[-1]}


def scenario_disk(ctx) -> dict:
    """issue 49: the checkpoint disk's sequential write speed (the physical limit a save's write is measured
    against), with dd in the directory the checkpoints go to, O_DIRECT and buffered + fdatasync."""
    target = WORK / "ckpt"
    target.mkdir(parents=True, exist_ok=True)
    usage = shutil.disk_usage(target)
    df = subprocess.run(["df", "-hT", str(target)], capture_output=True, text=True).stdout
    out = {"free_gib": round(usage.free / 2**30, 1), "total_gib": round(usage.total / 2**30, 1), "df": df.strip(),
           "direct": dd_write(target / "dd.direct", 16, True), "buffered": dd_write(target / "dd.buffered", 16, False)}
    out["ok"] = out["direct"]["rc"] == 0 and out["buffered"]["rc"] == 0
    return out


def scenario_collectives(ctx) -> dict:
    """issue 29: the TP=2 collectives of Llama-3-8B (32 MiB of bf16 per micro-batch) alone, with NCCL's
    own protocol choice and with each protocol forced (NCCL_PROTO); NCCL's log of its choice is kept."""
    gpus = min(ctx["gpus"], 2)
    out: dict = {"ranks": gpus}
    failures: list[str] = []
    for proto in NCCL_PROTOS:
        env = {"NCCL_PROTO": proto} if proto else {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,GRAPH,TUNING"}
        name = f"collectives_{proto or 'default'}"
        run = Run(name, gpus, [], env=env, gpus=all_gpus(gpus), module=False,
                  script=str(REPO / "e2e" / "gpu" / "collectives.py"))
        rc = run.wait(120)
        run.close()
        text = run.text()
        m = COLLECTIVES_RE.search(text)
        out[proto or "default"] = json.loads(m.group(1)) if m else {"rc": rc}
        check(m is not None, f"{name}: rc={rc}, no result line", failures)
        if not proto:
            out["nccl_log"] = [line.strip()[:240] for line in NCCL_CHOICE_RE.findall(text)][:40]
    out.update(ok=not failures, failures=failures)
    return out


ROPE_RE = re.compile(r"^ROPE (\{.*\})$", re.M)
ROPE_SHAPES = ("llama8b-tp2", "llama3b-q", "llama3b-kv")


def scenario_rope(ctx) -> dict:
    """issue 29: Megatron's unfused RoPE on one GPU, eager against torch.compile (MEGATRON_TRAINER_COMPILE_ROPE=1)
    and against torch.compile with Inductor's emulate_precision_casts (=exact, the trainer's default): the
    elements of the output and of the input's gradient that differ from eager, and forward + backward time,
    for Llama-3-8B's query heads on one of two TP ranks and the 3B's query and key heads without TP
    (bench/rope_numerics.py). The first shape's figures stay at the top level (earlier calls' layout)."""
    run = Run("rope", 1, ["--device", "cuda", "--shape", *ROPE_SHAPES], gpus=all_gpus(1), module=False,
              script=str(REPO / "bench" / "rope_numerics.py"))
    rc = run.wait(240)
    run.close()
    found = [json.loads(m.group(1)) for m in ROPE_RE.finditer(run.text())]
    out: dict = dict(found[0]) if found else {"rc": rc}
    out["shapes"] = {r["name"]: r for r in found}
    failures: list[str] = []
    check(len(found) == len(ROPE_SHAPES), f"rope: rc={rc}, {len(found)} of {len(ROPE_SHAPES)} result lines", failures)
    for r in found:
        exact = r.get("exact", {})
        check(exact.get("output_elements_differing") == 0 and exact.get("grad_elements_differing") == 0,
              f"rope {r['name']}: the exact compiled RoPE differs from eager: {exact}", failures)
    out.update(ok=not failures, failures=failures)
    return out


# issue 17's three-way benchmark, one layout per device call: (GPUs, TP, PP); DP is what is left.
# The overlap flags Megatron-LM's run gets at DP > 1 (mlm_peer.sh); ours' DP runs compared with it take them too.
DP_OVERLAP = ["--overlap-grad-reduce", "--overlap-param-gather"]
THREEWAY = {"dp1": (1, 1, 1), "tp2": (2, 2, 1), "dp2": (2, 1, 1), "pp2": (2, 1, 2),
            # issue 49: 4 GPUs
            "tp2pp2": (4, 2, 2), "tp2pp2vpp2": (4, 2, 2), "tp2dp2": (4, 2, 1), "tp4": (4, 4, 1), "pp4": (4, 1, 4)}
THREEWAY_VPP = {"tp2pp2vpp2": 2}  # virtual pipeline stages per pipeline rank (both programs)
MLM_RE = re.compile(r"MLM RESULT iter_ms=([0-9.]+) MFU=([0-9.]+)% losses1_5=(\[[^\]]*\])")


def run_mlm_peer(name: str, gpus: int, model: str, tp: int, pp: int, gbs: int, visible: str,
                 flags: list[str] | tuple[str, ...] = (), env_extra: dict | None = None, vpp: int | None = None,
                 iters: int = 26) -> dict:
    """Megatron-LM's own pretrain_gpt.py (../shared/bench/mlm_peer.sh, carried as .run/mlm_peer.sh) on
    the same model, layout and global batch; Megatron-LM's source at core_v0.19.0 in .run/mlm.
    `env_extra`: more environment for its processes (stepdump's STEPDUMP_DIR)."""
    m = MODELS[model]
    wheel = sorted((REPO / ".whl").glob("megatron_core-*.whl"))
    env = dict(os.environ, MLM_DIR=str(REPO / ".run" / "mlm"), WHL=str(wheel[0]) if wheel else "", GPUS=str(gpus),
               TP=str(tp), PP=str(pp), LAYERS=str(m["layers"]), HIDDEN=str(m["hidden"]), HEADS=str(m["heads"]),
               FFN=str(m["ffn"]), SEQ=str(m["seq"]), VOCAB=str(m["vocab"]), MBS=str(m["mbs"]), GBS=str(gbs),
               ITERS=str(iters), VPP=str(vpp or ""), CUDA_VISIBLE_DEVICES=visible, PORT=str(free_port()),
               **(env_extra or {}))
    # Extra flags reach pretrain_gpt.py after the script's own (argparse: the last one wins). No RoPE fusion:
    # it needs Transformer Engine, and ours runs RoPE unfused on the local path too.
    extra = llama_flags(m) + (["--no-rope-fusion"] if m.get("arch") == "llama" else []) + list(flags)
    # mlm_peer.sh prints only its RESULT line; its full log (mktemp) lands here, for report_memory's peak.
    tmp = WORK / f"{name}_tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    env["TMPDIR"] = str(tmp)
    t0 = time.monotonic()
    try:
        p = subprocess.run(["bash", str(REPO / ".run" / "mlm_peer.sh"), *extra], capture_output=True, text=True,
                           env=env, timeout=bounded(420))
        text, rc = p.stdout + p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        text, rc = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or ""), -999
    full = "".join(f.read_text(errors="replace") for f in sorted(tmp.glob("tmp.*")))
    (LOGS / f"{name}.log").write_text(text + "\n--- pretrain_gpt.py log ---\n" + full[-200000:])
    text += full
    mm = MLM_RE.search(text)
    if not mm:
        return {"rc": rc, "error": text[-800:], "out_of_memory": "out of memory" in text.lower()}
    peaks = [float(x) / 1024 for x in re.findall(r"\| max allocated: ([0-9.]+)", text)]  # report_memory, MB
    logged = json.loads(mm.group(3))
    return {"rc": rc, "iter_ms": float(mm.group(1)), "mfu_pct_classic": float(mm.group(2)),
            "losses_1_5": mlm_losses_per_iteration(logged), "losses_1_5_as_logged": logged,
            "peak_alloc_gib": round(max(peaks), 2) if peaks else None, "wall_s": round(time.monotonic() - t0, 1)}


def mlm_losses_per_iteration(logged: list[float]) -> list[float]:
    """Megatron-LM's logged `lm loss` of iterations 1-5 (mlm_peer.sh runs it with --log-interval 1) as the
    loss of each iteration. Its training_log (megatron/training/training.py at core_v0.19.0) prints the
    first iteration without resetting its sums (`should_reset = not is_first_iteration`), so the line of
    iteration 2 is the mean of iterations 1 and 2; from iteration 3 on each line is its own iteration.
    Found on 2026-11-26: ours, with the forward pass computed as Megatron-LM's, logged 12.5837 and 12.5954
    where Megatron-LM logged 12.5837 and 12.58955 = (12.5837 + 12.5954) / 2 (docs/benchmarks/megatron-lm.md#2026-11-26-iteration-2-log-line)."""
    losses = list(logged)
    if len(losses) >= 2:
        losses[1] = round(2 * losses[1] - losses[0], 6)
    return losses


def all_gpus(gpus: int) -> str:
    """CUDA_VISIBLE_DEVICES for the first `gpus` GPUs."""
    return ",".join(str(i) for i in range(gpus))


def mlm_second_peer(name: str, gpus: int, model: str, tp: int, gbs: int) -> dict:
    """Megatron-LM's pretrain_gpt.py as the second peer of `bench` and `perf` (issue 17), when its
    source is carried in .run/mlm; otherwise a record saying it was not (never a silent omission)."""
    if not (REPO / ".run" / "mlm" / "pretrain_gpt.py").is_file() or not (REPO / ".run" / "mlm_peer.sh").is_file():
        return {"not_run": "Megatron-LM's source (.run/mlm) or .run/mlm_peer.sh not carried"}
    return run_mlm_peer(name, gpus, model, tp, 1, gbs, all_gpus(gpus))


def ratio_vs_mlm(ours_ms: float | None, mlm: dict) -> float | None:
    return round(mlm["iter_ms"] / ours_ms, 3) if ours_ms and mlm.get("iter_ms") else None


def scenario_threeway(ctx) -> dict:
    """issue 17: ours (the default configuration the operator renders) / Megatron-LM's pretrain_gpt.py /
    the guides' loop (mcore_peer.py; TP x DP only) on the benchmark model, for each layout of
    --threeway (comma-separated), the three loops of a layout one after the other in the same call, same
    global batch; iteration time = median of iterations 4-20; MFU by the classic formula for all three."""
    # "tp2:llama8b,pp2:llama3b": a layout may name its own model (default --bench-model)
    specs = [x.split(":", 1) for x in (ctx.get("threeway") or "tp2").split(",") if x]
    layouts = [x[0] for x in specs]
    models = {x[0]: x[1] for x in specs if len(x) == 2}
    unknown = [x for x in layouts if x not in THREEWAY] + [m for m in models.values() if m not in MODELS]
    if unknown:
        return {"ok": False, "error": f"unknown --threeway layouts or models {unknown}; known: {sorted(THREEWAY)}, "
                                      f"{sorted(MODELS)}"}
    out: dict = {}
    for layout in layouts:
        if time.monotonic() + 150 > DEADLINE[0]:
            out[layout] = {"ok": False, "skipped": "deadline"}
            continue
        out[layout] = threeway_layout(dict(ctx, bench_model=models.get(layout, ctx.get("bench_model"))), layout)
    out["ok"] = bool(layouts) and all(out[x].get("ok") for x in layouts)
    return out


def threeway_layout(ctx, layout: str) -> dict:
    """One layout: Megatron-LM first (the loop that needs more memory: its local spec keeps the s x s
    attention scores), then ours. If Megatron-LM runs out of memory on --bench-model and
    --threeway-fallback names a model, both loops are measured on that model ("what fits"), and ours
    also runs on the model Megatron-LM could not fit, as a record of its own."""
    gpus, tp, pp = THREEWAY[layout]
    vpp, iters = THREEWAY_VPP.get(layout), ctx.get("threeway_iters") or 26
    models = [ctx.get("bench_model", "gpt1b")] + ([ctx["threeway_fallback"]] if ctx.get("threeway_fallback") else [])
    visible = all_gpus(gpus)
    out: dict = {"layout": layout, "gpus": gpus, "virtual_pipeline": vpp, "iterations": iters}
    for i, model in enumerate(models):
        gbs = ctx.get("threeway_gbs") or threeway_gbs(model, gpus, tp, pp)
        mlm = run_mlm_peer(f"threeway_mlm_{layout}_{model}", gpus, model, tp, pp, gbs, visible, vpp=vpp, iters=iters)
        if mlm.get("iter_ms"):
            mlm.update(throughput_fields(model, gbs, mlm["iter_ms"], gpus))
        if mlm.get("out_of_memory") and i + 1 < len(models):
            out.setdefault("megatron_lm_did_not_fit", {})[model] = {"global_batch": gbs, **mlm}
            continue
        out.update(model=model, global_batch=gbs, megatron_lm=mlm)
        break
    model, gbs, mlm = out["model"], out["global_batch"], out["megatron_lm"]
    for name in sorted(ctx.get("threeway_mlm_variants", ())):  # Megatron-LM with extra flags, for A/B runs
        key = f"megatron_lm_{name}"
        if time.monotonic() + 150 > DEADLINE[0]:
            out[key] = {"skipped": "deadline"}
            continue
        out[key] = run_mlm_peer(f"threeway_mlm_{name}_{layout}_{model}", gpus, model, tp, pp, gbs, visible,
                                MLM_VARIANTS[name], vpp=vpp, iters=iters)
        if out[key].get("iter_ms"):
            out[key].update(throughput_fields(model, gbs, out[key]["iter_ms"], gpus))
    m = MODELS[model]
    dp = gpus // (tp * pp)
    # "ours" is the configuration the operator renders by default (distributed optimizer, no overlap
    # flags); with DP > 1 the overlap flags Megatron-LM's run gets are measured too, as a variant.
    variants = [("default", [])] + ([("overlap", list(DP_OVERLAP))] if dp > 1 and not ctx.get("threeway_skip_overlap")
                                    else [])
    # ours' default has the full-iteration CUDA graph where the trainer verifies it (--cuda-graph-impl auto:
    # PP=1 here); "eager" measures the same run without it.
    variants = [(name, extra, {}) for name, extra in variants]
    for name in sorted(ctx.get("threeway_variants", ())):
        env, extra = THREEWAY_VARIANTS[name]
        if name != "eager" or pp == 1:
            variants.append((name, extra, env))
    for variant, extra, env in variants:
        key = "ours" if variant == "default" else f"ours_{variant}"
        if key != "ours" and time.monotonic() + 120 > DEADLINE[0]:
            out[key] = {"skipped": "deadline"}
            continue
        out[key] = run_ours_threeway(ctx, f"threeway_{key}_{layout}", model, gpus, tp, pp, gbs, extra, variant, env,
                                     vpp=vpp, iters=iters)
    if model != models[0] and time.monotonic() + 150 < DEADLINE[0]:
        # ours on the model Megatron-LM could not fit: does the default configuration fit, and how fast is it
        big = models[0]
        out["ours_on_" + big] = run_ours_threeway(ctx, f"threeway_ours_{layout}_{big}", big, gpus, tp, pp,
                                                  threeway_gbs(big, gpus, tp, pp), [], "default")
    ours_ms, rc = out["ours"]["iter_ms"], out["ours"]["rc"]
    for key in ["ours", "ours_overlap"] + [f"ours_{v}" for v in THREEWAY_VARIANTS]:  # each run of ours vs Megatron-LM
        prefix = "" if key == "ours" else f"{key}_"
        compare_with_mlm(out, out.get(key, {}), mlm, f"{key}_speedup_vs_megatron_lm",
                         f"{prefix}losses_1_5_max_abs_diff_vs_megatron_lm")
    for name in ctx.get("threeway_mlm_variants", ()):  # a variant of both loops: ours_X against megatron_lm_X
        compare_with_mlm(out, out.get(f"ours_{name}", {}), out.get(f"megatron_lm_{name}", {}),
                         f"ours_{name}_speedup_vs_megatron_lm_{name}",
                         f"ours_{name}_losses_1_5_max_abs_diff_vs_megatron_lm_{name}")
    compare_reruns(out, ctx.get("threeway_variants", ()))
    if pp == 1 and m.get("arch") != "llama":  # the guides' loop builds a GPT only
        out["guides_loop"] = run_peer(f"threeway_peer_{layout}", gpus, model, tp)
    failures: list[str] = []
    check(ours_ms is not None, f"ours rc={rc}", failures)
    check("iter_ms" in mlm, "Megatron-LM did not run", failures)
    peer = out.get("guides_loop", {})
    if ours_ms and "iter_ms" in peer:
        out["ours_speedup_vs_guides_loop"] = round(peer["iter_ms"] / ours_ms, 3)
    out["ok"], out["failures"] = not failures, failures
    return out


def compare_with_mlm(out: dict, ours: dict, mlm: dict, speedup_key: str, losses_key: str) -> None:
    """One run of ours against one of Megatron-LM's: its speed-up (`speedup_key`) and the largest difference of
    losses 1-5 (`losses_key`), each set in `out` only where both runs have the figures."""
    ratio = ratio_vs_mlm(ours.get("iter_ms"), mlm)
    if ratio is not None:
        out[speedup_key] = ratio
    a, b = ours.get("losses_1_5") or [], mlm.get("losses_1_5") or []
    if len(a) == 5 and len(b) == 5 and None not in a and None not in b:
        out[losses_key] = round(max(abs(x - y) for x, y in zip(a, b, strict=True)), 6)


def compare_reruns(out: dict, variants) -> None:
    """A variant named X+"again" reruns X's command line (`again`: the default's) in the same call: its losses
    against X's are ours' run-to-run spread, set as ours_Xagain_losses_1_5_max_abs_diff_vs_<X's key>."""
    for name in sorted(variants):
        if name.endswith("again"):
            base = f"ours_{name[:-len('again')]}" if name != "again" else "ours"
            compare_with_mlm(out, out.get(f"ours_{name}", {}), out.get(base, {}), f"ours_{name}_speed_vs_{base}",
                             f"ours_{name}_losses_1_5_max_abs_diff_vs_{base}")


def threeway_gbs(model: str, gpus: int, tp: int, pp: int) -> int:
    """PP=2: 4 micro-batches; a model may ask for more ("accum")."""
    m = MODELS[model]
    return m["mbs"] * (gpus // (tp * pp)) * m.get("accum", 4 if pp > 1 else 1)


# Extra variants of ours in threeway (--threeway-variants): name -> (environment, flags).
FUSED_ENV = {"MEGATRON_TRAINER_COMPILE_NORM": "1", "MEGATRON_TRAINER_CE_FUSION": "1"}
THREEWAY_VARIANTS = {
    "eager": ({}, ["--cuda-graph-impl", "none"]),  # the same run without the full-iteration CUDA graph
    "nofusion": ({}, ["--no-gradient-accumulation-fusion"]),  # weight gradients in bf16, then an fp32 add
    "nccl32": ({"NCCL_MIN_NCHANNELS": "32"}, []),  # more NCCL channels for the TP all-reduces
    "torchadam": ({"MEGATRON_TRAINER_FUSED_ADAM": "0"}, []),  # torch AdamW's foreach kernels, not its fused one
    "sp": ({}, ["--sequence-parallel"]),  # sequence parallelism forced on (the local path's default is off)
    "norope": ({"MEGATRON_TRAINER_COMPILE_ROPE": "0"}, []),  # Megatron's unfused RoPE, eager
    "normcompile": ({"MEGATRON_TRAINER_COMPILE_NORM": "1"}, []),  # RMSNorm through torch.compile
    "cefusion": ({"MEGATRON_TRAINER_CE_FUSION": "1"}, []),  # Megatron's native fused cross entropy
    "fused": (FUSED_ENV, []),  # the compiled norm and the fused cross entropy on top of the defaults
    "ncclsimple": ({"NCCL_PROTO": "Simple"}, []),  # NCCL's Simple protocol forced for every collective
    "nccll128": ({"NCCL_PROTO": "LL128"}, []),  # NCCL's LL128 protocol forced
    "tpoverlap2": ({"MEGATRON_TRAINER_TP_OVERLAP_CHUNKS": "2"}, []),  # row-parallel forward in 2 overlapped pieces
    "tpoverlap4": ({"MEGATRON_TRAINER_TP_OVERLAP_CHUNKS": "4"}, []),  # the same in 4 pieces
    # the same, with the GEMM pieces that run beside an all-reduce leaving 16 SMs to NCCL (of 132 on H100/H200)
    "tpoverlap2c16": ({"MEGATRON_TRAINER_TP_OVERLAP_CHUNKS": "2", "MEGATRON_TRAINER_TP_OVERLAP_SM_CARVEOUT": "16"}, []),
    "tpoverlap4c16": ({"MEGATRON_TRAINER_TP_OVERLAP_CHUNKS": "4", "MEGATRON_TRAINER_TP_OVERLAP_SM_CARVEOUT": "16"}, []),
    # 2 pieces, NCCL held to 8 CTAs (every collective) and 8 SMs left to it
    "tpoverlap2c8cta8": ({"MEGATRON_TRAINER_TP_OVERLAP_CHUNKS": "2", "MEGATRON_TRAINER_TP_OVERLAP_SM_CARVEOUT": "8",
                          "NCCL_MAX_CTAS": "8"}, []),
    "unfused": ({}, ["--attention-backend", "unfused"]),  # Megatron's DotProductAttention, as Megatron-LM's local spec
    # ours as close to Megatron-LM's run as its flags go: unfused attention, eager (no CUDA graph), Megatron's
    # unfused RoPE, torch AdamW's foreach kernels, weight gradients in bf16 then added (for the loss comparison)
    "mlmlike": ({"MEGATRON_TRAINER_COMPILE_ROPE": "0", "MEGATRON_TRAINER_FUSED_ADAM": "0"},
                ["--attention-backend", "unfused", "--cuda-graph-impl", "none", "--no-gradient-accumulation-fusion"]),
    # only what changes the forward pass as Megatron-LM's does: unfused attention, eager, unfused RoPE (mlmlike ran
    # out of memory on the 8B at TP=2 on H200 in iteration 2: foreach AdamW's and the bf16 weight gradients' buffers)
    "mlmfwd": ({"MEGATRON_TRAINER_COMPILE_ROPE": "0"}, ["--attention-backend", "unfused", "--cuda-graph-impl", "none"]),
    # the compiled RoPE with Inductor's emulate_precision_casts: eager's bf16 rounding of each intermediate (the
    # default from c3c0f8c); ropefast: compiled without it (the default before)
    "ropeexact": ({"MEGATRON_TRAINER_COMPILE_ROPE": "exact"}, []),
    "ropefast": ({"MEGATRON_TRAINER_COMPILE_ROPE": "1"}, []),
    # micro-batches of 2 sequences, the global batch unchanged (half as many fp32 weight-gradient accumulations)
    "mbs2": ({}, ["--micro-batch-size", "2"]),
    # the same command line once more in the same call: how far ours moves against itself (run-to-run spread)
    "again": ({}, []),
    "unfusedagain": ({}, ["--attention-backend", "unfused"]),
}

# Megatron-LM's extra runs in threeway (--threeway-mlm-variants): name -> flags for pretrain_gpt.py.
# mlmlike with Megatron-Core's own multi-tensor fallbacks (grad-norm and scale per tensor) instead of ours' foreach
THREEWAY_VARIANTS["mlmlikemt"] = ({**THREEWAY_VARIANTS["mlmlike"][0], "MEGATRON_TRAINER_FOREACH_OPS": "0"},
                                  THREEWAY_VARIANTS["mlmlike"][1])

MLM_VARIANTS = {
    "softmaxfp32": ["--attention-softmax-in-fp32"],  # its unfused attention's softmax in fp32, as ours computes it
    "mbs2": ["--micro-batch-size", "2"],  # as ours' mbs2: ours_mbs2 is also compared with this run
    # the two TransformerConfig settings where ours differs from Megatron-LM's command-line defaults (found on the
    # CPU by building both configs): the unfused attention's softmax in fp32 (Megatron-Core's own default, ours) and
    # the loss summed over tokens and divided by their count after the backward (ours)
    "oursconfig": ["--attention-softmax-in-fp32", "--calculate-per-token-loss"],
}


def run_ours_threeway(ctx, name: str, model: str, gpus: int, tp: int, pp: int, gbs: int, extra: list[str],
                      variant: str, variant_env: dict | None = None, vpp: int | None = None, iters: int = 26) -> dict:
    """One run of ours in threeway: median iteration 4 to iters-6 (4-20 of 26), the window mlm_peer.sh takes;
    profiled over iteration 22 when --threeway-profile names the variant (a kernel-time breakdown per rank
    lands in the result)."""
    m = MODELS[model]
    env = {"CUDA_DEVICE_MAX_CONNECTIONS": "1"} if tp > 1 else {}
    env.update(variant_env or {})
    profile_dir = LOGS / f"profile_{name}"
    if variant in ctx.get("threeway_profile", ()):
        env["MEGATRON_TRAINER_PROFILE"] = f"22:22:{profile_dir}"
    if vpp:
        extra = list(extra) + ["--num-virtual-stages-per-pipeline-rank", str(vpp)]
    ours = Run(name, gpus, trainer_args(model, tp=tp, pp=pp, mbs=m["mbs"], gbs=gbs, iters=iters, lr="3e-4", warmup=4,
                                        extra=extra), env=env, gpus=all_gpus(gpus))
    rc = ours.wait(bounded(300))
    wall = time.monotonic() - ours.started
    ours.close()
    text = ours.text()  # the log, read once
    logged = [(int(x.group(1)), float(x.group(2)), float(x.group(3)), float(x.group(5))) for x in ITER_RE.finditer(text)]
    steady = [ms for i, ms, _, _ in logged if 4 <= i <= iters - 6]
    it_ms = statistics.median(steady) if steady else None
    losses = {i: loss for i, _, loss, _ in logged}
    graph = re.search(r"CUDA graph: (\S+) \(([^)]*)\)", text)
    fusion = re.search(r"wgrad accumulation fusion=([^,\n]+)", text)
    res = {"rc": rc, "model": model, "global_batch": gbs, "iter_ms": it_ms, "flags": extra, "env": variant_env or {},
           "wgrad_fusion": fusion.group(1).strip() if fusion else None, "sdpa_kernel": sdpa_kernel(text),
           "losses_1_5": [losses.get(i) for i in range(1, 6)],
           "peak_alloc_gib_logging_rank": max((peak for *_, peak in logged), default=None),
           "cuda_graph": graph.group(1) if graph else None, "cuda_graph_reason": graph.group(2) if graph else None}
    if rc != 0 and "out of memory" in text.lower():
        res["out_of_memory"] = True
    if it_ms:
        res.update(throughput_fields(model, gbs, it_ms, gpus))
    summary = (trainer_summaries(text) or [None])[-1] or {}
    res["peak_alloc_gib_per_rank"] = [round(r["peak_allocated_gib"], 2) for r in summary.get("memory_per_rank", [])]
    startup = STARTUP_RE.search(text)
    res["startup_to_first_iteration_s"] = float(startup.group(1)) if startup else None
    res["wall_s"] = round(wall, 1)
    if profile_dir.is_dir():
        res["profile"] = profile_breakdown(profile_dir)
    return res


# Kernel categories of a profile, by the first pattern that matches the kernel's name (lower case).
KERNEL_CATEGORIES = (
    ("nccl", ("nccl",)),
    ("attention", ("flash", "fmha", "attention", "sdpa", "cudnn")),
    ("gemm", ("gemm", "xmma", "cutlass", "nvjet", "cublas", "wgmma", "sm90_", "sm80_")),
    ("optimizer", ("multi_tensor", "foreach", "adam")),
    ("norm", ("rms", "norm")),
    ("softmax_loss", ("softmax", "cross_entropy", "nll", "logsumexp")),
    # torch.compile's kernels (compiled RoPE, SwiGLU): their names list the fused ops ("cat", "_to_copy"),
    # which would otherwise count them as copies
    ("compiled", ("triton_",)),
    ("copy", ("memcpy", "memset", "copy", "cat_", "catarray")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "reduce", "index", "scatter", "gather")),
)


def kernel_category(name: str) -> str:
    """The first KERNEL_CATEGORIES entry whose pattern is in the kernel's name, else "other"."""
    low = name.lower()
    return next((c for c, pats in KERNEL_CATEGORIES if any(p in low for p in pats)), "other")


def merged(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted (start, end) intervals merged where they overlap."""
    out: list[tuple[float, float]] = []
    for a, b in spans:
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def covered(a: float, b: float, union: list[tuple[float, float]]) -> float:
    """How much of [a, b) the merged intervals `union` cover."""
    import bisect

    i = max(0, bisect.bisect_right(union, (a, float("inf"))) - 1)
    got = 0.0
    while i < len(union) and union[i][0] < b:
        got += max(0.0, min(b, union[i][1]) - max(a, union[i][0]))
        i += 1
    return got


def profile_breakdown(directory: Path, big_trace_bytes: int = 6 << 20) -> dict:
    """Per rank, from torch.profiler's Chrome trace of one iteration: GPU kernel time by category, the
    iteration's span on the GPU (first kernel start to last kernel end), the time some kernel was running
    (union over streams) and the GPU-idle share of the span. Traces over `big_trace_bytes` are deleted
    after reading (the logs archive must stay small enough to come back); the operator tables stay."""
    import gzip

    out: dict = {}
    for trace in sorted(directory.glob("rank*.json.gz")):
        try:
            events = json.loads(gzip.open(trace).read()).get("traceEvents", [])
        except Exception as e:  # diagnostics only
            out[trace.name] = {"error": f"{type(e).__name__}: {e}"}
            continue
        kernels = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
        if not kernels:
            out[trace.name.split(".")[0]] = {"kernels": 0}
            continue
        by_cat: dict[str, float] = {}
        top: dict[str, float] = {}
        nccl: list[tuple[float, float]] = []
        compute: list[tuple[float, float]] = []
        for e in kernels:
            cat = kernel_category(str(e.get("name", "")))
            by_cat[cat] = by_cat.get(cat, 0.0) + e["dur"]
            top[e.get("name", "")[:90]] = top.get(e.get("name", "")[:90], 0.0) + e["dur"]
            (nccl if cat == "nccl" else compute).append((e["ts"], e["ts"] + e["dur"]))
        spans = sorted(nccl + compute)
        busy = sum(b - a for a, b in merged(spans))
        span = spans[-1][1] - spans[0][0]
        total = sum(by_cat.values())
        compute = merged(sorted(compute))
        out[trace.name.split(".")[0]] = {
            "kernels": len(kernels), "gpu_span_ms": round(span / 1000, 2), "gpu_busy_ms": round(busy / 1000, 2),
            "gpu_idle_pct_of_span": round(100 * (1 - busy / span), 2) if span else None,
            # communication no compute kernel runs beside (what overlap could still win), and compute alone
            "nccl_exposed_ms": round(sum(b - a - covered(a, b, compute) for a, b in nccl) / 1000, 2),
            "compute_busy_ms": round(sum(b - a for a, b in compute) / 1000, 2),
            "kernel_ms_by_category": {k: round(v / 1000, 2) for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1])},
            "kernel_pct_by_category": {k: round(100 * v / total, 1) for k, v in sorted(by_cat.items(), key=lambda kv: -kv[1])},
            "top_kernels_ms": {k: round(v / 1000, 2) for k, v in sorted(top.items(), key=lambda kv: -kv[1])[:12]}}
        if trace.stat().st_size > big_trace_bytes:
            trace.unlink()
            out[trace.name.split(".")[0]]["trace_deleted"] = "over the size that comes back"
    return out


def pods_arg(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


def scenario_pods(ctx) -> dict:
    """`megatron-operator render` on the three test-only jobs (e2e/gpu/jobs); every pod run verbatim."""
    import pods as P

    if "data" not in ctx:
        r = scenario_indexed(ctx)
        if not r.get("ok"):
            return {"ok": False, "failures": ["preprocessing failed"], "indexed": r}
    corpus = P.PVC_ROOT / "corpus"
    shutil.rmtree(corpus, ignore_errors=True)
    (corpus / "text").mkdir(parents=True)
    for prefix in ctx["data"]["blend"][1::2]:
        for ext in (".bin", ".idx"):
            shutil.copy(prefix + ext, corpus / "text" / (Path(prefix).name + ext))
    shutil.copytree(ctx["data"]["tokenizer"], corpus / "tokenizers" / "bpe")
    subprocess.run(["chmod", "-R", "a+rX,go-w", str(corpus)], check=True)  # read-only PVC, owned by root
    _, ns_ok, ns_msg = _pod_setup(ctx)
    out = {"mount_namespace_per_pod": ns_ok, "namespace_probe": ns_msg}
    jobs = ctx.get("pod_jobs") or POD_JOBS
    for job in jobs:
        try:
            out[job] = pods_job(ctx, REPO / "e2e" / "gpu" / "jobs" / f"{job}.yaml")
        except Exception as e:
            out[job] = {"ok": False, "failures": [f"{type(e).__name__}: {e}"], "trace": traceback.format_exc()[-1500:]}
        flush_outputs(ctx["out_dir"], {**ctx.get("results", {}), "pods": out}, ctx)
    return {"ok": all(out[j]["ok"] for j in jobs), **out}


def scenario_preempt(ctx) -> dict:
    """A rendered pod whose final save takes > 30 s: SIGTERM -> the launcher waits (torchrun would SIGKILL
    after 30 s) -> a complete checkpoint, exit 0 -> a restart resumes from it."""
    import pods as P

    image, ns_ok, ns_msg = _pod_setup(ctx)
    jobset = P.render(REPO / "e2e" / "gpu" / "jobs" / "slow-save-tp2.yaml")
    name = jobset["metadata"]["name"]
    P.map_host(P.master_address(jobset))
    pod_spec = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    grace, uid = pod_spec["terminationGracePeriodSeconds"], pod_spec["securityContext"]["runAsUser"]
    save = P.PVC_ROOT / "checkpoints" / name
    shutil.rmtree(save, ignore_errors=True)
    failures: list[str] = []
    first = _start_pods(jobset, 0, ctx["gpus"], "start1", image, ns_ok)
    out = {"mount_namespace_per_pod": ns_ok, **_pod_log(first)}
    hit = P.wait_log(first, re.compile(r"iteration\s+3/"), bounded(400))
    check(hit is not None, "never reached iteration 3", failures)
    t0 = time.monotonic()
    for p in first:
        p.sigterm()
    rcs = P.wait_all(first, bounded(grace + 30))
    exit_s = time.monotonic() - t0
    for p in first:
        p.kill_tree()
    text = "".join(p.text() for p in first)
    stop = STOPPING_RE.search(text)
    stopped_at = int(stop.group(1)) if stop else None
    published = {int(a): float(b) for a, b in P.PUBLISHED_RE.findall(text)}
    state = ckpt_state(save)
    size_gb = sum(f.stat().st_size for f in save.rglob("*") if f.is_file()) / 1e9 if save.exists() else 0.0
    losses1 = P.losses_of(first)
    check(rcs == [0], f"exit codes {rcs}", failures)
    check("SIGTERM received: forwarding SIGTERM" in text, "launcher did not report forwarding SIGTERM", failures)
    check(stop is not None and stop.group(2) == "signal", "no 'stopping ... (signal)'", failures)
    check(stopped_at is not None and published.get(stopped_at, 0) > 30,
          f"final save of {stopped_at} took {published.get(stopped_at)} s (needs > 30 s)", failures)
    check(stopped_at is not None and state["tracker"] == stopped_at and bool(state["checkpoints"].get(stopped_at)),
          f"checkpoint {state}", failures)
    check(30 < exit_s < grace, f"SIGTERM -> exit {exit_s:.1f} s (grace {grace} s)", failures)
    check(not _no_pod_processes(uid), "processes left after exit", failures)
    second = _start_pods(jobset, 1, ctx["gpus"], "start2", image, ns_ok)
    resumed = P.wait_log(second, RESUMED_RE, bounded(400))
    more = P.wait_log(second, re.compile(rf"iteration\s+{(stopped_at or 0) + 2}/"), bounded(120))
    for p in second:
        p.kill_tree()
    load = re.search(r"resumed from .* in ([0-9.]+) s", "".join(p.text() for p in second))
    losses2 = P.losses_of(second)
    first_after = losses2.get((stopped_at or 0) + 1)
    last_before = losses1[max(losses1)] if losses1 else None  # the trainer logs every --log-interval
    check(resumed is not None and stopped_at is not None and int(resumed.group(2)) == stopped_at,
          f"resumed from {resumed.group(2) if resumed else None}, expected {stopped_at}", failures)
    check(more is not None and first_after is not None and last_before is not None
          and abs(first_after - last_before) < 0.1 * last_before,
          f"loss after resume {first_after} vs before {last_before}", failures)
    out.update({"ok": not failures, "failures": failures, "exit_code": rcs, "stopped_at": stopped_at,
                "final_save_s": published.get(stopped_at), "checkpoint_gb": round(size_gb, 1),
                "sigterm_to_exit_s": round(exit_s, 1), "grace_s": grace, "resumed_from": resumed.group(2) if resumed else None,
                "load_s": float(load.group(1)) if load else None, "loss_before": last_before, "loss_after": first_after})
    shutil.rmtree(save, ignore_errors=True)
    return out


SCENARIOS = {"probe": scenario_probe, "indexed": scenario_indexed, "layouts": scenario_layouts,
             "resume": scenario_resume, "sigterm": scenario_sigterm, "reshard": scenario_reshard,
             "bench": scenario_bench, "memory": scenario_memory, "perf": scenario_perf,
             "pods": scenario_pods, "preempt": scenario_preempt, "tensorboard": scenario_tensorboard,
             "deterministic": scenario_deterministic, "detcost": scenario_detcost, "objbench": scenario_objbench, "threeway": scenario_threeway,
             "collectives": scenario_collectives, "rope": scenario_rope, "disk": scenario_disk}
try:  # issue 27: Hugging Face import/export (e2e/gpu/hf.py; needs transformers, which the GPU image has)
    from hf import (
        scenario_hf_bench,
        scenario_hf_logits,
        scenario_hf_pods,
        scenario_hf_store,
        scenario_hf_train,
    )

    SCENARIOS.update(hf_logits=scenario_hf_logits, hf_train=scenario_hf_train, hf_bench=scenario_hf_bench,
                     hf_pods=scenario_hf_pods, hf_store=scenario_hf_store)
except ImportError as _e:  # pragma: no cover - reported by --only hf_*
    print(f"hf scenarios unavailable: {_e}", file=sys.stderr)
try:  # issue 28: supervised fine-tuning (e2e/gpu/sft.py; transformers for the oracle)
    from sft import scenario_sft_bench, scenario_sft_pods, scenario_sft_reverse, scenario_sft_sigterm

    SCENARIOS.update(sft_reverse=scenario_sft_reverse, sft_bench=scenario_sft_bench, sft_pods=scenario_sft_pods,
                     sft_sigterm=scenario_sft_sigterm)
except ImportError as _e:  # pragma: no cover - reported by --only sft_*
    print(f"sft scenarios unavailable: {_e}", file=sys.stderr)
from stepdump import scenario_stepdump  # noqa: E402  (issue 29: e2e/gpu/stepdump.py; needs only torch)

SCENARIOS["stepdump"] = scenario_stepdump


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--gpus", type=int, default=None)
    ap.add_argument("--only", default=",".join(SCENARIOS))
    ap.add_argument("--memory", default=",".join(c[0] for c in MEMORY_CONFIGS), help="memory configs to run")
    ap.add_argument("--layouts", default=None, help="layouts to train (default: all for the GPU count)")
    ap.add_argument("--resume-on", default=None, help="reference layouts for the kill -9 test (default: all)")
    ap.add_argument("--bench-on", default=None, help="benchmark layouts (default: all for the GPU count)")
    ap.add_argument("--model", default="small", choices=sorted(MODELS), help="model of layouts/resume/sigterm/reshard")
    ap.add_argument("--bench-model", default="gpt1b", choices=sorted(MODELS), help="model of the benchmark")
    ap.add_argument("--reshard-from", default=None, help="layout whose checkpoint is resharded (default tpN)")
    ap.add_argument("--reshard-to", default=None, help="layouts to resume it under (default ppN,dpN)")
    ap.add_argument("--perf-variants", default=None, help=f"perf variants (default: all of {sorted(PERF_VARIANTS)})")
    ap.add_argument("--perf-profile", default="", help="perf variants to profile over iteration 22")
    ap.add_argument("--bench-variant", default="foreach",
                    help="PERF_VARIANTS entry ours runs in the benchmark, or 'auto': the fastest one perf measured")
    ap.add_argument("--ours-extra", default="", help="flags appended to every trainer command line (space separated)")
    ap.add_argument("--pod-jobs", default="", help=f"e2e/gpu/jobs of the pods scenario (default {','.join(POD_JOBS)}; "
                    "llama-1gpu runs on one GPU)")
    ap.add_argument("--threeway", default="tp2",
                    help=f"layouts of the threeway scenario, comma-separated, of {sorted(THREEWAY)}; LAYOUT:MODEL "
                    "gives a layout its own model")
    ap.add_argument("--threeway-variants", default="", help="extra variants of ours in threeway, comma-separated, of "
                    f"{sorted(THREEWAY_VARIANTS)} (what each changes: THREEWAY_VARIANTS in e2e/gpu/suite.py)")
    ap.add_argument("--threeway-mlm-variants", default="", help="extra runs of Megatron-LM in threeway, comma-separated, "
                    f"of {sorted(MLM_VARIANTS)} (MLM_VARIANTS in e2e/gpu/suite.py)")
    ap.add_argument("--threeway-profile", default="", help="variants of ours in threeway (default, eager, overlap) to "
                    "profile over iteration 22 on the first and last rank")
    ap.add_argument("--threeway-fallback", default=None, choices=sorted(MODELS),
                    help="threeway's model where Megatron-LM runs out of memory on --bench-model")
    ap.add_argument("--threeway-gbs", type=int, default=None,
                    help="threeway's global batch (default: 4 micro-batches per pipeline, or the model's accum)")
    ap.add_argument("--threeway-iters", type=int, default=None,
                    help="iterations of each threeway run (default 26; the median is over 4 .. N-6)")
    ap.add_argument("--threeway-skip-overlap", action="store_true",
                    help="at DP > 1, leave out the run of ours with Megatron-LM's overlap flags (ours' default only)")
    ap.add_argument("--stepdump", default="dp1:llama1b",
                    help="layout:model[:Megatron-LM variant[:ours' variant]] of the stepdump scenario, comma-separated "
                         "(layouts as --threeway's; e2e/gpu/stepdump.py)")
    ap.add_argument("--perf-tp", type=int, default=None, help="TP of the perf runs (default: all GPUs)")
    ap.add_argument("--deadline-s", type=float, default=540, help="stop starting scenarios after this; runs already started are cut OVERRUN_S (30 s) "
                    "after it, so keep it at least 60 s under the device call's limit (wheel install, exit)")
    ap.add_argument("--stop-on-failure", default="layouts", help="scenarios whose failure ends the suite")
    ap.add_argument("--deterministic-attention", choices=("flash", "math"), default="flash",
                    help="MEGATRON_TRAINER_DETERMINISTIC_ATTENTION for every run of the deterministic scenario")
    ap.add_argument("--object-store", action="store_true",
                    help="checkpoints to versitygw on loopback through multi-storage-client (issue 33)")
    ap.add_argument("--objbench-model", default="gpt1b", choices=sorted(MODELS), help="model of objbench")
    args = ap.parse_args()
    unknown = set(filter(None, args.threeway_variants.split(","))) - set(THREEWAY_VARIANTS)
    if unknown:
        ap.error(f"--threeway-variants: unknown {sorted(unknown)}; known: {sorted(THREEWAY_VARIANTS)}")
    unknown = set(filter(None, args.threeway_mlm_variants.split(","))) - set(MLM_VARIANTS)
    if unknown:
        ap.error(f"--threeway-mlm-variants: unknown {sorted(unknown)}; known: {sorted(MLM_VARIANTS)}")
    import torch

    started = time.monotonic()
    DEADLINE[0] = started + args.deadline_s
    gpus = args.gpus or torch.cuda.device_count()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(WORK, ignore_errors=True)
    LOGS.mkdir(parents=True)
    ctx = {"gpus": gpus, "memory_names": set(args.memory.split(",")),
           "layouts": set(args.layouts.split(",")) if args.layouts else None,
           "resume_on": set(args.resume_on.split(",")) if args.resume_on else None,
           "bench_on": set(args.bench_on.split(",")) if args.bench_on else None,
           "model": args.model, "bench_model": args.bench_model,
           "reshard_from": args.reshard_from or f"tp{gpus}",
           "reshard_to": args.reshard_to.split(",") if args.reshard_to else None,
           "perf_variants": args.perf_variants.split(",") if args.perf_variants else None,
           "perf_profile": set(filter(None, args.perf_profile.split(","))), "perf_tp": args.perf_tp,
           "bench_variant": args.bench_variant, "threeway": args.threeway,
           "threeway_variants": set(filter(None, args.threeway_variants.split(","))),
           "threeway_mlm_variants": set(filter(None, args.threeway_mlm_variants.split(","))),
           "threeway_profile": set(filter(None, args.threeway_profile.split(","))),
           "threeway_fallback": args.threeway_fallback, "stepdump": args.stepdump,
           "threeway_gbs": args.threeway_gbs, "threeway_iters": args.threeway_iters,
           "threeway_skip_overlap": args.threeway_skip_overlap,
           "pod_jobs": tuple(filter(None, args.pod_jobs.split(",")))}
    OURS_EXTRA[:] = args.ours_extra.split()
    ctx["objbench_model"] = args.objbench_model
    ctx["det_env"] = dict(MATH_DETERMINISTIC_ENV) if args.deterministic_attention == "math" else {}
    results = {"started": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "gpus": gpus,
               "device": [torch.cuda.get_device_name(i) for i in range(gpus)]}
    ctx["out_dir"], ctx["results"] = out_dir, results
    if args.object_store:
        results["object_store"] = start_object_store()
    # Rough seconds a scenario needs (per layout); one that would not finish before the deadline is skipped.
    per_layout = {"probe": 60, "indexed": 30, "layouts": 35, "resume": 70, "sigterm": 70, "reshard": 40,
                  "bench": 230, "memory": 60, "perf": 360, "pods": 240, "preempt": 240,
                  "tensorboard": 95, "deterministic": 150, "objbench": 200,
                  "detcost": 60, "threeway": 170, "collectives": 90, "rope": 60, "stepdump": 200, "hf_logits": 120, "hf_train": 150, "hf_bench": 200,
                  "hf_pods": 200, "hf_store": 200}
    n_layouts = len(ctx["layouts"]) if ctx["layouts"] else len(layouts_for(gpus))
    n_bench = len(ctx["bench_on"]) if ctx["bench_on"] else len(bench_layouts(gpus))
    for name in args.only.split(","):
        scale = {"layouts": n_layouts, "bench": n_bench, "reshard": 2, "threeway": len(args.threeway.split(",")), "stepdump": len(args.stepdump.split(",")),
                 "deterministic": len(ctx["layouts"]) if ctx["layouts"] else 3,  # tpN, ppN, dpN
                 "resume": len(ctx["resume_on"]) if ctx["resume_on"] else n_layouts}.get(name, 1)
        need = per_layout.get(name, 60) * scale
        if time.monotonic() + need > DEADLINE[0]:
            results[name] = {"ok": False, "skipped": f"deadline (needs ~{need} s)"}
            continue
        t0 = time.monotonic()
        print(f"=== {name} (t={t0 - started:.0f}s)", flush=True)
        try:
            results[name] = SCENARIOS[name](ctx)
        except Exception as e:
            results[name] = {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-2000:]}
        results[name]["seconds"] = round(time.monotonic() - t0, 1)
        print(f"=== {name}: ok={results[name].get('ok')} in {results[name]['seconds']} s", flush=True)
        flush_outputs(out_dir, results, ctx)
        if not results[name].get("ok") and name in args.stop_on_failure.split(","):
            break
    table = flush_outputs(out_dir, results, ctx)
    print(table)
    return 0


def flush_outputs(out_dir: Path, results: dict, ctx: dict) -> str:
    """Write results, memory records, the table and all logs (after every scenario: a later one may time out)."""
    (out_dir / "results.json").write_text(json.dumps(results, indent=1, default=str))
    if "memory_records" in ctx:
        (out_dir / "memory_records.json").write_text(json.dumps(ctx["memory_records"], indent=1))
    with tarfile.open(out_dir / "logs.tar.gz", "w:gz") as tar:
        tar.add(LOGS, arcname="logs")
    table = render_table(results)
    (out_dir / "table.txt").write_text(table)
    return table


def render_table(results: dict) -> str:
    lines = [f"suite on {results.get('device')} ({results.get('gpus')} GPU) started {results.get('started')}"]
    for name, r in results.items():
        if not isinstance(r, dict):
            continue
        lines.append(f"{name:9s} ok={r.get('ok')} {r.get('seconds', '')}s "
                     + (r.get("error", "") or ";".join(r.get("failures", []) or [])))
        for sub, v in r.items():
            if isinstance(v, dict) and "ok" in v:
                lines.append(f"  {sub:10s} ok={v['ok']} " + "; ".join(v.get("failures", [])))
        if name == "bench":
            for _sub, v in r.items():
                if isinstance(v, dict) and "peer" in v:
                    o, p = v.get("ours", {}), v.get("peer", {})
                    lines.append(f"  BENCH {v['layout']} ({v.get('variant', {}).get('name')}): peer MFU {p.get('mfu_pct')}% tok/s/gpu {p.get('tokens_per_s_per_gpu')} "
                                 f"mem {p.get('peak_mem_gib')} save {p.get('sync_save_s')}s | ours MFU {o.get('mfu_pct_peer_formula')}% "
                                 f"tok/s/gpu {o.get('tokens_per_s_per_gpu')} mem {o.get('peak_mem_gib_rank_logging')} "
                                 f"blocked(own,waited) {[(b, c) for _, b, c in o.get('async_save_blocked_s', [])]} "
                                 f"start->resumed {o.get('startup_to_first_resumed_iteration_s')}s | ratio {v.get('mfu_ratio_ours_over_peer')} "
                                 f"| vs Megatron-LM {v.get('ours_speedup_vs_megatron_lm')}")
        if name == "perf":
            lines.append(f"  PERF {r.get('layout')} peer {r.get('peer')}")
            for sub, v in r.items():
                if isinstance(v, dict) and "losses_1_5" in v:
                    lines.append(f"  PERF {sub:9s} {v.get('median_iter_ms')} ms MFU {v.get('mfu_pct_peer_formula')}% "
                                 f"ratio {v.get('mfu_ratio_ours_over_peer')} mem {v.get('peak_mem_gib_logging_rank')} "
                                 f"losses {v.get('losses_1_5')}")
        if name == "memory":
            for rec in r.get("records", []):
                lines.append(f"  MEM {rec}")
        if name == "probe":
            lines.append(f"  {json.dumps({k: v for k, v in r.items() if k not in ('ok',)}, default=str)[:900]}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
