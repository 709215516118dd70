"""GroupedMLP (megatron_trainer/moe.py) against Megatron-Core's SequentialMLP on gloo ranks on the CPU
(tests/trainer/moe_cpu_check.py): outputs and gradients, whole MoE layers at TP 1, EP 2 and TP 2, checkpoints
written by either module loaded by the other (also from EP 2 into EP 1), the grouped-GEMM index math, and issue 50's
further settings (shared experts, sigmoid routing with the expert bias, capacity dropping and padding).
Needs torch and megatron-core: `make torch-tests`. What the CPU cannot show (grouped_mm's CUDA kernel, bf16 on
Hopper, the all-to-all dispatcher, speed) is tests/trainer/moe_gpu_check.py's, on a GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from conftest import require

torch = require("torch")
require("megatron.core")

sys.path.insert(0, str(Path(__file__).parent))
import moe_cpu_check as mc  # noqa: E402

FP32_TOL = 1e-5


def ok(results: list[dict]) -> list[dict]:
    for r in results:
        assert "error" not in r, r["error"]
    return results


def test_grouped_experts_match_sequential_mlp(tmp_path):
    """Same seed, same weights; the gradients of the tokens, the router probabilities and every expert weight
    within 1e-5 in fp32, for SwiGLU (Megatron's fused weighted SwiGLU, compiled, and unfused) and GeLU, 4, 6 and
    8 experts, top-1/2/3, uneven counts with experts that get no token (their weight gradients exactly zero), and
    no token at all; on grouped_mm, on grouped_mm with groups padded to 8 rows (MEGATRON_TRAINER_MOE_GROUP_ALIGN=8), and looping."""
    (r,) = ok(mc.run("experts", 1, 1, 1, tmp_path, compile_fusions=False))
    assert len(r["experts"]) == 6
    for row in r["experts"]:
        assert row["init_equal"] and row["problem"] is None, row
        assert row["scale"] > 0.1 or "[0, 0, 0, 0]" in row["case"], row  # outputs of order 1: 1e-5 means something
        for mode in ("grouped", "loop", "grouped_padded8"):
            assert max(v for k, v in row[mode].items() if isinstance(v, float)) <= FP32_TOL, (row["case"], mode, row)
        for mode in ("grouped", "loop"):
            assert row[mode]["idle_grad_zero"], (row["case"], mode)
        assert row["grouped"]["grouped_mm_calls"] == 2, row  # both GEMMs went through grouped_mm
        assert row["loop"]["grouped_mm_calls"] == 0
    # sizes grouped_mm cannot take: the module says why and loops, with the same results
    assert "not multiples of 16 bytes" in r["odd_sizes"]["problem"]
    assert r["odd_sizes"]["out"] <= FP32_TOL and r["odd_sizes"]["dx"] <= FP32_TOL
    # linear biases against MLP's math written out
    assert [b["act"] for b in r["bias"]] == ["swiglu", "gelu"]
    assert all(b[mode] <= FP32_TOL for b in r["bias"] for mode in ("grouped", "loop", "padded"))
    for layer in r["layers"]:
        assert layer["scale"] > 0.1 and max(layer["out"], layer["dx"], layer["drouter"]) <= FP32_TOL, layer
        assert layer["grouped_params"] == ["experts.weight1", "experts.weight2"] and layer["sequential_params"] > 2
    assert r["layers_grouped_mm_calls"] >= 2 * len(r["layers"])


@pytest.mark.parametrize("tp, ep", [(1, 2), (2, 1)])
def test_layers_and_checkpoints_at_two_ranks(tmp_path, tp, ep):
    """At EP 2 (two experts a rank, all-gather dispatcher) and at TP 2 (experts split over TP, sequence parallel):
    whole layers equal; every checkpoint entry of GroupedMLP is SequentialMLP's (key, global shape and offset,
    fragmentation, replica id, data); each loads the other's checkpoint; the trainer's in-place optimizer state
    maps GroupedMLP's factories; at EP 2, a SequentialMLP checkpoint loads into GroupedMLP at EP 1."""
    results = ok(mc.run("dist", 2, tp, ep, tmp_path, compile_fusions=False))
    for r in results:
        for layer in r["layers"]:
            assert max(layer["out"], layer["dx"], layer["drouter"]) <= FP32_TOL and layer["scale"] > 0.1, layer
        for act in ("swiglu", "gelu"):
            e = r[f"entries_{act}"]
            assert e["same_places"] and e["sequential"] == e["grouped"] > 0, e
            assert not e["metadata_differs"] and not e["data_differs"], e
        # SwiGLU's fc1: two halves per expert; fc2: one piece per expert (2 local experts at EP 2, 4 at TP 2)
        local = 4 // ep
        assert r["optimizer_chunks"] == {"decoder.layers.mlp.experts.weight1": 2 * local,
                                         "decoder.layers.mlp.experts.weight2": local}
        assert r["load"] == {"sequential->grouped": {"equal": True, "changed": True},
                             "grouped->sequential": {"equal": True, "changed": True}}
    if ep == 2:
        # each EP rank saved its own experts (own seeds); at EP 1 they come back in global order
        expected = [results[0]["weights_ep2"][i] + results[1]["weights_ep2"][i] for i in range(2)]
        assert results[0]["weights_ep2"] != results[1]["weights_ep2"]
        for r in results:
            assert r["reshard"]["experts"] == 4 and r["reshard"]["loaded"] == expected


def test_padded_rows_place_each_group_at_an_aligned_start():
    from megatron_trainer.moe import padded_rows

    counts = torch.tensor([3, 0, 5, 1])
    dest, offs, rows = padded_rows(counts, 4, 9)
    # groups [0,3) [3,3) [3,8) [8,9) padded to 4, 0, 8, 4 rows: starts 0, 4, 4, 12; the buffer holds 9 + 4 x 3 rows,
    # rounded up to 24, and the last group runs to its end (grouped_mm writes no row past the last offset)
    assert dest.tolist() == [0, 1, 2, 4, 5, 6, 7, 8, 12]
    assert offs.dtype == torch.int32 and offs.tolist() == [4, 4, 12, 24] and rows == 24
    dest, offs, rows = padded_rows(torch.tensor([2, 7]), 1, 9)  # align 1: the identity
    assert dest.tolist() == list(range(9)) and offs.tolist() == [2, 9] and rows == 9
    dest, offs, rows = padded_rows(torch.zeros(3, dtype=torch.int64), 8, 0)
    assert dest.numel() == 0 and offs.tolist() == [0, 0, 24] and rows == 24  # 3 x 7 rounded up to 8


@pytest.mark.parametrize("dtype, device, dims, problem", [
    (torch.bfloat16, "cuda", (2048, 1536, 768), None),
    (torch.float32, "cuda", (2048, 1536, 768), "CUDA takes bf16 only"),
    (torch.float32, "cpu", (16, 16, 8), None),
    (torch.bfloat16, "cpu", (16, 12, 6), "not multiples of 16 bytes (8 elements)"),
    (torch.float16, "cpu", (16, 16, 8), "takes bf16 or fp32"),
])
def test_grouped_mm_problem(dtype, device, dims, problem):
    from megatron_trainer.moe import default_align, grouped_mm_problem

    got = grouped_mm_problem(dtype, device, dims)
    assert (got is None) if problem is None else (problem in got), got
    assert default_align(torch.bfloat16, "cuda") == 1 and default_align(torch.float32, "cpu") == 1


def test_unsupported_configurations_are_refused_by_name():
    from megatron_trainer.moe import GroupedMLP

    class Cfg:  # only what __init__ reads before it refuses
        fp8 = fp4 = None
        moe_latent_size = None
        use_te_activation_func = False
        moe_mlp_glu_interleave_size = None
        delay_wgrad_compute = overlap_dispatch_backward_with_experts_wgrad = False
        expert_gtp_remat_size = 1
        bias_activation_fusion = True
        add_bias_linear = True
        gated_linear_unit = False
        activation_func = torch.nn.functional.gelu

    with pytest.raises(ValueError, match="bias_activation_fusion with linear biases.*MEGATRON_TRAINER_MOE_EXPERTS"):
        GroupedMLP(4, Cfg())


@pytest.mark.parametrize("knob, experts_cls", [("grouped", "GroupedMLP"), ("sequential", "SequentialMLP")])
def test_the_trainer_spec_takes_the_experts_the_knob_names(mock_argv, knob, experts_cls):
    """model.layer_spec on the local path: MEGATRON_TRAINER_MOE_EXPERTS picks the experts; the MoE flags reach
    TransformerConfig; an expert's bias-activation fusion only for SwiGLU without biases (mlp.py has no other
    weighted fusion)."""
    from conftest import without
    from megatron_trainer.config import parse_args
    from megatron_trainer.model import choose_path, layer_spec, moe_experts_path, transformer_config

    argv = without(mock_argv, "--bf16") + ["--num-experts", "4", "--moe-ffn-hidden-size", "32",
                                           "--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff", "0.001"]
    cfg = parse_args(argv + ["--swiglu", "--disable-bias-linear"])
    path = choose_path(cfg, have_te=False)
    moe_experts_path(cfg, path, knob, 0)
    experts = layer_spec(cfg, path).submodules.mlp.keywords["submodules"].experts
    assert (experts.func.__name__, path.moe_experts) == (experts_cls, knob)
    assert ("GroupedMLP on grouped_mm" if knob == "grouped" else "SequentialMLP") in path.describe()
    tc = transformer_config(cfg, path)
    assert (tc.num_moe_experts, tc.moe_ffn_hidden_size, tc.moe_aux_loss_coeff, tc.moe_z_loss_coeff) == (4, 32, 0.01, 1e-3)
    assert tc.bias_activation_fusion and not transformer_config(parse_args(argv), path).bias_activation_fusion
    # a dense model keeps Megatron's MLP and no experts note
    dense = parse_args(mock_argv)
    path = choose_path(dense, have_te=False)
    moe_experts_path(dense, path, knob, 0)
    assert path.moe_experts == "" and "MoE" not in path.describe()


def test_router_monitor_counts_training_tokens_and_reports_megatrons_router_losses(tmp_path):
    """moe.RouterMonitor on a 2-layer MoE GPTModel (4 experts, top-2): the tokens counted are the training
    forwards' (2 micro-batches of 2 x 16 tokens, top-2: 128 per layer; the evaluation forward is left out), the
    losses are megatron-core's tracker's; a router made to send every token to experts 0 and 1 shows as half the
    tokens each, 2 x the mean, 4 idle (layer, expert) pairs, and a load-balancing loss of 2: Megatron's switch loss
    over its coefficient, E / (k T^2) x sum_i (sum_t p_ti) n_i = 4 / (2 x 32^2) x (16 x 32 + 16 x 32)."""
    (r,) = ok(mc.run("router", 1, 1, 1, tmp_path, compile_fusions=False))
    assert "MoE experts=GroupedMLP on grouped_mm" in r["path"]
    assert r["names"] == ["load_balancing_loss", "z_loss"]
    rep = r["report"]
    assert rep["routed"] == [128, 128] and rep["idle"] == 0
    assert abs(sum(rep["share"]) - 1) < 1e-12 and 1 <= rep["max_over_mean"] < 2
    assert set(rep["losses"]) == {"load_balancing_loss", "z_loss"} and rep["losses"]["load_balancing_loss"] > 0.9
    assert r["empty"] is None  # nothing since the last report
    skew = r["skewed"]
    assert skew["routed"] == [64, 64] and skew["share"] == [0.5, 0.5, 0.0, 0.0]
    assert (skew["max_over_mean"], skew["idle"]) == (2.0, 4)
    assert abs(skew["losses"]["load_balancing_loss"] - 2.0) < 1e-4


def test_expert_load_figures():
    from megatron_trainer.moe import expert_load_figures

    tokens = torch.tensor([[10, 10, 10, 10], [0, 0, 0, 0], [30, 6, 4, 0]])  # layer 1 ran on another stage
    got = expert_load_figures(tokens)
    assert got["routed"] == [40, 0, 40] and got["worst_layer"] == 2 and got["idle"] == 1
    assert got["max_over_mean"] == 3.0 and got["share"] == [0.5, 0.2, 0.175, 0.125]
    assert expert_load_figures(torch.zeros(2, 4, dtype=torch.int64))["max_over_mean"] is None


def test_the_loop_logs_the_router_figures_and_sets_the_gauges(capsys):
    """Trainer._log_moe (loop.py): the report's figures to the log line (last rank) and the gauges (rank 0)."""
    import types

    from megatron_trainer.loop import Trainer

    class Recorder:
        def __init__(self):
            self.values = {}

        def set(self, name, value, **labels):
            self.values[(name, *labels.values())] = value

    figures = {"share": [0.5, 0.5, 0.0, 0.0], "max_over_mean": 2.0, "worst_layer": 1, "idle": 4, "routed": [64, 64],
               "losses": {"load_balancing_loss": 2.0, "z_loss": 0.5}}
    me = types.SimpleNamespace(router_monitor=types.SimpleNamespace(report=lambda group, it: figures),
                               env=types.SimpleNamespace(cpu_group=None), state=types.SimpleNamespace(iteration=7),
                               metrics=Recorder(), is_logging_rank=True, wandb=None)
    Trainer._log_moe(me)
    assert me.metrics.values == {("moe_load_balancing_loss",): 2.0, ("moe_z_loss",): 0.5,
                                 ("moe_expert_load_max_over_mean",): 2.0, ("moe_idle_experts",): 4,
                                 ("moe_expert_token_share", "0"): 0.5, ("moe_expert_token_share", "1"): 0.5,
                                 ("moe_expert_token_share", "2"): 0.0, ("moe_expert_token_share", "3"): 0.0}
    line = capsys.readouterr().out
    assert "MoE iteration        7 | load_balancing_loss: 2.0000E+00 | z_loss: 5.0000E-01 |" in line
    assert "busiest/mean: 2.00 (layer 2 of 2) | idle (layer, expert) pairs: 4 |" in line
    # with a Weights & Biases run (spec.logging.wandb): the same figures at the same iteration
    logged = []
    me.wandb = types.SimpleNamespace(log=lambda values, step: logged.append((step, values)))
    Trainer._log_moe(me)
    assert logged == [(7, {"moe/load_balancing_loss": 2.0, "moe/z_loss": 0.5, "moe/expert-load-max-over-mean": 2.0,
                           "moe/idle-experts": 4})]
    capsys.readouterr()
    # a window without a training forward sets nothing and prints nothing
    me.router_monitor, me.metrics = types.SimpleNamespace(report=lambda group, it: None), Recorder()
    Trainer._log_moe(me)
    assert me.metrics.values == {} and capsys.readouterr().out == "" and len(logged) == 1


def test_a_checkpoint_of_either_experts_module_loads_into_the_other_with_its_optimizer_state(tmp_path):
    """Through the trainer's Checkpointer and distributed optimizer (optimizer state saved in place), at EP 2 on two
    gloo ranks (moe_optim_check.py): SequentialMLP saves known Adam state, GroupedMLP loads it and saves again,
    SequentialMLP loads that; every weight, fp32 main parameter and Adam moment is bit-identical across the three,
    each expert's under its global index (the loading runs start from other weights)."""
    import os
    import socket
    import subprocess

    def run(experts: str, actions: str, ckpt_in: str, ckpt_out: str) -> Path:
        out = tmp_path / f"{experts}-{actions.replace(',', '-')}"
        out.mkdir()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = dict(os.environ, TMPDIR=str(tmp_path), TORCHDYNAMO_DISABLE="1")
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                               f"--master-port={port}", str(Path(__file__).parent / "moe_optim_check.py"), experts,
                               actions, str(tmp_path / ckpt_in), str(tmp_path / ckpt_out), str(out)],
                              env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
        return out

    def same(a: Path, b: Path) -> int:
        n = 0
        for rank in (0, 1):
            x, y = torch.load(a.parent / f"{a.name}_rank{rank}.pt"), torch.load(b.parent / f"{b.name}_rank{rank}.pt")
            for part in ("weights", "opt"):
                assert x[part].keys() == y[part].keys(), (part, sorted(x[part].keys() ^ y[part].keys())[:4])
                for key, value in x[part].items():
                    assert torch.equal(value, y[part][key]), (rank, part, key)
                    n += 1
        return n

    first = run("sequential", "save", "a", "a")
    second = run("grouped", "load,save", "a", "b")
    third = run("sequential", "load", "b", "b")
    counted = same(first / "saved", second / "loaded")
    assert counted == same(second / "saved", third / "loaded") == same(first / "saved", third / "loaded")
    expert_states = [k for k in torch.load(first / "saved_rank1.pt")["opt"] if "local_experts" in k]
    assert len(expert_states) == 2 * 2 * 2 * 3  # 2 layers x 2 local experts x fc1/fc2 x (param, exp_avg, exp_avg_sq)


@pytest.mark.parametrize("world, tp, ep", [(1, 1, 1), (2, 1, 2), (2, 2, 1)])
def test_shared_experts_sigmoid_bias_and_capacity_layers_match_sequential_mlp(tmp_path, world, tp, ep):
    """Issue 50's remaining settings in whole MoE layers built from the trainer's spec (all-gather dispatcher):
    shared experts (SwiGLU and GeLU, and gated as Qwen2-MoE's; megatron-core's SharedExpertMLP kept in the spec
    beside GroupedMLP), sigmoid
    scores with an expert bias, capacity 0.5 dropping by probability and by position (18 tokens at top-2 over 4
    experts: 5 each of 36 routed), padding to capacity 1.0 (9 each) and 0.5 with shared experts: GroupedMLP's
    outputs and gradients (tokens, router, shared experts) within 1e-5 of SequentialMLP's, the same tokens given;
    the expert bias is in the router's checkpoint entries (a ShardedTensor beside its weight);
    also at EP 2 (each rank's experts get both ranks' tokens) and at TP 2 with sequence parallelism (the shared
    experts split over TP)."""
    for r in ok(mc.run("options", world, tp, ep, tmp_path, compile_fusions=False)):
        check_option_layers(r["layers"], one_rank=world == 1)


def check_option_layers(rows: list[dict], one_rank: bool) -> None:
    assert len(rows) == len(mc.OPTION_CASES)
    for row, (_, _, _, _, kw) in zip(rows, mc.OPTION_CASES, strict=True):
        assert row["scale"] > 0.1 and max(row["out"], row["dx"], row["drouter"]) <= FP32_TOL, row
        assert row["same_counts"] and row["grouped_params"] == ["experts.weight1", "experts.weight2"], row
        if "moe_shared_expert_intermediate_size" in kw:
            gate = ["gate_weight"] if kw.get("moe_shared_expert_gate") else []  # Qwen2-MoE's, 1 x hidden
            assert row["shared_params"] == gate + ["linear_fc1", "linear_fc2"] and row["dshared"] <= FP32_TOL, row
        else:
            assert row["shared_params"] == [] and row["dshared"] is None, row
        bias = {"router.expert_bias": "ShardedTensor"} if kw.get("moe_router_enable_expert_bias") else {}
        assert row["router_checkpoint"] == {"router.weight": "ShardedTensor", **bias}, row["router_checkpoint"]
        factor = kw.get("moe_expert_capacity_factor")
        if not one_rank:  # counts of this rank's experts from the expert group's tokens: the equality above
            continue
        if factor is not None:  # Megatron's capacity: ceil(tokens x top-k / experts x factor)
            capacity = -(-18 * 2 * factor // 4)
            assert max(row["tokens_per_expert"]) <= capacity, row
            if kw.get("moe_pad_expert_input_to_capacity") or factor == 0.5:  # padded, or every expert full
                assert row["tokens_per_expert"] == [capacity] * 4, row
        else:
            assert sum(row["tokens_per_expert"]) == 18 * (1 if "gelu" in row["case"] and "k1" in row["case"] else 2)


@pytest.mark.parametrize("world, ep", [(1, 1), (2, 2)])
def test_the_trainers_step_trains_each_setting_and_updates_the_expert_bias_toward_balance(tmp_path, world, ep):
    """loop.Trainer.train_step (Megatron's schedule with model.wire_model_hooks' finalize_model_grads, then the
    optimizer) on the trainer's 2-layer MoE GPTModel, on one rank and at EP 2 (two data-parallel ranks with their own
    batches): with shared experts, sigmoid scores and an expert bias, capacity 0.5 by probability, and by position
    padded to capacity, the loss on the same batches falls over 3 steps; capacity holds every expert to 8 tokens a
    micro-batch (2 x 16 tokens x top-2 / 4 x 0.5: dropped by probability, filled to it when padded); GroupedMLP and
    SequentialMLP give the same losses with shared experts and dropping. Expert bias: a router pushed toward experts
    0 and 1 (all their tokens) gets its bias changed after every step by exactly rate x sign(mean - tokens), the
    tokens summed over the ranks (Megatron's update; the counts reset for the next step), the same on every rank:
    0 and 1 go down and 2 and 3 up, until 2 and 3 get tokens and the load evens out."""
    results = ok(mc.run("train", world, 1, ep, tmp_path, compile_fusions=False))
    for r in results:
        for name, run in r["runs"].items():
            assert all(run["ok"]) and run["losses"][2] < run["losses"][0] - 0.3, (name, run["losses"])
            assert len(run["counts"]) == 2 * run["microbatches"], run  # micro-batches x 2 layers
            if name == "capacity_position_pad":
                assert run["counts"] == [[8, 8, 8, 8]] * len(run["counts"]), (name, run["counts"])
            elif name == "capacity_probs":
                assert all(max(c) <= 8 and sum(c) < 64 for c in run["counts"]), (name, run["counts"])
            else:
                assert all(sum(c) == 64 for c in run["counts"]), (name, run["counts"])
            assert len(run["shared_params"]) == (4 if name == "shared" else 0), run["shared_params"]
        losses = r["shared_capacity_losses"]
        assert max(abs(a - b) for a, b in zip(losses["sequential"], losses["grouped"], strict=True)) <= FP32_TOL
        assert r["bias"]["local_tokens_reset"] == [0.0, 0.0]
    rate = results[0]["bias"]["rate"]
    steps = len(results[0]["bias"]["history"])
    totals = []
    for i in range(steps):
        rows = [r["bias"]["history"][i] for r in results]
        assert all(h["ok"] and h["bias_dtype"] == "torch.float32" for h in rows)
        assert all(h["delta"] == rows[0]["delta"] for h in rows)  # one update on every rank
        tokens = [[sum(h["tokens"][layer][e] for h in rows) for e in range(4)] for layer in range(2)]
        totals.append(tokens)
        for layer, counts in enumerate(tokens):
            mean = sum(counts) / 4
            expected = [rate * ((mean > c) - (mean < c)) for c in counts]
            assert max(abs(a - b) for a, b in zip(rows[0]["delta"][layer], expected, strict=True)) <= 1e-7, (i, rows)
    assert totals[0] == [[64, 64, 0, 0]] * 2  # the global batch, 4 x 16 tokens at top-2, on experts 0 and 1
    assert all(d[0] < 0 and d[1] < 0 and d[2] > 0 and d[3] > 0 for d in results[0]["bias"]["history"][0]["delta"])

    def max_over_mean(counts):
        return max(counts) / (sum(counts) / len(counts))

    late = [max_over_mean(t) for tokens in totals[-4:] for t in tokens]
    assert sum(late) / len(late) < 1.8, late
    assert all(min(t[2:]) > 0 for tokens in totals[-4:] for t in tokens if max_over_mean(t) < 2), totals
