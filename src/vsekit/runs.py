"""Run directories and checkpoints: weights in safetensors, everything else in JSON. Nothing is unpickled.

RUN_DIR/
  config.json            recipe + data spec + format version (what `vse eval`/`vse index` rebuild from)
  last.safetensors       model weights after the last completed epoch (or step checkpoint)
  last_optim.safetensors optimizer tensors;  last_state.json: epoch/step, schedule, RNG, history
  best.safetensors       weights with the best dev rsum (never selected on test); best.json its metrics
  metrics.jsonl          one JSON line per log interval / validation;  tb/  TensorBoard events
Every file is written atomically (temp + fsync + rename), so a crash leaves the previous good copy.

Checkpoint sets (`last`: weights + optimizer + state; `best`: weights + metrics) are written as versioned
files under ckpt/ and committed by `{tag}.manifest.json` (sizes and sha256 of each file), written last:
a SIGKILL at any moment leaves the previous set or the new one complete, never a mix of two steps. The
`{tag}.*` names above are hard links to the committed files (for tools that read them directly).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save

from vsekit.config import ConfigError, Recipe, check_model_size, recipe_from_dict, to_dict
from vsekit.data.text import read_vocab_json, vocab_words
from vsekit.errors import VseInputError
from vsekit.models.pair import ModelPair, build_model
from vsekit.models.vse import DataSpec, VSEModel
from vsekit.registry import MAX_WIDTH
from vsekit.utils.io import (
    atomic_write_bytes,
    atomic_write_json,
    sha256_file,
    storage_full_errno,
    storage_full_error,
)
from vsekit.utils.locks import LOCK_NAME, folder_lock
from vsekit.utils.safe_json import JsonBoundsError, read_json_file

RUN_FORMAT = "vsekit-run/1"
CHECKPOINT_FORMAT = "vsekit-checkpoint/1"


class CheckpointError(VseInputError):
    """A run directory or checkpoint file that cannot be loaded safely."""


def tensor_bytes(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> bytes:
    """A safetensors file's bytes (CPU copies), for `write_checkpoint_set`."""
    return save({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, metadata=metadata)


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise CheckpointError(f"{path}: missing")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(
            f"{path}: not a readable safetensors file ({e}); the file is corrupt or truncated"
        ) from e


def write_run_config(run_dir: Path, recipe: Recipe, spec: DataSpec, extra: dict[str, Any]) -> None:
    cfg = {
        "format": RUN_FORMAT,
        "recipe": to_dict(recipe),
        "data_spec": {
            "img_dim": spec.img_dim,
            "text_model_path": spec.text_model_path,
            **({"vision_config": spec.vision_config} if spec.vision_config else {}),
        },
        **extra,
    }
    if spec.vocab_words:  # before config.json, the file that makes the folder a run
        atomic_write_json(run_dir / "vocab.json", {"words": spec.vocab_words})
    atomic_write_json(run_dir / "config.json", cfg)


MAX_RUN_CONFIG_BYTES = 16 << 20  # a run's config.json: a recipe and a data spec, a few KB as vsekit writes it


def _read_config_json(path: Path) -> Any:
    """config.json within `MAX_RUN_CONFIG_BYTES` and JSON's bounds (`loads_bounded`: vsekit never writes NaN or
    infinity there, the recipe validator refuses them), or a CheckpointError naming the file."""
    try:
        return read_json_file(path, MAX_RUN_CONFIG_BYTES, "a run's config.json")
    except JsonBoundsError as e:
        raise CheckpointError(str(e)) from None


def _data_spec(spec_d: Any, path: Path) -> dict:
    """config.json's data_spec, each entry of the type it must have (img_dim an integer within MAX_WIDTH)."""
    if not isinstance(spec_d, dict):
        raise CheckpointError(f"{path}: data_spec must be an object")
    img_dim = spec_d.get("img_dim", 0)
    if isinstance(img_dim, bool) or not isinstance(img_dim, int) or not 0 <= img_dim <= MAX_WIDTH:
        raise CheckpointError(
            f"{path}: data_spec.img_dim={str(img_dim)[:40]}: must be an integer 0 .. {MAX_WIDTH:,}"
        )
    if not isinstance(spec_d.get("text_model_path", ""), str):
        raise CheckpointError(f"{path}: data_spec.text_model_path must be a string")
    if not isinstance(spec_d.get("vision_config", {}), dict):
        raise CheckpointError(f"{path}: data_spec.vision_config must be an object")
    return spec_d


def read_run_config(run_dir: str | Path) -> tuple[Recipe, DataSpec, dict]:
    """A run's recipe, data spec and config.json, each checked as a recipe from elsewhere is (bounded JSON, the
    recipe validator with its magnitudes, the parameter estimate with the run's feature width and vocabulary)
    before any model is built from them."""
    run_dir = Path(run_dir)
    path = run_dir / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{run_dir}: not a vsekit run directory (no config.json)")
    cfg = _read_config_json(path)
    if not isinstance(cfg, dict) or cfg.get("format") != RUN_FORMAT:
        raise CheckpointError(
            f"{path}: format {cfg.get('format') if isinstance(cfg, dict) else None!r}; this vsekit reads {RUN_FORMAT}"
        )
    try:
        recipe = recipe_from_dict(cfg["recipe"])
    except (ConfigError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path}: recipe does not fit this vsekit's schema: {e}") from e
    spec_d = _data_spec(cfg.get("data_spec", {}), path)
    vocab: list[str] = []
    vocab_path = run_dir / "vocab.json"
    if vocab_path.is_file():
        try:
            data = read_vocab_json(vocab_path)
            if not isinstance(data, dict) or "words" not in data:
                raise CheckpointError(
                    f"{vocab_path}: expected {{'words': [...]}}, the vocabulary vsekit writes"
                )
            vocab = vocab_words(data["words"], vocab_path)
        except CheckpointError:
            raise
        except VseInputError as e:
            raise CheckpointError(str(e)) from None
    try:
        check_model_size(recipe, spec_d.get("img_dim", 0), len(vocab), where=str(path))
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    text_path = spec_d.get("text_model_path", "")
    if text_path and not Path(text_path).is_absolute():  # imported runs carry their text model config inside
        text_path = str(run_dir / text_path)
    spec = DataSpec(
        img_dim=int(spec_d.get("img_dim", 0)),
        vocab_words=vocab,
        text_model_path=text_path,
        vision_config=dict(spec_d.get("vision_config", {})),
    )
    return recipe, spec, cfg


RUN_LOCK = LOCK_NAME
"""The run's writer lock (`run_writer_lock`): neither vsekit's nor anyone else's file, never cleared."""


@contextlib.contextmanager
def run_writer_lock(run_dir: str | Path, log: Callable[[str], None] = print) -> Iterator[Path]:
    """One writer per run: `vse train` (new or --resume) holds `RUN_DIR/.lock` for the whole run, so a second
    `vse train` of the same folder stops at once with one line naming the pid that writes it, before it reads
    or writes anything (two writers would train the same epochs side by side, each append to metrics.jsonl
    and delete the other's temporary checkpoint). The lock is `vsekit.utils.locks.folder_lock`'s, as
    `vse index` uses: dropped by the kernel when its holder dies, removed on every exit; a folder it
    created is removed again when nothing was written there."""
    with folder_lock(Path(run_dir), "vse train", "this run", CheckpointError, log, RUN_LOCK) as lock:
        yield lock


# A two-network (NCR / IN2R) run's splits: `prob_A`, `prob_B` per training pair and `weights_sha256`, the
# sha256 of the weights file (`tensor_bytes` of the model) that made them. The last split, and the split made
# from the best checkpoint's weights (the one an audit of `best` reads: the last is made from later weights).
SPLIT_STATE_FILE = "noisy_split.npz"
BEST_SPLIT_STATE_FILE = "noisy_split_best.npz"
SPLIT_WEIGHTS_KEY = "weights_sha256"  # in a split file: the sha256 of the weights that made the split

RUN_ARTIFACTS = frozenset(
    {
        SPLIT_STATE_FILE,
        BEST_SPLIT_STATE_FILE,
        "config.json",
        "vocab.json",
        "metrics.jsonl",
        "tb",
        "ckpt",
        "text_model",
        "last.safetensors",
        "last_optim.safetensors",
        "last_state.json",
        "last.manifest.json",
        "best.safetensors",
        "best.json",
        "best.manifest.json",
    }
)
"""What vsekit itself writes in a run directory (`text_model/`: imported runs); `.*.tmp` are its temp files."""


def is_run_dir(path: str | Path) -> bool:
    """True when `path` holds a vsekit run: a config.json of this format (not any folder with a config.json)."""
    cfg = Path(path) / "config.json"
    try:
        return cfg.is_file() and _read_config_json(cfg).get("format") == RUN_FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def split_run_dir(run_dir: str | Path) -> tuple[list[Path], list[Path]]:
    """The entries of `run_dir`: (written by vsekit, anything else). A config.json is vsekit's only when it is
    a run's (a model folder has one too)."""
    ours, others = [], []
    run = is_run_dir(run_dir)
    for p in sorted(Path(run_dir).iterdir()):
        if p.name == RUN_LOCK:  # held by this run's writer (`run_writer_lock`): never cleared, never "other"
            continue
        mine = p.name in RUN_ARTIFACTS or (p.name.startswith(".") and p.name.endswith(".tmp"))
        mine = mine and (run or p.name != "config.json")
        (ours if mine else others).append(p)
    return ours, others


def clear_run_dir(run_dir: str | Path) -> list[Path]:
    """Delete what a previous run wrote in `run_dir` (TensorBoard events and checkpoint sets included); files
    vsekit did not write are kept and returned. Only call it on a run directory (or a fresh one)."""
    import shutil

    ours, others = split_run_dir(run_dir)
    for p in ours:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink(missing_ok=True)
    return others


def update_run_recipe(run_dir: str | Path, changes: dict[str, Any]) -> None:
    """Record recipe values a resumed run was given (`--epochs`, a new lr schedule) in its config.json, so a
    later `--resume` keeps them. `changes` maps dotted keys (``train.epochs``) to their new values."""
    path = Path(run_dir) / "config.json"
    cfg = json.loads(path.read_text(encoding="utf-8"))
    for key, value in changes.items():
        *parents, leaf = key.split(".")
        node = cfg["recipe"]
        for part in parents:
            node = node[part]
        node[leaf] = value
    atomic_write_json(path, cfg)


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
            parts.append(
                f"wrong shape for {len(wrong)} (e.g. {k}: file {tuple(state[k].shape)} vs model {tuple(own[k].shape)})"
            )
        raise CheckpointError(f"{path}: weights do not fit the model: {'; '.join(parts)}")
    model.load_state_dict(state, strict=True)


def checkpoint_tag(run_dir: str | Path, which: str) -> str:
    """The checkpoint set `which` (best | last) names in a run: best falls back to last while the run has no best
    one (no best.safetensors and no best.manifest.json: no dev evaluation finished yet)."""
    run_dir = Path(run_dir)
    if (
        which == "best"
        and not (run_dir / "best.safetensors").is_file()
        and not _manifest_path(run_dir, "best").is_file()
    ):
        return "last"
    return which


def weights_path(run_dir: str | Path, which: str = "best") -> Path:
    """The weights file of a run's `which` checkpoint: `{tag}.safetensors` of `checkpoint_tag` (what `load_run`
    loads, after checking it against the set's manifest, and what an index's model fingerprint hashes)."""
    return Path(run_dir) / f"{checkpoint_tag(run_dir, which)}.safetensors"


def loaded_weights_file(run_dir: str | Path, which: str = "best") -> Path:
    """The weights file `load_run` reads for `which`: the committed set's, checked against its manifest's
    sha256 (a CheckpointError naming a corrupt or missing one), else `{tag}.safetensors`."""
    run_dir = Path(run_dir)
    tag = checkpoint_tag(run_dir, which)
    verified = read_checkpoint_set(run_dir, tag, (".safetensors",))
    return verified[".safetensors"] if verified else weights_path(run_dir, tag)


def load_run(
    run_dir: str | Path, which: str = "best", device: str | torch.device = "cpu", member: str | None = None
) -> tuple[VSEModel, dict]:
    """Rebuild a trained model from its run directory (`which` = best | last). A two-network run is the pair
    (`vsekit.models.pair`); `member` "A" / "B" is one of its networks alone (a `VseInputError` for a run of
    one network)."""
    run_dir = Path(run_dir)
    recipe, spec, cfg = read_run_config(run_dir)
    weights = loaded_weights_file(run_dir, which)
    model = build_model(recipe, spec)  # a two-network run: the pair (vsekit.models.pair)
    if member is not None and not isinstance(model, ModelPair):
        raise VseInputError(
            f"{run_dir}: trains one network; --member {member} applies to a two-network run "
            "(train.sample_policy.name=ncr)"
        )
    load_weights(model, weights)
    if member is not None:
        model = model.member(member)
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


def optimizer_from_files(
    optimizer: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict
) -> None:
    state: dict[int, dict] = {}
    for key, value in tensors.items():
        pid, name = key.split(".", 1)
        state.setdefault(int(pid), {})[name] = value
    for pid, st in meta.get("scalars", {}).items():
        state.setdefault(int(pid), {}).update(st)
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})


# ------------------------------------------------------------------------------ checkpoint sets


def _same(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _manifest_path(run_dir: Path, tag: str) -> Path:
    return run_dir / f"{tag}.manifest.json"


def _publish(run_dir: Path, versioned: Path, name: str) -> None:
    """Point `run_dir/name` at a committed file atomically (hard link + rename; a copy where links fail)."""
    target = run_dir / name
    tmp = run_dir / f".{name}.link.tmp"
    tmp.unlink(missing_ok=True)
    try:
        os.link(versioned, tmp)
        os.replace(tmp, target)
    except OSError:
        tmp.unlink(missing_ok=True)
        atomic_write_bytes(target, versioned.read_bytes())


def write_checkpoint_set(
    run_dir: Path, tag: str, parts: dict[str, bytes], info: dict[str, Any] | None = None
) -> Path:
    """Write one consistent set of files (`parts`: name suffix -> bytes, e.g. ".safetensors") and commit it.

    Order: every versioned file (atomic each), then the manifest with their sha256 (the commit point), then
    the `{tag}{suffix}` links, then the files of older sets are removed. Returns the manifest's path.
    """
    run_dir = Path(run_dir)
    manifest = _manifest_path(run_dir, tag)
    seq = 0
    if manifest.is_file():
        try:
            seq = int(json.loads(manifest.read_text(encoding="utf-8")).get("seq", 0)) + 1
        except (OSError, ValueError, AttributeError):
            seq = 0
    ckpt = run_dir / "ckpt"
    files = {}
    try:
        for suffix, data in parts.items():
            rel = f"ckpt/{tag}-{seq:06d}{suffix}"
            files[suffix] = {"path": rel, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
            atomic_write_bytes(run_dir / rel, data)
        atomic_write_json(
            manifest, {"format": CHECKPOINT_FORMAT, "tag": tag, "seq": seq, **(info or {}), "files": files}
        )
    except BaseException as e:  # not committed: the previous set stays the run's; this one's files go
        for f in files.values():
            with contextlib.suppress(OSError):
                (run_dir / f["path"]).unlink(missing_ok=True)
        if storage_full_errno(e) is None:
            raise
        kept = (
            f"the run keeps its previous {tag} checkpoint ({manifest.name})"
            if manifest.is_file()
            else f"no {tag} checkpoint was saved"
        )
        raise storage_full_error(manifest, e, kept) from e
    for suffix, f in files.items():
        _publish(run_dir, run_dir / f["path"], f"{tag}{suffix}")
    keep = {Path(f["path"]).name for f in files.values()}
    for old in [
        *ckpt.glob(f"{tag}-*"),
        *ckpt.glob(f".{tag}-*.tmp"),
    ]:  # older sets, temp files of killed writes
        if old.name not in keep:
            old.unlink(missing_ok=True)
    return manifest


def committed_sha256(run_dir: str | Path, tag: str, suffix: str = ".safetensors") -> str | None:
    """The sha256 the last committed `tag` set's manifest records for its `suffix` file (not re-hashed), or
    None when the run has no readable manifest for it."""
    try:
        meta = json.loads(_manifest_path(Path(run_dir), tag).read_text(encoding="utf-8"))
        digest = meta["files"][suffix]["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return digest if isinstance(digest, str) else None


def read_checkpoint_set(run_dir: Path, tag: str, suffixes: tuple[str, ...]) -> dict[str, Path] | None:
    """The verified files of the last committed `tag` set (suffix -> path), or None when there is none.

    Every file is checked against the manifest's size and sha256; a mismatch is a CheckpointError that names
    the file (nothing is loaded from it). Runs written before manifests existed are read from `{tag}{suffix}`.
    """
    run_dir = Path(run_dir)
    manifest = _manifest_path(run_dir, tag)
    if not manifest.is_file():
        legacy = {s: run_dir / f"{tag}{s}" for s in suffixes}
        return legacy if all(p.is_file() for p in legacy.values()) else None
    try:
        meta = json.loads(manifest.read_text(encoding="utf-8"))
        files = meta["files"]
        if meta.get("format") != CHECKPOINT_FORMAT:
            raise CheckpointError(
                f"{manifest}: format {meta.get('format')!r}; this vsekit reads {CHECKPOINT_FORMAT}"
            )
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        if isinstance(e, CheckpointError):
            raise
        raise CheckpointError(f"{manifest}: not a readable checkpoint manifest ({e!r})") from e
    out = {}
    for suffix in suffixes:
        entry = files.get(suffix) if isinstance(files, dict) else None
        if not isinstance(entry, dict) or not isinstance(entry.get("path"), str):
            raise CheckpointError(f"{manifest}: lists no {tag}{suffix} file")
        path = (run_dir / entry["path"]).resolve()
        if not path.is_relative_to(run_dir.resolve()):
            raise CheckpointError(f"{manifest}: file {entry['path']!r} lies outside the run directory")
        if not path.is_file():
            raise CheckpointError(
                f"{path}: missing; {manifest.name} (written last) lists it, so it was deleted afterwards"
            )
        if path.stat().st_size != entry.get("bytes") or sha256_file(path) != entry.get("sha256"):
            raise CheckpointError(
                f"{path}: size or sha256 differs from {manifest.name}; the file is corrupt or truncated, or was "
                f"changed after it was saved (nothing was loaded from it)"
            )
        out[suffix] = path
    ckpt_files = [p for p in (run_dir / "ckpt").glob(f"{tag}-*") if p.is_file()]
    for suffix, path in list(out.items()):
        named = run_dir / f"{tag}{suffix}"
        if not named.is_file() or any(_same(named, p) for p in ckpt_files):
            continue  # a link to the committed set, or to an older one left by a crash before publishing
        digest = sha256_file(named)
        older = {sha256_file(p) for p in ckpt_files if p.name.endswith(suffix) and p != path}
        if digest != files[suffix].get("sha256") and digest not in older:
            # not a link to any set (a copied run directory, or weights the user put there on purpose) and not
            # the committed bytes: the user's file wins, it is what they see and expect to be used
            out[suffix] = named
    for suffix, path in out.items():  # the convenience names follow the committed set
        if path.parent == run_dir:
            continue
        try:
            if not (run_dir / f"{tag}{suffix}").is_file() or not os.path.samefile(
                path, run_dir / f"{tag}{suffix}"
            ):
                _publish(run_dir, path, f"{tag}{suffix}")
        except OSError:
            pass  # a read-only run directory (e.g. shared): the verified files are used directly
    return out
