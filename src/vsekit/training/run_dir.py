"""The run folder as the trainer finds and starts it: checked before anything is written (`prepare_run_dir`),
created only once the run's setup has succeeded (`start_run_dir`), so an error or Ctrl-C before that point
leaves it as it was."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from vsekit.data.manifest import ManifestError, read_manifest
from vsekit.distributed import DistContext, barrier
from vsekit.runs import CheckpointError, clear_run_dir, is_run_dir, split_run_dir


def prepare_run_dir(run: Path, resume: bool, overwrite: bool, dist: DistContext) -> None:
    """Check the run directory; nothing is changed here (see `start_run_dir`)."""
    if run.exists() and not run.is_dir():
        raise CheckpointError(f"{run}: exists and is not a folder; choose another --out")
    if resume:
        if not (run / "config.json").exists():
            raise CheckpointError(f"{run}: nothing to resume (no config.json)")
    elif is_run_dir(run):
        if not overwrite:
            raise CheckpointError(
                f"{run} already holds a run; resume it with `vse train --resume {run}`, "
                "choose another --out, or pass --overwrite"
            )
    elif run.is_dir():
        _, others = split_run_dir(run)  # only vsekit's own files: a run whose setup was interrupted
        if others:
            names = ", ".join(p.name for p in others[:3]) + (", …" if len(others) > 3 else "")
            raise CheckpointError(
                f"{run}: exists, is not empty and is not a vsekit run (it holds {names}); nothing was written "
                "there: choose a new or empty --out"
            )
    barrier(dist)  # every rank has checked the directory before rank 0 changes it


def start_run_dir(run: Path, log: Callable[[str], None]) -> None:
    """A new run: clear what an earlier run (`--overwrite`) or an interrupted setup left, then create."""
    if run.is_dir():
        kept = clear_run_dir(run)
        if kept:
            log(
                f"note: {run}: kept {len(kept)} file(s) vsekit did not write: "
                f"{', '.join(p.name for p in kept[:5])}{', …' if len(kept) > 5 else ''}"
            )
    run.mkdir(parents=True, exist_ok=True)


def dataset_manifest(data_dir: Path, log: Callable[[str], None]) -> dict:
    """The dataset's manifest for config.json; an unreadable one is a warning, not a failed run."""
    try:
        return read_manifest(data_dir)
    except ManifestError as e:
        log(f"warning: {e}; ignored")
        return {}


def vocabulary_mismatch(
    run: Path, data_dir: Path, train_split: str, saved: list[str], built: list[str], recorded: str | None
) -> CheckpointError:
    """`--resume` with a dataset whose training captions give another vocabulary than the run's: the word
    embeddings would not fit (or, of the same size, mean other words), so say so before loading weights."""
    captions = f"in its {train_split} captions"
    if len(saved) != len(built):
        how = f"another vocabulary ({len(saved):,} words) than {data_dir} ({len(built):,} words {captions})"
    else:
        differ = sum(a != b for a, b in zip(saved, built))
        how = (
            f"another vocabulary than {data_dir}: the same size ({len(saved):,} words) but {differ:,} "
            f"of them differ {captions}"
        )
    hint = (
        f"resume it on the data it was trained on ({recorded})" if recorded else "resume it on its own data"
    )
    return CheckpointError(f"{run}: this run was trained on {how}; {hint}, or start a new run with --out")
