"""GPU scenarios of the Hugging Face import/export (issue 27). Registered in suite.py.

  hf_logits  every fixture architecture (tests/fixtures/hf: Llama 3, Llama 3.2 tied, Mistral, Qwen2,
             Qwen3), tiny and random (made here with transformers), imported at TP=1, TP=2 and PP=2 in
             fp32 and bf16 (tests/trainer/hf_cpu_check.py on CUDA/NCCL): logits against transformers'
             own, argmax, then export -> every tensor bit-identical to the source, config.json equal
  hf_moe_logits  issue 50: the MoE fixtures (tiny Qwen3-MoE, tiny Mixtral) at every (TP, EP) the GPU
             count holds (EP 1/2/4 x TP 1/2; EP 2 also with SequentialMLP experts; --moe-only picks), fp32
             and bf16, with the all-to-all dispatcher (the CPU tests can only run all-gather): logits
             against transformers, argmax, export round trip bit-identical; checked as hf_logits
  hf_train   the real trainer (torchrun, TP=2): --hf-init, 20 iterations, --hf-export; the saved
             torch_dist checkpoint exported again under PP=2 with --hf-export-only must be
             bit-identical; transformers' logits of the export against Megatron's (the export
             imported); a resume with the HF directory gone uses the job's own checkpoint
  hf_store   issue 33 (--object-store): the same with checkpoints and the export in the S3 server on
             loopback: the export in the bucket == --hf-export-only to a directory (PP=2) bit for bit;
             again: skipped; a prefix with someone else's key: exit 2, left as it was
  hf_bench   a Llama-3.2-1B-architecture model (random, made here) at TP=2: start -> first iteration
             from HF against resuming the same model from its torch_dist checkpoint (same call),
             host peak RSS per rank (and a baseline run without any load), export time
  hf_pods    the rendered pods of e2e/gpu/jobs/hf-llama-tp2.yaml, verbatim (harness.pods_job): start 1
             imports from the HF PVC, SIGTERM past the checkpoint of 10, start 2 resumes from the job's
             own checkpoint; the export on the PVC, written by uid 1000, loads in transformers with
             Megatron's logits
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "trainer"))

import hf_cpu_check as hc  # noqa: E402
from harness import (  # noqa: E402
    LOGS,
    STORE,
    STORE_BUCKET,
    WORK,
    Run,
    Scenario,
    check,
    hf_logits_verdict,
    pods_job,
    trainer_summaries,
)

ARCHS = ["tiny-llama3", "tiny-llama32-tied", "tiny-mistral", "tiny-qwen2", "tiny-qwen3"]
def scenario_hf_logits(ctx) -> dict:
    work = WORK / "hf_logits"
    out, failures = {}, []
    for tp, pp in ((1, 1), (2, 1), (1, 2)):
        results = hc.run(ARCHS, tp, pp, ("fp32", "bf16"), "cuda", work)
        out[f"tp{tp}pp{pp}"] = results
        for r in results:
            failures += hf_logits_verdict(r)
    return {"ok": not failures, "failures": failures, "results": out}


MOE_ARCHS = ["tiny-qwen3-moe", "tiny-qwen2-moe", "tiny-mixtral"]  # tiny-qwen2-moe: added 2026-11-28, not yet run on GPUs
# (TP, EP, experts) of hf_moe_logits; the world is TP x EP (data parallel = EP, PP 1)
MOE_LOGIT_LAYOUTS = ((1, 1, "grouped"), (1, 2, "grouped"), (1, 2, "sequential"), (2, 1, "grouped"),
                     (2, 2, "grouped"), (1, 4, "grouped"))


def scenario_hf_moe_logits(ctx) -> dict:
    work = WORK / "hf_moe_logits"
    out, failures = {}, []
    for tp, ep, experts in MOE_LOGIT_LAYOUTS:
        key = f"tp{tp}ep{ep}-{experts}"
        if tp * ep > ctx["gpus"] or (ctx.get("moe_only") and key not in ctx["moe_only"]):
            out[key] = {"skipped": f"needs {tp * ep} GPUs" if tp * ep > ctx["gpus"] else "not in --moe-only"}
            continue
        results = hc.run(MOE_ARCHS, tp, 1, ("fp32", "bf16"), "cuda", work, ep=ep, experts=experts,
                         dispatcher="alltoall")
        out[key] = results
        for r in results:
            failures += [f"ep{ep} {experts}: {f}" for f in hf_logits_verdict(r)]
            if "error" not in r and r.get("experts") != ("GroupedMLP" if experts == "grouped" else "SequentialMLP"):
                failures.append(f"{r['arch']} tp{tp}ep{ep}: built {r.get('experts')}, asked for {experts}")
    ran = [k for k, v in out.items() if isinstance(v, list)]
    return {"ok": bool(ran) and not failures, "failures": failures or ([] if ran else ["no layout ran"]),
            "layouts_run": ran, "results": out}


def _argv(config: dict, tp: int, pp: int, iters: int, extra: list[str]) -> list[str]:
    argv = hc.trainer_argv(config, tp, pp, "bf16")
    i = argv.index("--train-iters")
    argv[i + 1] = str(iters)
    return argv + ["--lr", "1e-3", "--min-lr", "1e-4", "--lr-warmup-iters", "1", "--lr-decay-style", "cosine",
                   "--log-interval", "1", "--use-distributed-optimizer", "--seed", "1234", *extra]


def scenario_hf_train(ctx) -> dict:
    work = WORK / "hf_train"
    src, ckpt = work / "src", work / "ckpt"
    out_a, out_b, out_c = work / "export-tp2", work / "export-only-pp2", work / "export-resumed"
    src.mkdir(parents=True)
    config = hc.make_model("tiny-llama3", src, "bfloat16")
    failures: list[str] = []
    res: dict = {}
    train = Run("hf_train_tp2", 2, _argv(config, 2, 1, 20, ["--hf-init", str(src), "--hf-export", str(out_a),
                                                             "--save", str(ckpt), "--load", str(ckpt),
                                                             "--save-interval", "10"]))
    rc = train.wait(240)
    losses = train.losses()
    res["train"] = {"rc": rc, "losses": losses, "summary": train.summary()}
    check(rc == 0, f"train with --hf-init/--hf-export exit {rc}", failures)
    check(len(losses) == 20 and losses[20] < losses[1], f"loss falls over 20 iterations: {losses}", failures)
    check((out_a / "config.json").is_file(), "export written on success", failures)
    check("hf import:" in train.text(), "the trainer logged its HF import", failures)
    only = Run("hf_export_only_pp2", 2, _argv(config, 1, 2, 20, ["--hf-init", str(src), "--load", str(ckpt),
                                                                  "--hf-export", str(out_b), "--hf-export-only"]))
    rc = only.wait(180)
    res["export_only"] = {"rc": rc, "summary": only.summary()}
    check(rc == 0, f"--hf-export-only under PP=2 exit {rc}", failures)
    if out_a.is_dir() and out_b.is_dir():
        same = hc.compare_export(out_a, out_b)
        res["export_vs_export_only"] = same
        check(not same["not_identical"] and same["config_equal"] and same["tensors"] == same["exported"],
              f"export on success (TP=2) == export-only of the checkpoint (PP=2): {same['not_identical'][:3]}",
              failures)
        # transformers' logits of the export against Megatron's (the export imported, TP=2)
        logits = hc.run_jobs([(str(out_a), str(work / "reexport"), "fp32"), (str(out_a), str(work / "reexport16"),
                                                                               "bf16")], 2, 1, "cuda", work)
        res["trained_logits"] = logits
        for r in logits:
            r["arch"] = "trained-export"
            failures += [f for f in hf_logits_verdict(r) if "round trip" not in f or r["precision"] == "bf16"]
    # resume with the HF directory gone: the job's own checkpoint, never the HF directory
    shutil.move(str(src), str(work / "src-moved-away"))
    resumed = Run("hf_resume", 2, _argv(config, 2, 1, 25, ["--hf-init", str(src), "--hf-export", str(out_c),
                                                            "--save", str(ckpt), "--load", str(ckpt),
                                                            "--save-interval", "10"]))
    rc = resumed.wait(180)
    res["resume"] = {"rc": rc, "losses": resumed.losses()}
    check(rc == 0 and min(resumed.losses() or {0: 0}) == 21, f"resume without the HF directory: exit {rc}, "
          f"first iteration {min(resumed.losses() or {0: 0})}", failures)
    check("hf import:" not in resumed.text(), "the resume did not import", failures)
    for r in (train, only, resumed):
        r.close()
    return {"ok": not failures, "failures": failures, **res}


def scenario_hf_store(ctx) -> dict:
    """Issue 33 (needs --object-store): the real trainer (TP=2) imports from HF, trains 10 iterations with
    its checkpoints in s3://suite/hf_store and exports to s3://suite/exports/hf_store; --hf-export-only
    of that checkpoint under PP=2 to a local directory must equal the downloaded export bit for bit; the
    same export again is skipped (a restart after the export); a prefix holding a key the trainer did
    not write is refused (exit 2) and left as it was."""
    if not STORE:
        return {"ok": False, "error": "needs --object-store"}
    import boto3

    srv = STORE["server"]
    s3 = boto3.client("s3", endpoint_url=srv.endpoint, region_name="us-east-1",
                      aws_access_key_id=srv.access_key, aws_secret_access_key=srv.secret_key)

    def keys(prefix: str) -> list[str]:
        pages = s3.get_paginator("list_objects_v2").paginate(Bucket=STORE_BUCKET, Prefix=prefix)
        return sorted(o["Key"] for page in pages for o in page.get("Contents", []))

    work = WORK / "hf_store"
    src, local, downloaded = work / "src", work / "export-only-pp2", work / "downloaded"
    src.mkdir(parents=True)
    config = hc.make_model("tiny-llama3", src, "bfloat16")
    ckpt, export = f"s3://{STORE_BUCKET}/hf_store", f"s3://{STORE_BUCKET}/exports/hf_store"
    store = ["--object-store-endpoint", STORE["endpoint"], "--object-store-region", "us-east-1"]
    failures: list[str] = []
    res: dict = {}
    train = Run("hf_store_train_tp2", 2, _argv(config, 2, 1, 10, [
        "--hf-init", str(src), "--save", ckpt, "--load", ckpt, "--save-interval", "10", "--ckpt-format",
        "torch_dist", "--hf-export", export, *store]))
    rc = train.wait(240)
    res["train"] = {"rc": rc, "summary": train.summary()}
    check(rc == 0, f"train with --hf-export s3:// exit {rc}", failures)
    exported = keys("exports/hf_store/")
    res["export_keys"] = exported
    check("exports/hf_store/.megatron-export.json" in exported
          and "exports/hf_store/.megatron-export-partial" not in exported
          and "exports/hf_store/model.safetensors.index.json" in exported,
          f"the export is complete in the bucket: {exported}", failures)
    only = Run("hf_store_export_only_pp2", 2, _argv(config, 1, 2, 10, [
        "--hf-init", str(src), "--load", ckpt, "--hf-export", str(local), "--hf-export-only", *store]))
    rc = only.wait(180)
    check(rc == 0, f"--hf-export-only of the s3:// checkpoint under PP=2 to a directory: exit {rc}", failures)
    downloaded.mkdir()
    for key in exported:
        s3.download_file(STORE_BUCKET, key, str(downloaded / key.rsplit("/", 1)[1]))
    if local.is_dir() and exported:
        same = hc.compare_export(downloaded, local)
        res["store_vs_local"] = same
        check(not same["not_identical"] and same["config_equal"] and same["tensors"] == same["exported"],
              f"the export in the bucket (TP=2) == --hf-export-only to a directory (PP=2): "
              f"{same['not_identical'][:3]}", failures)
    again = Run("hf_store_export_again", 2, _argv(config, 2, 1, 10, [
        "--hf-init", str(src), "--load", ckpt, "--hf-export", export, "--hf-export-only", *store]))
    rc = again.wait(180)
    check(rc == 0 and "already holds the export of iteration 10" in again.text(),
          f"the same export again is skipped: exit {rc}", failures)
    s3.put_object(Bucket=STORE_BUCKET, Key="exports/taken/README.md", Body=b"not the trainer's")
    taken = Run("hf_store_taken", 2, _argv(config, 2, 1, 10, [
        "--hf-init", str(src), "--load", ckpt, "--hf-export", f"s3://{STORE_BUCKET}/exports/taken",
        "--hf-export-only", *store]))
    rc = taken.wait(180)
    res["taken"] = {"rc": rc}
    # torchrun exits 1 when a worker fails; the worker's own code is in its message
    check(rc != 0 and "exit 2 (" in taken.text() and "did not write" in taken.text()
          and keys("exports/taken/") == ["exports/taken/README.md"],
          f"a taken prefix is refused (torchrun exit {rc}, the worker's exit 2) and left as it was", failures)
    for r in (train, only, again, taken):
        r.close()
    return {"ok": not failures, "failures": failures, **res}


LLAMA32_1B = {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
              "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
              "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
              "rope_theta": 500000.0, "head_dim": 64,
              "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192}}


def scenario_hf_bench(ctx) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    work = WORK / "hf_bench"
    src, ckpt, out = work / "llama32-1b", work / "ckpt", work / "export"
    src.mkdir(parents=True)
    t0 = time.monotonic()
    cfg = dict(LLAMA32_1B)
    hf_cfg = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(hf_cfg).to(torch.bfloat16)
    model.save_pretrained(src, max_shard_size="1GB")
    params = sum(p.numel() for p in model.parameters())
    del model
    torch.cuda.empty_cache()
    hc.make_tokenizer(src, hf_cfg.vocab_size)
    config = json.loads((src / "config.json").read_text())
    res: dict = {"model": {"params": params, "made_s": round(time.monotonic() - t0, 1),
                           "files": sorted(p.name for p in src.iterdir())}}
    failures: list[str] = []
    seq = ["--seq-length", "2048"]

    def argv(iters: int, extra: list[str]) -> list[str]:
        a = _argv(config, 2, 1, iters, extra)
        i = a.index("--seq-length")
        return a[:i] + seq + a[i + 2:] + ["--attention-backend", "flash"]

    runs = {
        "baseline_random_init": argv(3, []),
        "from_hf": argv(3, ["--hf-init", str(src), "--save", str(ckpt), "--load", str(ckpt), "--save-interval", "3"]),
        "resume_torch_dist": argv(4, ["--hf-init", str(src), "--save", str(ckpt), "--load", str(ckpt)]),
        "export_only": argv(4, ["--hf-init", str(src), "--load", str(ckpt), "--hf-export", str(out),
                                "--hf-export-only"]),
    }
    for name, a in runs.items():
        r = Run(f"hf_bench_{name}", 2, a)
        rc = r.wait(240)
        summaries = trainer_summaries(r.text())
        res[name] = {"rc": rc, "startup_to_first_iteration_s": [x.get("startup_to_first_iteration_s") for x in summaries],
                     "peak_rss_gib": [x.get("peak_rss_gib") for x in summaries],
                     "hf_import": [x.get("hf_import") for x in summaries],
                     "hf_export": [x.get("hf_export") for x in summaries], "load_s": [x.get("load_s") for x in summaries]}
        check(rc == 0, f"{name}: exit {rc}", failures)
        r.close()
    try:
        hf_s = max(res["from_hf"]["startup_to_first_iteration_s"])
        ours_s = max(res["resume_torch_dist"]["startup_to_first_iteration_s"])
        res["hf_vs_resume_startup_ratio"] = round(hf_s / ours_s, 3)
        share_gib = params * 2 / 2 / 2**30  # bf16, TP=2 (tied: the embedding once)
        # The process's peak RSS when the import ends (VmHWM: everything before it included, the CUDA
        # context and the model build too); the end-of-run peaks also hold the checkpoint save.
        at_import = max(x["peak_rss_gib"] for x in res["from_hf"]["hf_import"])
        res["rank_share_gib"] = round(share_gib, 3)
        res["peak_rss_at_import_end_gib"] = round(at_import, 3)
        check(res["hf_vs_resume_startup_ratio"] <= 1.5, f"HF start {hf_s:.1f} s vs resume {ours_s:.1f} s", failures)
        check(at_import <= 1.5 * share_gib + 1.0, f"peak RSS at the end of the import {at_import:.2f} GiB vs "
              f"1.5 x the rank's share {1.5 * share_gib:.2f} GiB + 1 GiB", failures)
    except (TypeError, ValueError, KeyError) as e:
        failures.append(f"figures missing: {e}")
    res["export_files"] = sorted(p.name for p in out.iterdir()) if out.is_dir() else None
    return {"ok": not failures, "failures": failures, **res}


def scenario_hf_pods(ctx) -> dict:
    """The rendered pods of e2e/gpu/jobs/hf-llama-tp2.yaml, verbatim (the `pods` scenario's flow:
    start 1 imports from the HF PVC and is SIGTERMed past its checkpoint of 10, start 2 resumes from
    the job's own checkpoint and trains to the end), then the export on the PVC: written by the pods
    (uid 1000), complete, loadable by transformers with Megatron's logits."""
    import os
    import subprocess

    import pods as P

    models = P.PVC_ROOT / "models"
    shutil.rmtree(models, ignore_errors=True)
    src = models / "tiny-llama3"
    src.mkdir(parents=True)
    hc.make_model("tiny-llama3", src, "bfloat16")
    subprocess.run(["chmod", "-R", "a+rX", str(models)], check=True)
    (models / "exports").mkdir()
    os.chown(models / "exports", 1000, 1000)  # the pods' user writes the export
    result = pods_job(ctx, REPO / "e2e" / "gpu" / "jobs" / "hf-llama-tp2.yaml")
    failures = list(result.get("failures", []))
    logs = sorted(LOGS.glob("pods_hf-llama-tp2_*.log"))
    start1 = "".join(p.read_text(errors="replace") for p in logs if "_start1_" in p.name)
    start2 = "".join(p.read_text(errors="replace") for p in logs if "_start2_" in p.name)
    check("hf import:" in start1, "start 1 imported from the HF PVC", failures)
    check("hf import:" not in start2, "start 2 resumed from its own checkpoint (no import)", failures)
    out = models / "exports" / "hf-llama-tp2"
    files = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    check({"config.json", "generation_config.json", "model.safetensors.index.json", "tokenizer.json"} <= set(files),
          f"export files {files}", failures)
    check(not list((models / "exports").glob(".hf-llama-tp2.partial-*")), "no partial directory left", failures)
    if out.is_dir():
        check(out.stat().st_uid == 1000, "the export belongs to the pods' user", failures)
        logits = hc.run_jobs([(str(out), str(WORK / "hf_pods_reexport"), "fp32")], 2, 1, "cuda", WORK)
        result["export_logits"] = logits
        for r in logits:
            r["arch"] = "pods-export"
            failures += [f for f in hf_logits_verdict(r) if "round trip" not in f]
    result.update(ok=not failures, failures=failures, export_files=files)
    return result


# name -> Scenario(the function, its line in --list, rough seconds per layout); suite.py registers them.
SCENARIOS = {
    "hf_logits": Scenario(scenario_hf_logits, "HF fixtures imported at TP=1, TP=2, PP=2 in fp32 and bf16: logits vs "
                          "transformers; export round trip bit-identical", 120, min_gpus=2),
    "hf_moe_logits": Scenario(scenario_hf_moe_logits, "issue 50: tiny Qwen3-MoE and Mixtral at EP 1/2/4 x TP 1/2, "
                              "all-to-all, fp32 and bf16: logits vs transformers; export round trip bit-identical",
                              60, min_gpus=2),
    "hf_train": Scenario(scenario_hf_train, "--hf-init, 20 iterations, --hf-export; export-only under PP=2 identical; "
                         "resume without the HF directory", 150, min_gpus=2),
    "hf_bench": Scenario(scenario_hf_bench, "a Llama-3.2-1B-shaped model: HF start vs torch_dist resume, peak RSS per "
                         "rank, export time", 200, min_gpus=2),
    "hf_pods": Scenario(scenario_hf_pods, "the rendered pods of e2e/gpu/jobs/hf-llama-tp2.yaml: import, SIGTERM, "
                        "resume, export on the PVC", 200, min_gpus=2),
    "hf_store": Scenario(scenario_hf_store, "hf_train's import, checkpoints and export in the object store "
                         "(--object-store)", 200, min_gpus=2),
}
