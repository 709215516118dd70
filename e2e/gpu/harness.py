"""The GPU suite's harness: what the scenario families share, and no scenario of its own.

- the trainer's command line as the operator renders it: `trainer_args`, `model_args`, MODELS, NO_SP;
- `Run`: one torchrun launch and its log; every wait is cut by the suite's deadline (`bounded`);
- the trainer's log lines (ITER_RE, RESUMED_RE, ...) and the checks on them: `check`, `compare`,
  `loss_falls`, `trainer_summaries`, `sdpa_kernel`;
- checkpoints on local disk or in the object store on loopback: `ckpt_state`, `ckpt_loc`, `start_object_store`;
- the peers: ../shared/bench/mcore_peer.py (`run_peer`) and Megatron-LM's pretrain_gpt.py (`run_mlm_peer`, on its
  local spec or on Transformer Engine; `mlm_second_peer`); tokens/s/GPU and MFU (`throughput_fields`,
  `ours_throughput`, `model_flops`);
- the HF import's logits and round trip judged (`hf_logits_verdict`: hf.py's scenarios and te.py's);
- rendered pods run verbatim (`pods_job`, on e2e/gpu/pods.py): pods, preempt, tensorboard, hf_pods, sft_pods;
- the outputs: results.json, table.txt, logs.tar.gz (`flush_outputs`, `render_table`);
- `Scenario`: an entry of a family's SCENARIOS table.

The suite's mutable state lives here and nowhere else: WORK and LOGS (where the runs write), DEADLINE
(set by suite.py's main), OURS_EXTRA (--ours-extra) and STORE (--object-store). The families import these
objects; they are changed in place (DEADLINE[0] = ..., OURS_EXTRA[:] = ..., STORE.update(...)), never
rebound, so every module sees the same object.
"""

from __future__ import annotations

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
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "contract"))  # megatron_contract, which megatron_trainer.hf_config imports
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
    # issue 59's model (e2e/gpu/te.py): 3.8B parameters, Llama architecture with full multi-head attention (24 KV
    # heads of 128), 32 x 3072, ffn 8192, vocabulary 32768, sequence 2048, global batch 8 (8 micro-batches of 1, as
    # the other Llama shapes: Megatron-LM's unfused attention keeps each layer's s x s probabilities)
    "llama_mha4b": dict(layers=32, hidden=3072, heads=24, groups=24, ffn=8192, seq=2048, vocab=32768, mbs=1, accum=8,
                        arch="llama"),
    # Llama-3-8B's layer (h 4096, 32/8 heads, ffn 14336, vocabulary 128256, sequence 4096) at 16 of its 32 layers:
    # 4.5B parameters, whose weights, fp32 main copy, gradients and Adam moments (18 bytes each, 82 GB) fit one
    # H200 with the activations; the GEMMs that FP8 speeds up are the 8B's own (issue 59's fp8 runs, te.py)
    "llama8b_l16": dict(layers=16, hidden=4096, heads=32, groups=8, ffn=14336, seq=4096, vocab=128256, mbs=1, accum=8,
                        arch="llama"),
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


def model_args(name: str | dict) -> list[str]:
    """The model's shape flags; `name` is a MODELS entry's name, or a shape of the same keys (moe.py's MoE shapes,
    kept out of MODELS so that no dense scenario picks them)."""
    m = MODELS[name] if isinstance(name, str) else name
    return ["--num-layers", str(m["layers"]), "--hidden-size", str(m["hidden"]),
            "--num-attention-heads", str(m["heads"]), "--ffn-hidden-size", str(m["ffn"]),
            "--seq-length", str(m["seq"]), "--max-position-embeddings", str(m["seq"]),
            "--vocab-size", str(m["vocab"]), "--normalization", "LayerNorm",
            "--position-embedding-type", "learned_absolute", "--untie-embeddings-and-output-weights", *llama_flags(m)]


# Suite-only marker in a variant's flags: leave out the --sequence-parallel-auto the operator renders at TP > 1.
NO_SP = "--no-sequence-parallel"


def trainer_args(model="small", tp=1, pp=1, mbs=4, gbs=None, iters=40, attn="flash", lr="1e-3",
                 warmup=5, dist_opt=True, extra=(), data=None, save=None, save_interval=None,
                 async_save=True, ep=1, impl="local") -> list[str]:
    """A command line shaped like the operator's rendering (docs/trainer-contract.md; the flags that
    change what runs are checked against render.megatron_args in tests/unit/test_gpu_suite_args.py).
    `impl`: --transformer-impl, the operator's default (local; transformer_engine only where the job needs it,
    vocab/values.impl) unless asked. With transformer_engine at TP > 1 the operator renders --sequence-parallel-auto
    (spec.parallelism.sequenceParallel unset: on where the trainer runs TE), so this does too, unless `extra` holds
    NO_SP or --sequence-parallel (forced on). `model`: a MODELS name or a shape (model_args); `ep`: the
    expert-parallel size of a MoE shape."""
    args = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
            "--context-parallel-size", "1", "--expert-model-parallel-size", str(ep), *model_args(model),
            "--transformer-impl", impl, "--attention-backend", attn,
            "--micro-batch-size", str(mbs), "--global-batch-size", str(gbs or mbs),
            "--train-iters", str(iters), "--lr", lr, "--min-lr", f"{float(lr) / 10:g}",
            "--lr-decay-style", "cosine", "--lr-warmup-iters", str(warmup), "--lr-decay-iters", str(iters),
            "--weight-decay", "0.1", "--clip-grad", "1.0", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
            "--bf16", "--seed", "1234", "--log-interval", "1", "--eval-iters", "0"]
    if dist_opt:
        args.append("--use-distributed-optimizer")
    if tp > 1 and impl == "transformer_engine" and NO_SP not in extra and "--sequence-parallel" not in extra:
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


# The overlap flags Megatron-LM's run gets at DP > 1 (mlm_peer.sh); ours' DP runs compared with it take them too.
DP_OVERLAP = ["--overlap-grad-reduce", "--overlap-param-gather"]


# --deterministic-mode with SDPA's math attention instead of the flash kernel's deterministic backward, the default
# from 38e7422. Before it math was the default, and detcost's runs were default, deterministic (math) and
# deterministic_flash.
MATH_DETERMINISTIC_ENV = {"MEGATRON_TRAINER_DETERMINISTIC_ATTENTION": "math"}


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
                 module: bool = True, script: str | None = None, grace_period_s: float | None = None):
        """`grace_period_s`: start the workers with the pods' launcher (`python -m megatron_trainer.launch`, which
        waits that long after SIGTERM, where torchrun SIGKILLs after 30 s) instead of torchrun."""
        self.name = name
        self.log_path = LOGS / f"{name}.log"
        LOGS.mkdir(parents=True, exist_ok=True)
        target = ["-m", "megatron_trainer"] if module else [script]
        if grace_period_s is not None:
            cmd = [sys.executable, "-m", "megatron_trainer.launch", f"--nproc-per-node={nproc}",
                   f"--master-port={free_port()}", f"--grace-period-s={grace_period_s:g}", *target, *args]
        else:
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


def summary_losses(log: Path) -> dict[int, float]:
    """The exact losses (TRAINER_SUMMARY) of a run: the log line has 7 significant digits only. With
    PP, rank 0 prints a summary too (no losses): the ranks' summaries are merged."""
    found: dict = {}
    for summary in trainer_summaries(log.read_text(errors="replace")):
        found.update(summary.get("losses", {}))
    return {int(k): float(v) for k, v in found.items()}


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


def sdpa_kernel(log_text: str) -> str | None:
    """The SDPA kernel the trainer logged at its first attention forward (attention.first_eligible), e.g.
    FLASH_ATTENTION; None where SDPA did not run on a GPU."""
    found = re.search(r"SDPA kernel \(first forward, layer \d+\): (\w+)", log_text)
    return found.group(1) if found else None


def all_gpus(gpus: int) -> str:
    """CUDA_VISIBLE_DEVICES for the first `gpus` GPUs."""
    return ",".join(str(i) for i in range(gpus))


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


MLM_RE = re.compile(r"MLM RESULT iter_ms=([0-9.]+) MFU=([0-9.]+)% losses1_5=(\[[^\]]*\])")


#: Where Transformer Engine is installed on the device (../shared/bench/te/README.md): TE_SITE, else /opt/te-site.
TE_SITE_DEFAULT = "/opt/te-site"


def run_mlm_peer(name: str, gpus: int, model: str, tp: int, pp: int, gbs: int, visible: str,
                 flags: list[str] | tuple[str, ...] = (), env_extra: dict | None = None, vpp: int | None = None,
                 iters: int = 26, impl: str = "local") -> dict:
    """Megatron-LM's own pretrain_gpt.py (../shared/bench/mlm_peer.sh, carried as .run/mlm_peer.sh) on
    the same model, layout and global batch; Megatron-LM's source at core_v0.19.0 in .run/mlm.
    `env_extra`: more environment for its processes (stepdump's STEPDUMP_DIR). `impl`: its layer spec, local or
    te (MLM_IMPL=te: Transformer Engine from TE_SITE, the spec Megatron-LM's users run)."""
    m = MODELS[model]
    wheel = sorted((REPO / ".whl").glob("megatron_core-*.whl"))
    te = {"MLM_IMPL": "te", "TE_SITE": os.environ.get("TE_SITE", TE_SITE_DEFAULT)} if impl == "te" else {}
    env = dict(os.environ, MLM_DIR=str(REPO / ".run" / "mlm"), WHL=str(wheel[0]) if wheel else "", GPUS=str(gpus),
               TP=str(tp), PP=str(pp), LAYERS=str(m["layers"]), HIDDEN=str(m["hidden"]), HEADS=str(m["heads"]),
               FFN=str(m["ffn"]), SEQ=str(m["seq"]), VOCAB=str(m["vocab"]), MBS=str(m["mbs"]), GBS=str(gbs),
               ITERS=str(iters), VPP=str(vpp or ""), CUDA_VISIBLE_DEVICES=visible, PORT=str(free_port()),
               **te, **(env_extra or {}))
    extra = mlm_extra_flags(m, impl) + list(flags)
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


def mlm_extra_flags(m: dict, impl: str = "local") -> list[str]:
    """The model's flags for pretrain_gpt.py beyond mlm_peer.sh's own (they come after its own: argparse's last one
    wins). On the local spec no RoPE fusion: it needs Transformer Engine, and ours runs RoPE unfused on the local path
    too; on TE (impl te) Megatron-LM's default, fused."""
    return llama_flags(m) + (["--no-rope-fusion"] if m.get("arch") == "llama" and impl != "te" else [])


def mlm_losses_per_iteration(logged: list[float]) -> list[float]:
    """Megatron-LM's logged `lm loss` of iterations 1-5 (mlm_peer.sh runs it with --log-interval 1) as the
    loss of each iteration. Its training_log (megatron/training/training.py at core_v0.19.0) prints the
    first iteration without resetting its sums (`should_reset = not is_first_iteration`), so the line of
    iteration 2 is the mean of iterations 1 and 2; from iteration 3 on each line is its own iteration.
    Found on 2026-11-26: ours, with the forward pass computed as Megatron-LM's, logged 12.5837 and 12.5954
    where Megatron-LM logged 12.5837 and 12.58955 = (12.5837 + 12.5954) / 2
    (docs/benchmarks/megatron-lm.md#2026-11-26-iteration-2-log-line)."""
    losses = list(logged)
    if len(losses) >= 2:
        losses[1] = round(2 * losses[1] - losses[0], 6)
    return losses


def mlm_second_peer(name: str, gpus: int, model: str, tp: int, gbs: int) -> dict:
    """Megatron-LM's pretrain_gpt.py as the second peer of `bench` and `perf` (issue 17), when its
    source is carried in .run/mlm; otherwise a record saying it was not (never a silent omission)."""
    if not (REPO / ".run" / "mlm" / "pretrain_gpt.py").is_file() or not (REPO / ".run" / "mlm_peer.sh").is_file():
        return {"not_run": "Megatron-LM's source (.run/mlm) or .run/mlm_peer.sh not carried"}
    return run_mlm_peer(name, gpus, model, tp, 1, gbs, all_gpus(gpus))


def ratio_vs_mlm(ours_ms: float | None, mlm: dict) -> float | None:
    return round(mlm["iter_ms"] / ours_ms, 3) if ours_ms and mlm.get("iter_ms") else None


def pod_setup(ctx) -> tuple:
    """PVC directories, the image's environment and whether pods get their own mount namespaces."""
    import pods as P

    if "pod_setup" not in ctx:
        ns_ok, ns_msg = P.can_namespace()
        ckpt = P.PVC_ROOT / "checkpoints"
        ckpt.mkdir(parents=True, exist_ok=True)
        os.chown(ckpt, 1000, 1000)  # the pod's fsGroup (1000) owns the volume
        ctx["pod_setup"] = (P.image_env(), ns_ok, ns_msg)
    return ctx["pod_setup"]


def pod_log(pods) -> dict:
    return {"pod0_command": pods[0].command(), "pod0_env": pods[0].env(), "gpus": [p.gpus for p in pods]}


def pod_processes_left(uid: int, timeout: float = 15.0) -> list[int]:
    """Processes of the pods' user still alive (the launcher must leave none)."""
    import psutil

    end = time.monotonic() + timeout
    while True:
        left = [p.pid for p in psutil.process_iter(["uids", "status"])
                if p.info["uids"] and p.info["uids"].real == uid and p.info["status"] != psutil.STATUS_ZOMBIE]
        if not left or time.monotonic() > end:
            return left
        time.sleep(0.2)


def start_pods(jobset, attempt: int, gpus: int, tag: str, image: dict, ns_ok: bool) -> list:
    import pods as P

    pods = P.pods_of(jobset, attempt, gpus)
    for i, p in enumerate(pods):
        p.start(LOGS / f"pods_{jobset['metadata']['name']}_{tag}_pod{i}.log", image, ns_ok)
    return pods


def pods_job(ctx, job_file: Path) -> dict:
    """Start 1: train, SIGTERM every pod past the checkpoint of 10 -> checkpoint, exit 143 (stopped before the end:
    the pod fails, so the JobSet restarts the gang). Start 2: resume from it, train to the end, exit 0. Loss falls
    over the whole run."""
    import pods as P

    image, ns_ok, _ = pod_setup(ctx)
    jobset = P.render(job_file)
    name = jobset["metadata"]["name"]
    P.map_host(P.master_address(jobset))
    pod_spec = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    grace = pod_spec["terminationGracePeriodSeconds"]
    uid = pod_spec["securityContext"]["runAsUser"]
    save = P.PVC_ROOT / "checkpoints" / name
    shutil.rmtree(save, ignore_errors=True)
    failures: list[str] = []
    first = start_pods(jobset, 0, ctx["gpus"], "start1", image, ns_ok)
    out = {"pods": len(first), **pod_log(first)}
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
    check(rcs1 == [143] * len(first), f"start 1 exit codes {rcs1} (143: stopped by SIGTERM after its checkpoint)",
          failures)
    check(stop is not None and stop.group(2) == "signal", "start 1: no 'stopping ... (signal)'", failures)
    check(stopped_at is not None and state1["tracker"] == stopped_at and bool(state1["checkpoints"].get(stopped_at)),
          f"start 1 checkpoint {state1}", failures)
    left = pod_processes_left(uid)
    check(not left, f"start 1 left processes {left}", failures)
    second = start_pods(jobset, 1, ctx["gpus"], "start2", image, ns_ok)
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
    left = pod_processes_left(uid)
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


def pods_arg(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


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
        if name.startswith("moe_") and "ours" in r:  # moe.py: one line per program
            for key in ("ours", "megatron_lm", "ours_sequential"):
                v = r.get(key, {})
                lines.append(f"  MOE {r.get('layout')} {key:15s} {v.get('iter_ms')} ms MFU {v.get('mfu_pct_active_params')}% "
                             f"tok/s/gpu {v.get('tokens_per_s_per_gpu')} losses {v.get('losses_1_3')} "
                             f"{v.get('not_run') or v.get('skipped') or ''}")
            lines.append(f"  MOE ours/Megatron-LM {r.get('ours_speedup_vs_megatron_lm')} (target {r.get('target')}), "
                         f"sequential/Megatron-LM {r.get('ours_sequential_speedup_vs_megatron_lm')}")
        if name == "probe":
            lines.append(f"  {json.dumps({k: v for k, v in r.items() if k not in ('ok',)}, default=str)[:900]}")
    return "\n".join(lines) + "\n"


FP32_TOL = 1e-4


def hf_logits_verdict(r: dict) -> list[str]:
    """What a tests/trainer/hf_cpu_check.py logits/round-trip result fails, in words (empty: passed): fp32 within
    FP32_TOL of transformers' logits with argmax equal, bf16 within its budget, the export bit-identical (hf.py's
    scenarios, te.py's te_hf_logits)."""
    bad = []
    if "error" in r:
        return [f"{r['arch']} tp{r['tp']}pp{r['pp']} {r['precision']}: {r['error'][-400:]}"]
    tag = f"{r['arch']} tp{r['tp']}pp{r['pp']} {r['precision']}"
    if r["precision"] == "fp32":
        if not r["max_abs_diff"] <= FP32_TOL:
            bad.append(f"{tag}: fp32 max |diff| {r['max_abs_diff']:.2e} > {FP32_TOL}")
        if r["argmax_equal"] != 1.0:
            bad.append(f"{tag}: argmax differs on {1 - r['argmax_equal']:.1%} of tokens")
    else:
        # bf16: our error against transformers' fp32 logits must stay within twice transformers' own
        # bf16 error (the same weights run in bf16 by transformers), plus 1 bf16 ulp at the logit scale.
        budget = 2 * r["hf_bf16_vs_fp32"] + r["logit_scale"] * 2 ** -8
        if not r["max_abs_diff_vs_fp32_hf"] <= budget:
            bad.append(f"{tag}: bf16 error {r['max_abs_diff_vs_fp32_hf']:.3e} > budget {budget:.3e}")
    rt = r["roundtrip"]
    if rt["not_identical"] or rt["extra"] or not rt["config_equal"] or rt["tensors"] != rt["exported"]:
        bad.append(f"{tag}: round trip not identical: {rt['not_identical'][:3]} extra {rt['extra'][:3]} "
                   f"config equal {rt['config_equal']}")
    return bad


class Scenario(NamedTuple):
    """An entry of a family's SCENARIOS table (name -> Scenario); suite.py registers the tables."""

    run: Callable[[dict], dict]  # the scenario: ctx -> its result, whose "ok" says whether it passed
    summary: str  # one line, for --list
    seconds: int = 60  # rough seconds per layout: suite.py skips a scenario that would not end before the deadline
    min_gpus: int = 1  # GPUs its fixed layouts need (TP=2, PP=2): suite.py skips it, saying so, on a smaller call
