"""Run directories and checkpoints: weights in safetensors, everything else in JSON. Nothing is unpickled.

RUN_DIR/
  config.json            recipe + data spec + format version (what `vse eval`/`vse index` rebuild from)
  last.safetensors       model weights after the last completed epoch (or step checkpoint)
  last_optim.safetensors optimizer tensors;  last_state.json: epoch/step, schedule, RNG, history
  best.safetensors       weights with the best dev rsum (never selected on test); best.json its metrics
  metrics.jsonl          one JSON line per log interval / validation;  tb/  TensorBoard events
Every file is written atomically (temp + fsync + rename), so a crash leaves the previous good copy.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save

from vsekit.config import ConfigError, Recipe, recipe_from_dict, to_dict
from vsekit.models.vse import DataSpec, VSEModel
from vsekit.utils.io import atomic_write_bytes, atomic_write_json

RUN_FORMAT = "vsekit-run/1"


class CheckpointError(ValueError):
    """A run directory or checkpoint file that cannot be loaded safely."""


def save_tensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    data = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    atomic_write_bytes(path, save(data, metadata=metadata))


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise CheckpointError(f"{path}: missing")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path}: not a readable safetensors file ({e}); the file is corrupt or truncated") from e


def write_run_config(run_dir: Path, recipe: Recipe, spec: DataSpec, extra: dict[str, Any]) -> None:
    cfg = {
        "format": RUN_FORMAT,
        "recipe": to_dict(recipe),
        "data_spec": {"img_dim": spec.img_dim, "text_model_path": spec.text_model_path},
        **extra,
    }
    atomic_write_json(run_dir / "config.json", cfg)
    if spec.vocab_words:
        atomic_write_json(run_dir / "vocab.json", {"words": spec.vocab_words})


def read_run_config(run_dir: Path) -> tuple[Recipe, DataSpec, dict]:
    path = run_dir / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{run_dir}: not a vsekit run directory (no config.json)")
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(cfg, dict) or cfg.get("format") != RUN_FORMAT:
        raise CheckpointError(f"{path}: format {cfg.get('format') if isinstance(cfg, dict) else None!r}; this vsekit reads {RUN_FORMAT}")
    try:
        recipe = recipe_from_dict(cfg["recipe"])
    except (ConfigError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path}: recipe does not fit this vsekit's schema: {e}") from e
    spec_d = cfg.get("data_spec", {})
    vocab: list[str] = []
    vocab_path = run_dir / "vocab.json"
    if vocab_path.is_file():
        vocab = json.loads(vocab_path.read_text(encoding="utf-8"))["words"]
    spec = DataSpec(img_dim=int(spec_d.get("img_dim", 0)), vocab_words=vocab, text_model_path=spec_d.get("text_model_path", ""))
    return recipe, spec, cfg


def load_weights(model: torch.nn.Module, path: Path) -> None:
    """Strict load: every key present, every shape equal; mismatches are listed, never ignored."""
    state = load_tensors(path)
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    wrong = sorted(k for k in set(own) & set(state) if own[k].shape != state[k].shape)
    if missing or unexpected or wrong:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} (e.g. {missing[0]})")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)} (e.g. {unexpected[0]})")
        if wrong:
            k = wrong[0]
            parts.append(f"wrong shape for {len(wrong)} (e.g. {k}: file {tuple(state[k].shape)} vs model {tuple(own[k].shape)})")
        raise CheckpointError(f"{path}: weights do not fit the model: {'; '.join(parts)}")
    model.load_state_dict(state, strict=True)


def load_run(run_dir: str | Path, which: str = "best", device: str | torch.device = "cpu") -> tuple[VSEModel, dict]:
    """Rebuild a trained model from its run directory (`which` = best | last)."""
    run_dir = Path(run_dir)
    recipe, spec, cfg = read_run_config(run_dir)
    weights = run_dir / f"{which}.safetensors"
    if not weights.is_file() and which == "best":
        weights = run_dir / "last.safetensors"
    model = VSEModel(recipe, spec)
    load_weights(model, weights)
    return model.to(device).eval(), cfg


def optimizer_to_files(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    sd = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict] = {}
    for pid, st in sd["state"].items():
        for name, value in st.items():
            if torch.is_tensor(value):
                tensors[f"{pid}.{name}"] = value
            else:
                scalars.setdefault(str(pid), {})[name] = value
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def optimizer_from_files(optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    state: dict[int, dict] = {}
    for key, value in tensors.items():
        pid, name = key.split(".", 1)
        state.setdefault(int(pid), {})[name] = value
    for pid, st in meta.get("scalars", {}).items():
        state.setdefault(int(pid), {}).update(st)
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
