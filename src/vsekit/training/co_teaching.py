"""Co-teaching: a run of two networks (`vsekit.models.pair.ModelPair`) trained in turn, each on the split its
peer makes of the training pairs — NCR's training (`train.sample_policy.name: ncr`, `loss.name: ncr`).

An epoch, as the NCR release runs it (NCR/train.py at 60256ba):

- warm-up epochs (`loss.warmup_epochs`): network A trains one pass over every pair with the warm-up loss,
  then network B does;
- later epochs: the **split pass** scores every training pair under each network (eval mode: the run's
  images and captions encoded once, captions visited in a seeded order in batches of the split batch size,
  each pair's hinge loss against its batch's negatives, `vsekit.losses.noisy_split.split_losses`); each
  network's losses become its clean probabilities and labeled set (`vsekit.losses.co_divide.CoDivide`);
  then network A trains on **B's** split and B on **A's**: one pass over the peer's labeled pairs, each
  labeled batch with its co-rectified soft margins (`prob_i + (1 - prob_i) pred_j`, [b, b] as released;
  `pred` NCR's prediction by the training network in eval mode); from `unlabeled_start_epoch` on each
  labeled step is followed by a step on a batch of the peer's unlabeled pairs (drawn in turn, cycled), whose
  targets are the mean of both networks' predictions.

Every optimiser step goes through the one step body (`TrainStep`, eager) of the network it trains, with the
targets as its `loss_inputs`; one AdamW holds both networks' parameters (a step on one leaves the other's
untouched: their gradients are None). Validation scores the pair (the mean of both similarity matrices, the
release's `validate`) and records each network alone (`A_rsum`, `B_rsum`). Each split is recorded in
metrics.jsonl (labeled counts, GMM means; the AUC against the dataset's recorded noise when it has one),
written to RUN/noisy_split.npz with the sha256 of the weights that made it (and to noisy_split_best.npz when
those are the best checkpoint's: what `vse data audit` reads for that checkpoint), and saved with the
checkpoint, so a run resumed inside an epoch trains on the split it started with; the draw of batch k of a
phase depends only on (seed, epoch, phase, k), so the rest of the epoch is the uninterrupted run's.

Refused here: torchrun, gradient caching and CUDA graphs (the step takes per-batch targets), and a loss that
does not read targets (the loss fact `takes_targets`).
"""

from __future__ import annotations

import hashlib
import io
import logging
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from vsekit.config import ConfigError
from vsekit.data.batch import Batch
from vsekit.evaluation import encode_captions, encode_images, image_source_for, pad_id_for
from vsekit.evaluation.audit import auc_score, read_ground_truth
from vsekit.losses import noisy_ncr
from vsekit.losses.co_divide import MemberSplit
from vsekit.losses.noisy_split import split_losses
from vsekit.metrics import evaluate_sims
from vsekit.models.pair import MEMBERS, SCALE, ModelPair
from vsekit.registry import get, has_fact
from vsekit.runs import (
    BEST_SPLIT_STATE_FILE,
    SPLIT_STATE_FILE,
    SPLIT_WEIGHTS_KEY,
    CheckpointError,
    committed_sha256,
    tensor_bytes,
)
from vsekit.similarity import all_pairs
from vsekit.training.callbacks import StepEnd, call_hook
from vsekit.training.checkpointing import save_state
from vsekit.training.data_path import EpochBatches, make_train_data
from vsekit.training.in2r_step import PeerQueueStep
from vsekit.training.step import TrainStep
from vsekit.utils.io import atomic_write_bytes
from vsekit.utils.progress import progress_bar
from vsekit.utils.runtime import derived_seed

if TYPE_CHECKING:
    from vsekit.training.trainer import Trainer

logger = logging.getLogger(__name__)

STATE_PREFIX = "__co_teaching__."  # the split's arrays in the `last` checkpoint's optimizer file
SPLIT_SEED = 0x5B17  # the split pass's caption order: (seed, epoch, SPLIT_SEED)
UNLABELED_SEED = 0x0AB1  # the unlabeled stream's draws: (seed, epoch, phase, UNLABELED_SEED)
SEED_MOD = 2**32


class CoTeaching:
    """The two-network side of a `Trainer` (module docstring): its epochs, validation and checkpoint state.
    The trainer holds it as `trainer.policy` (so `save_state` / `load_state` carry the split) and hands it
    its epochs."""

    def __init__(self, trainer: Trainer) -> None:
        if not isinstance(trainer.model, ModelPair):
            raise ConfigError("co-teaching needs a two-network model (vsekit.models.pair.ModelPair)")
        self.t = trainer
        r = trainer.recipe
        self.rule = get("sample_policy", r.train.sample_policy.name).build(r.train.sample_policy)
        self.margin = float(r.loss.margin)
        self.split_batch = self.rule.split_batch_size or r.train.batch_size
        self.splits: list[MemberSplit] | None = None  # the current epoch's, per network
        self.split_epoch = -1
        self._resumed: tuple[int, list[MemberSplit]] | None = None
        self._truth: np.ndarray | None | bool = False  # the dataset's recorded clean labels (False: not read)
        self._unlabeled_data = None
        self._source = None
        self._prob_cache: tuple[list[MemberSplit], int, torch.Tensor] | None = None
        self.peer_queue_step = PeerQueueStep(self) if has_fact("loss", r.loss.name, "peer_queues") else None

    # ------------------------------------------------------------------------------------- steps
    def build_steps(self) -> list[TrainStep]:
        t = self.t
        return [
            TrainStep(t.recipe, m, t.loss_fn, t.optimizer, t.device, t.dist, setup=t.step_setup)
            for m in t.model.members
        ]

    def _unlabeled(self):
        """The second stream of batches (the peer's unlabeled pairs), beside the trainer's, built once."""
        if self._unlabeled_data is None:
            t = self.t
            sampler = EpochBatches(len(t.train_set), t.recipe.train.batch_size, t.recipe.train.seed)
            self._unlabeled_data = make_train_data(
                t.recipe,
                t.train_split,
                t.train_set,
                sampler,
                t.device,
                t.dist,
                recorded=t.state.data_path,
                pad_id=pad_id_for(t.text),
                alongside=t.data,
                seed=derived_seed(t.recipe.train.seed, UNLABELED_SEED),
            )
        return self._unlabeled_data

    # ------------------------------------------------------------------------------------- split
    def _truth_labels(self) -> np.ndarray | None:
        if self._truth is False:
            t = self.t
            self._truth = read_ground_truth(t.data_dir, t.recipe.data.train_split, len(t.train_split.cap2img))
        return self._truth  # type: ignore[return-value]

    @torch.no_grad()
    def member_losses(self, k: int, order: np.ndarray) -> np.ndarray:
        """Network k's per-pair loss of the split pass (eval mode; its train mode restored)."""
        t = self.t
        member = t.model.members[k]
        was = member.training
        member.eval()
        try:
            bs = t.recipe.train.eval_batch_size
            if self._source is None:  # the split's un-augmented images, made once (its checks read every row)
                self._source = image_source_for(member, t.train_split)
            # a model that centres its embeddings (model.centre: batch) is scored as IN2R's split pass
            # scores it: the encoders' outputs, each batch of the pass centred by its own mean
            centred = member.centring is not None
            with member.uncentred():
                img = encode_images(member, self._source, bs, t.device)
                cap = encode_captions(member, t.train_split.captions, t.text, bs, t.device)
            return split_losses(
                img,
                cap,
                t.train_split.cap2img,
                order,
                self.split_batch,
                self.margin,
                centre=centred,
                score=lambda a, b: all_pairs(member.sim, a, b, t.device),
            )
        finally:
            member.train(was)

    def divide(self, epoch: int) -> list[MemberSplit]:
        """Both networks' splits of epoch `epoch`, from the models as they are now (the epoch start)."""
        t = self.t
        t0 = time.perf_counter()
        seed = t.recipe.train.seed
        n = len(t.train_split.cap2img)
        order = np.random.RandomState(derived_seed(seed, epoch, SPLIT_SEED) % SEED_MOD).permutation(n)
        splits, pass_s = [], []
        for k in range(2):
            t1 = time.perf_counter()
            losses = self.member_losses(k, order)
            pass_s.append(time.perf_counter() - t1)
            splits.append(self.rule.divide(losses, derived_seed(seed, epoch, k) % SEED_MOD))
        record: dict[str, Any] = {"kind": "split", "epoch": epoch + 1}
        record["split_time_s"] = time.perf_counter() - t0
        truth = self._truth_labels()
        for name, s, spent in zip(MEMBERS, splits, pass_s, strict=True):
            record[name] = {**s.summary(), "pass_s": spent}
            # mismatched pairs are the positives, 1 - prob the score (as `vse data audit`)
            if truth is not None:
                record[name]["auc"] = auc_score(~truth, 1.0 - s.prob)
        t.emit(record)
        t.log(
            f"epoch {epoch + 1} split: "
            + "; ".join(
                f"network {n} labels {s.labeled.sum():,} of {len(s.labeled):,} pairs clean"
                + (
                    f" (AUC {100 * record[n]['auc']:.1f} % against the recorded noise)"
                    if "auc" in record[n]
                    else ""
                )
                for n, s in zip(MEMBERS, splits, strict=True)
            )
            + f" [{record['split_time_s']:.1f} s]"
        )
        self._write_split_file(splits)
        return splits

    def _write_split_file(self, splits: list[MemberSplit]) -> None:
        t = self.t
        if not t.dist.is_main:
            return
        # the weights that made this split (the epoch start's), as the checkpoint writer hashes them: an audit
        # reads a split only for the checkpoint it was made from
        weights = hashlib.sha256(tensor_bytes(t.model.state_dict())).hexdigest()
        buf = io.BytesIO()
        np.savez(buf, prob_A=splits[0].prob, prob_B=splits[1].prob, **{SPLIT_WEIGHTS_KEY: np.array(weights)})
        atomic_write_bytes(t.run_dir / SPLIT_STATE_FILE, buf.getvalue())
        if weights == committed_sha256(t.run_dir, "best"):
            atomic_write_bytes(t.run_dir / BEST_SPLIT_STATE_FILE, buf.getvalue())

    # ------------------------------------------------------------------------------------- epoch
    def _phase_plans(self, epoch: int) -> list[tuple[np.ndarray | None, np.ndarray | None]]:
        """(labeled pairs, unlabeled pairs or None) of each phase: network k trains on its peer's split."""
        if self.splits is None:
            return [(None, None), (None, None)]
        trains_u = self.rule.trains_unlabeled(epoch, self.t.recipe.train.epochs)
        out = []
        for k in range(2):
            peer = self.splits[1 - k].labeled
            unl = np.flatnonzero(~peer) if trains_u and (~peer).sum() >= 2 else None
            out.append((np.flatnonzero(peer), unl))
        return out

    def _draw(self, epoch: int, k: int) -> int:
        return 2 * epoch + k  # the labeled sampler's epoch of phase k: each phase its own draw

    def train_epoch(self, epoch: int, max_steps: int | None) -> bool:
        """One co-teaching epoch (module docstring), or its rest when resumed; True when `max_steps` stopped it."""
        t, r = self.t, self.t.recipe
        t._set_lr(epoch)
        warm = epoch < r.loss.warmup_epochs
        start = t.state.step_in_epoch
        if warm:
            self.splits = None
        elif self._resumed is not None and self._resumed[0] == epoch and start > 0:
            self.splits = self._resumed[1]
        else:
            self.splits = self.divide(epoch)
        self._resumed = None
        self.split_epoch = epoch if self.splits is not None else -1
        plans = self._phase_plans(epoch)
        lengths = []
        for k, (labeled, _) in enumerate(plans):
            t.sampler.plan, t.sampler.epoch = labeled, self._draw(epoch, k)
            lengths.append(len(t.sampler.batches()))
        total = sum(lengths)
        call_hook(t.callbacks, "on_epoch_start", t, epoch)
        t.bar = progress_bar(
            total=total,
            initial=start,
            desc=f"epoch {epoch + 1}/{r.train.epochs}",
            enabled=t.progress,
            leave=False,
            dynamic_ncols=True,
        )
        samples, t_epoch, offset = 0, time.perf_counter(), 0
        phase_s = [0.0, 0.0]
        for k, (labeled, unlabeled) in enumerate(plans):
            if start < offset + lengths[k]:
                t_phase = time.perf_counter()
                done, stopped = self._run_phase(
                    k, epoch, labeled, unlabeled, offset, start, total, warm, max_steps
                )
                samples += done
                if stopped:
                    return True
                phase_s[k] = time.perf_counter() - t_phase
            offset += lengths[k]
        t.bar.close()
        t.sync(epoch)
        # each network's share of the epoch (the split pass has its own record): what the speed figures compare
        t.emit(
            {
                "kind": "phases",
                "epoch": epoch + 1,
                "steps": dict(zip(MEMBERS, lengths, strict=True)),
                "train_time_s": dict(zip(MEMBERS, phase_s, strict=True)),
                "unlabeled": [u is not None for _, u in plans],
            }
        )
        t._end_epoch(epoch, samples, time.perf_counter() - t_epoch)
        return False

    def _run_phase(
        self,
        k: int,
        epoch: int,
        labeled: np.ndarray | None,
        unlabeled: np.ndarray | None,
        offset: int,
        start: int,
        total: int,
        warm: bool,
        max_steps: int | None,
    ) -> tuple[int, bool]:
        """Network k's pass over its labeled batches (epoch steps `offset`...), from epoch step `start` on;
        (samples trained, whether `max_steps` stopped it, the checkpoint then saved)."""
        t = self.t
        skip = max(0, start - offset)
        t.sampler.plan = labeled
        t.train_set.set_epoch(self._draw(epoch, k))
        stream = self._unlabeled_stream(epoch, k, unlabeled, skip) if unlabeled is not None else None
        samples, t_data = 0, time.perf_counter()
        t.bar.set_postfix_str(f"network {MEMBERS[k]}")
        for j, batch in enumerate(t.data.epoch(self._draw(epoch, k), skip), start=skip):
            data_time = time.perf_counter() - t_data
            t0 = time.perf_counter()
            it = offset + j
            u_batch = next(stream) if stream is not None else None
            out = self.step(k, batch, u_batch, epoch, it, total, warm)
            step_time = time.perf_counter() - t0
            size = int(batch.caption_index.shape[0])
            samples += size
            t.state.step_in_epoch += 1
            t.state.global_step += 1
            t._steps_done += 1
            t.bar.update(1)
            s = StepEnd(epoch, it, t.state.global_step, total, batch, size, out, False, data_time, step_time)
            call_hook(t.callbacks, "on_step_end", t, s)
            if max_steps is not None and t._steps_done >= max_steps:
                t.bar.close()
                t.sync(epoch)
                save_state(t)
                return samples, True
            t_data = time.perf_counter()
        return samples, False

    def _unlabeled_stream(self, epoch: int, k: int, pairs: np.ndarray, skip: int):
        """Batches of the peer's unlabeled pairs for labeled steps `skip`, `skip + 1`, ...: pass c over them is
        drawn from (seed, epoch, phase, c), so batch `skip` is found without drawing the ones before it."""
        data = self._unlabeled()
        data.sampler.plan = pairs
        data.sampler.seed = derived_seed(self.t.recipe.train.seed, epoch, k, UNLABELED_SEED)
        data.sampler.epoch = 0
        per_pass = len(data.sampler.batches())
        cycle, pos = divmod(skip, per_pass)
        while True:
            yield from data.epoch(cycle, pos)
            cycle, pos = cycle + 1, 0

    def peer_prob(self, k: int) -> torch.Tensor:
        """The clean probabilities network k trains with (its peer's), float32 on the run's device, made once
        per split."""
        # keyed by the split itself (held, so a later split cannot reuse its id)
        cached = self._prob_cache
        if cached is None or cached[0] is not self.splits or cached[1] != k:
            prob = torch.as_tensor(self.splits[1 - k].prob, dtype=torch.float32).to(self.t.device)
            self._prob_cache = cached = (self.splits, k, prob)
        return cached[2]

    @torch.no_grad()
    def _predict(self, k: int, batch: Batch) -> torch.Tensor:
        """NCR's prediction for each pair of `batch` by network k, in eval mode (its mode restored)."""
        member = self.t.model.members[k]
        was = member.training
        member.eval()
        try:
            img = member.encode_images(batch.images, batch.image_lengths)
            txt = member.encode_texts(batch.tokens, batch.token_lengths)
            return noisy_ncr.predict(member.similarity(img, txt).float(), self.margin)
        finally:
            member.train(was)

    def step(
        self, k: int, batch: Batch, u_batch: Batch | None, epoch: int, it: int, total: int, warm: bool
    ) -> dict:
        """Network k's step(s) on a labeled batch (and an unlabeled one): targets first, then the step body."""
        # IN2R: two passes and the peer's queue (vsekit.training.in2r_step)
        if self.peer_queue_step is not None:
            return self.peer_queue_step(k, batch, u_batch, epoch, it, total, warm)
        t = self.t
        steps = t.member_steps
        if warm or self.splits is None:
            return steps[k](batch, epoch, 2 * it, 2 * total, global_step=t.state.global_step)
        # every target first, from the networks as they are before this step's updates (the release's order)
        prob_l = self.peer_prob(k)[batch.caption_index.to(t.device)].view(-1, 1)
        targets_l = noisy_ncr.rectified_targets(prob_l, torch.ones_like(prob_l), self._predict(k, batch))
        targets_u = None
        if u_batch is not None:
            targets_u = noisy_ncr.unlabeled_targets(self._predict(k, u_batch), self._predict(1 - k, u_batch))
        g = t.state.global_step
        out = steps[k](batch, epoch, 2 * it, 2 * total, global_step=g, loss_inputs={"targets": targets_l})
        out["loss_labeled"] = out["loss"]
        if targets_u is not None:
            out_u = steps[k](
                u_batch, epoch, 2 * it + 1, 2 * total, global_step=g, loss_inputs={"targets": targets_u}
            )
            out["loss_unlabeled"] = out_u["loss"]
            out["loss"] = out["loss"] + out_u["loss"]
        return out

    # ------------------------------------------------------------------------------------- validation
    @torch.no_grad()
    def validate(self) -> dict:
        """Dev metrics of the pair (the mean of both similarity matrices), with each network's rsum."""
        t = self.t
        model, split = t.model, t.val_split
        bs = t.recipe.train.eval_batch_size
        if t._val_source is None:
            t._val_source = image_source_for(model, split)
        img = encode_images(model, t._val_source, bs, t.device)
        txt = encode_captions(model, split.captions, t.text, bs, t.device)
        metrics = evaluate_sims(all_pairs(model.sim, img, txt, t.device), split.cap2img)
        d = int(t.recipe.model.embed_dim)
        for k, name in enumerate(MEMBERS):
            part = slice(k * d, (k + 1) * d)
            sims = all_pairs(model.members[k].sim, img[:, part] / SCALE, txt[:, part] / SCALE, t.device)
            metrics[f"{name}_rsum"] = evaluate_sims(sims, split.cap2img)["rsum"]
        return metrics

    # ------------------------------------------------------------------------------------- checkpoint
    def _arrays(self) -> dict[str, np.ndarray]:
        if self.splits is None:
            return {}
        out = {}
        for name, s in zip(MEMBERS, self.splits, strict=True):
            out[f"prob_{name}"] = np.ascontiguousarray(s.prob, dtype=np.float64)
            out[f"labeled_{name}"] = np.ascontiguousarray(s.labeled, dtype=np.uint8)
        return out

    @staticmethod
    def _digest(arrays: dict[str, np.ndarray]) -> str:
        h = hashlib.sha256()
        for name, a in sorted(arrays.items()):
            h.update(f"{name}:{a.dtype.str}:{a.shape};".encode())
            h.update(a.tobytes())
        return h.hexdigest()

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {STATE_PREFIX + k: torch.from_numpy(a.copy()) for k, a in self._arrays().items()}

    def state_json(self) -> dict[str, Any]:
        arrays = self._arrays()
        splits = {n: s.summary() for n, s in zip(MEMBERS, self.splits, strict=True)} if self.splits else None
        return {
            "co_teaching": True,
            "epoch": self.split_epoch,
            "digest": self._digest(arrays) if arrays else None,
            "thresholds": [s.threshold for s in self.splits] if self.splits else None,
            "splits": splits,
        }

    def load(self, tensors: dict[str, torch.Tensor], saved: dict[str, Any] | None, where: str) -> None:
        """Take the split's arrays out of `tensors` and keep them for the epoch they belong to, checked
        against their digest (a CheckpointError naming `where` when they do not match)."""
        arrays = {
            k[len(STATE_PREFIX) :]: tensors.pop(k).numpy()
            for k in list(tensors)
            if k.startswith(STATE_PREFIX)
        }
        if not saved or saved.get("digest") is None:
            return
        if self._digest(arrays) != saved["digest"]:
            raise CheckpointError(
                f"{where}: the saved split does not match its digest (sha256 {saved['digest'][:12]}…); the "
                "checkpoint is corrupt: resume from an intact copy or start a new run"
            )
        splits = [
            MemberSplit(
                arrays[f"prob_{n}"].astype(np.float64),
                arrays[f"labeled_{n}"].astype(bool),
                float(thr),
                None,
            )
            for n, thr in zip(MEMBERS, saved["thresholds"], strict=True)
        ]
        self._resumed = (int(saved["epoch"]), splits)
