"""Where the trainer's records go besides metrics.jsonl: TensorBoard (always, when installed) and
`vse train --report-to wandb`. Each reporter is a trainer callback (`on_record`, `on_fit_end`).

The trainer writes one record per log interval (`kind` train), per iteration for losses that ask for it
(`kind` step, e.g. ADOPT's K) and per validation (`kind` val) to RUN/metrics.jsonl, and the same numbers to
TensorBoard as `{kind}/{key}` at the record's global step. A `WandbReporter` logs exactly those scalars
under the same names and steps to a Weights & Biases run.

Modes (decided here, documented in docs/training.md):
- `wandb`: online when W&B credentials are found (`WANDB_API_KEY`, or a `wandb login` entry in ~/.netrc)
  or `WANDB_MODE` is set (then wandb's own rule applies); otherwise offline, with a note saying how to
  upload later (`wandb sync`). A run never fails or hangs for want of a network or an account.
- `wandb-offline`: always offline (no network at all); `wandb sync RUN/wandb/offline-run-*` uploads it.
The wandb folder is `WANDB_DIR` when set, else the run folder (RUN/wandb/); `WANDB_PROJECT` names the
project (default `vsekit`), the wandb run is named after the run folder.
"""

from __future__ import annotations

import importlib.util
import logging
import netrc
import os
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from vsekit.errors import MissingPackageError, VseInputError
from vsekit.training.callbacks import Callback

logger = logging.getLogger(__name__)

REPORT_TARGETS = ("wandb", "wandb-offline")
WANDB_HINT = "pip install wandb"


def check_report_to(targets: list[str] | tuple[str, ...] | None) -> tuple[str, ...]:
    """Validate `--report-to` values before any work: known names, at most one wandb mode, and the package
    installed (a clear MissingPackageError naming `pip install wandb` otherwise)."""
    chosen = tuple(dict.fromkeys(targets or ()))
    unknown = [t for t in chosen if t not in REPORT_TARGETS]
    if unknown:
        raise VseInputError(f"--report-to {unknown[0]}: choose one of {', '.join(REPORT_TARGETS)}")
    if len(chosen) > 1:
        raise VseInputError("--report-to: give wandb or wandb-offline, not both")
    if chosen and importlib.util.find_spec("wandb") is None:
        raise MissingPackageError(f"--report-to {chosen[0]} needs the wandb package: {WANDB_HINT}")
    return chosen


def wandb_credentials_found() -> bool:
    """True when wandb could log in without asking: an API key in the environment or a ~/.netrc entry for
    the W&B host (what `wandb login` writes)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname or "api.wandb.ai"
    try:
        return netrc.netrc().authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def wandb_mode(target: str) -> str | None:
    """The `mode` to pass to `wandb.init`: offline for `wandb-offline` or when no credentials are found,
    None (wandb decides: online, or `WANDB_MODE`) otherwise."""
    if target == "wandb-offline":
        return "offline"
    if os.environ.get("WANDB_MODE") or wandb_credentials_found():
        return None
    return "offline"


def scalars(record: dict) -> dict[str, float]:
    """The numbers of one trainer record under TensorBoard's names (`{kind}/{key}`), step and epoch aside."""
    kind = record.get("kind", "train")
    return {
        f"{kind}/{k}": v
        for k, v in record.items()
        if isinstance(v, (int, float)) and k not in ("step", "epoch")
    }


class TensorBoardReporter(Callback):
    """The records as TensorBoard scalars under RUN/tb; the writer is made at the first record, and a missing
    tensorboard package leaves the records in metrics.jsonl only."""

    def __init__(self, run_dir: str | Path) -> None:
        self.folder = Path(run_dir) / "tb"
        self.writer: Any = None  # None: not tried yet; False: tensorboard is not installed

    def on_record(self, trainer: Any, record: dict) -> None:
        if self.writer is None:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(str(self.folder))
                logger.debug("TensorBoard scalars go to %s", self.folder)
            except ImportError:
                self.writer = False
                logger.debug("tensorboard is not installed; the records are in metrics.jsonl only")
        if self.writer:
            step = record.get("step", 0)
            for k, v in scalars(record).items():
                self.writer.add_scalar(k, v, step)

    def flush(self) -> None:
        if self.writer:
            self.writer.flush()

    def on_fit_end(self, trainer: Any, failed: bool) -> None:
        self.flush()


class WandbReporter(Callback):
    """One W&B run fed with the trainer's records; started lazily at the first record."""

    def __init__(self, target: str, run_dir: str | Path, config: dict[str, Any]) -> None:
        self.target = target
        self.run_dir = Path(run_dir)
        self.config = config
        self.run = None

    def start(self) -> None:
        import wandb

        mode = wandb_mode(self.target)
        folder = Path(os.environ.get("WANDB_DIR") or self.run_dir)
        folder.mkdir(parents=True, exist_ok=True)
        # create_new (wandb >= 0.19.10): one W&B run per Trainer, whatever else the process has started
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or "vsekit",
            name=self.run_dir.name,
            dir=str(folder),
            config=self.config,
            mode=mode,
            reinit="create_new",
        )
        if getattr(self.run, "offline", mode == "offline"):
            if self.target == "wandb-offline":
                why = "--report-to wandb-offline"
            elif mode == "offline":
                why = "no W&B credentials found"
            else:
                why = f"WANDB_MODE={os.environ.get('WANDB_MODE', '')}"
            where = Path(self.run.dir).parent  # .../wandb/offline-run-*/files -> the run's folder
            logger.info(
                "wandb: offline run (%s) in %s; upload it later with: wandb sync %s", why, where, where
            )
        else:
            logger.info("wandb: logging to %s", getattr(self.run, "url", None) or "the W&B server")

    def log(self, record: dict) -> None:
        """Log one metrics.jsonl record at its global step (wandb merges records of the same step)."""
        if self.run is None:
            self.start()
        values = scalars(record)
        if "epoch" in record:
            values["epoch"] = record["epoch"]
        self.run.log(values, step=int(record.get("step", 0)))

    def finish(self, exit_code: int = 0) -> None:
        if self.run is not None:
            self.run.finish(exit_code=exit_code)
            self.run = None

    def on_record(self, trainer: Any, record: dict) -> None:
        self.log(record)

    def on_fit_end(self, trainer: Any, failed: bool) -> None:
        self.finish(exit_code=int(failed))  # a W&B run is closed however training ends (1: it failed)


def make_reporters(targets: tuple[str, ...], run_dir: str | Path, config: dict[str, Any]) -> list[Callback]:
    """TensorBoard, then the reporters of validated `--report-to` targets (see `check_report_to`)."""
    return [TensorBoardReporter(run_dir)] + [
        WandbReporter(t, run_dir, config) for t in targets if t in REPORT_TARGETS
    ]
