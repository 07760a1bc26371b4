"""Trainer callbacks: the points of a run where something besides the step happens, so that alarms, reporters,
checkpointing (and a user's own code, `Trainer(callbacks=[...])`) hook in without an edit of the trainer.

The trainer calls each hook on every callback of `trainer.callbacks`, in list order: the built-in ones first
(made by the trainer from the recipe, as `default_callbacks` lists them), then the user's. Hooks:

- `on_fit_start(trainer)`: `fit` begins (a resumed run: after its state was read);
- `on_epoch_start(trainer, epoch)`: before the first batch of `epoch` (counted from 0; a resumed run: the epoch
  it is in, `trainer.state.step_in_epoch` its steps already done);
- `on_step_end(trainer, s)`: after each step, `trainer.state` already counting it (`StepEnd`);
- `on_sync(trainer, epoch)`: where the trainer reads the device back anyway (log intervals, before a checkpoint,
  the end of an epoch): what is kept on the device per step is read here, with no host sync per step;
- `on_record(trainer, record)`: each record just appended to RUN/metrics.jsonl (rank 0 only);
- `on_validation_end(trainer, epoch, metrics, improved)`: after the dev validation of `epoch` and its `val`
  record; `trainer.state` already counts the epoch as finished (and its best, when `improved`);
- `on_fit_end(trainer, failed)`: however `fit` ends (an exception: `failed` is True).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from vsekit.data.batch import Batch
from vsekit.training.chance import ChanceAlarm
from vsekit.training.checkpointing import last_checkpoint_note, save_state, write_best
from vsekit.training.collapse import CollapseMonitor, TrainingCollapsed

if TYPE_CHECKING:
    from vsekit.training.trainer import Trainer

logger = logging.getLogger(__name__)


@dataclass
class StepEnd:
    """What one finished step hands its callbacks."""

    epoch: int  # counted from 0
    step: int  # index of the step in its epoch, from 0
    global_step: int  # steps trained so far, this one included
    steps_in_epoch: int
    batch: Batch
    batch_size: int  # samples of the global batch (all ranks)
    out: dict  # what the step returned: "loss" and the loss's scalars, on the device
    loss_warmup: bool
    data_time: float
    step_time: float


class Callback:
    """No-op hooks; a callback overrides the ones it needs (see the module docstring for when each runs)."""

    def on_fit_start(self, trainer: Trainer) -> None:
        return None

    def on_epoch_start(self, trainer: Trainer, epoch: int) -> None:
        return None

    def on_step_end(self, trainer: Trainer, s: StepEnd) -> None:
        return None

    def on_sync(self, trainer: Trainer, epoch: int) -> None:
        return None

    def on_record(self, trainer: Trainer, record: dict) -> None:
        return None

    def on_validation_end(self, trainer: Trainer, epoch: int, metrics: dict, improved: bool) -> None:
        return None

    def on_fit_end(self, trainer: Trainer, failed: bool) -> None:
        return None


def call_hook(callbacks: list[Callback], hook: str, *args: Any) -> None:
    """Call `hook` on each callback in order (the order is part of the run: records are written in it)."""
    for cb in callbacks:
        getattr(cb, hook)(*args)


class StepRecords(Callback):
    """Per-step scalars a loss wants recorded at every iteration (ADOPT's K), whatever train.log_every is: kept
    on the device and written, in step order, in one transfer per device at the next sync."""

    def __init__(self, keys: tuple[str, ...]) -> None:
        self.keys = keys
        self.pending: list[tuple[int, int, dict]] = []

    def on_step_end(self, trainer: Trainer, s: StepEnd) -> None:
        if self.keys:
            self.pending.append((s.epoch + 1, s.global_step, {k: s.out[k] for k in self.keys if k in s.out}))

    def on_sync(self, trainer: Trainer, epoch: int) -> None:
        if not self.pending:
            return
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for _, _, values in self.pending:
            for v in values.values():
                if torch.is_tensor(v):
                    by_device.setdefault(v.device, []).append(
                        v.detach().reshape(()).to(torch.float32 if v.device.type == "mps" else torch.float64)
                    )
        host = {dev: iter(torch.stack(vs).tolist()) for dev, vs in by_device.items()}
        pending, self.pending = self.pending, []
        for ep, step, values in pending:
            trainer.emit(
                {
                    "kind": "step",
                    "epoch": ep,
                    "step": step,
                    **{
                        k: next(host[v.device]) if torch.is_tensor(v) else float(v) for k, v in values.items()
                    },
                }
            )


class FiniteLoss(Callback):
    """The first non-finite loss, remembered on the device (no host sync per step) and raised at the next sync,
    naming the last good checkpoint."""

    def __init__(self) -> None:
        self.first_bad: torch.Tensor | None = None  # global step of the first non-finite loss, on the device

    def on_step_end(self, trainer: Trainer, s: StepEnd) -> None:
        loss = s.out["loss"]
        if self.first_bad is None:
            self.first_bad = torch.full((), -1, dtype=torch.long, device=loss.device)
        bad = (self.first_bad < 0) & ~torch.isfinite(loss)
        self.first_bad = torch.where(bad, s.global_step - 1, self.first_bad)

    def on_sync(self, trainer: Trainer, epoch: int) -> None:
        if self.first_bad is not None and int(self.first_bad) >= 0:
            raise FloatingPointError(
                f"loss became NaN/inf at step {int(self.first_bad)} (epoch {epoch + 1}); "
                f"{last_checkpoint_note(trainer.run_dir)}"
            )


class CollapseAlarm(Callback):
    """train.collapse_steps: counters on the device per step, read at each sync (training/collapse.py); warn
    once, or with train.stop_on_collapse save the state and stop."""

    def __init__(self, monitor: CollapseMonitor) -> None:
        self.monitor = monitor

    def on_step_end(self, trainer: Trainer, s: StepEnd) -> None:
        self.monitor.update(
            s.out,
            s.batch.image_index,
            s.batch_size,
            hardest=s.epoch >= trainer.recipe.loss.warmup_epochs,
            step=s.global_step,
            scale=(s.step + 1) / s.steps_in_epoch if s.loss_warmup else 1.0,
        )

    def on_sync(self, trainer: Trainer, epoch: int) -> None:
        report = self.monitor.poll()
        if report is None:
            return
        trainer.emit(
            {
                "kind": "collapse",
                "step": report.step,
                "loss": report.loss,
                "collapse_value": report.collapse_value,
                "spread": report.spread,
                "by_loss": report.by_loss,
                "by_spread": report.by_spread,
            }
        )
        if not trainer.recipe.train.stop_on_collapse:
            trainer.log(f"warning: {report.message()} (train.stop_on_collapse=true stops such a run)")
            return
        save_state(
            trainer
        )  # the state at this step: `vse train --resume` can continue it, e.g. with another lr
        raise TrainingCollapsed(
            f"{report.message()}. Stopped at step {trainer.state.global_step} "
            f"(train.stop_on_collapse=true); its state is saved in {trainer.run_dir}"
        )


class ChanceWarning(Callback):
    """train.chance_validations: dev retrieval no better than random scores, named once (training/chance.py)."""

    def __init__(self, alarm: ChanceAlarm) -> None:
        self.alarm = alarm

    def on_validation_end(self, trainer: Trainer, epoch: int, metrics: dict, improved: bool) -> None:
        chance = self.alarm.update(epoch + 1, metrics["rsum"])
        if not chance:
            return
        trainer.log(f"warning: {chance}")
        trainer.emit(
            {
                "kind": "chance",
                "epoch": epoch + 1,
                "step": trainer.state.global_step,
                "rsum": metrics["rsum"],
                "chance_rsum": self.alarm.mean,
                "chance_std": self.alarm.std,
            }
        )


class TrainLog(Callback):
    """The `train` record every train.log_every steps: means of the loss and timings since the last one."""

    def on_epoch_start(self, trainer: Trainer, epoch: int) -> None:
        self.meter = {"loss": 0.0, "data_time": 0.0, "step_time": 0.0, "n": 0}
        self.t_log = time.perf_counter()

    def on_step_end(self, trainer: Trainer, s: StepEnd) -> None:
        m, every = self.meter, trainer.recipe.train.log_every
        m["loss"] += s.out["loss"]
        m["data_time"] += s.data_time
        m["step_time"] += s.step_time
        m["n"] += 1
        if not every or s.global_step % every:
            return
        trainer.sync(s.epoch)
        n, wall = m["n"], time.perf_counter() - self.t_log
        rec = {
            "kind": "train",
            "epoch": s.epoch + 1,
            "step": s.global_step,
            "loss": float(m["loss"]) / n,
            "data_time": m["data_time"] / n,
            "step_time": m["step_time"] / n,
            "samples_per_s": trainer.recipe.train.batch_size * n / max(wall, 1e-9),
            "lr": trainer.optimizer.param_groups[0]["lr"],
            **{k: float(v) for k, v in s.out.items() if k != "loss"},
        }
        trainer.bar.set_postfix(loss=f"{rec['loss']:.3f}")
        trainer.emit(rec)
        if not trainer.progress:
            trainer.log(
                f"epoch {s.epoch + 1} step {s.global_step} loss {rec['loss']:.4f} "
                f"data {rec['data_time'] * 1e3:.1f}ms step {rec['step_time'] * 1e3:.1f}ms "
                f"{rec['samples_per_s']:.0f} samples/s"
            )
        self.on_epoch_start(trainer, s.epoch)


class Checkpointing(Callback):
    """The `last` checkpoint every train.checkpoint_every steps and after each epoch; `best` when dev improved."""

    def on_step_end(self, trainer: Trainer, s: StepEnd) -> None:
        every = trainer.recipe.train.checkpoint_every
        if every and s.global_step % every == 0:
            trainer.sync(s.epoch)
            save_state(trainer)

    def on_validation_end(self, trainer: Trainer, epoch: int, metrics: dict, improved: bool) -> None:
        if improved and trainer.dist.is_main:
            best = {"epoch": epoch + 1, "split": trainer.recipe.data.val_split, **metrics}
            write_best(
                trainer.run_dir, trainer.model, (json.dumps(best, indent=2) + "\n").encode("utf-8"), epoch
            )
        save_state(trainer)


def default_callbacks(trainer: Trainer) -> list[Callback]:
    """The built-in callbacks of a recipe, in the order their records have always been written."""
    r = trainer.recipe
    # on_sync runs them in this order: the step records, then the NaN check, then the collapse alarm
    cbs: list[Callback] = [StepRecords(tuple(trainer.loss_fn.step_log_keys)), FiniteLoss()]
    if r.train.collapse_steps:
        cbs.append(CollapseAlarm(CollapseMonitor(r.loss, r.train.collapse_steps)))
    cbs.append(TrainLog())
    if r.train.chance_validations:
        val = trainer.val_split
        cbs.append(ChanceWarning(ChanceAlarm(val.cap2img, val.n_images, r.train.chance_validations)))
    cbs.append(Checkpointing())
    return cbs
