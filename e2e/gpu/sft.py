"""GPU scenarios of supervised fine-tuning (issue 28). Registered in suite.py.

  sft_reverse  a tiny Llama made here with transformers (random weights, the word-level test tokenizer
               with a ChatML template): the real trainer (torchrun) fine-tunes it from --hf-init on
               synthetic conversations whose answer is the user's digits reversed (packed samples,
               validation file), exports it with --hf-export; transformers `generate` on held-out prompts
               must be >= 90 % exact. The trainer's final validation loss must equal transformers' loss
               of the export on the answer tokens of the same validation samples, and not its loss over
               all tokens (prompt tokens are not in the reported loss).
  sft_moe      issue 50: sft_reverse on a tiny Qwen3-MoE (8 experts, top-2, norm_topk_prob) at EP 2 with the
               all-to-all dispatcher: the same data, export, generate >= 90 % exact, answer-only validation loss
  sft_bench    the same Llama-architecture model and sequence length trained three ways in one call:
               pretraining on mock data, SFT padded, SFT packed (chat data of realistic length spread);
               iteration time, tokens/s over all positions and over real tokens, padding waste.
  sft_pods     e2e/gpu/jobs/sft-tiny.yaml's rendered pods, verbatim (harness.pods_job): SIGTERM past the
               checkpoint of 10, the restart resumes the SFT data where it stopped, then the export.
  sft_sigterm  SIGTERM during an SFT run with a validation file and async checkpoints (torchrun, 1 GPU),
               with and without periodic evaluation: the checkpoint is written and the run exits 0.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "trainer"))

import hf_cpu_check as hc  # noqa: E402
from harness import LOGS, WORK, Run, Scenario, check, pods_job  # noqa: E402
from sft_fixtures import CHATML, chat_corpus, make_tokenizer, reversal_conversations, write_jsonl  # noqa: E402

EXACT_TARGET = 0.90


def _make_llama(directory: Path, hidden: int, layers: int, heads: int, kv: int, ffn: int, vocab: int,
                max_pos: int, bf16: bool = False) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    directory.mkdir(parents=True, exist_ok=True)
    cfg = AutoConfig.for_model("llama", hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                               num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                               max_position_embeddings=max_pos, rms_norm_eps=1e-5, tie_word_embeddings=False,
                               rope_theta=10000.0)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(cfg)
    (model.to(torch.bfloat16) if bf16 else model).save_pretrained(directory)
    del model
    make_tokenizer(directory, CHATML, eos="<|im_end|>")  # tokenizer.json + tokenizer_config.json (+ template)
    return json.loads((directory / "config.json").read_text())


def _make_qwen3_moe(directory: Path, hidden: int, layers: int, heads: int, kv: int, experts: int, topk: int,
                    moe_ffn: int, vocab: int, max_pos: int) -> dict:
    """A tiny Qwen3-MoE (every layer MoE, norm_topk_prob true as Qwen3-30B-A3B), random, with the test tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    directory.mkdir(parents=True, exist_ok=True)
    cfg = AutoConfig.for_model("qwen3_moe", hidden_size=hidden, intermediate_size=4 * hidden,
                               moe_intermediate_size=moe_ffn, num_experts=experts, num_experts_per_tok=topk,
                               norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                               num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                               head_dim=hidden // heads, vocab_size=vocab, max_position_embeddings=max_pos,
                               rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=10000.0,
                               router_aux_loss_coef=0.001)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(directory)
    del model
    make_tokenizer(directory, CHATML, eos="<|im_end|>")
    return json.loads((directory / "config.json").read_text())


def _argv(config: dict, seq: int, iters: int, gpus: int, extra: list[str], ep: int = 1) -> list[str]:
    """TP = the GPUs of the call over `ep` (a MoE model: expert parallel `ep`, the all-to-all dispatcher)."""
    argv = hc.trainer_argv(config, gpus // ep, 1, "bf16", ep=ep, dispatcher="alltoall" if ep > 1 else None)
    for flag_name, value in (("--train-iters", iters), ("--seq-length", seq)):
        argv[argv.index(flag_name) + 1] = str(value)
    for drop in ("--mock-data",):
        argv.remove(drop)
    i = argv.index("--tokenizer-type")
    del argv[i:i + 2]
    return argv + ["--lr-decay-style", "cosine", "--log-interval", "10", "--use-distributed-optimizer",
                   "--seed", "1234", *extra]


def _sft_flags(src: Path, train: Path, valid: Path | None, packing: bool) -> list[str]:
    out = ["--data-format", "chat", "--sft-train-path", str(train), "--tokenizer-type", "HuggingFaceTokenizer",
           "--tokenizer-model", str(src), "--num-workers", "1", "--sft-packing" if packing else "--no-sft-packing"]
    if valid is not None:
        out += ["--sft-valid-path", str(valid)]
    return out


def _answer_only_loss(model_dir: Path, seq: int, valid: Path, n_samples: int, packed: bool) -> dict:
    """transformers' loss of ``model_dir`` over the first ``n_samples`` validation samples as the trainer
    builds them (wrapping), on answer tokens only and on all tokens, each document run alone (fp32)."""
    import torch
    from megatron_trainer import sft
    from transformers import AutoModelForCausalLM

    t = sft.SFTTokenizer(model_dir, sft.SFTOptions("chat", seq))
    docs, _ = t.tokenize_file(str(valid))
    samples = sft.SFTSamples.build(docs, seq, 0, packed)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    sums = {"answer": [0.0, 0], "all": [0.0, 0]}
    with torch.no_grad():
        for i in range(n_samples):
            j = i % len(samples)
            for d in samples.sample_docs[samples.sample_offsets[j]:samples.sample_offsets[j + 1]]:
                lo, hi = docs.offsets[d], docs.offsets[d + 1]
                ids = torch.from_numpy(docs.tokens[lo:hi].astype("int64")).cuda()[None]
                mask = torch.from_numpy(docs.loss_mask[lo + 1:hi].astype("float32")).cuda()
                logits = model(input_ids=ids).logits.float()[0, :-1]
                losses = torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="none")
                sums["answer"][0] += float((losses * mask).sum())
                sums["answer"][1] += int(mask.sum())
                sums["all"][0] += float(losses.sum())
                sums["all"][1] += losses.numel()
    return {k: v[0] / v[1] for k, v in sums.items()}


def _generate_exact(model_dir: Path, held_out: list[dict]) -> dict:
    """Greedy generation on each held-out prompt (system + user, generation prompt): exact when the
    tokens up to and including the end-of-turn token are the reversed digits."""
    import torch
    from megatron_trainer import sft
    from transformers import AutoModelForCausalLM

    t = sft.SFTTokenizer(model_dir, sft.SFTOptions("chat", 256))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    exact, examples = 0, []
    for conv in held_out:
        prompt = t.template.render(conv["messages"][:-1], add_generation_prompt=True)
        ids = t._tok.encode(prompt, add_special_tokens=False).ids
        want = t._tok.encode(conv["messages"][-1]["content"], add_special_tokens=False).ids + [t.eos_id]
        with torch.no_grad():
            out = model.generate(torch.tensor([ids], device="cuda"), max_new_tokens=len(want) + 4, do_sample=False,
                                 eos_token_id=t.eos_id, pad_token_id=t.eos_id)
        got = out[0, len(ids):].tolist()
        got = got[:got.index(t.eos_id) + 1] if t.eos_id in got else got
        exact += got == want
        if len(examples) < 5:
            examples.append({"user": conv["messages"][1]["content"], "want": t._tok.decode(want[:-1]),
                             "got": t._tok.decode([x for x in got if x != t.eos_id])})
    return {"exact": exact / len(held_out), "n": len(held_out), "examples": examples}


def scenario_sft_reverse(ctx) -> dict:
    return _sft_reverse(ctx, "sft_reverse", moe=False)


def scenario_sft_moe(ctx) -> dict:
    return _sft_reverse(ctx, "sft_moe", moe=True)


def _sft_reverse(ctx, name: str, moe: bool) -> dict:
    """sft_reverse (a tiny Llama, TP = the call's GPUs up to 2) or sft_moe (issue 50: a tiny Qwen3-MoE, 8 experts,
    top-2, at EP 2 with the all-to-all dispatcher and the auxiliary loss): the same data, checks and target."""
    gpus = min(ctx.get("gpus", 1), 2)
    work = WORK / name
    src, out = work / "src", work / "export"
    seq, iters, gbs, micro = 128, ctx.get("sft_iters", 400), 32, 8
    ep = gpus if moe else 1
    if moe:
        config = _make_qwen3_moe(src, hidden=256, layers=4, heads=4, kv=2, experts=8, topk=2, moe_ffn=256, vocab=64,
                                 max_pos=seq)
    else:
        config = _make_llama(src, hidden=256, layers=4, heads=4, kv=2, ffn=688, vocab=64, max_pos=seq)
    convs = reversal_conversations(1000, seed=1)
    seen = {c["messages"][1]["content"] for c in convs[:800]}
    held_out = [c for c in reversal_conversations(400, seed=2) if c["messages"][1]["content"] not in seen][:100]
    train = write_jsonl(work / "train.jsonl", convs[:800])
    valid = write_jsonl(work / "valid.jsonl", convs[800:])
    eval_iters = 2
    argv = _argv(config, seq, iters, gpus, [
        "--hf-init", str(src), "--hf-export", str(out), "--micro-batch-size", str(micro),
        "--global-batch-size", str(gbs), "--lr", "1e-3", "--min-lr", "1e-5", "--lr-warmup-iters", "20",
        "--eval-iters", str(eval_iters), "--eval-interval", "100", *_sft_flags(src, train, valid, True),
        *(["--moe-aux-loss-coeff", "0.001"] if moe else [])], ep=ep)
    run = Run(name, gpus, argv)
    rc = run.wait(400)
    failures: list[str] = []
    summary = run.summary() or {}
    res: dict = {"rc": rc, "gpus": gpus, "expert_parallel": ep, "iterations": iters, "losses": run.losses(),
                 "summary": summary}
    check(rc == 0, f"{name} exit {rc}", failures)
    if moe:
        experts = re.search(r"MoE experts=([^,\n]*)", run.text())
        res["experts"] = experts.group(1).strip() if experts else None
        router = re.findall(r"MoE iteration\s+(\d+) \|(.*)", run.text())
        res["router_log_last"] = router[-1][1].strip()[:300] if router else None
        check(res["experts"] is not None, "the trainer logged which experts it built", failures)
    check("sft data (chat" in run.text(), "the trainer logged its SFT data counts", failures)
    if rc == 0 and (out / "config.json").is_file():
        gen = _generate_exact(out, held_out)
        res["generate"] = gen
        check(gen["exact"] >= EXACT_TARGET, f"held-out exact {gen['exact']:.2%} < {EXACT_TARGET:.0%}", failures)
        ref = _answer_only_loss(out, seq, valid, eval_iters * gbs, packed=True)
        res["validation"] = {"trainer": summary.get("validation_loss"), "transformers_answer_only": ref["answer"],
                             "transformers_all_tokens": ref["all"]}
        v = summary.get("validation_loss")
        check(v is not None and abs(v - ref["answer"]) <= 0.02 + 0.05 * ref["answer"],
              f"trainer validation loss {v} vs transformers' answer-only loss {ref['answer']:.4f}", failures)
        check(v is not None and abs(v - ref["all"]) > 0.1,
              f"validation loss {v} should not be the all-token loss {ref['all']:.4f}", failures)
    run.close()
    return {"ok": not failures, "failures": failures, **res}


def scenario_sft_bench(ctx) -> dict:
    """Pretraining vs SFT padded vs SFT packed, same model and sequence length, in one call."""
    gpus = min(ctx.get("gpus", 1), 2)
    work = WORK / "sft_bench"
    src = work / "model"
    seq, iters, gbs, micro = 2048, 30, 16, 4
    # Llama-3.2-1B's shape (16 layers, 2048 hidden, GQA 32/8, SwiGLU 8192), untied, with the test vocabulary
    config = _make_llama(src, hidden=2048, layers=16, heads=32, kv=8, ffn=8192, vocab=128256, max_pos=seq,
                         bf16=True)
    train = write_jsonl(work / "chat.jsonl", chat_corpus(6000, seed=3, lo=20, hi=600))
    common = ["--micro-batch-size", str(micro), "--global-batch-size", str(gbs), "--lr", "1e-4", "--min-lr", "1e-5",
              "--lr-warmup-iters", "2", "--attention-backend", "flash", "--hf-init", str(src)]
    runs = {"pretraining_mock": _argv(config, seq, iters, gpus, common + ["--mock-data", "--tokenizer-type",
                                                                          "NullTokenizer"]),
            "sft_padded": _argv(config, seq, iters, gpus, common + _sft_flags(src, train, None, False)),
            "sft_packed": _argv(config, seq, iters, gpus, common + _sft_flags(src, train, None, True))}
    res: dict = {"seq": seq, "gbs": gbs, "gpus": gpus}
    failures: list[str] = []
    for name, argv in runs.items():
        r = Run(f"sft_bench_{name}", gpus, argv)
        rc = r.wait(300)
        summ = r.summary() or {}
        med = summ.get("median_iteration_s")
        data = summ.get("sft_data") or {}
        eff = data.get("packingEfficiency", 1.0)
        res[name] = {"rc": rc, "median_iteration_s": med, "sft_data": data,
                     "tokens_per_s_per_gpu_positions": gbs * seq / med / gpus if med else None,
                     "tokens_per_s_per_gpu_real": gbs * seq * eff / med / gpus if med else None,
                     "peak_gib": summ.get("max_peak_allocated_gib"), "startup_s": summ.get("startup_to_first_iteration_s")}
        check(rc == 0, f"{name}: exit {rc}", failures)
        r.close()
    return {"ok": not failures, "failures": failures, **res}


def scenario_sft_pods(ctx) -> dict:
    """The rendered pods of e2e/gpu/jobs/sft-tiny.yaml, verbatim (the `pods` scenario's flow: SIGTERM past
    the checkpoint of 10, the restart resumes the SFT data where it stopped), then the export."""
    import os
    import shutil
    import subprocess

    import pods as P

    models, data = P.PVC_ROOT / "models", P.PVC_ROOT / "sft-data"
    for d in (models, data):
        shutil.rmtree(d, ignore_errors=True)
    _make_llama(models / "sft-tiny-src", hidden=128, layers=2, heads=4, kv=2, ffn=256, vocab=64, max_pos=128)
    (data / "reverse").mkdir(parents=True)
    convs = reversal_conversations(600, seed=5)
    write_jsonl(data / "reverse" / "train.jsonl", convs[:500])
    write_jsonl(data / "reverse" / "valid.jsonl", convs[500:])
    subprocess.run(["chmod", "-R", "a+rX", str(models), str(data)], check=True)
    (models / "exports").mkdir()
    os.chown(models / "exports", 1000, 1000)  # the pods' user writes the export
    result = pods_job(ctx, REPO / "e2e" / "gpu" / "jobs" / "sft-tiny.yaml")
    failures = list(result.get("failures", []))
    logs = sorted(LOGS.glob("pods_sft-tiny_*.log"))
    start1 = "".join(p.read_text(errors="replace") for p in logs if "_start1_" in p.name)
    start2 = "".join(p.read_text(errors="replace") for p in logs if "_start2_" in p.name)
    check("sft data (chat" in start1 and "hf import:" in start1, "start 1 tokenized the chat data and imported",
          failures)
    check("from the cache" in start2, "start 2 read the tokens from the data cache", failures)
    check("validation at iteration" in start2, "validation loss logged", failures)
    out = models / "exports" / "sft-tiny"
    files = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    check({"config.json", "model.safetensors.index.json", "tokenizer.json"} <= set(files), f"export files {files}",
          failures)
    result.update(ok=not failures, failures=failures, export_files=files)
    return result


def scenario_sft_sigterm(ctx) -> dict:
    """SIGTERM during an SFT run with a validation file and async checkpoints (torchrun, 1 GPU): the
    checkpoint on SIGTERM must be written and the run exit 0; with and without periodic evaluation. On a
    hang, every thread's stack is dumped (faulthandler, SIGABRT) into the log."""
    import os
    import re
    import signal
    import time

    work = WORK / "sft_sigterm"
    src = work / "src"
    config = _make_llama(src, hidden=128, layers=2, heads=4, kv=2, ffn=256, vocab=64, max_pos=128)
    convs = reversal_conversations(600, seed=5)
    train = write_jsonl(work / "train.jsonl", convs[:500])
    valid = write_jsonl(work / "valid.jsonl", convs[500:])
    failures: list[str] = []
    res: dict = {}
    for name, extra in (("eval_every_20", ["--eval-interval", "20"]), ("eval_at_end", [])):
        ckpt = work / f"ckpt-{name}"
        argv = _argv(config, 128, 200, 1, [
            "--hf-init", str(src), "--micro-batch-size", "8", "--global-batch-size", "16", "--lr", "1e-3",
            "--min-lr", "1e-4", "--lr-warmup-iters", "2", "--eval-iters", "4", *extra,
            "--save", str(ckpt), "--load", str(ckpt), "--save-interval", "10", "--async-save",
            "--use-persistent-ckpt-worker", "--exit-signal-handler", *_sft_flags(src, train, valid, True)])
        run = Run(f"sft_sigterm_{name}", 1, argv)
        hit = run.wait_for(re.compile(r"iteration\s+(1[2-9]|[2-9]\d)/"), 240)
        worker = run.worker(0)
        # SIGTERM to the rank's process group, as the launcher forwards it (not through torchrun's agent,
        # which would SIGKILL the rank after 30 s)
        os.killpg(os.getpgid(worker.pid), signal.SIGTERM)
        t0 = time.monotonic()
        stopped = run.wait_for(re.compile(r"megatron_trainer: exit 143 \(signal\)"), 90)
        if stopped is None and worker.is_running():
            worker.send_signal(signal.SIGUSR1)  # the trainer's faulthandler: every thread's stack into the log
            time.sleep(3)
        run.kill_tree()
        res[name] = {"reached": bool(hit), "stopped": bool(stopped), "sigterm_to_exit_s": round(time.monotonic() - t0, 1),
                     "tail": run.text()[-12000:] if not stopped else run.text()[-600:]}
        check(stopped is not None, f"{name}: SIGTERM -> no 'exit 143 (signal)' within 90 s", failures)
        run.close()
    return {"ok": not failures, "failures": failures, **res}


# name -> Scenario(the function, its line in --list, rough seconds per layout); suite.py registers them.
SCENARIOS = {
    "sft_reverse": Scenario(scenario_sft_reverse, "fine-tune a tiny Llama on digit reversal, export: generate >= 90 % "
                            "exact; validation loss = the answer-only loss"),
    "sft_moe": Scenario(scenario_sft_moe, "issue 50: sft_reverse on a tiny Qwen3-MoE at EP2 (all-to-all): generate "
                        ">= 90 % exact; validation loss = the answer-only loss", 120, min_gpus=2),
    "sft_bench": Scenario(scenario_sft_bench, "pretraining vs SFT padded vs SFT packed on a Llama-3.2-1B shape: "
                          "iteration time, tokens/s, padding waste"),
    "sft_pods": Scenario(scenario_sft_pods, "the rendered pods of e2e/gpu/jobs/sft-tiny.yaml: SIGTERM, resume of the "
                         "SFT data, export"),
    "sft_sigterm": Scenario(scenario_sft_sigterm, "SIGTERM during SFT with validation and async saves: checkpoint, "
                            "exit 0 (with and without evaluation)"),
}
