"""The trainer's checkpoints: the `last` set (weights, optimizer, RNG, loss state, train state, history) that
`--resume` continues bit-exactly from, the `best` set, and what a resume checks and repairs in the run folder.

Every set is committed as one unit (`vsekit.runs.write_checkpoint_set`: manifest with sha256 written last), so a
kill never mixes two steps; metrics.jsonl is cut back to the size it had at the checkpoint (its later lines are
replayed).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from vsekit.runs import (
    CheckpointError,
    load_tensors,
    load_weights,
    optimizer_from_files,
    optimizer_to_files,
    read_checkpoint_set,
    tensor_bytes,
    update_run_recipe,
    write_checkpoint_set,
)
from vsekit.training.schedule import TrainState

if TYPE_CHECKING:
    from vsekit.training.trainer import Trainer

LOSS_STATE = "__loss__."  # prefix of the loss's own state in the `last` checkpoint's optimizer file


def save_state(trainer: Trainer, tag: str = "last") -> None:
    """Write the run's resumable state (rank 0 only)."""
    if not trainer.dist.is_main:
        return
    tensors, meta = optimizer_to_files(trainer.optimizer)
    tensors["__torch_rng__"] = torch.get_rng_state()
    # a loss's own parameters and buffers (HREM's graph layer and call counter) resume with the optimizer
    tensors.update({LOSS_STATE + k: v for k, v in trainer.loss_fn.state_dict().items()})
    tensors.update(trainer.policy.state_tensors())  # the epoch plan's arrays (training/sample_policy.py)
    metrics = trainer.run_dir / "metrics.jsonl"
    state = {
        "sample_policy": trainer.policy.state_json(),
        "train_state": trainer.state.__dict__,
        "optimizer": meta,
        "history": trainer.history,
        "metrics_bytes": metrics.stat().st_size if metrics.is_file() else 0,
    }
    write_checkpoint_set(
        trainer.run_dir,
        tag,
        {
            ".safetensors": tensor_bytes(trainer.model.state_dict()),
            "_optim.safetensors": tensor_bytes(tensors),
            "_state.json": (json.dumps(state, indent=2) + "\n").encode("utf-8"),
        },
        {
            "epoch": trainer.state.epoch,
            "step_in_epoch": trainer.state.step_in_epoch,
            "global_step": trainer.state.global_step,
        },
    )


def write_best(run_dir: Path, model: torch.nn.Module, best_json: bytes, epoch: int) -> None:
    """The best-on-dev weights and their dev metrics (best.json), one committed set."""
    write_checkpoint_set(
        run_dir,
        "best",
        {".safetensors": tensor_bytes(model.state_dict()), ".json": best_json},
        {"epoch": epoch},
    )


def load_state(trainer: Trainer) -> None:
    """`--resume`: read the `last` set into the trainer (or start over when none was committed yet)."""
    run_dir = trainer.run_dir
    files = read_checkpoint_set(run_dir, "last", (".safetensors", "_optim.safetensors", "_state.json"))
    if files is None:  # killed before the first checkpoint: start over (same seed, same result)
        truncate_metrics(trainer, 0)
        record_epochs(trainer)
        trainer.log(f"{run_dir}: no complete checkpoint yet; training from the start")
        return
    load_weights(trainer.model, files[".safetensors"])
    tensors = load_tensors(files["_optim.safetensors"])
    rng = tensors.pop("__torch_rng__", None)
    trainer.loss_fn.load_state_dict(
        {k[len(LOSS_STATE) :]: tensors.pop(k) for k in list(tensors) if k.startswith(LOSS_STATE)}
    )
    path = files["_state.json"]
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: cannot read training state ({e})") from e
    trainer.policy.load(tensors, saved.get("sample_policy"), str(path))  # the plan, its digest checked
    optimizer_from_files(trainer.optimizer, tensors, saved["optimizer"])
    if rng is not None:
        torch.set_rng_state(rng)
    trainer.state = TrainState(**saved["train_state"])
    check_resume_epochs(run_dir, trainer.state, trainer.recipe.train.epochs)  # before the folder changes
    trainer.history = saved.get("history", [])
    truncate_metrics(trainer, saved.get("metrics_bytes"))
    record_epochs(trainer)
    st, total = trainer.state, trainer.recipe.train.epochs
    if st.step_in_epoch:
        trainer.log(f"resumed {run_dir} in epoch {st.epoch + 1}/{total}, after its step {st.step_in_epoch}")
    elif st.epoch < total:
        trainer.log(f"resumed {run_dir} after epoch {st.epoch}/{total}")
    else:
        trainer.log(
            f"resumed {run_dir}: all {total} epochs are trained, nothing to do "
            f"(`vse train --resume {run_dir} --epochs N` trains it on to N epochs)"
        )


def check_resume_epochs(run_dir: Path, st: TrainState, want: int) -> None:
    """A resumed run may be given more epochs (or fewer, down to the epoch it is in), never fewer than it has."""
    needed = st.epoch + (1 if st.step_in_epoch else 0)
    if want < needed:
        done = f"{st.epoch} epoch(s)" + (
            f" and {st.step_in_epoch} steps of epoch {st.epoch + 1}" if st.step_in_epoch else ""
        )
        raise CheckpointError(
            f"{run_dir}: has already trained {done}; train.epochs (--epochs) {want} is "
            f"fewer: give --epochs {needed} or more"
        )


def record_epochs(trainer: Trainer) -> None:
    """A resumed run given another train.epochs or lr schedule (`--epochs`, `--set optim.lr_decay…`):
    config.json records the new values, so a later --resume keeps them."""
    saved = trainer.saved_cfg.get("recipe", {})
    o = trainer.recipe.optim
    now = {
        "train.epochs": trainer.recipe.train.epochs,
        "optim.lr_decay_epochs": list(o.lr_decay_epochs),
        "optim.lr_decay": o.lr_decay,
    }
    changes = {}
    for key, value in now.items():
        section, leaf = key.split(".")
        before = saved.get(section, {}).get(leaf)
        if before is not None and before != value:
            changes[key] = (before, value)
    if not changes:
        return
    if trainer.dist.is_main:
        update_run_recipe(trainer.run_dir, {k: v for k, (_, v) in changes.items()})
    said = "; ".join(f"{k} {b} -> {v}" for k, (b, v) in changes.items())
    if "optim.lr_decay_epochs" in changes or "optim.lr_decay" in changes:
        trainer.log(f"{trainer.run_dir}: {said}")
    else:
        trainer.log(
            f"{trainer.run_dir}: {said}; the lr schedule is unchanged "
            f"(optim.lr_decay_epochs={o.lr_decay_epochs}, optim.lr_decay={o.lr_decay})"
        )


def truncate_metrics(trainer: Trainer, size: int | None) -> None:
    """Drop metrics.jsonl lines written after the checkpoint (they are replayed), torn last line included."""
    path = trainer.run_dir / "metrics.jsonl"
    if size is not None and trainer.dist.is_main and path.is_file() and path.stat().st_size > size:
        os.truncate(path, size)


def last_checkpoint_note(run_dir: Path) -> str:
    """Where the last good weights are: only a checkpoint that was committed is named."""
    if (run_dir / "last.manifest.json").is_file() or (run_dir / "last.safetensors").is_file():
        return (
            f"last good checkpoint: {run_dir / 'last.safetensors'} (`vse train --resume {run_dir}` "
            "continues from it)"
        )
    return (
        f"no checkpoint was saved before it ({run_dir} holds no weights); check the recipe's values "
        "(learning rate, margins, temperatures) and start the run again"
    )
