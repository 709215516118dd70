"""The Trainer: one linear, sectioned set-up and a training loop of named steps."""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime

import torch

from . import flops as flops_mod
from .checkpoint import Checkpointer
from .config import RuntimeConfig, TrainerConfig, ignored_flags
from .distributed import DistEnv, StopSignal, any_rank, init_distributed
from .exitcodes import ExitCode, Fatal, Lifecycle, data_errors_are_fatal
from .metrics import Metrics
from .model import (
    apply_deterministic_attention,
    build_model,
    choose_path,
    count_parameters,
    fusion_flags,
    moe_experts_path,
    plan_te_path,
    refuse_missing_fusion_kernels,
    te_available,
    tp_overlap_chunks,
    transformer_config,
    wire_model_hooks,
)
from .progress import Cadence, Progress, ProgressWriter

log = logging.getLogger(__name__)

GIB = 2**30


def peak_rss_gib() -> float:
    """This process's peak resident set size (VmHWM)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def process_age_s() -> float | None:
    """Seconds since this process started (/proc), so start-up time includes interpreter and imports."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


@dataclass
class TrainState:
    iteration: int = 0
    consumed_samples: int = 0
    iteration_times_s: list[float] = field(default_factory=list)
    productive_s: float = 0.0  # this attempt's step time after its first step (goodput.py)
    losses: dict[int, float] = field(default_factory=dict)
    skipped_iterations: int = 0


class Trainer:
    def __init__(self, cfg: TrainerConfig, runtime: RuntimeConfig, lifecycle: Lifecycle | None = None,
                 hf_source=None):
        from megatron.core import parallel_state
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        self.cfg, self.runtime = cfg, runtime
        self.hf_source = hf_source  # hf_source.HfSource: weights for a start without a checkpoint (--hf-init)
        self.export_only = cfg.checkpoint.hf_export_only
        self.loaded_iteration: int | None = None  # the iteration training starts from, once known
        self.lifecycle = lifecycle or Lifecycle()  # the stage a fatal error is reported in
        t, m = cfg.training, cfg.model
        # set up below; here so that close() works whatever stage set-up reached
        self.forward_backward = None
        self.data_iterators: list = []
        self.progress: ProgressWriter | None = None
        self.stop_signal: StopSignal | None = None
        self.mem_after_first_step = 0
        self.sft_data = None
        self.validation_loss: float | None = None
        self.last_snapshot: Progress | None = None  # the last figures sent to status.progress (_report_stage)
        self.evaluated_at: int | None = None
        self.started_age_s = process_age_s() or 0.0
        self.t_start = time.monotonic() - self.started_age_s

        # --- distributed --------------------------------------------------------------------
        self.lifecycle.enter("initialising")
        try:
            self.env: DistEnv = init_distributed(cfg)
        except ValueError as exc:  # the layout does not divide the world size
            raise Fatal(ExitCode.BAD_ARGUMENTS, str(exc)) from exc
        if self.env.is_rank0 and runtime.job_name and runtime.job_namespace and runtime.progress_interval_s > 0:
            # Start-up stages go to status.progress.stage at once: minutes of loading look hung otherwise.
            self.progress = ProgressWriter.in_cluster(runtime.job_name, runtime.job_namespace)
            self.lifecycle.on_stage = self._report_stage
        layout = self.env.layout
        self.is_last_stage = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
        self.is_logging_rank = self.env.rank == self.env.world_size - 1  # last stage: holds the loss
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", torch.cuda.device_count() or 1))
        self.num_nodes = max(1, self.env.world_size // local_world)

        # --- model ----------------------------------------------------------------------------
        self.path = choose_path(cfg, te_available())
        from .tokenizer import build_tokenizer

        with data_errors_are_fatal("--tokenizer-model"):
            tokenizer = build_tokenizer(cfg.data.tokenizer_type, cfg.data.tokenizer_model, m.vocab_size)
        self.vocab_size = tokenizer.vocab_size
        if cfg.checkpoint.hf_init or cfg.checkpoint.hf_export:
            # A Hugging Face model's vocabulary is config.json's vocab_size (--vocab-size, checked against it),
            # which may be larger than the tokenizer's (Qwen2.5: 151936 rows for 151665 tokens).
            if tokenizer.vocab_size > (m.vocab_size or 0):
                raise Fatal(ExitCode.BAD_ARGUMENTS, f"the tokenizer has {tokenizer.vocab_size} tokens, more than "
                            f"--vocab-size {m.vocab_size} (the Hugging Face model's vocab_size)")
            self.vocab_size = m.vocab_size
        self.lifecycle.enter("building the model")
        if self.path.transformer_impl == "transformer_engine":
            # TE's attention kernel and fused RoPE as this machine has them; a request none serves is refused here
            # (exit 2, one line) rather than failing at the first forward (te_path.py)
            from .te_path import probe

            for note in plan_te_path(cfg, self.path, probe(cfg), os.environ):
                if self.env.is_rank0:
                    log.info("%s", note)
        # Megatron-Core's own linears (all of them on the local path, the output layer on the TE path too) fuse
        # weight-gradient accumulation only with a kernel for it: apex's, or the trainer's torch stand-in
        from .compat import patch_wgrad_accumulation_fusion

        self.path.wgrad_fusion = "off: --no-gradient-accumulation-fusion" \
            if t.no_gradient_accumulation_fusion else patch_wgrad_accumulation_fusion()
        self.path.tp_overlap_chunks = tp_overlap_chunks(cfg, self.path, runtime.tp_overlap_chunks)
        self.path.tp_overlap_sm_carveout = runtime.tp_overlap_sm_carveout if self.path.tp_overlap_chunks > 1 else 0
        if self.path.tp_overlap_sm_carveout and torch.cuda.is_available():
            from .tp_overlap import carveout_problem

            sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
            problem = carveout_problem(self.path.tp_overlap_sm_carveout, sms)
            if problem:
                raise Fatal(ExitCode.BAD_ARGUMENTS, problem)
        if runtime.tp_overlap_chunks > 1 and self.path.tp_overlap_chunks == 1:
            log.info("MEGATRON_TRAINER_TP_OVERLAP_CHUNKS=%d ignored: only for dense models on the local path at "
                     "TP > 1 without sequence parallelism", runtime.tp_overlap_chunks)
        if runtime.tp_overlap_sm_carveout and self.path.tp_overlap_chunks == 1:
            log.info("MEGATRON_TRAINER_TP_OVERLAP_SM_CARVEOUT=%d ignored: it applies to the overlapped pieces only "
                     "(MEGATRON_TRAINER_TP_OVERLAP_CHUNKS > 1)", runtime.tp_overlap_sm_carveout)
        moe_experts_path(cfg, self.path, runtime.moe_experts, runtime.moe_group_align)
        note = apply_deterministic_attention(cfg, self.path, runtime.deterministic_attention,
                                             runtime.deterministic_attention_set)
        if note:
            log.info(note)
        refuse_missing_fusion_kernels(fusion_flags(cfg, self.path))
        self.tconfig = transformer_config(cfg, self.path)
        self.model, self.padded_vocab = build_model(cfg, self.tconfig, self.path, self.vocab_size)
        self.pad_id = tokenizer.pad if getattr(tokenizer, "pad", -1) >= 0 else tokenizer.eod
        if cfg.data.sft_packing:  # choose_path keeps packed jobs on the local path, which honours the mask
            from .sft_data import restart_rope_positions

            restart_rope_positions(self.model)
        self.num_params_rank = count_parameters(self.model)
        self.router_monitor = self._router_monitor() if m.num_experts else None
        torch.cuda.synchronize()
        self.mem_after_model = torch.cuda.memory_allocated()

        # --- optimizer and LR schedule (Megatron's; steps counted in samples like Megatron-LM) ---
        self.lifecycle.enter("building the optimizer")
        opt_cfg = OptimizerConfig(
            optimizer="adam", lr=t.lr, min_lr=t.min_lr, weight_decay=t.weight_decay,
            adam_beta1=t.adam_beta1, adam_beta2=t.adam_beta2, adam_eps=t.adam_eps, clip_grad=t.clip_grad,
            bf16=t.bf16, fp16=t.fp16, params_dtype=self.tconfig.params_dtype,
            use_distributed_optimizer=t.use_distributed_optimizer, overlap_param_gather=t.overlap_param_gather)
        self.optimizer = get_megatron_optimizer(opt_cfg, self.model)
        from .compat import patch_distopt_state_load_for_torch_adam, patch_multi_tensor_fallbacks

        patch_distopt_state_load_for_torch_adam(self.optimizer)
        self.patched_ops = patch_multi_tensor_fallbacks() if runtime.foreach_ops else []
        if runtime.fused_adam:
            from .compat import use_fused_adamw

            if use_fused_adamw(self.optimizer):
                self.patched_ops.append("torch.optim.AdamW fused")
        if runtime.compile_rope and m.position_embedding_type == "rope" and t.device != "cpu":
            if self.path.transformer_impl == "local" and not cfg.data.sft_packing:
                from .compat import compile_unfused_rope

                compile_unfused_rope(exact=runtime.rope_exact)
                self.patched_ops.append("RoPE compiled (torch.compile" + (", eager's bf16 rounding)" if runtime.rope_exact
                                                                         else ")"))
            elif self.path.transformer_impl == "local":  # the TE path has its own fused RoPE
                log.info("RoPE not compiled: packed SFT applies it per sequence, whose lengths vary")
        if runtime.compile_norm:
            if self.path.transformer_impl == "local" and m.normalization == "RMSNorm" and not cfg.data.sft:
                from .compat import compile_rms_norms

                self.patched_ops.append(f"RMSNorm compiled (torch.compile, {compile_rms_norms(self.model)} norms)")
            else:
                log.info("MEGATRON_TRAINER_COMPILE_NORM=1 ignored: only for RMSNorm on the local path, pretraining")
        if runtime.ce_fusion:
            if t.bf16 and self.is_last_stage:
                # read when the loss is computed, so setting it on the built model's config is enough
                self.tconfig.cross_entropy_loss_fusion, self.tconfig.cross_entropy_fusion_impl = True, "native"
                self.patched_ops.append("cross entropy fused (Megatron's native)")
            elif not t.bf16:
                log.info("MEGATRON_TRAINER_CE_FUSION=1 ignored: Megatron's native fused cross entropy is bf16 only")
        gbs = layout.global_batch_size
        decay_iters = t.lr_decay_iters if t.lr_decay_iters is not None else t.train_iters
        wsd_iters = t.lr_wsd_decay_iters if t.lr_wsd_decay_iters is not None else max(1, decay_iters // 10)
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0, max_lr=t.lr, min_lr=t.min_lr,
            lr_warmup_steps=t.lr_warmup_iters * gbs, lr_decay_steps=decay_iters * gbs,
            lr_decay_style=t.lr_decay_style, start_wd=t.weight_decay, end_wd=t.weight_decay,
            wd_incr_steps=t.train_iters * gbs, wd_incr_style="constant",
            wsd_decay_steps=wsd_iters * gbs if t.lr_decay_style == "WSD" else None,
            lr_wsd_decay_style=t.lr_wsd_decay_style if t.lr_decay_style == "WSD" else None)
        wire_model_hooks(cfg, self.tconfig, self.model, self.optimizer)
        from megatron.core.pipeline_parallel import get_forward_backward_func

        self.forward_backward = get_forward_backward_func()
        if t.cuda_graph_impl == "full_iteration":
            from megatron.core.full_cuda_graph import FullCudaGraphWrapper

            # Eager for the warm-up steps, then forward+backward of a whole step is captured once
            # (data copied into static buffers) and replayed; the optimizer step stays outside.
            self.forward_backward = FullCudaGraphWrapper(self.forward_backward,
                                                         cuda_graph_warmup_steps=t.cuda_graph_warmup_steps)
        torch.cuda.synchronize()
        self.mem_after_optimizer = torch.cuda.memory_allocated()

        # --- checkpoints: start the writer, resume --------------------------------------------
        self.state = TrainState()
        self.checkpointer = Checkpointer(cfg, self.env, self.model, self.optimizer, self.scheduler,
                                         keep=runtime.checkpoint_keep, fused_adam=runtime.fused_adam,
                                         optim_in_place=runtime.optim_in_place)
        try:
            self._init_after_checkpointer(cfg, runtime, gbs)
        except BaseException:
            self.close(abort=True)
            raise

    def _init_after_checkpointer(self, cfg: TrainerConfig, runtime: RuntimeConfig, gbs: int) -> None:
        t, m = cfg.training, cfg.model
        self.lifecycle.enter("starting the checkpoint writer")
        self.checkpointer.start_workers()
        from .distributed import start_compile_workers

        if t.device != "cpu":  # no torch.compile on CPUs (cpu.py)
            start_compile_workers()
        self.lifecycle.enter("looking for a checkpoint")
        self.checkpointer.on_loading = lambda iteration: self.lifecycle.enter(f"loading checkpoint {iteration}")
        self.loaded = self.checkpointer.load()
        self.hf_import = None
        if self.loaded is None and self.export_only:
            raise Fatal(ExitCode.BAD_CHECKPOINT, f"--hf-export-only: no complete checkpoint under "
                        f"{cfg.checkpoint.load} to export")
        if self.loaded is None and self.hf_source is not None:
            self._import_hf()
        if self.loaded is not None:
            self.state.iteration = self.loaded.iteration
            self.state.consumed_samples = self.loaded.consumed_samples
        self.loaded_iteration = self.state.iteration  # from here on status.progress.iteration is known

        # --- data (resumes from consumed samples) ---------------------------------------------
        from .data import build_data

        self.eval_forward_backward = None
        if not self.export_only and cfg.data.sft:
            self._build_sft_data(cfg, runtime, gbs)
        elif not self.export_only:  # an export needs the weights only
            self.lifecycle.enter("building the data index")
            with data_errors_are_fatal("--data-path"):
                _, self.data_iterators = build_data(cfg, self.env, self.state.consumed_samples, self.num_nodes,
                                                    runtime.data_cache_shared)
        self.lifecycle.enter("running the first iteration")

        # --- throughput arithmetic -------------------------------------------------------------
        self.tokens_per_iteration = gbs * m.seq_length
        self.flops_per_iteration = flops_mod.megatron_flops_per_iteration(
            gbs, m.seq_length, m.num_layers, m.hidden_size, m.num_attention_heads, m.effective_num_query_groups,
            m.effective_moe_ffn_hidden_size if m.num_experts else m.effective_ffn_hidden_size, self.padded_vocab,
            swiglu=m.swiglu, kv_channels=m.kv_channels,
            moe_topk=m.moe_router_topk if m.num_experts else 1)
        self.classic_flops_per_iteration = flops_mod.classic_flops_per_iteration(
            gbs, m.seq_length, m.num_layers, m.hidden_size, self.vocab_size)

        # --- observability: metrics, progress, preemption -------------------------------------
        # Only global rank 0 serves (it receives the loss from the last stage in log_iterations): one
        # target per job, the pod of node rank 0, which is what the chart's PodMonitor scrapes.
        self.metrics = Metrics(runtime.metrics_port, self.env.is_rank0)
        self.metrics.set("train_iters", t.train_iters)
        self.metrics.set("restarts", runtime.restart_attempt)
        if self.loaded is not None:
            self.metrics.set("checkpoint_load_seconds", self.loaded.seconds)
        self.progress_cadence = Cadence(runtime.progress_interval_s)
        self._begin_goodput()
        self.tensorboard = None
        if cfg.logging.tensorboard_dir and self.is_logging_rank:
            from .tensorboard import TensorBoardWriter

            self.tensorboard = TensorBoardWriter(cfg.logging.tensorboard_dir, cfg.logging.tensorboard_log_interval,
                                                 cfg.logging.tensorboard_queue_size)
        self.wandb = self._wandb_writer(cfg, runtime)
        self.checkpointer.on_published = self._on_checkpoint_published
        self.stop_signal = StopSignal()
        if cfg.checkpoint.exit_signal_handler:
            self.stop_signal.install()
        self.last_log = {"loss": None, "tokens_per_second": None, "tflops_per_gpu": None, "mfu": None}
        self.first_iteration_age_s: float | None = None
        self.profiler = IterationProfiler.from_spec(runtime.profile, self.env.rank, {0, self.env.world_size - 1})
        self._log_startup()

    def _build_sft_data(self, cfg: TrainerConfig, runtime: RuntimeConfig, gbs: int) -> None:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from .data import dataset_cache_path, total_samples
        from .sft_data import build_sft_iterators, load_sft_data

        self.lifecycle.enter("tokenizing the fine-tuning data")
        cache = dataset_cache_path(cfg, runtime.data_cache_shared, self.num_nodes)
        self.sft_data = load_sft_data(cfg, self.env, self.vocab_size, self.pad_id, cache)
        total = total_samples(cfg.training.train_iters, gbs)
        self.data_iterators = build_sft_iterators(cfg, self.env, self.sft_data, self.state.consumed_samples, total)
        if self.env.is_rank0:
            log.info("sft: %d iterations x %d samples = %.2f epochs of %d samples", cfg.training.train_iters, gbs,
                     cfg.training.train_iters * gbs / len(self.sft_data.train), len(self.sft_data.train))
        self.eval_forward_backward = get_forward_backward_func()  # eager, also under the full-iteration graph

    def evaluate(self) -> float | None:
        """Validation loss over --eval-iters global batches (forward only; every rank calls it). The mean
        over answer tokens, like the training loss; returned on every rank."""
        from megatron.core import parallel_state

        from .sft_data import build_eval_iterators

        layout, m = self.env.layout, self.cfg.model
        iterators = build_eval_iterators(self.cfg, self.env, self.sft_data, layout.global_batch_size)
        for chunk in self.model:
            chunk.eval()
        total = torch.zeros(2, dtype=torch.float32, device=torch.cuda.current_device())
        try:
            with torch.no_grad():
                for _ in range(self.cfg.training.eval_iters):
                    reports = self.eval_forward_backward(
                        forward_step_func=self._forward_step,
                        data_iterator=iterators if len(self.model) > 1 else iterators[0],
                        model=self.model if len(self.model) > 1 else self.model[0],
                        num_microbatches=layout.num_microbatches, seq_length=m.seq_length,
                        micro_batch_size=self.cfg.training.micro_batch_size, decoder_seq_length=m.seq_length,
                        forward_only=True)
                    if self.is_last_stage and reports:
                        total += torch.stack([r["lm loss"] for r in reports]).sum(dim=0)
        finally:
            for chunk in self.model:
                chunk.train()
            for it in iterators:
                if it is not None:
                    it.close()
        if self.is_last_stage:
            torch.distributed.all_reduce(total, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
        shared = torch.tensor([float(total[0] / total[1]) if self.is_logging_rank and total[1] > 0 else 0.0,
                               1.0 if self.is_logging_rank and total[1] > 0 else 0.0], dtype=torch.float64)
        torch.distributed.all_reduce(shared, group=self.env.cpu_group)
        loss = float(shared[0]) if shared[1] > 0 else None
        self.validation_loss, self.evaluated_at = loss, self.state.iteration
        if self.is_logging_rank:
            print(f" validation at iteration {self.state.iteration:8d} | lm loss: {loss:.6E} | "
                  f"{self.cfg.training.eval_iters} x {layout.global_batch_size} samples", flush=True)
        return loss

    def should_evaluate(self, final: bool = False) -> bool:
        """At --eval-interval (or, ``final``, at the end unless just done), unless a rank has a stop signal:
        the grace period is for the checkpoint. Collective when due (one gloo all-reduce): every rank
        decides the same."""
        if self.sft_data is None or self.sft_data.valid is None:
            return False
        interval = self.cfg.training.eval_interval
        if final:
            due = self.evaluated_at != self.state.iteration
        else:
            due = interval is not None and self.state.iteration % interval == 0
        return due and not any_rank(self.stop_signal.received is not None, self.env)

    def _import_hf(self) -> None:
        """Weights from the Hugging Face directory (validated in main): this rank's slices only. A fresh
        optimizer at iteration 0: its fp32 main parameters are copied from the loaded weights."""
        from megatron.core import parallel_state

        from .hf_torch import import_weights

        self.lifecycle.enter("importing Hugging Face weights")
        figures = import_weights(self.model, self.hf_source, parallel_state.get_tensor_model_parallel_world_size(),
                                 parallel_state.get_tensor_model_parallel_rank(), self.padded_vocab)
        self.optimizer.reload_model_params()
        torch.distributed.barrier(group=self.env.cpu_group)
        self.hf_import = {**figures, "peak_rss_gib": peak_rss_gib()}
        log.info("hf import: %d tensors, %.2f GB read on this rank in %.1f s (peak RSS %.2f GiB) from %s",
                 figures["tensors"], figures["bytes_read"] / 1e9, figures["seconds"], self.hf_import["peak_rss_gib"],
                 self.hf_source.directory)

    def export_hf(self) -> dict:
        """Collective: the model as a Hugging Face checkpoint in --hf-export."""
        from .hf_torch import export_weights

        self.lifecycle.enter("exporting to Hugging Face format")
        self.checkpointer.finalize(blocking=True)
        self.release_cuda_graph()  # training is over: the export's gathers run with no captured graph alive
        torch.cuda.synchronize()
        self.hf_export = export_weights(self.model, self.cfg, self.env, self.state.iteration, self.padded_vocab)
        self.hf_export["peak_rss_gib"] = peak_rss_gib()
        return self.hf_export

    # ------------------------------------------------------------------------------------------
    def _log_startup(self) -> None:
        p, t = self.cfg.parallel, self.cfg.training
        if self.env.is_rank0:
            log.info("megatron_trainer: %s", self.path.describe())
            log.info("layout: world=%d TP=%d PP=%d VPP=%s CP=%d EP=%d DP=%d SP=%s | micro batch %d, global batch %d, "
                     "%d micro-batches/step | %s | distributed optimizer %s | recompute %s | CUDA graph %s",
                     self.env.world_size, p.tensor, p.pipeline, p.virtual_pipeline, p.context, p.expert,
                     self.env.layout.data_parallel, p.sequence_parallel, t.micro_batch_size,
                     self.env.layout.global_batch_size, self.env.layout.num_microbatches, t.precision,
                     t.use_distributed_optimizer, t.recompute_granularity or "none", t.cuda_graph_impl)
            log.info("params on rank 0: %.1fM | vocab %d (padded %d) | async save: %s",
                     self.num_params_rank / 1e6, self.vocab_size, self.padded_vocab,
                     self.checkpointer.async_strategy or "off")
            if self.patched_ops:
                log.info("optimizer kernels (compat.py): %s", ", ".join(self.patched_ops))
            ignored = ignored_flags(self.cfg)
            if ignored:
                log.info("accepted for Megatron-LM compatibility, not used by this trainer: %s "
                         "(metrics: the log line, Prometheus, status.progress)", " ".join(ignored))
            if t.manual_gc:
                log.info("manual gc: automatic collection off, gc.collect() every %s iterations",
                         t.manual_gc_interval or "0 (start-up only)")

    # ----------------------------------------------------------------------- cadence predicates
    def should_log(self) -> bool:
        return self.state.iteration % self.cfg.training.log_interval == 0 or \
            self.state.iteration == self.cfg.training.train_iters

    def should_collect_garbage(self) -> bool:
        t = self.cfg.training
        return t.manual_gc and t.manual_gc_interval > 0 and self.state.iteration % t.manual_gc_interval == 0

    def should_stop(self) -> str | None:
        """Why every rank stops now (None: keep going). One gloo all-reduce, so all ranks agree."""
        t = self.cfg.training
        local = self.stop_signal.received is not None
        if t.exit_duration_in_mins is not None:
            local = local or (time.monotonic() - self.t_start) / 60 >= t.exit_duration_in_mins
        if any_rank(local, self.env):
            return "signal" if any_rank(self.stop_signal.received is not None, self.env) else "exit-duration"
        if t.exit_interval and self.state.iteration % t.exit_interval == 0:
            return "exit-interval"
        return None

    # ------------------------------------------------------------------------------- the step
    def _forward_step(self, data_iterator, model):
        batch = next(data_iterator) if data_iterator is not None else None
        if batch is None:
            return model(None, None, None), lambda out: (out, None, {})
        tokens = batch["tokens"].cuda(non_blocking=True)
        labels = batch["labels"].cuda(non_blocking=True)
        loss_mask = batch["loss_mask"].cuda(non_blocking=True)
        position_ids = batch["position_ids"].cuda(non_blocking=True)
        attention_mask = batch.get("attention_mask")
        if attention_mask is not None:
            attention_mask = attention_mask.cuda(non_blocking=True)
        elif "segment_ids" in batch:  # packed SFT samples: each attends within its own document only
            from .sft_data import packed_attention_mask

            attention_mask = packed_attention_mask(batch["segment_ids"].cuda(non_blocking=True))
        output = model(tokens, position_ids, attention_mask, labels=labels)

        def loss_func(output_tensor):
            # Megatron-LM's 3-tuple: (sum of token losses, token count, report); with
            # calculate_per_token_loss the schedule/finalize divide by the global token count.
            losses = output_tensor.float().view(-1)
            mask = loss_mask.view(-1).float()
            loss_sum = torch.sum(losses * mask)
            num_tokens = mask.sum().to(torch.int)
            report = torch.stack([loss_sum.detach(), num_tokens.detach().float()])
            return loss_sum, num_tokens, {"lm loss": report}

        return output, loss_func

    def train_step(self) -> tuple[torch.Tensor | None, torch.Tensor | float | None, bool]:
        """One optimizer step; (the loss, still on the GPU; the gradient norm as Megatron's optimizer returns it, a
        float or, where TE's multi-tensor kernels computed it, a 1-element CUDA tensor; whether the update ran)."""
        from megatron.core import parallel_state

        layout, m = self.env.layout, self.cfg.model
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        iterators = self.data_iterators if len(self.model) > 1 else self.data_iterators[0]
        reports = self.forward_backward(
            forward_step_func=self._forward_step, data_iterator=iterators,
            model=self.model if len(self.model) > 1 else self.model[0],
            num_microbatches=layout.num_microbatches, seq_length=m.seq_length,
            micro_batch_size=self.cfg.training.micro_batch_size, decoder_seq_length=m.seq_length,
            forward_only=False)
        update_ok, grad_norm, _ = self.optimizer.step()
        if update_ok:
            self.scheduler.step(increment=layout.global_batch_size)
        loss = None
        if self.is_last_stage and reports:
            total = torch.stack([r["lm loss"] for r in reports]).sum(dim=0)
            torch.distributed.all_reduce(total, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
            loss = total[0] / total[1]
        return loss, grad_norm, update_ok

    # ------------------------------------------------------------------------------- the loop
    def train(self) -> str:
        """Train to --train-iters or until a stop (step -> log -> save -> stop); returns why it stopped."""
        window = _LogWindow()
        stop_reason = None
        if self.cfg.training.manual_gc:  # Megatron-LM's --manual-gc: no collector pause on one rank at a time
            gc.disable()
            gc.collect()
        with self.profiler.session(self.state.iteration) as profiler:
            while self.state.iteration < self.cfg.training.train_iters:
                t0 = time.monotonic()
                capture = self.cfg.training.cuda_graph_impl == "full_iteration" and \
                    self.state.iteration == self.loaded_iteration + self.cfg.training.cuda_graph_warmup_steps
                if capture:
                    self.lifecycle.enter("capturing the CUDA graph")
                loss, grad_norm, ok = self.train_step()
                if capture:
                    self.lifecycle.enter("training")
                self._advance(loss, ok, window)
                step_s = time.monotonic() - t0
                self.state.iteration_times_s.append(step_s)
                if len(self.state.iteration_times_s) > 1:  # the first step is the end of start-up
                    self.state.productive_s += step_s
                if self.goodput is not None and self.goodput_cadence.due():
                    self._report_goodput(write=True)
                profiler.step(self.state.iteration)
                if self.first_iteration_age_s is None:
                    self._after_first_iteration()
                if self.should_log():
                    self.log_iterations(window.losses, window.seconds_per_iteration(), grad_norm)
                    window.reset()
                if self.should_evaluate():
                    self.evaluate()
                if self.should_collect_garbage():
                    gc.collect()
                recent = self.state.iteration_times_s[-20:]
                if saved := self.checkpointer.maybe_save(self.state.iteration, self.state.consumed_samples,
                                                         sorted(recent)[len(recent) // 2]):
                    self.metrics.set("checkpoint_save_blocked_seconds", saved.blocked_s)
                if stop_reason := self.should_stop():
                    if window.iterations:  # iterations since the last log line would go unreported (collective)
                        self.log_iterations(window.losses, window.seconds_per_iteration(), grad_norm)
                    if self.env.is_rank0:
                        log.warning("stopping at iteration %d (%s)", self.state.iteration, stop_reason)
                    break
        if stop_reason is None and self.should_evaluate(final=True):
            self.evaluate()  # the final validation loss (not on a stop: the grace period is for the checkpoint)
        signal_at = self.stop_signal.received_at if stop_reason == "signal" else None
        self.checkpointer.save_final(
            self.state.iteration, self.state.consumed_samples,
            signal_age_s=None if signal_at is None else time.monotonic() - signal_at,
            grace_s=self.runtime.shutdown_grace_s)
        self._write_progress(force=True, ended_cleanly=True)
        return stop_reason or "done"

    # ------------------------------------------------------------------------- goodput
    def _begin_goodput(self) -> None:
        """Rank 0: this attempt's goodput ledger, closing the previous attempt's from the checkpoint root
        (goodput.py). Without --save there is no durable place: the ledger covers this attempt only."""
        from . import ckpt_layout, goodput

        self.goodput = None
        self.goodput_cadence = Cadence(min(10.0, self.runtime.progress_interval_s or 10.0))
        if not self.env.is_rank0:
            return
        # beside the checkpoints: the --save directory, or --load's when nothing is saved
        root = self.goodput_root = self.checkpointer.save_dir or self.checkpointer.load_dir
        previous = goodput.Ledger.from_json(ckpt_layout.read_small_file(root, goodput.LEDGER_NAME)) \
            if root is not None else None
        started = time.time() - (time.monotonic() - self.t_start)
        self.goodput = goodput.begin(previous, started, self.state.iteration)
        if previous is not None:
            g = goodput.summary(self.goodput, started)
            log.info("goodput: attempt %d; before it: %.1f %% of %.0f s productive (lost %.0f s, restart %.0f s)",
                     self.goodput.attempts, 100 * g["ratio"], g["wallSeconds"], g["lostSeconds"],
                     g["restartSeconds"])

    def _report_goodput(self, write: bool = False, ended_cleanly: bool = False) -> dict | None:
        """Rank 0: the current attempt's figures into the ledger, written to the checkpoint root if `write`
        (the loop does every 10 s, and at the end); returns status.progress.goodput."""
        if self.goodput is None:
            return None
        from . import ckpt_layout, goodput

        cur, now = self.goodput.current, time.time()
        cur.iteration = self.state.iteration
        cur.productive = self.state.productive_s
        cur.startup = self.first_iteration_age_s or 0.0
        cur.save_blocked = sum(s["blocked_s"] for s in self.checkpointer.stats.saves)
        cur.report_time = now
        cur.ended_cleanly = ended_cleanly
        if write and self.goodput_root is not None:
            try:
                ckpt_layout.write_small_file(self.goodput_root, goodput.LEDGER_NAME, self.goodput.to_json())
            except Exception as exc:  # goodput is reporting: it never stops training
                log.warning("goodput: could not write the ledger (%s: %s)", type(exc).__name__, exc)
        return goodput.summary(self.goodput, now)

    def _goodput_now(self) -> dict | None:
        """The ledger's figures as of now, as last reported (rank 0; None elsewhere)."""
        from . import goodput

        return goodput.summary(self.goodput, time.time()) if self.goodput is not None else None

    def _advance(self, loss: torch.Tensor | None, update_ok: bool, window: _LogWindow) -> None:
        """Count the step just taken; let async saves whose writers are done publish."""
        self.state.iteration += 1
        self.state.consumed_samples += self.env.layout.global_batch_size
        self.state.skipped_iterations += 0 if update_ok else 1
        window.add(self.state.iteration, loss)
        self.checkpointer.finalize(blocking=False)

    def _after_first_iteration(self) -> None:
        self.checkpointer.after_first_step()
        torch.cuda.synchronize()
        now = time.monotonic()
        self.first_iteration_age_s = now - self.t_start
        self.startup_breakdown = self.lifecycle.breakdown(self.t_start, now)
        self.lifecycle.first_iteration_done = True
        self.lifecycle.enter("training")
        self.mem_after_first_step = torch.cuda.memory_allocated()
        if self.env.is_rank0:
            log.info("startup: process start -> first %siteration done: %.1f s (%s)",
                     "resumed " if self.loaded else "", self.first_iteration_age_s,
                     ", ".join(f"{stage} {s:.1f} s" for stage, s in self.startup_breakdown))

    # ------------------------------------------------------------------------- observability
    def log_iterations(self, pending: list[tuple[int, torch.Tensor]], seconds_per_iteration: float,
                       grad_norm: torch.Tensor | float | None) -> None:
        """Megatron-style lines (last rank), metrics and progress (rank 0). Collective on the CPU group."""
        # A host float from here on, for the line, TensorBoard and W&B: with Transformer Engine installed,
        # Megatron-Core's clip_grads keeps the norm on the device (get_grad_norm_fp32 returns
        # total_norm.pow(1 / norm_type), a CUDA tensor, where TE's multi_tensor_scale_tensor is importable),
        # and formatting a tensor with ':.3f' raised TypeError (issue 59). Read here, once per log line, not
        # per step: the step itself stays free of host syncs.
        grad_norm = None if grad_norm is None else float(grad_norm)
        losses = [(it, float(v)) for it, v in zip([i for i, _ in pending],
                                                  torch.stack([x for _, x in pending]).tolist(), strict=True)] if pending else []
        for it, value in losses:
            self.state.losses[it] = value
        # The loss lives on the last stage; bring it to rank 0 (for metrics and status.progress).
        shared = torch.tensor([losses[-1][1] if (losses and self.is_logging_rank) else 0.0,
                               1.0 if (losses and self.is_logging_rank) else 0.0], dtype=torch.float64)
        torch.distributed.all_reduce(shared, group=self.env.cpu_group)
        loss = float(shared[0]) if shared[1] > 0 else None
        tp = flops_mod.throughput(self.flops_per_iteration, self.tokens_per_iteration, seconds_per_iteration,
                                  self.env.world_size)
        self.last_log = {"loss": loss, "tokens_per_second": tp["tokens_per_s"],
                         "tflops_per_gpu": tp["tflops_per_gpu"], "mfu": tp["mfu"]}
        for name, value in (("iteration", self.state.iteration), ("loss", loss),
                            ("tokens_per_second", tp["tokens_per_s"]), ("tflops_per_gpu", tp["tflops_per_gpu"]),
                            ("mfu", tp["mfu"])):
            self.metrics.set(name, value)
        if self.is_logging_rank:
            lr = self.optimizer.param_groups[0]["lr"] if self.optimizer.param_groups else float("nan")
            for it, value in losses:
                print(f" [{datetime.now():%Y-%m-%d %H:%M:%S}] iteration {it:8d}/{self.cfg.training.train_iters:8d} |"
                      f" consumed samples: {it * self.env.layout.global_batch_size:12d} |"
                      f" elapsed time per iteration (ms): {seconds_per_iteration * 1000:.1f} |"
                      f" throughput per GPU (TFLOP/s/GPU): {tp['tflops_per_gpu']:.1f} |"
                      f" learning rate: {lr:.6E} | global batch size: {self.env.layout.global_batch_size:5d} |"
                      f" lm loss: {value:.6E} | grad norm: {grad_norm if grad_norm is not None else float('nan'):.3f} |"
                      f" number of skipped iterations: {self.state.skipped_iterations:3d} |"
                      f" mem GiB (alloc/peak): {torch.cuda.memory_allocated() / GIB:.2f}/"
                      f"{torch.cuda.max_memory_allocated() / GIB:.2f} |", flush=True)
            if self.tensorboard is not None:
                from .tensorboard import StepFigures

                self.tensorboard.write(losses, StepFigures(
                    self.state.iteration, self.env.layout.global_batch_size, self.env.world_size, lr, grad_norm,
                    seconds_per_iteration, tp["tflops_per_gpu"], torch.cuda.memory_stats()))
            if self.wandb is not None:
                self._log_wandb(losses, lr, grad_norm, seconds_per_iteration, tp)
        if self.router_monitor is not None:
            self._log_moe()
        self._write_progress()

    def _wandb_writer(self, cfg: TrainerConfig, runtime: RuntimeConfig):
        """The W&B run, on the last rank only (Megatron-LM's get_wandb_writer: it holds the loss); else None."""
        from . import wandb_log

        if not (self.is_logging_rank and wandb_log.enabled(cfg)):
            return None
        return wandb_log.WandbWriter(cfg, runtime.job_name)

    def _log_wandb(self, losses: list[tuple[int, float]], lr: float, grad_norm: float | None,
                   seconds_per_iteration: float, tp: dict) -> None:
        """The log line's figures to the W&B run (last rank): each iteration's loss at its step, the rest at the
        window's last iteration (TensorBoard's scalar names, as Megatron-LM's wandb writer uses them)."""
        for it, value in losses:  # a step logged again is merged into its row (the window's last one below)
            self.wandb.log({"lm loss": value}, step=it)
        self.wandb.log({"learning-rate": lr, "grad-norm": grad_norm,
                        "iteration-time": seconds_per_iteration, "throughput": tp["tflops_per_gpu"],
                        "tokens-per-second": tp["tokens_per_s"], "mfu": tp["mfu"],
                        "batch-size": self.env.layout.global_batch_size,
                        "skipped-iterations": self.state.skipped_iterations}, step=self.state.iteration)

    # ----------------------------------------------------------------------------- MoE routing
    def _router_monitor(self):
        """Expert load and router losses for the log line and the metrics (moe.RouterMonitor)."""
        from .moe import RouterMonitor, router_loss_names

        m = self.cfg.model
        return RouterMonitor(self.model, m.num_layers, m.num_experts, router_loss_names(m))

    def _log_moe(self) -> None:
        """Collective: the router's figures since the last log line to the log (last rank) and the metrics."""
        got = self.router_monitor.report(self.env.cpu_group, self.state.iteration)
        if got is None:
            return
        losses = got["losses"]
        for name, value in (("moe_load_balancing_loss", next((v for k, v in losses.items() if k != "z_loss"), None)),
                            ("moe_z_loss", losses.get("z_loss")),
                            ("moe_expert_load_max_over_mean", got["max_over_mean"]), ("moe_idle_experts", got["idle"])):
            self.metrics.set(name, value)
        for expert, share in enumerate(got["share"]):
            self.metrics.set("moe_expert_token_share", share, expert=str(expert))
        if self.wandb is not None and got["max_over_mean"] is not None:
            self.wandb.log({**{f"moe/{k}": v for k, v in losses.items()},
                            "moe/expert-load-max-over-mean": got["max_over_mean"], "moe/idle-experts": got["idle"]},
                           step=self.state.iteration)
        if self.is_logging_rank and got["max_over_mean"] is not None:
            text = "".join(f" {k}: {v:.4E} |" for k, v in losses.items())
            print(f" [{datetime.now():%Y-%m-%d %H:%M:%S}] MoE iteration {self.state.iteration:8d} |{text}"
                  f" tokens per expert, busiest/mean: {got['max_over_mean']:.2f} (layer {got['worst_layer'] + 1} of "
                  f"{len(got['routed'])}) |"
                  f" idle (layer, expert) pairs: {got['idle']} |", flush=True)

    def _report_stage(self, stage: str) -> None:
        """A stage (start-up, training again after a capture, the export) to status.progress, right away. After this
        attempt has reported figures, they go along: status.progress is written by server-side apply, so a patch
        without them would drop the loss, goodput and the rest (seen on real pods: the export's stage cleared them)."""
        if self.progress is None:
            return
        if self.last_snapshot is not None:
            self.progress.submit(dataclasses.replace(self.last_snapshot, iteration=self.state.iteration, stage=stage))
            return
        self.progress.submit(Progress(iteration=None if self.loaded_iteration is None else self.state.iteration,
                                      train_iters=self.cfg.training.train_iters, stage=stage))

    def _write_progress(self, force: bool = False, ended_cleanly: bool = False) -> None:
        if force:  # the final report: the ledger too, whether or not there is a status to write
            g = self._report_goodput(write=True, ended_cleanly=ended_cleanly)
            if g:
                log.info("goodput: %.1f %% of %.0f s over %d attempt(s): productive %.0f s, start-up %.0f s, "
                         "save-blocked %.1f s, lost %.0f s, restart %.0f s, other %.0f s", 100 * g["ratio"],
                         g["wallSeconds"], g["attempts"], g["productiveSeconds"], g["startupSeconds"],
                         g["saveBlockedSeconds"], g["lostSeconds"], g["restartSeconds"], g["otherSeconds"])
        if self.progress is None or not (force or self.progress_cadence.due()):
            return
        figures = self._report_goodput(ended_cleanly=ended_cleanly)
        ck = self.checkpointer
        last_save = ck.stats.saves[-1] if ck.stats.saves else {}
        snapshot = Progress(iteration=self.state.iteration, train_iters=self.cfg.training.train_iters,
                            goodput=figures, save_warning=ck.interval_warning or ck.space_warning,
                            last_save_blocked_seconds=last_save.get("blocked_s"),
                            last_save_seconds=next((s["total_s"] for s in reversed(ck.stats.saves) if s.get("total_s")),
                                                   None),
                            loss=self.last_log["loss"], tokens_per_second=self.last_log["tokens_per_second"],
                            tflops_per_gpu=self.last_log["tflops_per_gpu"], mfu=self.last_log["mfu"],
                            last_checkpoint_iteration=self.checkpointer.stats.last_published,
                            stage=self.lifecycle.stage, validation_loss=self.validation_loss,
                            data=self.sft_data.status() if self.sft_data is not None else None)
        self.last_snapshot = snapshot
        if force:
            self.progress.write_now(snapshot)
        else:
            self.progress.submit(snapshot)

    def _on_checkpoint_published(self, iteration: int, total_s: float) -> None:
        self.metrics.set("last_checkpoint_iteration", iteration)
        self.metrics.set("checkpoint_save_seconds", total_s)

    def summary(self) -> dict:
        """Figures for benchmarks and memory calibration (collective: gathers per-rank memory)."""
        times = self.state.iteration_times_s
        steady = sorted(times[3:]) if len(times) > 4 else sorted(times)
        median = steady[len(steady) // 2] if steady else None
        mem = {"rank": self.env.rank, "peak_allocated_gib": torch.cuda.max_memory_allocated() / GIB,
               "peak_reserved_gib": torch.cuda.max_memory_reserved() / GIB,
               "after_model_gib": self.mem_after_model / GIB,
               "after_optimizer_init_gib": self.mem_after_optimizer / GIB,
               "after_first_step_gib": self.mem_after_first_step / GIB,
               "params_on_rank": self.num_params_rank}
        gathered = [None] * self.env.world_size
        torch.distributed.all_gather_object(gathered, mem, group=self.env.cpu_group)
        out = {"iterations_run": len(times), "median_iteration_s": median,
               "losses": {str(k): v for k, v in sorted(self.state.losses.items())},
               "memory_per_rank": gathered,
               "max_peak_allocated_gib": max(g["peak_allocated_gib"] for g in gathered),
               "checkpoint_saves": self.checkpointer.stats.saves,
               "load_s": self.loaded.seconds if self.loaded else None,
               "resumed_from": self.loaded.iteration if self.loaded else None,
               "startup_to_first_iteration_s": self.first_iteration_age_s,
               "startup_breakdown_s": dict(getattr(self, "startup_breakdown", [])),
               "goodput": self._goodput_now(),
               "checkpoint_bytes": self.checkpointer.checkpoint_bytes,
               "hf_import": self.hf_import, "hf_export": getattr(self, "hf_export", None),
               "validation_loss": self.validation_loss,
               "sft_data": self.sft_data.status() if self.sft_data is not None else None,
               "peak_rss_gib": peak_rss_gib(),
               "path": self.path.describe()}
        if median:
            out["megatron_formula"] = flops_mod.throughput(self.flops_per_iteration, self.tokens_per_iteration,
                                                           median, self.env.world_size)
            out["classic_formula"] = flops_mod.throughput(self.classic_flops_per_iteration,
                                                          self.tokens_per_iteration, median, self.env.world_size)
        return out

    def release_cuda_graph(self) -> None:
        """Destroy the captured graph before the process groups. With the graph alive (it holds the
        NCCL kernels it captured), `destroy_process_group` hung at exit on 2 x H200 (torch 2.11)."""
        reset = getattr(self.forward_backward, "reset_cuda_graph", None)
        if reset is not None:
            torch.cuda.synchronize()
            reset()
            torch.cuda.synchronize()

    def close(self, abort: bool = False) -> None:
        try:
            self.release_cuda_graph()
        except Exception as e:  # after a CUDA error the graph may not be releasable; closing goes on
            if not abort:
                raise
            log.warning("could not release the CUDA graph: %s", e)
        for it in self.data_iterators:
            if it is not None:
                it.close()
        self.checkpointer.close(abort=abort)
        if self.progress is not None:
            self.progress.close()
        if getattr(self, "tensorboard", None) is not None:
            self.tensorboard.close()
        if getattr(self, "wandb", None) is not None:
            try:
                self.wandb.close(exit_code=1 if abort else 0)
            except Exception as e:  # tracking never fails the job's own ending
                log.warning("wandb: could not finish the run (%s: %s)", type(e).__name__, e)
        if self.stop_signal is not None:
            self.stop_signal.restore()


@dataclass
class _LogWindow:
    """The iterations since the last log line: their losses (still on the GPU) and wall time."""

    losses: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    iterations: int = 0
    started: float = field(default_factory=time.monotonic)

    def add(self, iteration: int, loss: torch.Tensor | None) -> None:
        self.iterations += 1
        if loss is not None:
            self.losses.append((iteration, loss))

    def seconds_per_iteration(self) -> float:
        return (time.monotonic() - self.started) / max(1, self.iterations)

    def reset(self) -> None:
        self.losses, self.iterations, self.started = [], 0, time.monotonic()


class IterationProfiler:
    """torch.profiler over iterations FIRST..LAST on chosen ranks (MEGATRON_TRAINER_PROFILE=FIRST:LAST:DIR).

    Like torch.profiler's own schedule, an iteration spans from one `step()` to the next (the step,
    then its logging and saving). Writes DIR/rank<r>.json.gz (a Chrome/Perfetto trace) and
    DIR/rank<r>.txt (operators by CUDA time). A diagnostics knob for benchmarks, off by default; a
    malformed value is ignored with a warning, never fatal.
    """

    def __init__(self, first: int = 0, last: int = -1, directory: str = "", rank: int = 0):
        self.first, self.last, self.directory, self.rank = first, last, directory, rank
        self.prof = None

    @classmethod
    def from_spec(cls, value: str | None, rank: int, ranks: set[int]) -> IterationProfiler:
        if not value or rank not in ranks:
            return cls()
        try:
            first, last, directory = value.split(":", 2)
            if int(first) < 1 or int(last) < int(first) or not directory:
                raise ValueError
        except ValueError:
            log.warning("MEGATRON_TRAINER_PROFILE=%r ignored: expected FIRST:LAST:DIR with 1 <= FIRST <= LAST", value)
            return cls()
        return cls(int(first), int(last), directory, rank)

    @contextmanager
    def session(self, iteration: int) -> Iterator[IterationProfiler]:
        """Profile while the loop runs from `iteration` on; a trace still open at the end is dropped."""
        self.step(iteration)
        try:
            yield self
        finally:
            if self.prof is not None:
                self.prof.__exit__(None, None, None)
                self.prof = None

    def step(self, done: int) -> None:
        """Iteration `done` finished: export after LAST, start before FIRST."""
        if self.prof is not None and done >= self.last:
            self._stop_and_export()
        if self.prof is None and done + 1 == self.first:
            from torch.profiler import ProfilerActivity, profile

            torch.cuda.synchronize()
            self.prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            self.prof.__enter__()

    def _stop_and_export(self) -> None:
        torch.cuda.synchronize()
        self.prof.__exit__(None, None, None)
        os.makedirs(self.directory, exist_ok=True)
        base = os.path.join(self.directory, f"rank{self.rank}")
        try:
            self.prof.export_chrome_trace(base + ".json.gz")
            with open(base + ".txt", "w") as f:
                f.write(self.prof.key_averages().table(sort_by="cuda_time_total", row_limit=60))
        except Exception as e:  # diagnostics only
            log.warning("profiler export failed: %s", e)
        self.prof = None


def dump_summary(summary: dict) -> None:
    """One write of the whole line: print() writes the text and the newline separately, and two ranks
    sharing a pipe then glued their summaries into one line (PP=2, 2 x H200)."""
    sys.stdout.write("TRAINER_SUMMARY " + json.dumps(summary, sort_keys=True) + "\n")
    sys.stdout.flush()
