"""GPU scenarios of correctness: the trainer trains, checkpoints, stops and resumes as it should, on every
layout, from torchrun and from the operator's rendered pods. Registered in suite.py.

Each launches `torchrun ... -m megatron_trainer <Megatron-LM flags>`; pods, preempt and tensorboard run the
rendered pods' own command, `python -m megatron_trainer.launch ...`.

  probe      torch/torchrun facts (SIGTERM forwarding and its SIGKILL timeout), Megatron-LM's own
             parser on a rendered command line, SDPA backends vs unfused attention
  indexed    preprocess JSONL -> .bin/.idx (no torch), read back with Megatron's IndexedDataset
  layouts    train with TP=N, PP=N, DP=N (N = --gpus; for 8 GPUs also TP2xPP2xDP2): loss falls.
             The DP layout trains on the preprocessed real data (HF tokenizer, blend of two prefixes)
  resume     kill -9 a rank mid-run, restart: resumes from the last checkpoint, later losses match
             the uninterrupted run
  sigterm    SIGTERM to torchrun: all ranks agree, checkpoint, exit 0; restart resumes from it
  reshard    resume a TP=N checkpoint under PP=N and DP=N (optimizer saved fully reshardable)
  deterministic  issue 17: --deterministic-mode at TP, PP, DP = N: kill -9 at 25, resume from 20, losses
             of 21-40 bit-identical to the uninterrupted run
  pods       issue 13: `megatron-operator render` on e2e/gpu/jobs (3 jobs); every pod's command and env
             verbatim, as uid 1000 in its own mount namespace (e2e/gpu/pods.py); SIGTERM past the
             checkpoint of 10 -> checkpoint, exit 0 -> restart resumes, trains to the end, exit 0
  preempt    issue 13: a rendered pod whose final save takes > 30 s: SIGTERM -> the launcher waits the
             pod's grace period -> complete checkpoint, exit 0 -> restart resumes from it
  tensorboard  issue 17: the pp2 job of `pods` alone (spec.logging.tensorboard): Megatron-LM's scalar
             names read back from the event files with tensorboard's reader, lm loss = the log lines

With --object-store the checkpoints of layouts, resume, sigterm and deterministic go to the S3 server on
loopback (harness.ckpt_loc).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import traceback
import urllib.request
from pathlib import Path

from harness import (
    LOGS,
    MODELS,
    REPO,
    RESUMED_RE,
    STOPPING_RE,
    WORK,
    Run,
    Scenario,
    bounded,
    check,
    ckpt_loc,
    ckpt_state,
    compare,
    flush_outputs,
    free_port,
    loss_falls,
    pod_log,
    pod_processes_left,
    pod_setup,
    pods_job,
    sdpa_kernel,
    start_pods,
    summary_losses,
    trainer_args,
)

# Switches of the trainer that Megatron-LM's pretrain_gpt.py does not have (docs/trainer-contract.md), left out of the
# line the probe gives Megatron-LM's parser.
TRAINER_ONLY_FLAGS = ("--sequence-parallel-auto",)


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
    # The operator's rendered line without the trainer's own flags, which Megatron-LM does not have (the trainer's
    # --sequence-parallel-auto, rendered at TP > 1 since da6d3e0; the probe failed on it from then on)
    mlm_line = [a for a in rendered if a not in TRAINER_ONLY_FLAGS]
    code = ("import sys, json\nsys.argv=['pretrain_gpt.py']+json.loads(sys.argv[1])\n"
            "from megatron.training.arguments import parse_args\n"
            "a=parse_args(ignore_unknown_args=False)\n"
            "print('MEGATRON_LM_PARSED', a.tensor_model_parallel_size, a.num_layers, a.async_save, a.attention_backend)")
    p = subprocess.run([sys.executable, "-c", code, json.dumps(mlm_line)], capture_output=True, text=True, timeout=120)
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
        check("megatron_trainer: exit 143 (signal)" in text, "rank 0 did not exit 143 (stopped by SIGTERM)", failures)
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


POD_JOBS = ("kubeflow-tp2", "pp2-checkpoint", "real-data-2node")


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
    _, ns_ok, ns_msg = pod_setup(ctx)
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

    image, ns_ok, ns_msg = pod_setup(ctx)
    jobset = P.render(REPO / "e2e" / "gpu" / "jobs" / "slow-save-tp2.yaml")
    name = jobset["metadata"]["name"]
    P.map_host(P.master_address(jobset))
    pod_spec = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    grace, uid = pod_spec["terminationGracePeriodSeconds"], pod_spec["securityContext"]["runAsUser"]
    save = P.PVC_ROOT / "checkpoints" / name
    shutil.rmtree(save, ignore_errors=True)
    failures: list[str] = []
    first = start_pods(jobset, 0, ctx["gpus"], "start1", image, ns_ok)
    out = {"mount_namespace_per_pod": ns_ok, **pod_log(first)}
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
    check(not pod_processes_left(uid), "processes left after exit", failures)
    second = start_pods(jobset, 1, ctx["gpus"], "start2", image, ns_ok)
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


def scenario_tensorboard(ctx) -> dict:
    """issue 17: the rendered pp2 job with spec.logging.tensorboard, both starts; event files read back."""
    pod_setup(ctx)
    r = pods_job(ctx, REPO / "e2e" / "gpu" / "jobs" / "pp2-checkpoint.yaml")
    check("tensorboard" in r, "no --tensorboard-dir rendered", r.setdefault("failures", []))
    r["ok"] = not r["failures"]
    return r


# name -> Scenario(the function, its line in --list, rough seconds per layout); suite.py registers them.
SCENARIOS = {
    "probe": Scenario(scenario_probe, "torch/torchrun facts, Megatron-LM's parser on a rendered command line, "
                      "SDPA backends vs unfused attention", 60),
    "indexed": Scenario(scenario_indexed, "preprocess JSONL -> .bin/.idx without torch; Megatron's IndexedDataset "
                        "reads the same tokens", 30),
    "layouts": Scenario(scenario_layouts, "train at TP=N, PP=N, DP=N (8 GPUs: also TP2xPP2xDP2): loss falls; DP on "
                        "the preprocessed real data", 35),
    "resume": Scenario(scenario_resume, "kill -9 a rank mid-run, restart: resumes from the newest complete "
                       "checkpoint, later losses match", 70),
    "sigterm": Scenario(scenario_sigterm, "SIGTERM to torchrun: all ranks checkpoint and exit 0; the restart resumes "
                        "from it", 70),
    "reshard": Scenario(scenario_reshard, "resume a TP=N checkpoint under PP=N and DP=N", 40),
    "deterministic": Scenario(scenario_deterministic, "--deterministic-mode at TP, PP, DP = N: kill -9, resume; the "
                              "later losses bit-identical", 150),
    "pods": Scenario(scenario_pods, "`megatron-operator render` on e2e/gpu/jobs, every pod verbatim: SIGTERM, "
                     "checkpoint, resume, train to the end", 240),
    "preempt": Scenario(scenario_preempt, "a rendered pod whose final save takes > 30 s: SIGTERM -> checkpoint within "
                        "the grace period, exit 0 -> resume", 240),
    "tensorboard": Scenario(scenario_tensorboard, "the pp2 job of pods with spec.logging.tensorboard: its scalars "
                            "read back from the event files", 95),
}
