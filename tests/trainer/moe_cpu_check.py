"""The MoE experts (megatron_trainer/moe.py) against Megatron-Core's SequentialMLP, run for real on CPUs.

Each check runs in `world` gloo processes (Megatron's parallel state initialised as asked) and returns one
JSON-able dict per rank; tests/trainer/test_moe_torch.py asserts on them. Nothing here compares by itself.

- `experts`: the experts alone, fed tokens already sorted by expert with chosen counts (experts that get
  none included): GroupedMLP on grouped_mm, on grouped_mm with padded groups, and looping, against
  SequentialMLP with the same weights (outputs, and the gradients of the tokens, the probabilities and every
  weight); then whole MoE layers (router, all-gather dispatcher, experts) built from the trainer's spec.
- `dist` (any layout): the whole layers as above, then the sharded state dicts of both modules entry by entry, a checkpoint written by either loaded by
  the other through torch_dist (also from EP 2 into EP 1), and the trainer's model-space optimizer state
  mapping (optim_state.parameter_chunks) on GroupedMLP's factories.
- `options`: whole layers as above with issue 50's further settings (OPTION_CASES: shared experts, sigmoid scores
  with an expert bias, capacity dropping and padding), and the tokens each expert was given.
- `train`: the trainer's own step (loop.Trainer.train_step) on the trainer's MoE GPTModel with each of those
  settings, and the expert bias over steps of a router pushed toward two experts.

    python tests/trainer/moe_cpu_check.py experts|dist|options|train|router WORLD TP EP WORKDIR
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "trainer_image"), str(ROOT / "contract"), str(Path(__file__).resolve().parent)]

HIDDEN, FFN = 16, 8  # fp32 rows of 16 and 8 elements: multiples of grouped_mm's 16 bytes


def config(glu: bool = True, fusion: bool = False, bias: bool = False, experts: int = 4, topk: int = 2,
           ffn: int = FFN, **kw):
    import torch
    import torch.nn.functional as F
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=2, hidden_size=HIDDEN, num_attention_heads=2, num_moe_experts=experts, moe_router_topk=topk,
        moe_router_pre_softmax=topk == 1,  # Megatron's rule for top-1
        moe_ffn_hidden_size=ffn, ffn_hidden_size=4 * HIDDEN, gated_linear_unit=glu,
        activation_func=F.silu if glu else F.gelu, add_bias_linear=bias, bias_activation_fusion=fusion,
        use_cpu_initialization=True, params_dtype=torch.float32, init_method_std=0.5,  # outputs of order 1
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        expert_model_parallel_size=ps.get_expert_model_parallel_world_size(),
        expert_tensor_parallel_size=ps.get_expert_tensor_parallel_world_size(), **kw)


def pair(cfg, seed: int = 3, align: int | None = None):
    """SequentialMLP and GroupedMLP built from the same seed (their initialisations must then agree)."""
    import torch
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron_trainer.moe import GroupedMLP

    pgs = get_default_pg_collection()
    local = cfg.num_moe_experts // pgs.ep.size()
    torch.manual_seed(seed)
    seq = SequentialMLP(local, cfg, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                             linear_fc2=RowParallelLinear), pg_collection=pgs)
    torch.manual_seed(seed)
    grp = GroupedMLP(local, cfg, pg_collection=pgs, align=align)
    return seq, grp


def stacked(seq, what: str):
    import torch

    fc, kind = what.split(".")
    return torch.stack([getattr(getattr(e, fc), kind) for e in seq.local_experts])


def copy_biases(seq, grp) -> None:
    """Random biases (Megatron initialises them to zero, which would hide a wrong bias path)."""
    import torch

    with torch.no_grad():
        for e in seq.local_experts:
            e.linear_fc1.bias.normal_()
            e.linear_fc2.bias.normal_()
        grp.bias1.copy_(stacked(seq, "linear_fc1.bias"))
        grp.bias2.copy_(stacked(seq, "linear_fc2.bias"))


def run_experts(module, x, counts, probs, **kw):
    import torch

    x = x.clone().requires_grad_()
    p = probs.clone().requires_grad_()
    out, bias = module(x, counts, p, **kw) if kw else module(x, counts, p)
    assert bias is None
    torch.manual_seed(11)
    out.backward(torch.randn_like(out))
    return out.detach(), x.grad, p.grad


def max_diff(a, b) -> float:
    return float((a - b).abs().max()) if a.numel() else 0.0


def reference_with_bias(grp, x, counts, probs):
    """MLP.forward's expert math written out (bias after fc1, activation, probability, fc2, probability x bias)."""
    import torch

    c = grp.config
    outs, start = [], 0
    for i, n in enumerate(counts.tolist()):
        xi, pi = x[start:start + n], probs[start:start + n].unsqueeze(-1)
        start += n
        h = xi @ grp.weight1[i].t() + grp.bias1[i]
        if c.gated_linear_unit:
            a, b = torch.chunk(h, 2, dim=-1)
            h = c.activation_func(a) * b
        else:
            h = c.activation_func(h)
        outs.append((h * pi) @ grp.weight2[i].t() + grp.bias2[i] * pi)
    return torch.cat(outs)


def check_experts() -> dict:
    import torch
    from megatron_trainer import moe

    calls = []
    real = moe.grouped_mm_fn()

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    moe.grouped_mm_fn = lambda: counting  # how many GEMMs went through grouped_mm
    out: dict = {"experts": [], "layers": []}
    # (activation, fused, experts, top-k, tokens per expert)
    cases = [("swiglu", True, 4, 2, [5, 0, 9, 2]), ("swiglu", False, 4, 2, [0, 7, 0, 3]),
             ("gelu", False, 4, 2, [6, 1, 0, 13]), ("swiglu", True, 8, 1, [3, 0, 0, 4, 1, 0, 9, 2]),
             ("gelu", False, 6, 3, [2, 2, 0, 5, 0, 8]), ("swiglu", True, 4, 2, [0, 0, 0, 0])]
    for act, fused, experts, topk, counts in cases:
        cfg = config(glu=act == "swiglu", fusion=fused, experts=experts, topk=topk)
        seq, grp = pair(cfg)
        counts_t = torch.tensor(counts)
        torch.manual_seed(5)
        x = torch.randn(sum(counts), HIDDEN)
        probs = torch.rand(sum(counts))
        ref = run_experts(seq, x, counts_t, probs)
        row = {"case": f"{act}{'-fused' if fused else ''} E{experts} k{topk} {counts}",
               "init_equal": bool(torch.equal(stacked(seq, "linear_fc1.weight"), grp.weight1)
                                  and torch.equal(stacked(seq, "linear_fc2.weight"), grp.weight2)),
               "problem": grp.problem(x)}
        row["scale"] = float(ref[0].abs().max()) if ref[0].numel() else 0.0
        for mode, kw in (("grouped", {"grouped": True}), ("loop", {"grouped": False})):
            grp.zero_grad(set_to_none=True)
            before = len(calls)
            got = run_experts(grp, x, counts_t, probs, **kw)
            row[mode] = {"grouped_mm_calls": len(calls) - before,
                "out": max_diff(got[0], ref[0]), "dx": max_diff(got[1], ref[1]), "dprobs": max_diff(got[2], ref[2]),
                "dw1": max_diff(grp.weight1.grad, torch.stack([e.linear_fc1.weight.grad for e in seq.local_experts])),
                "dw2": max_diff(grp.weight2.grad, torch.stack([e.linear_fc2.weight.grad for e in seq.local_experts])),
                # an expert without tokens gets a zero gradient, not a stale or uninitialised one
                "idle_grad_zero": all(float(grp.weight1.grad[i].abs().max()) == 0.0 and
                                      float(grp.weight2.grad[i].abs().max()) == 0.0
                                      for i, n in enumerate(counts) if n == 0)}
        grp.align = 8  # the padded layout CUDA gets by default, run on the CPU's grouped_mm
        grp.zero_grad(set_to_none=True)
        got = run_experts(grp, x, counts_t, probs, grouped=True)
        row["grouped_padded8"] = {"out": max_diff(got[0], ref[0]), "dx": max_diff(got[1], ref[1]),
                                  "dprobs": max_diff(got[2], ref[2]),
                                  "dw1": max_diff(grp.weight1.grad, torch.stack([e.linear_fc1.weight.grad
                                                                                 for e in seq.local_experts]))}
        out["experts"].append(row)

    # sizes grouped_mm cannot take (6 fp32 elements = 24 bytes): the module loops by itself
    cfg = config(ffn=6)
    seq, grp = pair(cfg)
    counts_t, x, probs = torch.tensor([3, 0, 4, 1]), torch.randn(8, HIDDEN), torch.rand(8)
    ref, got = run_experts(seq, x, counts_t, probs), run_experts(grp, x, counts_t, probs)
    out["odd_sizes"] = {"problem": grp.problem(x), "out": max_diff(got[0], ref[0]), "dx": max_diff(got[1], ref[1])}

    # linear biases: SequentialMLP cannot run them at TP = EP = 1 in megatron-core 0.19 (RowParallelLinear returns
    # a view its in-place bias add refuses), so the grouped and looping paths are held to MLP's math written out
    out["bias"] = []
    for act in ("swiglu", "gelu"):
        seq, grp = pair(config(glu=act == "swiglu", bias=True))
        copy_biases(seq, grp)
        counts_t = torch.tensor([4, 0, 6, 3])
        x, probs = torch.randn(13, HIDDEN), torch.rand(13)
        with torch.no_grad():
            ref = reference_with_bias(grp, x, counts_t, probs)
            out["bias"].append({"act": act, **{mode: max_diff(grp(x, counts_t, probs, grouped=g)[0], ref)
                                               for mode, g in (("grouped", True), ("loop", False))},
                                "padded": max_diff(GroupedAlign(grp, 8)(x, counts_t, probs), ref)})

    before = len(calls)
    out["layers"] = check_layers()
    out["layers_grouped_mm_calls"] = len(calls) - before
    return out


class GroupedAlign:
    """Calls `grp` with its groups padded to `align` rows."""

    def __init__(self, grp, align: int):
        self.grp, self.align = grp, align

    def __call__(self, x, counts, probs):
        old, self.grp.align = self.grp.align, self.align
        try:
            return self.grp(x, counts, probs, grouped=True)[0]
        finally:
            self.grp.align = old


#: (activation, fused, experts, top-k, further TransformerConfig fields) of check_layers' MoE layers
LAYER_CASES = (("swiglu", True, 8, 2, {}), ("gelu", False, 4, 1, {}), ("swiglu", False, 6, 3, {}))
#: shared experts, sigmoid scores with an expert bias, capacity dropping by either policy and padding to capacity,
#: on the all-gather dispatcher (the all-to-all one asks for a CUDA stream when built: GPU only); 18 tokens a layer at top-2 over 4 experts: capacity
#: ceil(18 x 2 / 4 x factor), 5 at 0.5 (tokens dropped), 9 at 1.0
OPTION_CASES = (
    ("swiglu", True, 4, 2, {"moe_shared_expert_intermediate_size": 32}),
    ("gelu", False, 4, 1, {"moe_shared_expert_intermediate_size": 16}),
    ("swiglu", True, 4, 2, {"moe_shared_expert_intermediate_size": 32, "moe_shared_expert_gate": True}),  # Qwen2-MoE
    ("swiglu", True, 4, 2, {"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True}),
    ("swiglu", True, 4, 2, {"moe_expert_capacity_factor": 0.5}),
    ("swiglu", False, 4, 2, {"moe_expert_capacity_factor": 0.5, "moe_token_drop_policy": "position"}),
    ("swiglu", True, 4, 2, {"moe_expert_capacity_factor": 1.0, "moe_pad_expert_input_to_capacity": True}),
    ("gelu", False, 4, 2, {"moe_expert_capacity_factor": 0.5, "moe_pad_expert_input_to_capacity": True,
                           "moe_token_drop_policy": "position", "moe_shared_expert_intermediate_size": 16}),
)


def check_layers(cases=LAYER_CASES) -> list:
    """Whole MoE layers (router with aux loss and z-loss, the dispatcher, experts, shared experts where asked) from
    the trainer's own layer spec, SequentialMLP against GroupedMLP; the tokens each expert was given."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron_trainer.moe import grouped_experts_spec

    rows = []
    for act, fused, experts, topk, kw in cases:
        # megatron-core refuses MoE training at TP > 1 without sequence parallelism (moe_layer.py)
        cfg = config(glu=act == "swiglu", fusion=fused, experts=experts, topk=topk, moe_aux_loss_coeff=1e-2,
                     moe_z_loss_coeff=1e-3, calculate_per_token_loss=False,
                     sequence_parallel=ps.get_tensor_model_parallel_world_size() > 1, **kw)
        results = []
        for grouped in (False, True):
            spec = get_gpt_layer_local_spec(num_experts=experts, normalization="RMSNorm")
            if grouped:
                grouped_experts_spec(spec)
            torch.manual_seed(4)
            layer = spec.submodules.mlp(config=cfg, layer_number=1)
            layer.set_layer_number(1)
            if layer.router.expert_bias is not None:  # a bias that changes the choice (Megatron starts it at 0)
                layer.router.expert_bias.copy_(torch.linspace(-0.3, 0.3, experts))
            counts = []
            layer.experts.register_forward_pre_hook(lambda m, args, seen=counts: seen.append(args[1].tolist()))
            torch.manual_seed(6)
            x = torch.randn(9, 2, HIDDEN, requires_grad=True)
            y, _ = layer(x)
            torch.manual_seed(7)
            y.backward(torch.randn_like(y))
            shared = layer.shared_experts
            results.append((y.detach(), x.grad, layer.router.weight.grad.clone(),
                            [n for n, _ in layer.named_parameters()], counts,
                            None if shared is None else shared.linear_fc1.weight.grad.clone()))
        (y0, gx0, gr0, names0, counts0, gs0), (y1, gx1, gr1, names1, counts1, gs1) = results
        rows.append({"case": f"{act}{'-fused' if fused else ''} E{experts} k{topk} {kw}", "out": max_diff(y0, y1),
                     "dx": max_diff(gx0, gx1), "drouter": max_diff(gr0, gr1), "scale": float(y0.abs().max()),
                     "dshared": None if gs0 is None else max_diff(gs0, gs1),
                     "shared_params": sorted({n.split(".")[1] for n in names1 if n.startswith("shared_experts.")}),
                     "tokens_per_expert": counts1[0], "same_counts": counts0 == counts1,
                     # what a checkpoint of the router holds (the expert bias must survive a resume)
                     "router_checkpoint": {k: type(v).__name__ for k, v in
                                           layer.router.sharded_state_dict(prefix="router.").items()},
                     "grouped_params": [n for n in names1 if n.startswith("experts.")],
                     "sequential_params": len([n for n in names0 if n.startswith("experts.")])})
    return rows


def train_argv(extra: list[str]) -> list[str]:
    """A 2-layer MoE GPTModel (4 experts, top-2, SwiGLU), fp32, two micro-batches of 2 x 16 tokens a step."""
    return ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--ffn-hidden-size", "64",
            "--seq-length", "16", "--max-position-embeddings", "16", "--vocab-size", "128", "--swiglu",
            "--disable-bias-linear", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
            "--transformer-impl", "local", "--attention-backend", "auto", "--micro-batch-size", "2",
            "--global-batch-size", "4", "--train-iters", "4", "--lr", "1e-2", "--mock-data", "--tokenizer-type",
            "NullTokenizer", "--eval-iters", "0", "--num-experts", "4", "--moe-router-topk", "2",
            "--moe-ffn-hidden-size", "16", "--moe-aux-loss-coeff", "0.01", *extra]


def check_train() -> dict:
    """The trainer's own step (loop.Trainer.train_step: Megatron's schedule, with the hooks model.wire_model_hooks
    sets, then the optimizer) on the trainer's MoE GPTModel for each of issue 50's remaining settings, the same
    batches each step; then the expert bias over steps of a router made to prefer experts 0 and 1."""
    import types

    import torch
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron_trainer.config import parse_args, world_layout
    from megatron_trainer.loop import Trainer
    from megatron_trainer.model import (
        build_model,
        choose_path,
        moe_experts_path,
        transformer_config,
        wire_model_hooks,
    )

    def trainer(extra: list[str], experts: str = "grouped"):
        cfg = parse_args(train_argv(extra))
        path = choose_path(cfg, have_te=False)
        moe_experts_path(cfg, path, experts, 0)
        tconfig = transformer_config(cfg, path)
        tconfig.use_cpu_initialization = True
        torch.manual_seed(0)
        model, _ = build_model(cfg, tconfig, path, 128)
        optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=cfg.training.lr, bf16=False,
                                                           params_dtype=torch.float32), model)
        wire_model_hooks(cfg, tconfig, model, optimizer)
        gen = torch.Generator().manual_seed(1 + torch.distributed.get_rank())  # each data-parallel rank its own
        batches = []
        for _ in range(2):
            tokens = torch.randint(0, 128, (2, 16), generator=gen)
            batches.append({"tokens": tokens, "labels": tokens.roll(-1, 1), "loss_mask": torch.ones(2, 16),
                            "position_ids": torch.arange(16).unsqueeze(0).expand(2, -1)})
        me = types.SimpleNamespace(model=model, optimizer=optimizer, cfg=cfg, is_last_stage=True,
                                   env=types.SimpleNamespace(layout=world_layout(cfg, torch.distributed.get_world_size())),
                                   scheduler=types.SimpleNamespace(step=lambda increment: None),
                                   forward_backward=get_forward_backward_func())
        me._forward_step = types.MethodType(Trainer._forward_step, me)
        counts = []  # this rank's tokens routed to each expert (the router's map, after any dropping), per forward
        for layer in model[0].module.decoder.layers:
            layer.mlp.router.register_forward_hook(lambda m, args, out: counts.append(out[1].sum(0).tolist()))

        def step():
            me.data_iterators = [iter(batches)]
            counts.clear()
            loss, _, ok = Trainer.train_step(me)
            return float(loss), ok, [list(c) for c in counts]

        return me, step

    out: dict = {"runs": {}}
    for name, extra in (("shared", ["--moe-shared-expert-intermediate-size", "32"]),
                        ("sigmoid_bias", ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias"]),
                        ("capacity_probs", ["--moe-expert-capacity-factor", "0.5"]),
                        ("capacity_position_pad",
                         ["--moe-expert-capacity-factor", "0.5", "--moe-token-drop-policy", "position",
                          "--moe-pad-expert-input-to-capacity"])):
        me, step = trainer(extra)
        names = [n for n, _ in me.model[0].named_parameters()]
        steps = [step() for _ in range(3)]
        out["runs"][name] = {"losses": [s[0] for s in steps], "ok": [s[1] for s in steps], "counts": steps[0][2],
                             "microbatches": me.env.layout.num_microbatches,
                             "shared_params": [n for n in names if ".shared_experts." in n]}
    # GroupedMLP and SequentialMLP train to the same losses with shared experts and capacity dropping
    for name, extra in (("shared_capacity", ["--moe-shared-expert-intermediate-size", "32",
                                             "--moe-expert-capacity-factor", "0.5"]),):
        both = {}
        for experts in ("sequential", "grouped"):
            _, step = trainer(extra, experts)
            both[experts] = [step()[0] for _ in range(3)]
        out[f"{name}_losses"] = both

    # expert bias: a router that prefers experts 0 and 1 by a margin; the bias moves against it every step
    rate = 0.1
    me, step = trainer(["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
                        "--moe-router-bias-update-rate", str(rate)])
    routers = [layer.mlp.router for layer in me.model[0].module.decoder.layers]
    for router in routers:
        router.gating = lambda x, gating=router.gating: gating(x) + torch.tensor([2.0, 2.0, 0.0, 0.0])
    history = []
    for _ in range(8):
        before = [r.expert_bias.clone() for r in routers]
        _, ok, counts = step()
        # this rank's tokens per expert over the step's micro-batches, per layer (forwards alternate the 2 layers);
        # the test sums them over the ranks, as Megatron's update does (all-reduce over TP x DP x CP)
        per_layer = [torch.tensor(counts[i::2]).sum(0) for i in range(2)]
        history.append({"ok": ok, "tokens": [c.tolist() for c in per_layer],
                        "delta": [(r.expert_bias - b).tolist() for r, b in zip(routers, before, strict=True)],
                        "bias_dtype": str(routers[0].expert_bias.dtype)})
    out["bias"] = {"rate": rate, "history": history,
                   "local_tokens_reset": [float(r.local_tokens_per_expert.abs().sum()) for r in routers]}
    return out


def describe(sh) -> dict:
    """A checkpoint entry as plain data (ShardedTensor, ShardedObject)."""
    d = {"type": type(sh).__name__, "key": sh.key, "replica_id": list(sh.replica_id)
         if isinstance(sh.replica_id, tuple) else sh.replica_id}
    for name in ("global_shape", "global_offset", "axis_fragmentations", "local_shape", "prepend_axis_num"):
        if hasattr(sh, name):
            value = getattr(sh, name)
            d[name] = list(value) if isinstance(value, tuple) else value
    return d


def flat_entries(sd: dict) -> dict:
    """Dict key -> list of built entries (factories built; their data dropped), in order."""
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    out = {}
    for k, v in sd.items():
        if isinstance(v, ShardedTensorFactory):
            built = v.build()
            items = built if isinstance(built, list) else list(built.values()) if isinstance(built, dict) else [built]
            flat = []
            for item in items:
                flat += item if isinstance(item, list) else [item]
            out[k] = flat
        else:
            out[k] = [v]
    return {k: [(describe(x), x.data.clone() if torch.is_tensor(getattr(x, "data", None)) else None) for x in v]
            for k, v in out.items()}


def by_checkpoint_place(entries: dict) -> dict:
    """(key, global offset) -> (entry description, data): how the two modules' entries are matched."""
    out = {}
    for items in entries.values():
        for desc, data in items:
            out[(desc["key"], tuple(desc.get("global_offset", ())))] = (desc, data)
    return out


def check_ckpt(tmp: Path) -> dict:
    import torch
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron_trainer.optim_state import parameter_chunks

    out: dict = {}
    prefix, offsets = "decoder.layers.mlp.experts.", ((0, 1, 2),)  # layer 1 of 2, as a stacked decoder gives
    for glu in (True, False):
        seq, grp = pair(config(glu=glu, experts=4))
        a = by_checkpoint_place(flat_entries(seq.sharded_state_dict(prefix, offsets)))
        b = by_checkpoint_place(flat_entries(grp.sharded_state_dict(prefix, offsets)))
        out[f"entries_{'swiglu' if glu else 'gelu'}"] = {
            "sequential": len(a), "grouped": len(b), "same_places": sorted(map(str, a)) == sorted(map(str, b)),
            "metadata_differs": [str(k) for k in a if k in b and a[k][0] != b[k][0]],
            "data_differs": [str(k) for k in a if k in b and a[k][1] is not None
                             and not torch.equal(a[k][1], b[k][1])]}
        if glu:
            chunks = {name: parameter_chunks(f) for name, f in grp.sharded_state_dict(prefix, offsets).items()
                      if name.endswith(("weight1", "weight2"))}
            out["optimizer_chunks"] = {name: c if isinstance(c, str) else len(c) for name, c in chunks.items()}

    # a checkpoint of either module into the other (weights of one, fresh weights of the other)
    offsets = ((0, 0, 1),)  # a decoder of one layer: a checkpoint must cover its global tensors
    results = {}
    for writer, reader in (("sequential", "grouped"), ("grouped", "sequential")):
        directory = tmp / f"ckpt-{writer}-ep{ps.get_expert_model_parallel_world_size()}"
        directory.mkdir(parents=True, exist_ok=True)
        torch.distributed.barrier()
        # each EP rank's experts from its own seed: a load that put them at the wrong global index would show
        src = pair(config(), seed=21 + ps.get_expert_model_parallel_rank())[0 if writer == "sequential" else 1]
        dst = pair(config(), seed=99)[0 if reader == "sequential" else 1]
        dist_checkpointing.save(src.sharded_state_dict(prefix, offsets), str(directory))
        before = weights(dst)
        loaded = dist_checkpointing.load(dst.sharded_state_dict(prefix, offsets), str(directory))
        dst.load_state_dict({k[len(prefix):]: v for k, v in loaded.items()}, strict=True)
        results[f"{writer}->{reader}"] = {"equal": all(torch.equal(x, y) for x, y in zip(weights(src), weights(dst),
                                                                                      strict=True)),
                                          "changed": not all(torch.equal(x, y) for x, y in zip(before, weights(dst),
                                                                                             strict=True))}
    out["load"] = results
    return out


def weights(module) -> list:
    """The module's expert weights as [experts, ...] tensors, in SequentialMLP's order, whichever module."""
    if hasattr(module, "weight1"):
        return [module.weight1.detach().clone(), module.weight2.detach().clone()]
    return [stacked(module, "linear_fc1.weight").detach().clone(), stacked(module, "linear_fc2.weight").detach().clone()]


def check_reshard(tmp: Path) -> dict:
    """A SequentialMLP checkpoint saved at EP 2 (2 experts a rank) loaded by GroupedMLP at EP 1 (4 a rank)."""
    import torch
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    prefix, offsets = "decoder.layers.mlp.experts.", ((0, 0, 1),)
    directory = tmp / "ckpt-sequential-ep2"
    ps.destroy_model_parallel()
    ps.initialize_model_parallel(expert_model_parallel_size=1)
    dst = pair(config(), seed=99)[1]
    loaded = dist_checkpointing.load(dst.sharded_state_dict(prefix, offsets), str(directory))
    dst.load_state_dict({k[len(prefix):]: v for k, v in loaded.items()}, strict=True)
    # the EP 2 save holds experts 0-1 from rank 0 and 2-3 from rank 1 (weights_ep2 of each rank)
    return {"experts": int(dst.weight1.shape[0]), "finite": bool(torch.isfinite(dst.weight1).all()),
            "loaded": [x.tolist() for x in torch.stack([dst.weight1[:, 0, 0], dst.weight2[:, 0, 0]])]}


def check_router() -> dict:
    """The trainer's RouterMonitor on a 2-layer MoE GPTModel (grouped experts, aux loss and z-loss): two training
    micro-batches and an evaluation forward, then the report; then a router made to prefer two experts."""
    import torch
    from megatron_trainer.config import parse_args
    from megatron_trainer.model import build_model, choose_path, moe_experts_path, transformer_config
    from megatron_trainer.moe import RouterMonitor, router_loss_names

    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--ffn-hidden-size", "64",
            "--seq-length", "16", "--max-position-embeddings", "16", "--vocab-size", "128", "--swiglu",
            "--disable-bias-linear", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
            "--transformer-impl", "local", "--attention-backend", "auto", "--micro-batch-size", "2",
            "--train-iters", "1", "--mock-data", "--tokenizer-type", "NullTokenizer", "--eval-iters", "0",
            "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "16",
            "--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff", "0.001"]
    cfg = parse_args(argv)
    path = choose_path(cfg, have_te=False)
    moe_experts_path(cfg, path, "grouped", 0)
    tconfig = transformer_config(cfg, path)
    tconfig.use_cpu_initialization = True
    torch.manual_seed(0)
    (model,), _ = build_model(cfg, tconfig, path, 128, ddp=False)
    monitor = RouterMonitor([model], 2, 4, router_loss_names(cfg.model))
    group = torch.distributed.group.WORLD
    position_ids = torch.arange(16).unsqueeze(0).expand(2, -1)

    def step(train: bool):
        tokens = torch.randint(0, 128, (2, 16))
        model.train(train)
        if train:
            model(tokens, position_ids, None, labels=tokens).sum().backward()
        else:
            with torch.no_grad():
                model(tokens, position_ids, None)

    for train in (True, True, False):
        step(train)
    out = {"path": path.describe(), "names": monitor.loss_names, "report": monitor.report(group, 2),
           "empty": monitor.report(group, 3)}  # nothing since the last report
    # a router whose logits favour experts 0 and 1 by a wide margin: experts 2 and 3 idle in every layer
    for layer in model.decoder.layers:
        router = layer.mlp.router
        router.gating = lambda x, gating=router.gating: gating(x) + torch.tensor([30.0, 30.0, 0.0, 0.0])
    step(True)
    out["skewed"] = monitor.report(group, 4)
    return out


def worker(rank: int, world: int, check: str, tp: int, ep: int, port: int, out_path: str, tmp: str) -> None:
    import torch

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.current_device = lambda: "cpu"  # Megatron's router and init ask for it; the CPU here
    torch.cuda.synchronize = lambda *a, **k: None  # dist_checkpointing's save waits for the device
    result: dict = {"rank": rank}
    try:
        torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
        from megatron.core import parallel_state as ps

        ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep)
        if check == "experts":
            result.update(check_experts())
        elif check == "options":  # issue 50's remaining settings, whole layers
            result["layers"] = check_layers(OPTION_CASES)
        elif check == "train":
            from optim_state_check import stub_cuda

            stub_cuda(torch)  # DDP's grad sync waits on the current stream: cpu.use_cpu gives torch.cpu's
            result.update(check_train())
        elif check == "router":
            torch.Tensor.cuda = lambda self, *a, **k: self  # GPTModel's batch and rotary tables, on the CPU
            result.update(check_router())
        else:  # "dist": layers and checkpoints at this layout
            result["layers"] = check_layers()
            result.update(check_ckpt(Path(tmp)))
            if ep == 2 and tp == 1:
                torch.distributed.barrier()
                result["weights_ep2"] = [x[:, 0, 0].tolist() for x in
                                         weights(pair(config(), seed=21 + ps.get_expert_model_parallel_rank())[0])]
                result["reshard"] = check_reshard(Path(tmp))
    except BaseException as e:  # reported, the test fails on it
        result["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    Path(f"{out_path}.{rank}").write_text(json.dumps(result))
    os._exit(0)


def run(check: str, world: int, tp: int, ep: int, work: Path, compile_fusions: bool = True) -> list[dict]:
    """`check` in `world` spawned ranks; one result per rank. `compile_fusions=False`: hf_cpu_check.fusions_compiled
    (the same for both modules compared)."""
    import socket

    import torch.multiprocessing as mp
    from hf_cpu_check import fusions_compiled

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(work / f"{check}-tp{tp}-ep{ep}")
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=worker, args=(r, world, check, tp, ep, port, out, str(work))) for r in range(world)]
    with fusions_compiled(compile_fusions):
        for p in procs:
            p.start()
    for p in procs:
        p.join(300)
        if p.is_alive():
            p.kill()
    return [json.loads(Path(f"{out}.{r}").read_text()) if Path(f"{out}.{r}").exists() else
            {"rank": r, "error": "no result"} for r in range(world)]


if __name__ == "__main__":
    check, world, tp, ep = sys.argv[1], *map(int, sys.argv[2:5])
    print(json.dumps(run(check, world, tp, ep, Path(sys.argv[5]) if len(sys.argv) > 5 else Path(".")), indent=1))
