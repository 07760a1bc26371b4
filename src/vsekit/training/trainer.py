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
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from vsekit.config import Recipe, to_dict
from vsekit.data.batch import Batch
from vsekit.data.datasets import FeatureSource
from vsekit.data.manifest import manifest_extractor
from vsekit.data.precomp import DataFormatError, load_precomp_split
from vsekit.data.raw_images import PixelSource
from vsekit.distributed import (
    broadcast_module,
    convert_batchnorm,
    init_from_env,
    main_first,
    rank_device,
    shard_sizes,
    writes_run_files,
)
from vsekit.evaluation import image_source_for, pad_id_for, split_similarities
from vsekit.features.backbones import pixel_transform_of
from vsekit.losses import create_loss
from vsekit.metrics import evaluate_sims, format_table
from vsekit.models.image import BackboneImageEncoder
from vsekit.models.pair import ModelPair, build_model
from vsekit.models.vse import DataSpec
from vsekit.registry import has_fact
from vsekit.runs import read_run_config, run_writer_lock, write_run_config
from vsekit.training.advice import small_data_advice  # noqa: F401 (imported from here too)
from vsekit.training.callbacks import Callback, StepEnd, call_hook, default_callbacks
from vsekit.training.checkpointing import LOSS_STATE, load_state, save_state  # noqa: F401 (LOSS_STATE: here too)
from vsekit.training.co_teaching import CoTeaching
from vsekit.training.data_path import (  # noqa: F401 (EpochBatches, device_batches: imported from here too)
    EpochBatches,
    device_batches,
    make_train_data,
    train_feature_source,
    train_pairs,
)
from vsekit.training.reporting import TensorBoardReporter, check_report_to, make_reporters
from vsekit.training.run_dir import dataset_manifest, prepare_run_dir, start_run_dir, vocabulary_mismatch
from vsekit.training.sample_policy import PolicyRunner
from vsekit.training.schedule import TrainState, lr_at_epoch  # noqa: F401 (lr_at_epoch: imported from here too)
from vsekit.training.step import TrainStep, tf32_matmul  # noqa: F401 (tf32_matmul: imported from here too)
from vsekit.training.step_setup import check_step_setup
from vsekit.training.text_input import load_text_processor  # noqa: F401 (imported from here too)
from vsekit.utils.machine import machine_facts
from vsekit.utils.memory import peak_memory_bytes
from vsekit.utils.progress import progress_bar
from vsekit.utils.runtime import resolve_device, seed_everything

logger = logging.getLogger(__name__)


def _quiet(*_args, **_kwargs) -> None:
    return None


class Trainer:
    """One training run of a recipe on a dataset into a run folder; `fit` trains it. `callbacks` are called
    after the built-in ones at each hook (vsekit.training.callbacks)."""

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
        callbacks: Sequence[Callback] = (),
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
        self._load_splits()
        prepare_run_dir(self.run_dir, resume, overwrite, self.dist)
        spec = self._build_model(resume)
        # train.sample_policy: each epoch's plan of pairs, its state saved with the checkpoint (sample_policy.py);
        # a two-network policy (NCR) trains the pair in turn, its split saved instead (co_teaching.py)
        self.co = CoTeaching(self) if isinstance(self.model, ModelPair) else None
        self.policy = self.co or PolicyRunner(
            recipe, self.model, self.train_split, self.text, self.device, self.dist
        )
        self.state = TrainState()
        self.history: list[dict] = []
        if resume:
            load_state(self)
        # before a new run's folder is made: a data path that cannot be built (train.data_on_device=true on a
        # set too large) leaves it as it was
        self._build_loader()
        if not resume and self.dist.is_main:
            self._start_run(
                spec
            )  # only now: an error or Ctrl-C before this point leaves the folder as it was
        if self.co is not None:  # one step body per network, sharing the optimizer
            self.member_steps = self.co.build_steps()
            self.step_fn = self.member_steps[0]
        else:
            self.step_fn = TrainStep(
                recipe,
                self.model,
                self.loss_fn,
                self.optimizer,
                self.device,
                self.dist,
                setup=self.step_setup,
            )
        self.bar = None  # the epoch's progress bar, while an epoch trains
        self._val_source = None  # the dev split's images for validation, made at the first one
        # the alarms, checkpointing, then the reporters (rank 0: TensorBoard, --report-to wandb), then the user's
        reporters = make_reporters(report_to, self.run_dir, to_dict(recipe)) if self.dist.is_main else []
        self.callbacks: list[Callback] = [*default_callbacks(self), *reporters, *callbacks]
        self._tb = next((cb for cb in reporters if isinstance(cb, TensorBoardReporter)), None)

    # ----------------------------------------------------------------------------------------- setup
    def _load_splits(self) -> None:
        """Check both splits (every problem in one message) and read them, before any training."""
        cfg = self.recipe.data
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
        if advice := small_data_advice(self.recipe, self.train_split.n_images):
            self.log(f"note: {advice}")
        self.val_split = load_precomp_split(self.data_dir, cfg.val_split, cfg.captions_per_image).truncate(
            cfg.val_max_images
        )
        if self.train_split.feature_shape[1] != self.val_split.feature_shape[1]:
            raise DataFormatError(
                f"{self.data_dir}: feature size differs between {cfg.train_split} ({self.train_split.feature_shape[1]}) "
                f"and {cfg.val_split} ({self.val_split.feature_shape[1]})"
            )

    def _build_model(self, resume: bool) -> DataSpec:
        """The text processor, model, loss and optimizer (a resumed run: of its recorded data spec)."""
        recipe = self.recipe
        spec = DataSpec(img_dim=self.train_split.feature_shape[1])
        self.saved_cfg: dict = {}
        if resume:
            _, saved_spec, self.saved_cfg = read_run_config(self.run_dir)
            spec = saved_spec
        saved_words = list(spec.vocab_words) if resume else []
        self.text = load_text_processor(recipe, self.train_split.captions, spec)
        if saved_words and list(spec.vocab_words) != saved_words:  # before any weights are read
            raise vocabulary_mismatch(
                self.run_dir,
                self.data_dir,
                recipe.data.train_split,
                saved_words,
                list(spec.vocab_words),
                self.saved_cfg.get("data_dir"),
            )
        self.model = build_model(recipe, spec).to(self.device)  # two networks for a co-teaching policy
        convert_batchnorm(self.model, self.dist)  # global-batch BatchNorm statistics under torchrun
        broadcast_module(self.model, self.dist)
        self.loss_fn = create_loss(
            recipe.loss, image_views=recipe.model.image.views, embed_dim=recipe.model.embed_dim
        )
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
        return spec

    def _start_run(self, spec: DataSpec) -> None:
        """A new run's folder and config.json (rank 0)."""
        start_run_dir(self.run_dir, self.log)
        manifest = dataset_manifest(self.data_dir, self.log)
        extra = {
            "data_dir": str(self.data_dir.resolve()),
            "extractor": manifest_extractor(manifest),
            "dataset_format": manifest.get("format"),
            "machine": machine_facts(self.device),  # runs drift apart across CPUs' kernels: say where
        }
        write_run_config(self.run_dir, self.recipe, spec, extra)

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

    # ------------------------------------------------------------------------------------- records
    def emit(self, record: dict) -> None:
        """Append one record to RUN/metrics.jsonl (rank 0), then hand it to each callback (the reporters)."""
        if not self.dist.is_main:
            return
        with open(self.run_dir / "metrics.jsonl", "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        call_hook(self.callbacks, "on_record", self, record)

    def sync(self, epoch: int) -> None:
        """Read the device back (what the callbacks keep there, the NaN flag): at log intervals, before a
        checkpoint, at the end of an epoch; never once per step."""
        call_hook(self.callbacks, "on_sync", self, epoch)

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
        return self.step_fn(
            batch, epoch, step, steps_in_epoch, loss_warmup, shard_sizes, self.state.global_step
        )

    def validate(self) -> dict:
        if self.co is not None:  # the pair, and each network's rsum
            return self.co.validate()
        if self._val_source is None:  # made once: its checks read every row of the dev features
            self._val_source = image_source_for(self.model, self.val_split)
        sims = split_similarities(
            self.model,
            self.val_split,
            self.recipe.train.eval_batch_size,
            self.device,
            text=self.text,
            source=self._val_source,
        )
        return evaluate_sims(sims, self.val_split.cap2img)

    def fit(self, max_steps: int | None = None) -> dict:
        """Train to the recipe's last epoch (or stop after `max_steps` steps, for tests/benchmarks)."""
        failed = True
        try:
            call_hook(self.callbacks, "on_fit_start", self)
            result = self._fit(max_steps)
            failed = False
            return result
        finally:
            call_hook(self.callbacks, "on_fit_end", self, failed)

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
        logger.debug("callbacks: %s", ", ".join(type(cb).__name__ for cb in self.callbacks))
        self._steps_done = 0
        while self.state.epoch < r.train.epochs:
            if self._train_epoch(self.state.epoch, max_steps):
                return {"stopped_at_step": self.state.global_step}
        # epochs count from 1 for users (logs, metrics.jsonl, best.json); the trainer's state counts finished epochs
        return {
            "best_rsum": self.state.best_rsum,
            "best_epoch": self.state.best_epoch + 1,
            "history": self.history,
        }

    def _train_epoch(self, epoch: int, max_steps: int | None) -> bool:
        """One epoch (or its rest, resumed), then its validation; True when `max_steps` stopped it."""
        if self.co is not None:
            return self.co.train_epoch(epoch, max_steps)
        r = self.recipe
        self._set_lr(epoch)
        # first unfrozen backbone epoch: ramp the loss (released code) or the lr (paper) in over its steps
        warmup = r.model.image.backbone_warmup if self._backbone_phase(epoch) else "none"
        loss_warmup = warmup == "loss"
        self.train_set.set_epoch(epoch)
        self.policy.epoch_start(
            self.sampler, epoch, self.state.step_in_epoch
        )  # the epoch plan, before the draw
        self.sampler.epoch, self.sampler.skip = epoch, self.state.step_in_epoch
        epoch_batches = self.sampler.batches()
        steps_in_epoch = len(epoch_batches)
        samples = (
            0  # global batch samples trained in this epoch (by this process: a resumed run counts from there)
        )
        t_epoch = t_data = time.perf_counter()
        call_hook(self.callbacks, "on_epoch_start", self, epoch)
        self.bar = progress_bar(
            total=steps_in_epoch,
            initial=self.state.step_in_epoch,
            desc=f"epoch {epoch + 1}/{r.train.epochs}",
            enabled=self.progress,
            leave=False,
            dynamic_ncols=True,
        )
        for batch in self.data.epoch(epoch, self.state.step_in_epoch):
            batch = self.policy.weigh(batch)  # the epoch plan's per-pair weights (none: unchanged)
            data_time = time.perf_counter() - t_data
            t0 = time.perf_counter()
            step = self.state.step_in_epoch
            size = len(epoch_batches[step])
            samples += size
            sizes = shard_sizes(size, self.dist.world_size) if self.dist.enabled else None
            if warmup == "lr":
                self._set_lr(epoch, (step + 1) / steps_in_epoch)
            out = self.train_step(batch, epoch, step, steps_in_epoch, loss_warmup, sizes)
            step_time = time.perf_counter() - t0  # host time; the device may still be working
            self.state.step_in_epoch += 1
            self.state.global_step += 1
            self._steps_done += 1
            self.bar.update(1)
            s = StepEnd(
                epoch,
                step,
                self.state.global_step,
                steps_in_epoch,
                batch,
                size,
                out,
                loss_warmup,
                data_time,
                step_time,
            )
            call_hook(self.callbacks, "on_step_end", self, s)
            if max_steps is not None and self._steps_done >= max_steps:
                self.bar.close()
                self.sync(epoch)
                save_state(self)
                return True
            t_data = time.perf_counter()
        self.bar.close()
        self.sync(epoch)  # reads a device flag: the epoch's steps have finished when it returns
        self._end_epoch(epoch, samples, time.perf_counter() - t_epoch)
        return False

    def _end_epoch(self, epoch: int, samples: int, train_time: float) -> None:
        """The epoch's throughput record, its dev validation and record, then the validation callbacks."""
        samples_per_s = samples / max(train_time, 1e-9)
        # the epoch's throughput (training only, validation excluded) in a record of its own: the val record
        # holds what is the same in any two runs of the recipe (the resume tests compare them whole)
        self.emit(
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
        }
        record.update(metrics)
        self.history.append(record)
        self.emit(record)
        self.log(
            f"epoch {epoch + 1}/{self.recipe.train.epochs} dev: {format_table(metrics)}"
            f"{'  (best)' if improved else ''}  [{samples_per_s:,.0f} samples/s]"
        )
        self.state.epoch += 1
        self.state.step_in_epoch = 0
        if improved:
            self.state.best_rsum, self.state.best_epoch = metrics["rsum"], epoch
        # the chance alarm, then the `best` and `last` checkpoints (training/callbacks.py), then the user's
        call_hook(self.callbacks, "on_validation_end", self, epoch, metrics, improved)


def train(recipe: Recipe, data_dir: str | Path, run_dir: str | Path, **kwargs) -> dict:
    """Train a run to its last epoch, as its one writer (`vsekit.runs.run_writer_lock`, as `vse train`)."""
    if not writes_run_files():  # torchrun's other ranks: rank 0 holds the run
        return Trainer(recipe, data_dir, run_dir, **kwargs).fit()
    with run_writer_lock(run_dir, log=logger.info):
        return Trainer(recipe, data_dir, run_dir, **kwargs).fit()
