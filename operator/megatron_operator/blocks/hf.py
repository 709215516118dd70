"""spec.init.huggingFace and spec.export.huggingFace: start from a Hugging Face checkpoint, export one when
training finishes (docs/huggingface.md).

The block's room: its schema, its admission rules (a Llama-family model, an export apart from its source) and
its part of the rendered pod and command line (the two PVCs and the trainer's --hf-init/--hf-export). An export
to the checkpoint bucket is the object store's to check and to name (blocks/object_store.py).
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from ..expr import Expr, Lit, StartsWith, cond, fmt, lit
from ..names import HF_EXPORT_MOUNT, HF_EXPORT_VOLUME, HF_INIT_MOUNT, HF_INIT_VOLUME
from ..vocab.api import ApiModel
from ..vocab.patterns import DNS_LABEL, REL_PATH
from ..vocab.rule import Rule
from ..vocab.values import (
    activation,
    add_bias_linear,
    experts,
    f,
    has,
    mla,
    moe_score_function,
    moe_shared_ffn,
    moe_shared_gate,
    normalization,
    position_embedding,
)

# --------------------------------------------------------------------------------------------
# Schema
# --------------------------------------------------------------------------------------------


class HuggingFaceDir(ApiModel):
    """A Hugging Face model directory (config.json, *.safetensors, tokenizer files) on a PVC."""

    pvc: str = Field(..., max_length=253, pattern=DNS_LABEL, description="PersistentVolumeClaim that holds the "
                     "directory.")
    path: str = Field(..., min_length=1, max_length=512, pattern=REL_PATH, description="Directory inside the PVC "
                      "(relative: no leading '/', no '..' or '.' components).")


class InitSpec(ApiModel):
    """Where the weights come from when the job has no checkpoint yet (a fine-tune)."""

    hugging_face: HuggingFaceDir = Field(..., description="A Hugging Face checkpoint of a Llama-family model, "
                                         "mounted read-only at /hf-init (--hf-init): its weights start the job at "
                                         "iteration 0 with a fresh optimizer; a resume from spec.checkpoint never "
                                         "reads it. spec.model must match its config.json (megatron-operator "
                                         "hf-config prints the block).")


class HuggingFaceExportDir(ApiModel):
    """Where a Hugging Face export goes: a directory on a PVC, or a prefix in the job's checkpoint bucket."""

    pvc: str | None = Field(None, max_length=253, pattern=DNS_LABEL, description="PersistentVolumeClaim that "
                            "holds the directory, mounted read-write at /hf-export. Exactly one of pvc and "
                            "objectStore.")
    object_store: bool = Field(False, description="Write to the bucket of spec.checkpoint.objectStore instead "
                               "(same endpoint, region and credentials), under the key prefix `path` "
                               "(docs/object-storage.md). Exactly one of pvc and objectStore.")
    path: str = Field(..., min_length=1, max_length=512, pattern=REL_PATH, description="Directory inside the PVC, "
                      "or key prefix inside the bucket (relative: no leading '/', no '..' or '.' components).")


class ExportSpec(ApiModel):
    """Where the trained model is written when training finishes."""

    hugging_face: HuggingFaceExportDir = Field(
        ..., description="Write the model as a Hugging Face checkpoint (safetensors, config.json, tokenizer) "
        "when training finishes (--hf-export): to a directory on a PVC, never the init directory nor inside "
        "it or around it; or to the checkpoint bucket, apart from the checkpoints' prefix. An export never "
        "overwrites: a target that already holds files is refused.")


# --------------------------------------------------------------------------------------------
# Admission rules
# --------------------------------------------------------------------------------------------


def llama_family_rule(name: str, where: str, what: str) -> Rule:
    """The trainer's converter maps Llama, Mistral, Qwen2 and Qwen3, and the mixture-of-experts Qwen3-MoE, Qwen2-MoE
    and Mixtral (SwiGLU, RMSNorm, RoPE, no linear biases): any other model has no Hugging Face counterpart it can
    read or write."""
    off = [(activation.ne("swiglu"), fmt(" activation is ", activation, " (set swiglu);")),
           (normalization.ne("RMSNorm"), fmt(" normalization is ", normalization, " (set RMSNorm);")),
           (position_embedding.ne("rope"), fmt(" positionEmbedding is ", position_embedding, " (set rope);")),
           (add_bias_linear, lit(" addBiasLinear is true (set false);")),
           # shared experts only as Qwen2-MoE's, gated; no family has sigmoid routing (nor, with it, an expert bias)
           ((experts > 0) & (moe_shared_ffn > 0) & ~moe_shared_gate,
            lit(" moeSharedExpertIntermediateSize is set without moeSharedExpertGate (Qwen2-MoE's shared expert is "
                "gated: set moeSharedExpertGate true, or omit both);")),
           ((experts > 0) & moe_score_function.eq("sigmoid"), lit(" moeRouterScoreFunction is sigmoid (set "
                                                                   "softmax);")),
           # issue 61: hf-config maps DeepSeek-V3, GLM-4.5 and dense-layer Qwen3-MoE to spec.model; the trainer's
           # weight converter does not read or write them yet (megatron_trainer.hf_config.not_converted)
           (mla, lit(" multiLatentAttention is true (the converter does not map MLA weights yet);")),
           ((experts > 0) & has("model.moeLayerFreq"),
            lit(" moeLayerFreq is set (the converter does not map dense layers among MoE ones yet);")),
           (has("model.rotaryPercent"), lit(" rotaryPercent is set (the converter does not map partial RoPE yet);"))]
    ok: Expr = Lit(True)
    for bad, _ in off:
        ok = ok & ~bad
    return Rule(name, where, ok, when=has(where.split(".")[0]),
                message=fmt(f"spec.{where}: {what} needs a Llama-family spec.model (Llama, Mistral, Qwen2, Qwen3, "
                            "or Qwen3-MoE, Qwen2-MoE and Mixtral), but in spec.model", *[cond(bad, part, "") for bad, part in off],
                            " `megatron-operator hf-config config.json` prints the matching spec.model"))


init_pvc, init_path = f("init.huggingFace.pvc"), f("init.huggingFace.path")
export_pvc, export_path = f("export.huggingFace.pvc"), f("export.huggingFace.path")

RULES: list[Rule] = [
    llama_family_rule("hf-init-llama-family", "init.huggingFace", "a Hugging Face import"),
    llama_family_rule("hf-export-llama-family", "export.huggingFace", "a Hugging Face export"),
    # The trainer never overwrites its source; an export inside the source (or around it) would
    # mix the two checkpoints' files.
    Rule("hf-export-outside-init", "export.huggingFace.path",
         ~(export_path.eq(init_path) | StartsWith(export_path, init_path + "/")
           | StartsWith(init_path, export_path + "/")),
         when=has("init") & has("export") & has("export.huggingFace.pvc") & export_pvc.eq(init_pvc),
         message=fmt("spec.export.huggingFace.path: ", export_path,
                     cond(export_path.eq(init_path), " is the same directory as",
                          cond(StartsWith(export_path, init_path + "/"), " is inside", " contains")),
                     " spec.init.huggingFace.path ", init_path, " on PVC ", init_pvc,
                     "; export to a directory apart from the source, e.g. exports/<name>")),
]


# --------------------------------------------------------------------------------------------
# Render: the source and target directories, their volumes and the trainer's flags
# --------------------------------------------------------------------------------------------


def init_dir(init: InitSpec) -> str:
    """The Hugging Face checkpoint the job starts from, in the trainer (its tokenizer too, for SFT without one)."""
    return f"{HF_INIT_MOUNT}/{init.hugging_face.path}"


def export_dir(export: ExportSpec) -> str:
    """The export's directory on its PVC (an export to the bucket: object_store.url)."""
    return f"{HF_EXPORT_MOUNT}/{export.hugging_face.path}"


def flags(init: InitSpec | None, export_location: str | None) -> list[str]:
    """--hf-init and --hf-export (``export_location``: export_dir, or the bucket's URL)."""
    return [*(["--hf-init", init_dir(init)] if init is not None else []),
            *(["--hf-export", export_location] if export_location is not None else [])]


def volumes(init: InitSpec | None, export: ExportSpec | None) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(volume, the trainer's mount of it): the source read-only, the export's PVC read-write."""
    out = []
    if init is not None:
        out.append(({"name": HF_INIT_VOLUME, "persistentVolumeClaim": {"claimName": init.hugging_face.pvc,
                                                                        "readOnly": True}},
                    {"name": HF_INIT_VOLUME, "mountPath": HF_INIT_MOUNT, "readOnly": True}))
    if export is not None and export.hugging_face.pvc is not None:
        out.append(({"name": HF_EXPORT_VOLUME, "persistentVolumeClaim": {"claimName": export.hugging_face.pvc}},
                    {"name": HF_EXPORT_VOLUME, "mountPath": HF_EXPORT_MOUNT}))
    return out
