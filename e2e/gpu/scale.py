"""GPU scenarios of scale and goodput (issue 49): what a job loses to saves, starts, failures and layout changes,
measured on the model and layout of --model / --reshard-from (the 7B at TP2 x PP2 on 4 GPUs). Registered in
suite.py.

  goodput    one job, three attempts, as a gang would live them: (1) a fresh start saving every
             --goodput-interval iterations, kill -9 of a rank once a save is complete; (2) the restart resumes
             from it, trains, SIGTERM -> the final save (fully reshardable, in place) -> exit 0; (3) a layout
             change (--reshard-to's first layout, the same global batch) resumes from that save and trains on,
             the loss continuing. Per attempt: start-up and its breakdown, blocked time per save apart from the
             wait for the previous one, write time against the disk's dd speed, lost iterations; then the
             trainer's own goodput ledger over the three attempts (goodput.json beside the checkpoints).
  diskfull   a save into a volume too small for it (a tmpfs of --diskfull-mib, 700: one checkpoint of the small
             model fits, two do not; one GPU): exit 8 (not retried),
             one line naming the volume, the bytes needed and free; the earlier checkpoint complete and named
             by the tracker; the failed save's directory gone; the start-up warning that keep + 1 do not fit.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time

from harness import (
    ITER_RE,
    MODELS,
    RESUMED_RE,
    SCHEDULED_RE,
    STOPPING_RE,
    WORK,
    Run,
    Scenario,
    all_gpus,
    check,
    ckpt_state,
    compare,
    trainer_args,
    trainer_summaries,
)

PUBLISHED_RE = re.compile(r"checkpoint: iteration (\d+) published \(([0-9.]+) s after the save started\)")
SAVED_SYNC_RE = re.compile(r"sync save of iteration (\d+) written to \S+ \(loop blocked ([0-9.]+) s, of which ([0-9.]+) s")
BREAKDOWN_RE = re.compile(r"process start -> first (resumed )?iteration done: ([0-9.]+) s \((.*)\)")
SIZE_RE = re.compile(r"checkpoint: ([0-9.]+) GiB per save")
GOODPUT_RE = re.compile(r"goodput: ([0-9.]+) % of ([0-9.]+) s over (\d+) attempt")


def _parse_layout(name: str, gpus: int) -> tuple[int, int]:
    m = re.fullmatch(r"(?:tp(\d+))?(?:pp(\d+))?(?:dp(\d+))?", name)
    if not m or not name:
        raise ValueError(f"bad layout {name!r}")
    tp, pp = int(m.group(1) or 1), int(m.group(2) or 1)
    if gpus % (tp * pp):
        raise ValueError(f"layout {name!r} does not divide {gpus} GPUs")
    return tp, pp


def attempt_figures(run: Run, started: float) -> dict:
    """What one attempt's log says: start-up (and its stages), saves (blocked, waited, write time), iterations."""
    text = run.text()
    startup = BREAKDOWN_RE.search(text)
    saves = [{"iteration": int(m.group(1)), "blocked_s": float(m.group(2)), "waited_s": float(m.group(3)),
              "async": True} for m in SCHEDULED_RE.finditer(text)]
    saves += [{"iteration": int(m.group(1)), "blocked_s": float(m.group(2)), "waited_s": float(m.group(3)),
               "async": False} for m in SAVED_SYNC_RE.finditer(text)]
    published = {int(m.group(1)): float(m.group(2)) for m in PUBLISHED_RE.finditer(text)}
    for s in saves:
        s["write_s"] = published.get(s["iteration"])
    iters = [(int(m.group(1)), float(m.group(2))) for m in ITER_RE.finditer(text)]
    resumed = RESUMED_RE.search(text)
    size = SIZE_RE.search(text)
    return {"startup_s": float(startup.group(2)) if startup else None, "startup_stages_s": _stages(startup),
            "resumed_from": int(resumed.group(2)) if resumed else None, "saves": saves,
            "checkpoint_gib": float(size.group(1)) if size else None,
            "first_iteration": iters[0][0] if iters else None, "last_iteration": iters[-1][0] if iters else None,
            "median_iteration_ms": sorted(ms for _, ms in iters[2:])[len(iters[2:]) // 2] if len(iters) > 2 else None,
            "wall_s": round(time.monotonic() - started, 1)}


def _stages(match) -> dict[str, float]:
    """'interpreter and imports 8.1 s, initialising 3.0 s, ...' -> {stage: seconds}."""
    if not match:
        return {}
    out = {}
    for part in match.group(3).split(", "):
        m = re.fullmatch(r"(.*) ([0-9.]+) s", part.strip())
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def scenario_goodput(ctx) -> dict:
    gpus, model = ctx["gpus"], ctx.get("model", "gpt7b")
    src = ctx.get("reshard_from") or "tp2pp2"
    dst = (ctx.get("reshard_to") or ["tp4"])[0]
    tp, pp = _parse_layout(src, gpus)
    tp2, pp2 = _parse_layout(dst, gpus)
    m = MODELS[model]
    dp, dp2 = gpus // (tp * pp), gpus // (tp2 * pp2)
    gbs = ctx.get("goodput_gbs") or 16
    interval = ctx.get("goodput_interval") or 10
    save = WORK / "ckpt" / "goodput"
    shutil.rmtree(save, ignore_errors=True)
    env = {"MEGATRON_CHECKPOINT_KEEP": "1", "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    grace = 400.0  # the launcher's SIGTERM -> SIGKILL budget: a 7B final save takes minutes on this disk

    def args(tp_, pp_, iters, save_dir: str | None, load: str):
        a = trainer_args(model, tp=tp_, pp=pp_, mbs=m["mbs"], gbs=gbs, iters=iters, lr="3e-4", warmup=4,
                         save=save_dir, save_interval=interval)
        if save_dir is None:
            a += ["--load", load, "--ckpt-format", "torch_dist", "--exit-signal-handler"]
        return a

    out: dict = {"model": model, "layout": src, "reshard_to": dst, "global_batch": gbs, "save_interval": interval,
                 "dp": [dp, dp2], "attempts": []}
    failures: list[str] = []
    t_job = time.monotonic()

    # attempt 1: fresh; kill -9 a rank once a save is complete and a few more iterations ran
    one = Run("goodput_1_fresh", gpus, args(tp, pp, 100000, str(save), str(save)), env=env, gpus=all_gpus(gpus),
              grace_period_s=grace)
    t1 = time.monotonic()
    published = one.wait_for(PUBLISHED_RE, 400)
    check(published is not None, "attempt 1: no save completed", failures)
    killed_at_iteration = None
    if published:
        done = int(published.group(1))
        one.wait_for(re.compile(rf"iteration\s+{done + 3}/"), 120)
        its = [int(x.group(1)) for x in ITER_RE.finditer(one.text())]
        killed_at_iteration = max(its) if its else None
        victim = gpus - 1
        check(one.kill_rank(victim), "attempt 1: rank not found to kill", failures)
    t_kill = time.monotonic()
    rc1 = one.wait(120)
    one.close()
    first = attempt_figures(one, t1)
    first.update(rc=rc1, killed_rank=gpus - 1, last_logged_iteration=killed_at_iteration)
    out["attempts"].append(first)
    state_after_kill = ckpt_state(save)
    out["checkpoints_after_kill"] = state_after_kill

    # attempt 2: the gang restart resumes from the newest complete checkpoint; SIGTERM -> final save -> exit 0
    two = Run("goodput_2_restart", gpus, args(tp, pp, 100000, str(save), str(save)), env=env, gpus=all_gpus(gpus),
              grace_period_s=grace)
    t2 = time.monotonic()
    resumed = two.wait_for(RESUMED_RE, 300)
    going = two.wait_for(re.compile(r"startup: process start"), 300)
    kill_to_training_s = round(time.monotonic() - t_kill, 1) if going else None
    if going:
        start_it = int(resumed.group(2)) if resumed else 0
        two.wait_for(re.compile(rf"iteration\s+{start_it + 8}/"), 120)
    t_term = time.monotonic()
    two.sigterm()
    rc2 = two.wait(grace + 30)
    sigterm_to_exit_s = round(time.monotonic() - t_term, 1)
    two.close()
    second = attempt_figures(two, t2)
    stop = STOPPING_RE.search(two.text())
    second.update(rc=rc2, kill_to_first_iteration_s=kill_to_training_s, sigterm_to_exit_s=sigterm_to_exit_s,
                  stopped_at=int(stop.group(1)) if stop else None)
    out["attempts"].append(second)
    state_after_term = ckpt_state(save)
    out["checkpoints_after_sigterm"] = state_after_term
    newest_before = max((it for it, ok in state_after_kill["checkpoints"].items() if ok), default=None)
    check(rc1 != 0 and newest_before is not None, f"attempt 1: rc={rc1}, checkpoints {state_after_kill}", failures)
    check(second["resumed_from"] == newest_before, f"attempt 2 resumed from {second['resumed_from']}, newest "
          f"complete {newest_before}", failures)
    if killed_at_iteration is not None and newest_before is not None:
        first["lost_iterations"] = killed_at_iteration - newest_before
        check(first["lost_iterations"] <= interval + 3 + 1, f"lost {first['lost_iterations']} iterations > the "
              f"save interval {interval} (+ the 3 run on purpose)", failures)
    check(rc2 == 143 and "megatron_trainer: exit 143 (signal)" in two.text(), f"attempt 2: rc={rc2}", failures)
    check(second["stopped_at"] is not None and state_after_term["tracker"] == second["stopped_at"],
          f"attempt 2: final save {state_after_term} for the stop at {second['stopped_at']}", failures)
    losses_before = {**_losses(one), **_losses(two)}

    # attempt 3: a layout change (as a suspended job edited and resumed): the final save loads under `dst`
    stopped_at = second["stopped_at"] or 0
    # --load only: nothing is saved at its end (the disk holds two 7B checkpoints); the ledger is read and
    # written beside the checkpoints all the same
    three = Run("goodput_3_relayout", gpus, args(tp2, pp2, stopped_at + 10, None, str(save)), env=env,
                gpus=all_gpus(gpus), grace_period_s=grace)
    t3 = time.monotonic()
    rc3 = three.wait(400)
    three.close()
    third = attempt_figures(three, t3)
    third["rc"] = rc3
    out["attempts"].append(third)
    after = _losses(three)
    cont = compare(losses_before, after, stopped_at + 1, rel_tol=1.0)  # no overlap: see the check below
    out["loss_before_stop"] = losses_before.get(stopped_at)
    out["loss_after_relayout"] = {k: after[k] for k in sorted(after)[:3]}
    check(rc3 == 0 and third["resumed_from"] == stopped_at, f"attempt 3: rc={rc3}, resumed from "
          f"{third['resumed_from']} (want {stopped_at})", failures)
    first_after = after.get(stopped_at + 1)
    last_before = losses_before.get(stopped_at)
    # the loss continues: the first iteration under the new layout is near the last before the stop, far below
    # a fresh model's (which starts near ln(vocab))
    fresh_loss = losses_before.get(1)
    check(first_after is not None and last_before is not None and fresh_loss is not None
          and abs(first_after - last_before) < 0.25 * abs(fresh_loss - last_before),
          f"loss does not continue: {last_before} before the stop, {first_after} after, fresh {fresh_loss}", failures)
    out["compare_note"] = cont.get("ok")
    summary = (trainer_summaries(three.text()) or [None])[-1] or {}
    out["goodput_ledger"] = summary.get("goodput")
    ledger_file = save / "goodput.json"
    out["goodput_file"] = json.loads(ledger_file.read_text()) if ledger_file.is_file() else None
    out["job_wall_s"] = round(time.monotonic() - t_job, 1)
    saves = [s for a in out["attempts"] for s in a["saves"]]
    out["max_blocked_s"] = max((s["blocked_s"] - s["waited_s"] for s in saves if s["async"]), default=None)
    check(bool(out["goodput_ledger"]) and out["goodput_ledger"].get("attempts") == 3,
          f"goodput ledger {out['goodput_ledger']}", failures)
    out.update(ok=not failures, failures=failures)
    return out


def _losses(run: Run) -> dict[int, float]:
    return {int(m.group(1)): float(m.group(3)) for m in ITER_RE.finditer(run.text())}


def scenario_diskfull(ctx) -> dict:
    """A volume that holds one checkpoint of the small model but not two (keep=2): the second save fails."""
    mib = ctx.get("diskfull_mib") or 700  # one checkpoint of the small model (~450 MiB) fits, two do not
    vol = WORK / "smallvolume"
    vol.mkdir(parents=True, exist_ok=True)
    mount = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mib}m", "tmpfs", str(vol)], capture_output=True,
                           text=True)
    if mount.returncode != 0:
        return {"ok": False, "error": f"mount tmpfs: {mount.stderr.strip()}"}
    try:
        save = vol / "ckpt"
        args = trainer_args("small", tp=1, pp=1, mbs=4, gbs=4, iters=40, save=str(save), save_interval=10)
        # the pods' launcher, which exits with the failed worker's code (torchrun exits 1 for any failure)
        run = Run("diskfull", 1, args, env={"MEGATRON_CHECKPOINT_KEEP": "2"}, gpus="0", grace_period_s=30)
        rc = run.wait(240)
        run.close()
        text = run.text()
        state = ckpt_state(save)
        line = next((ln for ln in text.splitlines() if "megatron_trainer: rank 0: exit 8" in ln), None)
        failures: list[str] = []
        check(rc == 8, f"rc={rc}", failures)
        check(line is not None and f"the checkpoint volume at {save} is full" in line and "GiB free of" in line
              and "needs about" in line, f"exit line: {line}", failures)
        complete = [it for it, ok in state["checkpoints"].items() if ok]
        check(bool(complete) and state["tracker"] == max(complete), f"checkpoints {state}", failures)
        check(all(ok for ok in state["checkpoints"].values()), f"an incomplete save is left: {state}", failures)
        warned = "checkpoint: the checkpoint volume at" in text and "need" in text
        check(warned, "no start-up warning that keep + 1 checkpoints do not fit", failures)
        size = SIZE_RE.search(text)
        return {"ok": not failures, "failures": failures, "rc": rc, "exit_line": line, "checkpoints": state,
                "volume_mib": mib, "checkpoint_gib": float(size.group(1)) if size else None,
                "startup_warning": warned}
    finally:
        subprocess.run(["umount", "-l", str(vol)], capture_output=True)


SCENARIOS = {
    "goodput": Scenario(scenario_goodput, "one job, three attempts: kill -9 -> resume, SIGTERM -> final save, a "
                        "layout change; start-up, save cost, lost work and the goodput ledger", 420),
    "diskfull": Scenario(scenario_diskfull, "a save into a volume too small for it: exit 8, one line, the earlier "
                         "checkpoint intact", 60),
}
