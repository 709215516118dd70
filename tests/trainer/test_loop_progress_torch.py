"""status.progress from the training loop: a stage reported after the first figures keeps them (the patch is a
server-side apply: what it leaves out, the field manager stops owning and the API server drops)."""

from __future__ import annotations

from conftest import require


class Sink:
    def __init__(self):
        self.sent = []

    def submit(self, snapshot):
        self.sent.append(snapshot)


def test_a_stage_after_the_first_figures_keeps_them():
    require("torch")
    from megatron_trainer.loop import Trainer
    from megatron_trainer.progress import Progress, build_patch

    class Cfg:
        class training:
            train_iters = 40

    t = Trainer.__new__(Trainer)  # only what _report_stage reads
    t.progress, t.cfg, t.loaded_iteration, t.last_snapshot = Sink(), Cfg, 0, None
    t.state = type("S", (), {"iteration": 0})()
    t._report_stage("loading checkpoint 20")  # start-up: nothing to keep yet
    assert t.progress.sent[-1] == Progress(iteration=0, train_iters=40, stage="loading checkpoint 20")
    t.last_snapshot = Progress(iteration=40, train_iters=40, loss=4.8, tokens_per_second=950.0,
                               goodput={"ratio": 0.5, "attempts": 2}, stage="training")
    t.state.iteration = 40
    t._report_stage("exporting to Hugging Face format")
    sent = build_patch("job", "ns", t.progress.sent[-1])["status"]["progress"]
    assert sent["stage"] == "exporting to Hugging Face format" and sent["iteration"] == 40
    assert sent["loss"] == 4.8 and sent["tokensPerSecond"] == 950.0 and sent["goodput"]["attempts"] == 2
