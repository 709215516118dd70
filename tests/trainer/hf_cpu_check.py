"""The Hugging Face import/export run for real on CPUs: transformers' own logits are the oracle.

For each architecture, a tiny model is made with transformers (`from_config` + `save_pretrained`,
random weights, nothing downloaded). Megatron-Core's GPTModel is built by the trainer's own
functions (model.transformer_config/build_model, local spec) in `world` gloo processes at the given
TP x PP, its weights filled by hf_torch.import_weights (each rank reads its own slices), and its
fp32 logits on a fixed batch compared with transformers'. Then hf_torch.export_weights writes the
model back out, and every tensor must be bit-identical to the source.

    python tests/trainer/hf_cpu_check.py --tp 2 --pp 1 --arch tiny-qwen2 --work DIR
    python tests/trainer/hf_cpu_check.py --tp 2 --ep 2 --arch tiny-qwen3-moe,tiny-mixtral --work DIR

Used by tests/trainer/test_hf_torch.py (skipped where torch, megatron-core or transformers is
missing) and, on GPUs, by the GPU suite's `hf_logits` scenario (e2e/gpu/hf.py; same functions, NCCL,
bf16 too).

`--impl te` (CUDA, Transformer Engine importable) builds the Transformer Engine layer spec instead, as the trainer
builds it (model.plan_te_path with te_path.probe): the GPU suite's `te_hf_logits` (e2e/gpu/te.py, issue 59).
`--diagnose` (TP = PP = 1, fp32 jobs) also reports where the fp32 logits part from transformers': every
layer's attention block, MLP block and output, the final norm, each against transformers' same module in the
same forward (`modules`), and with `--impl te` TE's own operators against float64 references at the model's
sizes (`ops`: Linear, RMSNorm, LayerNormLinear, fused RoPE, DotProductAttention, beside torch's fp32 Linear).
`--tf32 on|off` sets torch.backends.cuda.matmul/cudnn.allow_tf32 in the workers (default: torch's own); the
environment (NVIDIA_TF32_OVERRIDE=0 turns TF32 off in cuBLAS for every caller, TE's GEMMs included) is
inherited by the spawned workers.

    python tests/trainer/hf_cpu_check.py --device cuda --impl te --diagnose --arch tiny-llama3 --work DIR
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "trainer_image"), str(ROOT / "contract")]
FIXTURES = ROOT / "tests" / "fixtures" / "hf"
SEQ, BATCH = 24, 2


def make_tokenizer(directory: Path, vocab_size: int) -> None:
    """A word-level tokenizer over `vocab_size` made-up words (tokenizers library, no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(vocab_size - 2)}
    vocab.update({"<unk>": vocab_size - 2, "</s>": vocab_size - 1})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "unk_token": "<unk>",
                                                                 "tokenizer_class": "PreTrainedTokenizerFast"}))


def make_model(arch: str, directory: Path, dtype: str = "float32", seed: int = 0) -> dict:
    """A tiny random HF model of fixture `arch` saved in `directory`; its config dict."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fixture = json.loads((FIXTURES / f"{arch}.json").read_text())
    config = AutoConfig.for_model(fixture.pop("model_type"), **{k: v for k, v in fixture.items()
                                                                 if k not in ("architectures", "transformers_version",
                                                                              "dtype")})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(getattr(torch, dtype))
    with torch.no_grad():  # RMSNorm weights start at 1: make them random so a swapped norm shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            if name.endswith(".gate.weight"):  # a MoE router: logits of order 1, so routing decides something
                p.normal_(0.0, 0.3)
            if name.endswith(".shared_expert_gate.weight"):  # Qwen2-MoE: gate scores spread over (0, 1), not ~0.5
                p.normal_(0.0, 0.3)
    model.save_pretrained(directory)
    make_tokenizer(directory, config.vocab_size)
    return json.loads((directory / "config.json").read_text())


def trainer_argv(config: dict, tp: int, pp: int, precision: str, ep: int = 1,
                 dispatcher: str | None = None, impl: str = "local") -> list[str]:
    """The trainer command line for the model (what `megatron-operator hf-config` + render produce; for a
    mixture-of-experts model, the MoE flags the trainer compares with config.json; `dispatcher`: its
    --moe-token-dispatcher-type, Megatron's default (allgather) when None; `impl`: local or te, the layer spec).
    Attention `auto` on both: on TE that is TE's own choice, its fused kernels in bf16 and its unfused one in fp32
    (neither fused kernel takes fp32)."""
    from megatron_trainer.hf_config import parse_config

    m = parse_config(config, SEQ)
    argv = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
            "--num-layers", str(m.num_layers), "--hidden-size", str(m.hidden_size),
            "--num-attention-heads", str(m.num_heads), "--group-query-attention", "--num-query-groups",
            str(m.num_kv_heads), "--ffn-hidden-size", str(m.ffn_hidden_size), "--seq-length", str(SEQ),
            "--max-position-embeddings", str(m.max_position_embeddings), "--vocab-size", str(m.vocab_size),
            "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
            "--rotary-base", str(int(m.rope_theta)), "--disable-bias-linear", "--norm-epsilon", repr(m.norm_epsilon),
            "--transformer-impl", {"local": "local", "te": "transformer_engine"}[impl], "--attention-backend", "auto",
            "--micro-batch-size", str(BATCH),
            "--train-iters", "1", "--mock-data", "--tokenizer-type", "NullTokenizer", "--eval-iters", "0"]
    if m.explicit_head_dim:
        argv += ["--kv-channels", str(m.head_dim)]
    if m.rope_scaling_factor:
        argv += ["--use-rope-scaling", "--rope-scaling-factor", repr(m.rope_scaling_factor)]
    if not m.tied:
        argv.append("--untie-embeddings-and-output-weights")
    if m.qkv_bias:
        argv.append("--add-qkv-bias")
    if m.qk_norm:
        argv.append("--qk-layernorm")
    if m.moe:
        argv += ["--num-experts", str(m.num_experts), "--moe-router-topk", str(m.moe_topk),
                 "--moe-ffn-hidden-size", str(m.moe_ffn_hidden_size), "--expert-model-parallel-size", str(ep)]
        if m.moe_pre_softmax:
            argv.append("--moe-router-pre-softmax")
        if m.shared_expert_ffn_hidden_size:
            argv += ["--moe-shared-expert-intermediate-size", str(m.shared_expert_ffn_hidden_size),
                     "--moe-shared-expert-gate"]
        if dispatcher:
            argv += ["--moe-token-dispatcher-type", dispatcher]
        if tp > 1:  # megatron-core trains MoE at TP > 1 only with it
            argv.append("--sequence-parallel")
    if precision == "bf16":
        argv.append("--bf16")
    return argv


def hf_logits(directory: Path, tokens, dtype: str = "float32", device: str = "cpu", capture: dict | None = None):
    """transformers' logits [b, s, vocab]; with `capture`, its modules' outputs of that forward too (hf_modules)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=getattr(torch, dtype),
                                                 attn_implementation="eager").to(device).eval()
    with torch.no_grad(), _captured(hf_modules(model) if capture is not None else {}, capture, batch_first=True):
        return model(input_ids=tokens.to(device)).logits.float().cpu()


# ------------------------------------------------------------------------------------------ --diagnose
def hf_modules(model) -> dict:
    """transformers' modules whose outputs --diagnose compares, by the names megatron_modules gives Megatron's."""
    inner = model.model
    out = {"embedding": inner.embed_tokens, "final_norm": inner.norm}
    for i, layer in enumerate(inner.layers):
        mlp = getattr(layer, "mlp", None) or getattr(layer, "block_sparse_moe", None)
        out.update({f"layer{i}.attention": layer.self_attn, f"layer{i}.mlp": mlp, f"layer{i}.output": layer})
    return out


def megatron_modules(gpt) -> dict:
    """Megatron's GPTModel modules of the same places: the attention block includes its input norm on both (TE
    fuses it into linear_qkv; transformers' self_attn takes the normed input, so it is hooked on its output
    only), the MLP block likewise."""
    out = {"embedding": gpt.embedding, "final_norm": gpt.decoder.final_layernorm}
    for i, layer in enumerate(gpt.decoder.layers):
        out.update({f"layer{i}.attention": layer.self_attention, f"layer{i}.mlp": layer.mlp, f"layer{i}.output": layer})
    return out


@contextlib.contextmanager
def _captured(modules: dict, into: dict | None, batch_first: bool):
    """Forward hooks that put each module's (first) output, as fp32 [b, s, h] on the CPU, into `into`."""
    import torch

    def hook(name):
        def record(_module, _inputs, output):
            t = output[0] if isinstance(output, (tuple, list)) else output
            if isinstance(t, torch.Tensor):
                t = t.detach().float()
                into[name] = (t if batch_first else t.transpose(0, 1)).cpu()
        return record

    handles = [m.register_forward_hook(hook(n)) for n, m in modules.items() if m is not None]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def module_diffs(ours: dict, theirs: dict) -> list[dict]:
    """Per module, in forward order: max |ours - transformers'| and transformers' max |value| (its scale)."""
    out = []
    for name in theirs:
        if name in ours and ours[name].shape == theirs[name].shape:
            out.append({"module": name, "max_abs_diff": float((ours[name] - theirs[name]).abs().max()),
                        "scale": float(theirs[name].abs().max())})
        elif name in ours:
            out.append({"module": name, "shapes": [list(ours[name].shape), list(theirs[name].shape)]})
    return out


def te_op_errors(cfg, device: str, seed: int = 0) -> dict:
    """Transformer Engine's operators in fp32 at this model's sizes against float64 references computed by hand
    (max |error| and the reference's max |value|), beside torch's own fp32 Linear: which of them carries the fp32
    logits' difference. TE runs its fp32 GEMMs with cuBLAS's CUBLAS_COMPUTE_32F_FAST_TF32 (common/gemm/
    cublaslt_gemm.cu: "Use TF32 only for pure FP32 GEMM"), which NVIDIA_TF32_OVERRIDE=0 turns off."""
    import torch
    import transformer_engine.pytorch as te
    from megatron.core.models.common.embeddings import rope_utils

    m = cfg.model
    gen = torch.Generator(device=device).manual_seed(seed)
    s, b, h, heads, groups, d = SEQ, BATCH, m.hidden_size, m.num_attention_heads, m.effective_num_query_groups, m.head_dim
    ffn = m.effective_ffn_hidden_size

    def rand(*shape):
        return torch.randn(*shape, device=device, generator=gen, dtype=torch.float32)

    def err(got, ref) -> dict:
        return {"max_abs_err": float((got.double() - ref).abs().max()), "scale": float(ref.abs().max())}

    out: dict = {}
    x = rand(s * b, h)
    with torch.no_grad():
        lin = te.Linear(h, ffn, bias=False, params_dtype=torch.float32, device=device)
        ref = x.double() @ lin.weight.double().t()
        out["te_linear"] = err(lin(x), ref)
        out["torch_linear"] = err(torch.nn.functional.linear(x, lin.weight), ref)
        norm = te.RMSNorm(h, eps=m.norm_epsilon, params_dtype=torch.float32, device=device)
        norm.weight.copy_(rand(h).abs() + 0.5)
        xd = x.double()
        normed = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + m.norm_epsilon) * norm.weight.double()
        out["te_rmsnorm"] = err(norm(x), normed)
        ln_lin = te.LayerNormLinear(h, ffn, bias=False, normalization="RMSNorm", eps=m.norm_epsilon,
                                    params_dtype=torch.float32, device=device)
        ln_lin.layer_norm_weight.copy_(norm.weight)
        ln_lin.weight.copy_(lin.weight)
        out["te_layernorm_linear"] = err(ln_lin(x), normed @ lin.weight.double().t())
        if rope_utils.fused_apply_rotary_pos_emb is not None:  # TE's fused RoPE through Megatron-Core, [s, b, n, d]
            inv = 1.0 / (m.rotary_base ** (torch.arange(0, d, 2, device=device, dtype=torch.float64) / d))
            freqs = torch.outer(torch.arange(s, device=device, dtype=torch.float64), inv)
            emb = torch.cat([freqs, freqs], dim=-1)[:, None, None, :]
            t = rand(s, b, heads, d)
            half = torch.cat([-t.double()[..., d // 2:], t.double()[..., :d // 2]], dim=-1)
            ref = t.double() * emb.cos() + half * emb.sin()
            out["te_fused_rope"] = err(rope_utils.fused_apply_rotary_pos_emb(t, emb.float()), ref)
        q, k, v = rand(s, b, heads, d), rand(s, b, groups, d), rand(s, b, groups, d)
        attn = te.DotProductAttention(heads, d, num_gqa_groups=groups, attn_mask_type="causal", qkv_format="sbhd",
                                      attention_dropout=0.0)
        kk, vv = (t.double().repeat_interleave(heads // groups, dim=2) for t in (k, v))
        scores = torch.einsum("sbnd,tbnd->bnst", q.double(), kk) / d ** 0.5
        mask = torch.triu(torch.ones(s, s, dtype=torch.bool, device=device), 1)
        probs = scores.masked_fill(mask, float("-inf")).softmax(-1)
        ref = torch.einsum("bnst,tbnd->sbnd", probs, vv).reshape(s, b, heads * d)
        out["te_attention"] = err(attn(q, k, v), ref)
    return out


def megatron_logits(model: list, tokens, vocab: int, device: str):
    """Logits [b, s, vocab] of the whole model on the last stage (None elsewhere); PP by send/recv."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron_trainer.checkpoint import unwrap

    tokens = tokens.to(device)
    b, s = tokens.shape
    position_ids = torch.arange(s, device=device).unsqueeze(0).expand(b, -1)
    chunk = model[0]
    gpt = unwrap(chunk)
    pp, pp_rank = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    hidden_size = gpt.config.hidden_size
    with torch.no_grad():
        if pp_rank > 0:
            recv = torch.empty((s, b, hidden_size), dtype=gpt.config.params_dtype, device=device)
            torch.distributed.recv(recv, src=ps.get_pipeline_model_parallel_prev_rank())
            chunk.set_input_tensor(recv)
        out = chunk(tokens if pp_rank == 0 else None, position_ids, None)
        if pp_rank < pp - 1:
            torch.distributed.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
            return None
        tp = ps.get_tensor_model_parallel_world_size()
        parts = [torch.empty_like(out) for _ in range(tp)]
        torch.distributed.all_gather(parts, out.contiguous(), group=ps.get_tensor_model_parallel_group())
        full = torch.cat(parts, dim=-1)  # GPTModel returns [b, s, padded vocab / TP] without labels
        return full[:, :, :vocab].float().cpu()


def describe_experts(model: list) -> str | None:
    """The experts' module class of the built model (None for a dense one)."""
    from megatron_trainer.checkpoint import unwrap

    for module in unwrap(model[0]).modules():
        if hasattr(module, "num_local_experts") and type(module).__name__ != "MoELayer":
            return type(module).__name__
    return None


class Env:
    """What export_weights needs of the trainer's DistEnv."""

    def __init__(self, rank: int, world_size: int, cpu_group):
        self.rank, self.world_size, self.cpu_group = rank, world_size, cpu_group

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0


def build(argv: list[str], device: str, experts: str = "grouped"):
    """The trainer's own model construction (no DDP, no optimizer) for a parsed command line; `experts`: the
    MEGATRON_TRAINER_MOE_EXPERTS choice for a MoE model. A Transformer Engine command line gets TE's layer spec,
    planned as the trainer plans it (te_path.probe on this GPU), or a RuntimeError where TE is not importable."""
    from megatron_trainer.config import parse_args
    from megatron_trainer.model import (
        build_model,
        choose_path,
        moe_experts_path,
        plan_te_path,
        te_available,
        transformer_config,
    )

    cfg = parse_args(argv)
    te = cfg.training.transformer_impl == "transformer_engine"
    if te and not te_available():
        raise RuntimeError("--impl te: Transformer Engine is not importable here")
    path = choose_path(cfg, have_te=te)
    if te:
        from megatron_trainer.te_path import probe

        plan_te_path(cfg, path, probe(cfg), os.environ)
    moe_experts_path(cfg, path, experts, 0)
    tconfig = transformer_config(cfg, path)
    if device == "cpu":
        tconfig.use_cpu_initialization = True
    model, padded = build_model(cfg, tconfig, path, cfg.model.vocab_size, ddp=False)
    return cfg, model, padded


def worker(rank: int, world: int, args, port: int, results_path: str) -> None:
    import dataclasses

    import torch
    from megatron.core import parallel_state as ps
    from megatron_trainer.hf_source import validate_source
    from megatron_trainer.hf_torch import export_weights, import_weights

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = args.device
    if device == "cpu":
        # Megatron-Core moves RoPE frequencies to torch.cuda.current_device() at the first forward
        # (rotary_pos_embedding.py get_emb); on a CPU-only machine that device is the CPU.
        torch.cuda.current_device = lambda: "cpu"
        # ...and with tied embeddings over PP > 1 it moves the last stage's output weight to the GPU
        # for the embedding all-reduce (language_module.setup_embeddings_and_output_layer).
        torch.Tensor.cuda = lambda self, *a, **k: self
    result: dict = {"rank": rank}
    if args.tf32 is not None:  # --tf32: torch's own matmuls and cuDNN (transformers', and TE's unfused attention)
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = args.tf32 == "on"
    try:
        if device == "cuda":
            torch.cuda.set_device(rank)
        torch.distributed.init_process_group("gloo" if device == "cpu" else "nccl", rank=rank, world_size=world,
                                             **({"device_id": torch.device("cuda", rank)} if device == "cuda" else {}))
        cpu_group = torch.distributed.new_group(backend="gloo")
        ps.initialize_model_parallel(tensor_model_parallel_size=args.tp, pipeline_model_parallel_size=args.pp,
                                     expert_model_parallel_size=args.ep)
        if device == "cuda":
            from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

            model_parallel_cuda_manual_seed(1234)
        else:  # sequence parallelism forks the CUDA RNG for its dropout (none here): a tracker that forks nothing
            from megatron.core.tensor_parallel.random import initialize_rng_tracker

            initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
        env = Env(rank, world, cpu_group)
        result["jobs"] = []
        for src, dst, precision in args.jobs:
            src = Path(src)
            job: dict = {"src": src.name, "precision": precision}
            result["jobs"].append(job)
            config = json.loads((src / "config.json").read_text())
            argv = trainer_argv(config, args.tp, args.pp, precision, args.ep, getattr(args, "dispatcher", None),
                                args.impl)
            cfg, model, padded = build(argv + ["--hf-init", str(src.resolve())], device, args.experts)
            job["path"] = describe_experts(model)
            source = validate_source(src, cfg)
            job["import"] = import_weights(model, source, args.tp, ps.get_tensor_model_parallel_rank(), padded)
            torch.manual_seed(7)
            tokens = torch.randint(0, config["vocab_size"], (BATCH, SEQ))
            diagnose = args.diagnose and precision == "fp32" and args.tp == args.pp == 1
            ours_modules: dict = {}
            from megatron_trainer.checkpoint import unwrap

            with _captured(megatron_modules(unwrap(model[0])) if diagnose else {}, ours_modules, batch_first=False):
                logits = megatron_logits(model, tokens, config["vocab_size"], device)
            if logits is not None:
                ref_dtype = "float32" if precision == "fp32" else "bfloat16"
                hf_modules_out: dict | None = {} if diagnose else None
                ref = hf_logits(src, tokens, ref_dtype, device, capture=hf_modules_out)
                if diagnose:
                    job["modules"] = module_diffs(ours_modules, hf_modules_out)
                    if args.impl == "te":
                        job["ops"] = te_op_errors(cfg, device)
                ref32 = hf_logits(src, tokens, "float32", device) if ref_dtype != "float32" else ref
                job["max_abs_diff"] = float((logits - ref).abs().max())
                job["max_abs_diff_vs_fp32_hf"] = float((logits - ref32).abs().max())
                job["hf_bf16_vs_fp32"] = float((ref - ref32).abs().max())
                job["logit_scale"] = float(ref32.abs().max())
                job["argmax_equal"] = float((logits.argmax(-1) == ref32.argmax(-1)).float().mean())
                job["argmax_equal_vs_hf_same_dtype"] = float((logits.argmax(-1) == ref.argmax(-1)).float().mean())
                job["hf_bf16_argmax_vs_fp32"] = float((ref.argmax(-1) == ref32.argmax(-1)).float().mean())
            if dst.startswith("s3://"):  # the object store: the endpoint is the checkpoints' flag
                export = {"hf_export": dst, "object_store_endpoint": args.endpoint, "object_store_region": "us-east-1"}
            else:
                export = {"hf_export": str(Path(dst).resolve())}
            cfg = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, **export))
            job["export"] = export_weights(model, cfg, env, 0, padded, max_shard_bytes=args.max_shard_bytes)
            del model
    except BaseException as e:  # report, do not hang the other ranks' collectives forever
        from megatron_trainer.exitcodes import classify, fatal_message

        code = classify(e, first_iteration_done=True)
        result["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
        result["exit_code"] = int(code)
        result["fatal_message"] = fatal_message(e, code, rank, "exporting to Hugging Face format")
        Path(results_path + f".{rank}").write_text(json.dumps(result))
        os._exit(1)
    Path(results_path + f".{rank}").write_text(json.dumps(result))
    torch.distributed.destroy_process_group()


def compare_export(src: Path, out: Path) -> dict:
    """Every exported tensor against the source: names, dtypes, shapes and bytes."""
    from safetensors import safe_open

    def tensors(d: Path) -> dict:
        index = d / "model.safetensors.index.json"
        files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() \
            else ["model.safetensors"]
        out = {}
        for f in files:
            with safe_open(str(d / f), framework="pt") as h:
                for k in h.keys():
                    out[k] = h.get_tensor(k)
        return out

    a, b = tensors(src), tensors(out)
    diff = [k for k in a if k not in b or a[k].dtype != b[k].dtype or a[k].shape != b[k].shape
            or not bool((a[k].view(-1).view(dtype=__import__("torch").uint8)
                         == b[k].view(-1).view(dtype=__import__("torch").uint8)).all())]
    from megatron_trainer.hf_config import parse_config

    cfg_a = json.loads((src / "config.json").read_text())
    cfg_b = json.loads((out / "config.json").read_text())
    return {"tensors": len(a), "exported": len(b), "not_identical": diff, "extra": sorted(set(b) - set(a)),
            "config_equal": cfg_a == cfg_b, "config_equivalent": parse_config(cfg_a) == parse_config(cfg_b),
            "files": sorted(p.name for p in out.iterdir())}


def run(archs: list[str], tp: int, pp: int, precisions: tuple[str, ...] = ("fp32",), device: str = "cpu",
        work: Path | None = None, max_shard_bytes: int = 5 * 10**9, ep: int = 1, experts: str = "grouped",
        compile_fusions: bool = True, dispatcher: str | None = None, impl: str = "local", diagnose: bool = False,
        tf32: str | None = None) -> list[dict]:
    """Every (arch, precision) at one TP x PP (x EP) layout, in one set of worker processes: one result each.
    `compile_fusions=False` runs Megatron's jit_fuser functions (the experts' weighted SwiGLU) eagerly: torch.compile
    on the CPU costs about 10 s a process. `impl`, `diagnose`, `tf32`: the module docstring's --impl, --diagnose,
    --tf32."""


    work = work or Path(tempfile.mkdtemp(prefix="hfcheck-"))
    jobs = []
    for arch in archs:
        for precision in precisions:
            src = work / f"{arch}-src-{precision}"
            if not src.exists():
                src.mkdir(parents=True)
                make_model(arch, src, "float32" if precision == "fp32" else "bfloat16")
            jobs.append((str(src), str(work / f"{arch}-tp{tp}pp{pp}ep{ep}-{experts}-{dispatcher or 'default'}-"
                                                 f"{'' if impl == 'local' else impl + '-'}{precision}-export"), precision))
    return run_jobs(jobs, tp, pp, device, work, max_shard_bytes, ep=ep, experts=experts,
                    compile_fusions=compile_fusions, dispatcher=dispatcher, impl=impl, diagnose=diagnose, tf32=tf32)


@contextlib.contextmanager
def fusions_compiled(compile_fusions: bool):
    """Processes started inside inherit TORCHDYNAMO_DISABLE=1 unless `compile_fusions`: Megatron's jit_fuser
    functions then run eagerly (torch.compile on the CPU costs about 10 s a process)."""
    saved = os.environ.get("TORCHDYNAMO_DISABLE")
    if not compile_fusions:
        os.environ["TORCHDYNAMO_DISABLE"] = "1"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("TORCHDYNAMO_DISABLE", None)
        else:
            os.environ["TORCHDYNAMO_DISABLE"] = saved


def run_jobs(jobs: list[tuple[str, str, str]], tp: int, pp: int, device: str, work: Path,
             max_shard_bytes: int = 5 * 10**9, endpoint: str | None = None, ep: int = 1,
             experts: str = "grouped", compile_fusions: bool = True, dispatcher: str | None = None,
             impl: str = "local", diagnose: bool = False, tf32: str | None = None) -> list[dict]:
    """(HF source directory, export directory or s3://BUCKET/PREFIX, precision) jobs at one layout, one set
    of workers. An s3:// export goes to `endpoint` (credentials from boto3's chain); the caller downloads
    it to compare (no "roundtrip" here)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = argparse.Namespace(tp=tp, pp=pp, ep=ep, experts=experts, jobs=jobs, device=device,
                              max_shard_bytes=max_shard_bytes, endpoint=endpoint, dispatcher=dispatcher, impl=impl,
                              diagnose=diagnose, tf32=tf32)
    results = str(work / f"results-{tp}-{pp}-{ep}-{experts}-{dispatcher or 'default'}-{impl}")
    world = tp * pp * ep  # the expert grid (expert TP = TP) x EP must divide the world: data parallel = EP
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=worker, args=(r, world, args, port, results)) for r in range(world)]
    with fusions_compiled(compile_fusions):
        for p in procs:
            p.start()
    for p in procs:
        p.join(600)
        if p.is_alive():
            p.kill()
    per_rank = [json.loads(Path(results + f".{r}").read_text()) if Path(results + f".{r}").exists() else
                {"rank": r, "error": "no result"} for r in range(world)]
    errors = [r["error"] for r in per_rank if "error" in r]
    out = []
    for i, (src, dst, precision) in enumerate(jobs):
        summary = {"arch": Path(src).name.split("-src")[0], "tp": tp, "pp": pp, "ep": ep, "precision": precision,
                   **({"dispatcher": dispatcher} if dispatcher else {})}
        done = [r["jobs"][i] for r in per_rank if len(r.get("jobs", [])) > i]
        if len(done) < world or errors:
            summary["error"] = errors[0] if errors else "not run"
            summary["exit_codes"] = [r.get("exit_code") for r in per_rank]
            summary["fatal_messages"] = [r.get("fatal_message") for r in per_rank]
            out.append(summary)
            continue
        last = done[-1]
        summary.update({k: last.get(k) for k in ("max_abs_diff", "max_abs_diff_vs_fp32_hf", "hf_bf16_vs_fp32",
                                                 "logit_scale", "argmax_equal", "argmax_equal_vs_hf_same_dtype",
                                                 "hf_bf16_argmax_vs_fp32")})
        summary.update({k: last[k] for k in ("modules", "ops") if k in last})  # --diagnose
        summary["import_s_max"] = max(d["import"]["seconds"] for d in done)
        summary["experts"] = last.get("path")
        summary["export"] = [d.get("export") for d in done]
        if not dst.startswith("s3://"):
            summary["roundtrip"] = compare_export(Path(src), Path(dst))
        out.append(summary)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="tiny-llama3", help="comma-separated fixture names")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--experts", default="grouped", choices=("grouped", "sequential"))
    ap.add_argument("--dispatcher", default=None, choices=("allgather", "alltoall"))
    ap.add_argument("--precision", default="fp32", help="comma-separated: fp32,bf16")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--impl", default="local", choices=("local", "te"), help="the layer spec (te: CUDA and TE)")
    ap.add_argument("--diagnose", action="store_true", help="where the fp32 logits part (TP = PP = 1)")
    ap.add_argument("--tf32", default=None, choices=("on", "off"), help="torch's allow_tf32 in the workers")
    ap.add_argument("--work")
    args = ap.parse_args()
    out = run(args.arch.split(","), args.tp, args.pp, tuple(args.precision.split(",")), args.device,
              Path(args.work) if args.work else None, ep=args.ep, experts=args.experts, dispatcher=args.dispatcher,
              impl=args.impl, diagnose=args.diagnose, tf32=args.tf32)
    print(json.dumps(out, indent=2))
    return 0 if all("error" not in r for r in out) else 1


if __name__ == "__main__":
    sys.exit(main())
