"""The trainer: builds the parts a recipe names, trains with AdamW + step decay, validates on dev every
epoch (never on test), keeps the best-on-dev weights, and resumes bit-exactly.

Determinism: the data order of epoch e is a permutation drawn from (seed, e); the augmentation of batch
`step` from (seed, e, step) when the batches are made on the device, from (seed, e, index) per sample with the
DataLoader (`vsekit.training.data_path`); in-model randomness (grid size augmentation) from (seed, e, step).
A resumed run therefore replays exactly the batches an uninterrupted run would have seen.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from vsekit.config import Recipe, to_dict
from vsekit.data.batch import Batch
from vsekit.data.datasets import FeatureSource
from vsekit.data.manifest import ManifestError, manifest_extractor, read_manifest
from vsekit.data.precomp import DataFormatError, load_precomp_split
from vsekit.data.raw_images import PixelSource
from vsekit.data.text import HFTextProcessor, Vocabulary
from vsekit.distributed import (
    barrier,
    broadcast_module,
    convert_batchnorm,
    init_from_env,
    main_first,
    rank_device,
    shard_sizes,
    writes_run_files,
)
from vsekit.evaluation import pad_id_for, split_similarities
from vsekit.features.backbones import pixel_transform_of
from vsekit.losses import create_loss
from vsekit.metrics import evaluate_sims, format_table
from vsekit.models.image import BackboneImageEncoder
from vsekit.models.text import default_transformer_path, load_tokenizer
from vsekit.models.vse import DataSpec, VSEModel
from vsekit.registry import has_fact
from vsekit.runs import (
    CheckpointError,
    clear_run_dir,
    is_run_dir,
    load_tensors,
    load_weights,
    optimizer_from_files,
    optimizer_to_files,
    read_checkpoint_set,
    read_run_config,
    run_writer_lock,
    split_run_dir,
    tensor_bytes,
    update_run_recipe,
    write_checkpoint_set,
    write_run_config,
)
from vsekit.training.advice import small_data_advice  # noqa: F401 (imported from here too)
from vsekit.training.chance import ChanceAlarm
from vsekit.training.collapse import CollapseMonitor, TrainingCollapsed
from vsekit.training.data_path import (  # noqa: F401 (EpochBatches, device_batches: imported from here too)
    EpochBatches,
    device_batches,
    make_train_data,
    train_feature_source,
    train_pairs,
)
from vsekit.training.reporting import check_report_to, make_reporters
from vsekit.training.schedule import TrainState, lr_at_epoch  # noqa: F401 (lr_at_epoch: imported from here too)
from vsekit.training.step import TrainStep, tf32_matmul  # noqa: F401 (tf32_matmul: imported from here too)
from vsekit.training.step_setup import check_step_setup
from vsekit.utils.memory import peak_memory_bytes
from vsekit.utils.progress import progress_bar
from vsekit.utils.runtime import resolve_device, seed_everything

logger = logging.getLogger(__name__)

LOSS_STATE = "__loss__."  # prefix of the loss's own state in the `last` checkpoint's optimizer file


def load_text_processor(recipe: Recipe, train_captions: list[str], spec: DataSpec):
    t = recipe.model.text
    if has_fact("text_encoder", t.kind, "word_vocabulary"):
        if t.vocab_path:
            vocab = Vocabulary.load(t.vocab_path, t.tokenizer)
            t.tokenizer = vocab.tokenizer  # a SCAN vocabulary is read with nltk: the run records what it used
        else:
            vocab = Vocabulary.build(train_captions, t.vocab_min_count, t.tokenizer)
        spec.vocab_words = vocab.idx2word
        return vocab
    path = spec.text_model_path or t.model_path or default_transformer_path()
    spec.text_model_path = path
    return HFTextProcessor(load_tokenizer(path), t.max_tokens)


def _quiet(*_args, **_kwargs) -> None:
    return None


class Trainer:
    def __init__(
        self,
        recipe: Recipe,
        data_dir: str | Path,
        run_dir: str | Path,
        *,
        resume: bool = False,
        overwrite: bool = False,
        progress: bool = True,
        log=print,
        report_to: Sequence[str] = (),
    ) -> None:
        report_to = check_report_to(report_to)  # `--report-to wandb` without wandb: fail before any work
        self.recipe = recipe
        self.data_dir = Path(data_dir)
        self.run_dir = Path(run_dir)
        self.progress = progress
        self.log = log
        self.device = resolve_device(recipe.train.device)
        # under torchrun: join the group, one GPU per rank; only rank 0 logs and writes files
        self.dist = init_from_env(self.device.type)
        self.device = rank_device(self.device, self.dist)
        # before anything is read or written: every setting the step cannot run with, refused at once
        self.step_setup = check_step_setup(recipe, self.device, self.dist)
        if not self.dist.is_main:
            self.progress, self.log = False, _quiet
        seed_everything(recipe.train.seed)
        cfg = recipe.data
        from vsekit.data.validate import check_dataset

        report = check_dataset(self.data_dir, [cfg.train_split, cfg.val_split], cfg.captions_per_image)
        report.raise_for_errors()  # every problem of both splits in one message, before any training
        for problem in report.warnings:
            self.log(str(problem))  # "warning: FILE:LINE: …" (the problem names its severity)
        self.train_split = load_precomp_split(self.data_dir, cfg.train_split, cfg.captions_per_image)
        if cfg.train_fraction < 1.0:
            full = self.train_split.n_images
            self.train_split = self.train_split.sample_images(cfg.train_fraction, cfg.train_subset_seed)
            self.log(
                f"training on {self.train_split.n_images} of {full} training images "
                f"(data.train_fraction={cfg.train_fraction}, subset seed {cfg.train_subset_seed})"
            )
        if advice := small_data_advice(recipe, self.train_split.n_images):
            self.log(f"note: {advice}")
        self.val_split = load_precomp_split(self.data_dir, cfg.val_split, cfg.captions_per_image).truncate(
            cfg.val_max_images
        )
        if self.train_split.feature_shape[1] != self.val_split.feature_shape[1]:
            raise DataFormatError(
                f"{self.data_dir}: feature size differs between {cfg.train_split} ({self.train_split.feature_shape[1]}) "
                f"and {cfg.val_split} ({self.val_split.feature_shape[1]})"
            )
        self._prepare_run_dir(resume, overwrite)
        spec = DataSpec(img_dim=self.train_split.feature_shape[1])
        self._saved_cfg: dict = {}
        if resume:
            _, saved_spec, self._saved_cfg = read_run_config(self.run_dir)
            spec = saved_spec
        saved_words = list(spec.vocab_words) if resume else []
        self.text = load_text_processor(recipe, self.train_split.captions, spec)
        if saved_words and list(spec.vocab_words) != saved_words:  # before any weights are read
            self._vocabulary_mismatch(saved_words, list(spec.vocab_words))
        self.model = VSEModel(recipe, spec).to(self.device)
        convert_batchnorm(self.model, self.dist)  # global-batch BatchNorm statistics under torchrun
        broadcast_module(self.model, self.dist)
        self.loss_fn = create_loss(recipe.loss, image_views=recipe.model.image.views)
        if self.loss_fn.needs_caption_embeddings:  # ladder losses: caption relevance as tensors
            from vsekit.relevance import prepare_ladder_relevance

            with main_first(self.dist):  # rank 0 computes and caches, the others read the cache
                prepare_ladder_relevance(self.loss_fn, self.data_dir, self.train_split, self.log)
            if self.loss_fn.derived_thresholds is not None:  # config.json shows the θ used
                recipe.loss.ladder_thresholds = list(self.loss_fn.derived_thresholds)
        self.loss_fn.to(self.device)
        params = self.model.parameter_groups(recipe.optim.lr)
        params += (
            [{"params": list(self.loss_fn.parameters()), "lr": recipe.optim.lr, "lr_mult": 1.0}]
            if list(self.loss_fn.parameters())
            else []
        )
        self.optimizer = torch.optim.AdamW(params, lr=recipe.optim.lr, weight_decay=recipe.optim.weight_decay)
        self.state = TrainState()
        self.history: list[dict] = []
        if resume:
            self._load_state()
        # before a new run's folder is made: a data path that cannot be built (train.data_on_device=true on a
        # set too large) leaves it as it was
        self._build_loader()
        if not resume and self.dist.is_main:
            self._start_run_dir()  # only now: an error or Ctrl-C before this point leaves the folder as it was
            manifest = self._dataset_manifest()
            write_run_config(
                self.run_dir,
                recipe,
                spec,
                {
                    "data_dir": str(self.data_dir.resolve()),
                    "extractor": manifest_extractor(manifest),
                    "dataset_format": manifest.get("format"),
                },
            )
        self.step_fn = TrainStep(
            recipe, self.model, self.loss_fn, self.optimizer, self.device, self.dist, setup=self.step_setup
        )
        # scalars a loss wants recorded at every iteration, whatever train.log_every is (ADOPT's K)
        self._step_keys: tuple[str, ...] = tuple(self.loss_fn.step_log_keys)
        # their values stay on the device until _check_finite reads them all at once (no host read per step)
        self._pending_steps: list[tuple[int, int, dict]] = []
        self._first_bad: torch.Tensor | None = None  # global step of the first non-finite loss, on the device
        # train.collapse_steps: counters on the device, read where _check_finite reads (training/collapse.py)
        self._collapse = (
            CollapseMonitor(recipe.loss, recipe.train.collapse_steps) if recipe.train.collapse_steps else None
        )
        # train.chance_validations: dev retrieval no better than random scores (training/chance.py)
        self._chance = (
            ChanceAlarm(self.val_split.cap2img, self.val_split.n_images, recipe.train.chance_validations)
            if recipe.train.chance_validations
            else None
        )
        self._tb = None
        # --report-to wandb: the records of _emit, also sent to W&B (rank 0 only)
        self._reporters = (
            make_reporters(report_to, self.run_dir, to_dict(recipe)) if self.dist.is_main else []
        )

    # ----------------------------------------------------------------------------------------- setup
    def _vocabulary_mismatch(self, saved: list[str], built: list[str]) -> None:
        """`--resume` with a dataset whose training captions give another vocabulary than the run's: the word
        embeddings would not fit (or, of the same size, mean other words), so say so before loading weights."""
        captions = f"in its {self.recipe.data.train_split} captions"
        if len(saved) != len(built):
            how = f"another vocabulary ({len(saved):,} words) than {self.data_dir} ({len(built):,} words {captions})"
        else:
            differ = sum(a != b for a, b in zip(saved, built))
            how = (
                f"another vocabulary than {self.data_dir}: the same size ({len(saved):,} words) but {differ:,} "
                f"of them differ {captions}"
            )
        recorded = self._saved_cfg.get("data_dir")
        hint = (
            f"resume it on the data it was trained on ({recorded})"
            if recorded
            else "resume it on its own data"
        )
        raise CheckpointError(
            f"{self.run_dir}: this run was trained on {how}; {hint}, or start a new run with --out"
        )

    def _dataset_manifest(self) -> dict:
        try:
            return read_manifest(self.data_dir)
        except ManifestError as e:
            self.log(f"warning: {e}; ignored")
            return {}

    def _prepare_run_dir(self, resume: bool, overwrite: bool) -> None:
        """Check the run directory; nothing is changed here (see `_start_run_dir`)."""
        run = self.run_dir
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
        barrier(self.dist)  # every rank has checked the directory before rank 0 changes it

    def _start_run_dir(self) -> None:
        """A new run: clear what an earlier run (`--overwrite`) or an interrupted setup left, then create."""
        if self.run_dir.is_dir():
            kept = clear_run_dir(self.run_dir)
            if kept:
                self.log(
                    f"note: {self.run_dir}: kept {len(kept)} file(s) vsekit did not write: "
                    f"{', '.join(p.name for p in kept[:5])}{', …' if len(kept) > 5 else ''}"
                )
        self.run_dir.mkdir(parents=True, exist_ok=True)

    def _image_source(self, split, train: bool):
        img = self.recipe.model.image
        if has_fact("image_encoder", img.kind, "reads_pixels"):
            return PixelSource(split, img.image_size, augment=train, transform=pixel_transform_of(self.model))
        split.require_width(
            self.model.spec.img_dim, f"the run in {self.run_dir}"
        )  # --resume with other --data
        return train_feature_source(self.recipe, split) if train else FeatureSource(split, None)

    def _build_loader(self) -> None:
        r = self.recipe
        self.train_set = train_pairs(
            r, self.train_split, self.text, self._image_source(self.train_split, True)
        )
        lengths = None
        if r.train.length_bucketing:
            lengths = np.array([len(c.split()) for c in self.train_split.captions])
        self.sampler = EpochBatches(
            len(self.train_set),
            r.train.batch_size,
            r.train.seed,
            lengths,
            rank=self.dist.rank,
            world_size=self.dist.world_size,
        )
        # on the device when the set fits there (train.data_on_device), else the DataLoader: see data_path
        self.data = make_train_data(
            r,
            self.train_split,
            self.train_set,
            self.sampler,
            self.device,
            self.dist,
            recorded=self.state.data_path,
            pad_id=pad_id_for(self.text),
            log=self.log,
        )
        self.loader = self.data.loader
        self.state.data_path = self.data.path
        if self.dist.is_main:
            logger.info("training batches: %s", self.data.reason)

    # ----------------------------------------------------------------------------------------- state
    def _save_state(self, tag: str = "last") -> None:
        if not self.dist.is_main:
            return
        tensors, meta = optimizer_to_files(self.optimizer)
        tensors["__torch_rng__"] = torch.get_rng_state()
        # a loss's own parameters and buffers (HREM's graph layer and call counter) resume with the optimizer
        tensors.update({LOSS_STATE + k: v for k, v in self.loss_fn.state_dict().items()})
        metrics = self.run_dir / "metrics.jsonl"
        state = {
            "train_state": self.state.__dict__,
            "optimizer": meta,
            "history": self.history,
            "metrics_bytes": metrics.stat().st_size if metrics.is_file() else 0,
        }
        # one committed set (manifest with sha256 written last): a kill never mixes two steps
        write_checkpoint_set(
            self.run_dir,
            tag,
            {
                ".safetensors": tensor_bytes(self.model.state_dict()),
                "_optim.safetensors": tensor_bytes(tensors),
                "_state.json": (json.dumps(state, indent=2) + "\n").encode("utf-8"),
            },
            {
                "epoch": self.state.epoch,
                "step_in_epoch": self.state.step_in_epoch,
                "global_step": self.state.global_step,
            },
        )

    def _load_state(self) -> None:
        files = read_checkpoint_set(
            self.run_dir, "last", (".safetensors", "_optim.safetensors", "_state.json")
        )
        if files is None:  # killed before the first checkpoint: start over (same seed, same result)
            self._truncate_metrics(0)
            self._record_epochs()
            self.log(f"{self.run_dir}: no complete checkpoint yet; training from the start")
            return
        load_weights(self.model, files[".safetensors"])
        tensors = load_tensors(files["_optim.safetensors"])
        rng = tensors.pop("__torch_rng__", None)
        self.loss_fn.load_state_dict(
            {k[len(LOSS_STATE) :]: tensors.pop(k) for k in list(tensors) if k.startswith(LOSS_STATE)}
        )
        path = files["_state.json"]
        try:
            saved = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{path}: cannot read training state ({e})") from e
        optimizer_from_files(self.optimizer, tensors, saved["optimizer"])
        if rng is not None:
            torch.set_rng_state(rng)
        self.state = TrainState(**saved["train_state"])
        self._check_resume_epochs()  # before anything in the run directory changes
        self.history = saved.get("history", [])
        self._truncate_metrics(saved.get("metrics_bytes"))
        self._record_epochs()
        st, total = self.state, self.recipe.train.epochs
        if st.step_in_epoch:
            self.log(
                f"resumed {self.run_dir} in epoch {st.epoch + 1}/{total}, after its step {st.step_in_epoch}"
            )
        elif st.epoch < total:
            self.log(f"resumed {self.run_dir} after epoch {st.epoch}/{total}")
        else:
            self.log(
                f"resumed {self.run_dir}: all {total} epochs are trained, nothing to do "
                f"(`vse train --resume {self.run_dir} --epochs N` trains it on to N epochs)"
            )

    def _check_resume_epochs(self) -> None:
        """A resumed run may be given more epochs (or fewer, down to the epoch it is in), never fewer than it has."""
        st, want = self.state, self.recipe.train.epochs
        needed = st.epoch + (1 if st.step_in_epoch else 0)
        if want < needed:
            done = f"{st.epoch} epoch(s)" + (
                f" and {st.step_in_epoch} steps of epoch {st.epoch + 1}" if st.step_in_epoch else ""
            )
            raise CheckpointError(
                f"{self.run_dir}: has already trained {done}; train.epochs (--epochs) {want} is "
                f"fewer: give --epochs {needed} or more"
            )

    def _record_epochs(self) -> None:
        """A resumed run given another train.epochs or lr schedule (`--epochs`, `--set optim.lr_decay…`):
        config.json records the new values, so a later --resume keeps them."""
        saved = self._saved_cfg.get("recipe", {})
        o = self.recipe.optim
        now = {
            "train.epochs": self.recipe.train.epochs,
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
        if self.dist.is_main:
            update_run_recipe(self.run_dir, {k: v for k, (_, v) in changes.items()})
        said = "; ".join(f"{k} {b} -> {v}" for k, (b, v) in changes.items())
        if "optim.lr_decay_epochs" in changes or "optim.lr_decay" in changes:
            self.log(f"{self.run_dir}: {said}")
        else:
            self.log(
                f"{self.run_dir}: {said}; the lr schedule is unchanged "
                f"(optim.lr_decay_epochs={o.lr_decay_epochs}, optim.lr_decay={o.lr_decay})"
            )

    def _truncate_metrics(self, size: int | None) -> None:
        """Drop metrics.jsonl lines written after the checkpoint (they are replayed), torn last line included."""
        path = self.run_dir / "metrics.jsonl"
        if size is not None and self.dist.is_main and path.is_file() and path.stat().st_size > size:
            os.truncate(path, size)

    # ------------------------------------------------------------------------------------- logging
    def _emit(self, record: dict) -> None:
        if not self.dist.is_main:
            return
        with open(self.run_dir / "metrics.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        if self._tb is None:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(self.run_dir / "tb"))
                logger.debug("TensorBoard scalars go to %s", self.run_dir / "tb")
            except ImportError:
                self._tb = False
                logger.debug(
                    "tensorboard is not installed; the records are in %s only", self.run_dir / "metrics.jsonl"
                )
        if self._tb:
            step = record.get("step", 0)
            for k, v in record.items():
                if isinstance(v, (int, float)) and k not in ("step", "epoch"):
                    self._tb.add_scalar(f"{record.get('kind', 'train')}/{k}", v, step)
        for reporter in self._reporters:
            reporter.log(record)

    # ---------------------------------------------------------------------------------------- train
    def _set_lr(self, epoch: int, scale: float = 1.0) -> None:
        o = self.recipe.optim
        lr = lr_at_epoch(o.lr, epoch, o.lr_decay_epochs, o.lr_decay) * scale
        for g in self.optimizer.param_groups:
            g["lr"] = lr * g.get("lr_mult", 1.0)

    def _backbone_phase(self, epoch: int) -> bool:
        """Unfreeze the CNN after its frozen epochs; True during the first unfrozen epoch (loss warm-up)."""
        enc = self.model.image_encoder
        if not isinstance(enc, BackboneImageEncoder):
            return False
        frozen = self.recipe.model.image.backbone_frozen_epochs
        enc.set_backbone_trainable(epoch >= frozen)
        return epoch == frozen and frozen > 0

    def train_step(
        self,
        batch: Batch,
        epoch: int,
        step: int,
        steps_in_epoch: int,
        loss_warmup: bool,
        shard_sizes: list[int] | None = None,
    ) -> dict:
        return self.step_fn(batch, epoch, step, steps_in_epoch, loss_warmup, shard_sizes)

    def _track_finite(self, loss: torch.Tensor) -> None:
        """Remember the first non-finite loss on the device (no host sync); `_check_finite` reads it."""
        if self._first_bad is None:
            self._first_bad = torch.full((), -1, dtype=torch.long, device=loss.device)
        bad = (self._first_bad < 0) & ~torch.isfinite(loss)
        self._first_bad = torch.where(bad, self.state.global_step, self._first_bad)

    def _check_finite(self, epoch: int) -> None:
        """Read the flag back (one sync) at log intervals and before anything is saved or validated; the
        per-step records (`_pending_steps`) are written here too."""
        self._write_step_records()
        if self._first_bad is not None and int(self._first_bad) >= 0:
            raise FloatingPointError(
                f"loss became NaN/inf at step {int(self._first_bad)} (epoch {epoch + 1}); "
                f"{self._last_checkpoint_note()}"
            )
        self._check_collapse()

    def _check_collapse(self) -> None:
        """The collapse alarm, read at the same points: warn once; with train.stop_on_collapse save and stop."""
        report = self._collapse.poll() if self._collapse is not None else None
        if report is None:
            return
        self._emit(
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
        if not self.recipe.train.stop_on_collapse:
            self.log(f"warning: {report.message()} (train.stop_on_collapse=true stops such a run)")
            return
        self._save_state()  # the state at this step: `vse train --resume` can continue it, e.g. with another lr schedule
        raise TrainingCollapsed(
            f"{report.message()}. Stopped at step {self.state.global_step} "
            f"(train.stop_on_collapse=true); its state is saved in {self.run_dir}"
        )

    def _write_step_records(self) -> None:
        """The per-step records kept since the last read (ADOPT's K and gammas), read back in one transfer per
        device and written in step order, as they would have been written one by one."""
        if not self._pending_steps:
            return
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for _, _, values in self._pending_steps:
            for v in values.values():
                if torch.is_tensor(v):
                    by_device.setdefault(v.device, []).append(
                        v.detach().reshape(()).to(torch.float32 if v.device.type == "mps" else torch.float64)
                    )
        host = {dev: iter(torch.stack(vs).tolist()) for dev, vs in by_device.items()}
        pending, self._pending_steps = self._pending_steps, []
        for epoch, step, values in pending:
            self._emit(
                {
                    "kind": "step",
                    "epoch": epoch,
                    "step": step,
                    **{
                        k: next(host[v.device]) if torch.is_tensor(v) else float(v) for k, v in values.items()
                    },
                }
            )

    def _last_checkpoint_note(self) -> str:
        """Where the last good weights are: only a checkpoint that was committed is named."""
        if (self.run_dir / "last.manifest.json").is_file() or (self.run_dir / "last.safetensors").is_file():
            return (
                f"last good checkpoint: {self.run_dir / 'last.safetensors'} (`vse train --resume {self.run_dir}` "
                "continues from it)"
            )
        return (
            f"no checkpoint was saved before it ({self.run_dir} holds no weights); check the recipe's values "
            "(learning rate, margins, temperatures) and start the run again"
        )

    def validate(self) -> dict:
        sims = split_similarities(self.model, self.val_split, self.recipe.train.eval_batch_size, self.device)
        return evaluate_sims(sims, self.val_split.cap2img)

    def fit(self, max_steps: int | None = None) -> dict:
        """Train to the recipe's last epoch (or stop after `max_steps` steps, for tests/benchmarks)."""
        failed = True
        try:
            result = self._fit(max_steps)
            failed = False
            return result
        finally:
            for (
                reporter
            ) in self._reporters:  # a W&B run is closed however training ends (exit code 1: it failed)
                reporter.finish(exit_code=int(failed))

    def _fit(self, max_steps: int | None) -> dict:
        r = self.recipe
        if self.state.epoch < r.train.epochs and self.dist.is_main and logger.isEnabledFor(logging.INFO):
            logger.info(
                "training %s: recipe %s, epochs %d-%d, %d steps per epoch, batch %d, on %s",
                self.run_dir,
                r.name,
                self.state.epoch + 1,
                r.train.epochs,
                len(self.sampler.batches()),
                r.train.batch_size,
                self.device,
            )
        total_epochs = r.train.epochs
        steps_done = 0
        while self.state.epoch < total_epochs:
            epoch = self.state.epoch
            self._set_lr(epoch)
            # first unfrozen backbone epoch: ramp the loss (released code) or the lr (paper) in over its steps
            warmup = r.model.image.backbone_warmup if self._backbone_phase(epoch) else "none"
            loss_warmup = warmup == "loss"
            self.train_set.set_epoch(epoch)
            self.sampler.epoch, self.sampler.skip = epoch, self.state.step_in_epoch
            epoch_batches = self.sampler.batches()
            steps_in_epoch = len(epoch_batches)
            samples = 0  # global batch samples trained in this epoch (by this process: a resumed run counts from there)
            t_epoch = time.perf_counter()
            t_data = t_log = time.perf_counter()
            meter = {"loss": 0.0, "data_time": 0.0, "step_time": 0.0, "n": 0}
            bar = progress_bar(
                total=steps_in_epoch,
                initial=self.state.step_in_epoch,
                desc=f"epoch {epoch + 1}/{total_epochs}",
                enabled=self.progress,
                leave=False,
                dynamic_ncols=True,
            )
            for batch in self.data.epoch(epoch, self.state.step_in_epoch):
                data_time = time.perf_counter() - t_data
                t0 = time.perf_counter()
                step = self.state.step_in_epoch
                samples += len(epoch_batches[step])
                sizes = (
                    shard_sizes(len(epoch_batches[step]), self.dist.world_size) if self.dist.enabled else None
                )
                if warmup == "lr":
                    self._set_lr(epoch, (step + 1) / steps_in_epoch)
                out = self.train_step(batch, epoch, step, steps_in_epoch, loss_warmup, sizes)
                self._track_finite(
                    out["loss"]
                )  # no float(loss) here: that would sync with the GPU every step
                if self._collapse is not None:
                    self._collapse.update(
                        out,
                        batch.image_index,
                        len(epoch_batches[step]),
                        hardest=epoch >= r.loss.warmup_epochs,
                        step=self.state.global_step + 1,
                        scale=(step + 1) / steps_in_epoch if loss_warmup else 1.0,
                    )
                if self._step_keys:
                    self._pending_steps.append(
                        (
                            epoch + 1,
                            self.state.global_step + 1,
                            {k: out[k] for k in self._step_keys if k in out},
                        )
                    )
                step_time = time.perf_counter() - t0  # host time; the device may still be working
                self.state.step_in_epoch += 1
                self.state.global_step += 1
                steps_done += 1
                meter["loss"] += out["loss"]
                meter["data_time"] += data_time
                meter["step_time"] += step_time
                meter["n"] += 1
                bar.update(1)
                if r.train.log_every and self.state.global_step % r.train.log_every == 0:
                    self._check_finite(epoch)
                    n = meter["n"]
                    wall = time.perf_counter() - t_log
                    rec = {
                        "kind": "train",
                        "epoch": epoch + 1,
                        "step": self.state.global_step,
                        "loss": float(meter["loss"]) / n,
                        "data_time": meter["data_time"] / n,
                        "step_time": meter["step_time"] / n,
                        "samples_per_s": r.train.batch_size * n / max(wall, 1e-9),
                        "lr": self.optimizer.param_groups[0]["lr"],
                        **{k: float(v) for k, v in out.items() if k != "loss"},
                    }
                    bar.set_postfix(loss=f"{rec['loss']:.3f}")
                    self._emit(rec)
                    if not self.progress:
                        self.log(
                            f"epoch {epoch + 1} step {self.state.global_step} loss {rec['loss']:.4f} "
                            f"data {rec['data_time'] * 1e3:.1f}ms step {rec['step_time'] * 1e3:.1f}ms "
                            f"{rec['samples_per_s']:.0f} samples/s"
                        )
                    meter = {"loss": 0.0, "data_time": 0.0, "step_time": 0.0, "n": 0}
                    t_log = time.perf_counter()
                if r.train.checkpoint_every and self.state.global_step % r.train.checkpoint_every == 0:
                    self._check_finite(epoch)
                    self._save_state()
                if max_steps is not None and steps_done >= max_steps:
                    bar.close()
                    self._check_finite(epoch)
                    self._save_state()
                    return {"stopped_at_step": self.state.global_step}
                t_data = time.perf_counter()
            bar.close()
            self._check_finite(epoch)  # reads a device flag: the epoch's steps have finished when it returns
            train_time = time.perf_counter() - t_epoch
            samples_per_s = samples / max(train_time, 1e-9)
            # the epoch's throughput (training only, validation excluded) in a record of its own: the val record
            # holds what is the same in any two runs of the recipe (the resume tests compare them whole)
            self._emit(
                {
                    "kind": "epoch",
                    "epoch": epoch + 1,
                    "step": self.state.global_step,
                    "samples": samples,
                    "train_time_s": train_time,
                    "samples_per_s": samples_per_s,
                    "data_path": self.data.path,
                    # the run's peak so far: CUDA max allocated, or the process's peak RSS (vsekit.utils.memory)
                    "peak_memory_gib": peak_memory_bytes(self.device)[0] / 2**30,
                }
            )
            metrics = self.validate()
            improved = metrics["rsum"] > self.state.best_rsum
            record = {
                "kind": "val",
                "epoch": epoch + 1,
                "step": self.state.global_step,
                "train_time_s": train_time,
                **metrics,
            }
            self.history.append(record)
            self._emit(record)
            self.log(
                f"epoch {epoch + 1}/{total_epochs} dev: {format_table(metrics)}{'  (best)' if improved else ''}"
                f"  [{samples_per_s:,.0f} samples/s]"
            )
            chance = self._chance.update(epoch + 1, metrics["rsum"]) if self._chance is not None else None
            if chance:
                self.log(f"warning: {chance}")
                self._emit(
                    {
                        "kind": "chance",
                        "epoch": epoch + 1,
                        "step": self.state.global_step,
                        "rsum": metrics["rsum"],
                        "chance_rsum": self._chance.mean,
                        "chance_std": self._chance.std,
                    }
                )
            self.state.epoch += 1
            self.state.step_in_epoch = 0
            if improved:
                self.state.best_rsum, self.state.best_epoch = metrics["rsum"], epoch
            if improved and self.dist.is_main:
                best = {"epoch": epoch + 1, "split": r.data.val_split, **metrics}
                write_checkpoint_set(
                    self.run_dir,
                    "best",
                    {
                        ".safetensors": tensor_bytes(self.model.state_dict()),
                        ".json": (json.dumps(best, indent=2) + "\n").encode("utf-8"),
                    },
                    {"epoch": epoch},
                )
            self._save_state()
        if self._tb:
            self._tb.flush()
        # epochs count from 1 for users (logs, metrics.jsonl, best.json); the trainer's state counts finished epochs
        return {
            "best_rsum": self.state.best_rsum,
            "best_epoch": self.state.best_epoch + 1,
            "history": self.history,
        }


def train(recipe: Recipe, data_dir: str | Path, run_dir: str | Path, **kwargs) -> dict:
    """Train a run to its last epoch, as its one writer (`vsekit.runs.run_writer_lock`, as `vse train`)."""
    if not writes_run_files():  # torchrun's other ranks: rank 0 holds the run
        return Trainer(recipe, data_dir, run_dir, **kwargs).fit()
    with run_writer_lock(run_dir, log=logger.info):
        return Trainer(recipe, data_dir, run_dir, **kwargs).fit()
