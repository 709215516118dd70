"""The Transformer Engine path's start-up decisions (issue 59): which of TE's attention kernels serves
``--attention-backend``, and whether TE's fused RoPE is there.

Each decision is a pure function of the config and of `TeKernels`, what this machine's TE can run for
this model; `probe` is the one function that asks TE, after the process group is up (it reads the GPU's
compute capability and cuDNN's version). A request no kernel here can serve is refused at start-up
(`exitcodes.Refusal`: exit 2, not retried, one line that says what to change); a default that cannot run
here is switched off and the start-up line says so.

Megatron-Core hands TE its backend through three environment variables (NVTE_FLASH_ATTN, NVTE_FUSED_ATTN,
NVTE_UNFUSED_ATTN), set when the GPTModel is built from ``config.attention_backend``
(models/common/language_module/language_module.py, ``_set_attention_backend``, megatron-core 0.19.2):
``flash`` enables TE's flash-attn backend only, ``fused`` its cuDNN backend only, ``unfused`` its
unfused one, ``auto`` all three, ``local`` none (Megatron-LM allows ``local`` with the local spec only).
TE then fails at the first forward with "No dot product attention backend is available" when the
enabled ones cannot serve the call (the issue's second crash: flash-attn is not installed, cuDNN is).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from .exitcodes import ExitCode, Refusal

#: The NVTE_* values Megatron-Core sets for each backend (language_module.py, _set_attention_backend), in
#: the order (NVTE_FLASH_ATTN, NVTE_FUSED_ATTN, NVTE_UNFUSED_ATTN); it asserts that a value already in the
#: environment is the one it would set.
NVTE_ATTENTION_ENV = ("NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")
NVTE_VALUES = {"flash": ("1", "0", "0"), "fused": ("0", "1", "0"), "unfused": ("0", "0", "1"),
               "auto": ("1", "1", "1")}

#: What each TE backend is, for the start-up line and the refusals.
KERNEL_NAMES = {"flash": "TE's flash-attn backend", "fused": "TE's fused attention (cuDNN)",
                "unfused": "TE's unfused attention (materialises s x s)"}


@dataclass(frozen=True)
class TeKernels:
    """What Transformer Engine here can run for this model's attention (TE's own verdict:
    ``get_attention_backend``'s available backends for the model's shapes, dtype and mask), and whether
    Megatron-Core found TE's fused RoPE. None: the probe could not tell (the request is trusted)."""

    flash: bool | None = None  # the flash-attn package, in a version TE supports, serves this attention
    fused: bool | None = None  # cuDNN fused attention does
    unfused: bool | None = None  # TE's unfused attention does
    fused_first: bool = True  # TE prefers cuDNN over flash-attn where both serve (Hopper and later)
    rope_fusion: bool = True  # megatron.core.models.common.embeddings.rope_utils.fused_apply_rotary_pos_emb
    note: str = ""  # versions and the probe's own words, for the start-up line and the refusals

    def serves(self, kernel: str) -> bool | None:
        return {"flash": self.flash, "fused": self.fused, "unfused": self.unfused}[kernel]


@dataclass(frozen=True)
class TePlan:
    """The Transformer Engine path as it will run."""

    attention_backend: str  # the megatron.core.transformer.enums.AttnBackend member's name
    attention: str  # what runs, for the start-up line
    rope_fusion: bool  # apply_rope_fusion may be on (TE's fused RoPE is there)
    notes: tuple[str, ...] = ()  # defaults switched off here, for the start-up log


def user_disabled(environ: Mapping[str, str]) -> set[str]:
    """The TE backends the environment turns off (NVTE_*_ATTN=0), which Megatron-Core would keep off too."""
    return {kernel for kernel, var in zip(("flash", "fused", "unfused"), NVTE_ATTENTION_ENV, strict=True)
            if environ.get(var) == "0"}


def nvte_env_problem(backend: str, environ: Mapping[str, str]) -> str | None:
    """Why Megatron-Core's assertion in _set_attention_backend would fail on this environment for `backend`
    (an NVTE_*_ATTN already set to another value than the one it sets), else None."""
    wrong = [f"{var}={environ[var]}" for var, want in zip(NVTE_ATTENTION_ENV, NVTE_VALUES[backend], strict=True)
             if environ.get(var) not in (None, want)]
    if not wrong:
        return None
    return (f"the environment sets {', '.join(wrong)}, which Megatron-Core refuses for TE's {backend} attention "
            f"(language_module.py, _set_attention_backend): unset {' and '.join(w.split('=')[0] for w in wrong)}, "
            "and choose the kernel with --attention-backend")


def _refuse(requested: str, why: str, kernels: TeKernels) -> Refusal:
    seen = f" ({kernels.note})" if kernels.note else ""
    return Refusal(ExitCode.BAD_ARGUMENTS,
                   f"--attention-backend {requested} on the Transformer Engine path: {why}{seen}. Use --attention-backend "
                   "unfused (spec.training.attentionBackend: unfused), or --transformer-impl local (torch SDPA's fused "
                   "kernels)")


def attention_backend(requested: str, kernels: TeKernels, environ: Mapping[str, str]) -> tuple[str, str]:
    """(the AttnBackend Megatron-Core gets, what runs) for `requested`; a Refusal where no TE kernel here serves it.

    - ``flash`` is the product's "fused flash/cuDNN attention" (spec.py, attentionBackend): whichever of TE's
      two fused kernels serves this model, in TE's own order of preference (cuDNN first on Hopper and later,
      dot_product_attention/utils.py get_attention_backend), never the unfused one. Megatron-Core's own
      ``flash`` (flash-attn only) would fail where only cuDNN is there, which is the image's case.
    - ``fused`` is TE's cuDNN attention and only that (Megatron-LM's meaning).
    - ``unfused`` and ``auto`` are TE's; ``local`` (Megatron's own attention) is not in TE's layer spec:
      refused, as Megatron-LM refuses it (training/arguments.py, "only supported with --spec local").
    A kernel the environment turns off (NVTE_FUSED_ATTN=0, ...) does not serve."""
    off = user_disabled(environ)

    def serves(kernel: str) -> bool | None:
        return False if kernel in off else kernels.serves(kernel)

    if requested == "local":
        raise Refusal(ExitCode.BAD_ARGUMENTS,
                      "--attention-backend local is Megatron-Core's own attention, which the Transformer Engine layer "
                      "spec does not hold (Megatron-LM refuses it too: training/arguments.py, '--attention-backend "
                      "local is only supported with --spec local'). Use --attention-backend unfused (TE's unfused "
                      "attention) or --transformer-impl local")
    if requested == "flash":
        order = ("fused", "flash") if kernels.fused_first else ("flash", "fused")
        chosen = next((k for k in order if serves(k)), None)
        if chosen is None:  # neither is known to serve: one not known NOT to serve is tried (an unverified probe)
            chosen = next((k for k in order if serves(k) is None), None)
        if chosen is None:
            raise _refuse(requested, "neither of TE's fused kernels serves this model here (flash-attn: "
                          f"{_verdict(serves('flash'))}, cuDNN fused attention: {_verdict(serves('fused'))})", kernels)
        backend, text = chosen, f"{KERNEL_NAMES[chosen]} for --attention-backend flash"
    elif requested in ("fused", "unfused"):
        if serves(requested) is False:
            raise _refuse(requested, f"{KERNEL_NAMES[requested]} does not serve this model here", kernels)
        backend, text = requested, KERNEL_NAMES[requested]
    elif requested == "auto":
        if not any(serves(k) is not False for k in ("flash", "fused", "unfused")):
            raise _refuse(requested, "no TE attention kernel serves this model here", kernels)
        backend, text = "auto", "TE's choice among its attention kernels (--attention-backend auto)"
    else:
        raise ValueError(f"unknown --attention-backend {requested!r}")
    known = serves(backend) if backend != "auto" else (True if any(serves(k) for k in KERNEL_NAMES) else None)
    if known is None:
        text += " (not verified at start-up: TE's attention probe could not tell)"
    problem = nvte_env_problem(backend, environ)
    if problem:
        raise Refusal(ExitCode.BAD_ARGUMENTS, f"--attention-backend {requested} on the Transformer Engine path: {problem}")
    return backend, text


def _verdict(serves: bool | None) -> str:
    return {True: "serves", False: "not available", None: "unknown"}[serves]


def plan(cfg, kernels: TeKernels, environ: Mapping[str, str]) -> TePlan:
    """The Transformer Engine path for `cfg` on this machine (Refusal where it cannot run as asked)."""
    backend, text = attention_backend(cfg.training.attention_backend, kernels, environ)
    notes = []
    wants_rope = cfg.model.position_embedding_type == "rope" and not cfg.training.no_rope_fusion
    if wants_rope and not kernels.rope_fusion:
        # TransformerConfig raises "apply_rope_fusion is not available. Please install TE >= 1.4." otherwise
        # (transformer_config.py, __post_init__); megatron/core/extensions/transformer_engine.py imports TE's
        # apply_rotary_pos_emb (attention/rope.py from TE 2.3, attention/ before)
        notes.append("RoPE fusion off: Megatron-Core finds no fused RoPE in this Transformer Engine (it asks for TE >= 1.4)")
    return TePlan(backend, text, kernels.rope_fusion, tuple(notes))


# ------------------------------------------------------------------------------------------------ the probe
def attention_params(cfg, dtype) -> dict:
    """TE's AttentionParams fields for one of this model's attention calls on one rank, as Megatron-Core's
    TEDotProductAttention makes them (separate sbhd q, k and v, causal mask, the rank's heads and sequence)."""
    m, p, t = cfg.model, cfg.parallel, cfg.training
    return dict(qkv_dtype=dtype, qkv_layout="sbhd_sbhd_sbhd", batch_size=t.micro_batch_size,
                num_heads=m.num_attention_heads // p.tensor, num_gqa_groups=max(1, m.effective_num_query_groups // p.tensor),
                max_seqlen_q=m.seq_length // p.context, max_seqlen_kv=m.seq_length // p.context,
                head_dim_qk=m.head_dim, head_dim_v=m.head_dim, attn_mask_type="causal", window_size=(-1, 0),
                attention_dropout=m.attention_dropout, context_parallel=p.context > 1, cp_size=p.context,
                deterministic=t.deterministic_mode, is_training=True)


@contextlib.contextmanager
def _every_backend_enabled(environ) -> Iterator[None]:
    """NVTE_*_ATTN=1 while TE lists what could serve (its filters read them), restored after."""
    saved = {var: environ.get(var) for var in NVTE_ATTENTION_ENV}
    environ.update({var: "1" for var in NVTE_ATTENTION_ENV})
    try:
        yield
    finally:
        for var, value in saved.items():
            if value is None:
                environ.pop(var, None)
            else:
                environ[var] = value


def probe(cfg) -> TeKernels:
    """TeKernels for `cfg` on this GPU (imports TE; CUDA must be set to this rank's device). Never raises: a
    probe that fails says so in the note and leaves the attention verdicts unknown."""
    import os

    import torch

    try:
        from megatron.core.models.common.embeddings import rope_utils

        rope = rope_utils.fused_apply_rotary_pos_emb is not None
    except Exception:  # megatron-core without its TE extension: no fused RoPE
        rope = False
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[cfg.training.precision]
    try:
        import transformer_engine.pytorch  # noqa: F401  (sets flash-attn's flags: attention/.../backends.py)
        from transformer_engine.pytorch.attention.dot_product_attention import utils as dpa

        names = {f.name for f in dataclasses.fields(dpa.AttentionParams)}
        params = dpa.AttentionParams(**{k: v for k, v in attention_params(cfg, dtype).items() if k in names})
        with _every_backend_enabled(os.environ):
            available = list(dpa.get_attention_backend(params)[-1])
        if len(available) != 3:
            raise TypeError(f"get_attention_backend returned {available!r} as its available backends")
        flash, fused, unfused = (bool(x) for x in available)
        sm = tuple(dpa.get_device_compute_capability())
    except Exception as e:  # TE's internals move between versions: trust the request, say why it was not checked
        return TeKernels(rope_fusion=rope, note=f"attention probe failed: {type(e).__name__}: {str(e)[:200]}")
    return TeKernels(flash, fused, unfused, fused_first=sm >= (9, 0), rope_fusion=rope, note=_versions(dpa, sm, dtype))


def _versions(dpa, sm: tuple, dtype) -> str:
    """TE's, the GPU's, cuDNN's and flash-attn's versions and the dtype, for the start-up line (best effort)."""
    import transformer_engine

    parts = [f"TE {getattr(transformer_engine, '__version__', '?')}", f"sm{10 * sm[0] + sm[1]}"]
    try:
        cudnn = dpa.get_cudnn_version()
        parts.append("cuDNN " + (".".join(map(str, cudnn)) if isinstance(cudnn, (tuple, list)) else str(cudnn)))
        fa = dpa.FlashAttentionUtils
        parts.append(f"flash-attn {fa.version}" if fa.is_installed else "flash-attn not installed")
        if getattr(fa, "v3_is_installed", False):
            parts.append(f"flash-attn 3 {fa.fa3_version}")
    except Exception:  # a note only
        pass
    return ", ".join(parts + [str(dtype).removeprefix("torch.")])
