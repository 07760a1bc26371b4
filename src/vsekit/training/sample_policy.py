"""Sample policies (`train.sample_policy`): which training pairs an epoch trains on, and how much each counts.

A policy is a registered part of kind `sample_policy` (`vsekit.registry`); its builder `(cfg)` returns an object
with the `SamplePolicy` methods, or None (the built-in `uniform`: every pair, a fresh permutation each epoch,
bit for bit the training of a run without a policy). At each epoch start the trainer calls
`PolicyRunner.epoch_start` once:

- if the policy `wants_scores(epoch)`, every training pair is scored with the current model by one service,
  `score_pairs`: eval mode, no gradient, no draw from any random generator, in fixed chunks of
  `train.eval_batch_size` captions (the chunk grid does not depend on the world size, so each pair's score is
  the same computation under torchrun as in one process); under torchrun rank r scores chunks r, r+W, ... and
  the scores are gathered (summed: every other rank holds an exact 0 there) so every rank has all of them;
- the policy returns the epoch's `EpochPlan`: a subset of pair indices (`indices`), and/or per-pair `weights`,
  and/or `soft_labels` (each [n_pairs] float32, indexed by pair); None is every pair, weight 1;
- the plan's `indices` become `EpochBatches.plan`, the one input of the draw both data paths read; its
  `weights` fill each batch's `Batch.weights` (`PolicyRunner.weigh`, by `batch.caption_index`), which the
  loss's reduction reads; `soft_labels` travel in the plan (`PolicyRunner.plan`) for a loss that reads them.

Resume: the plan of the epoch in progress and its digest (sha256 of the plan's arrays) are saved with each
checkpoint (`state_tensors` / `state_json`) and re-read on `--resume` mid-epoch, the digest checked: the model
state of the epoch start is gone by then, so re-reading is what is exact. At an epoch boundary the plan is
computed afresh from the saved model, which is the epoch start's. Under torchrun the ranks compare their plans'
digests: a plan that differs between ranks stops the run before it trains on it.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist

from vsekit import registry
from vsekit.config import Recipe
from vsekit.data.batch import Batch
from vsekit.data.datasets import Collate
from vsekit.distributed import DistContext
from vsekit.errors import SetupError
from vsekit.evaluation import image_source_for, pad_id_for
from vsekit.runs import CheckpointError
from vsekit.similarity import all_pairs

logger = logging.getLogger(__name__)

PLAN_STATE = "__sample_policy__."  # prefix of the plan's arrays in the `last` checkpoint's optimizer file
PLAN_FIELDS = ("indices", "weights", "soft_labels")


@dataclass(frozen=True)
class PairScores:
    """What the scoring pass gives a policy: `positive[i]`, the model's similarity of training pair i (caption i
    and its image), float32 [n_pairs]; `cap2img` maps pairs to images."""

    positive: np.ndarray
    cap2img: np.ndarray


@dataclass(frozen=True)
class EpochPlan:
    """An epoch's plan: `indices` the pairs trained on (int64, any order; None: all), `weights` and `soft_labels`
    per pair (float32 [n_pairs]; None: 1 and the hard label)."""

    indices: np.ndarray | None = None
    weights: np.ndarray | None = None
    soft_labels: np.ndarray | None = None

    def arrays(self) -> dict[str, np.ndarray]:
        """The plan's arrays, in their canonical dtypes (what the digest and the checkpoint hold)."""
        out = {}
        for name in PLAN_FIELDS:
            a = getattr(self, name)
            if a is not None:
                out[name] = np.ascontiguousarray(a, dtype=np.int64 if name == "indices" else np.float32)
        return out

    def digest(self) -> str:
        """sha256 over each present array's name, dtype, shape and bytes: equal plans, equal digests."""
        h = hashlib.sha256()
        for name, a in sorted(self.arrays().items()):
            h.update(f"{name}:{a.dtype.str}:{a.shape};".encode())
            h.update(a.tobytes())
        return h.hexdigest()


class SamplePolicy(Protocol):
    """What a registered policy's builder returns (state is JSON: numbers, strings, lists)."""

    def wants_scores(self, epoch: int) -> bool: ...

    def plan(self, epoch: int, n_pairs: int, scores: PairScores | None) -> EpochPlan | None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@torch.no_grad()
def score_pairs(
    model: torch.nn.Module,
    split: Any,
    text: Any,
    batch_size: int,
    device: torch.device,
    dist_ctx: DistContext | None = None,
    source: Any = None,
) -> PairScores:
    """Every training pair's similarity under `model` (module docstring): eval mode, batched in fixed chunks,
    gathered across ranks; the model's train/eval mode is restored after. `source`: the split's un-augmented
    images (default: evaluation's source of the split)."""
    ctx = dist_ctx or DistContext()
    cap2img = np.asarray(split.cap2img, dtype=np.int64)
    n = len(cap2img)
    source = image_source_for(model, split) if source is None else source
    collate = Collate(pad_id_for(text), float32=True)
    out = torch.zeros(n, dtype=torch.float32)
    was_training = model.training
    model.eval()
    try:
        for k, start in enumerate(range(0, n, batch_size)):
            if k % ctx.world_size != ctx.rank:
                continue
            caps = range(start, min(n, start + batch_size))
            ims = collate.images([(source.load(int(cap2img[c]), None), int(cap2img[c])) for c in caps])
            txt = collate.captions(
                [(torch.tensor(text.encode(split.captions[c]), dtype=torch.long), c) for c in caps]
            )
            im = model.encode_images(ims.images.float().to(device), ims.image_lengths.to(device)).float()
            tx = model.encode_texts(txt.tokens.to(device), txt.token_lengths.to(device)).float()
            sims = all_pairs(model.sim, im, tx, device)
            out[start : start + len(caps)] = torch.from_numpy(np.ascontiguousarray(np.diagonal(sims)))
    finally:
        model.train(was_training)
    if ctx.enabled:
        summed = out.to(device)  # on the run's device: NCCL reduces CUDA tensors only
        dist.all_reduce(summed)  # each pair is scored on one rank; the others hold an exact 0 there
        out = summed.cpu()
    return PairScores(out.numpy(), cap2img)


def build_policy(recipe: Recipe) -> SamplePolicy | None:
    """The policy `train.sample_policy` names, built from its section (None: `uniform`, no plan)."""
    cfg = recipe.train.sample_policy
    return registry.get("sample_policy", cfg.name).build(cfg)


class PolicyRunner:
    """The trainer's side of a policy: at each epoch start, the plan (computed once, or re-read on resume), set
    as the sampler's `plan`; the plan and the policy's state saved with each checkpoint."""

    def __init__(
        self,
        recipe: Recipe,
        model: torch.nn.Module,
        split: Any,
        text: Any,
        device: torch.device,
        dist_ctx: DistContext,
    ) -> None:
        self.policy = build_policy(recipe)
        self.model, self.split, self.text = model, split, text
        self.device, self.dist = device, dist_ctx
        self.batch_size = recipe.train.eval_batch_size
        self.plan: EpochPlan | None = None
        self.plan_epoch = -1
        self._resumed: tuple[int, EpochPlan] | None = None
        self._source: Any = None  # the split's un-augmented images, made at the first scoring pass
        self._weights: torch.Tensor | None = None  # the plan's weights, on the batches' device

    def epoch_start(self, sampler: Any, epoch: int, step_in_epoch: int = 0) -> EpochPlan | None:
        """Set the plan of `epoch` as `sampler.plan` (an `EpochBatches`): the saved one when resuming inside
        the epoch, else the policy's, computed now (None: `uniform`, the sampler is left as it is)."""
        if self.policy is None:
            return None
        if self._resumed is not None and self._resumed[0] == epoch and step_in_epoch > 0:
            plan = self._resumed[1]
            self._check_plan(plan)
        else:
            scores = None
            if self.policy.wants_scores(epoch):
                if self._source is None:
                    self._source = image_source_for(self.model, self.split)
                scores = score_pairs(
                    self.model, self.split, self.text, self.batch_size, self.device, self.dist, self._source
                )
            plan = self.policy.plan(epoch, len(self.split.cap2img), scores) or EpochPlan()
            self._check_plan(plan)
        self._resumed = None
        self._agree_across_ranks(plan)
        self.plan, self.plan_epoch, self._weights = plan, epoch, None
        sampler.plan = plan.indices if plan.indices is None else plan.arrays()["indices"]
        if logger.isEnabledFor(logging.INFO):
            kept = len(self.split.cap2img) if plan.indices is None else len(plan.indices)
            logger.info("epoch %d plan: %d pairs, digest %s", epoch + 1, kept, plan.digest()[:12])
        return plan

    def weigh(self, batch: Batch) -> Batch:
        """`batch` with `Batch.weights` from the plan's per-pair weights (by `caption_index`: this rank's
        shard under torchrun, gathered by the step); unchanged when the plan has none."""
        if self.plan is None or self.plan.weights is None:
            return batch
        if self._weights is None or self._weights.device != batch.caption_index.device:
            self._weights = torch.from_numpy(self.plan.arrays()["weights"]).to(batch.caption_index.device)
        return batch.replace(weights=self._weights[batch.caption_index])

    def _check_plan(self, plan: EpochPlan) -> None:
        n = len(self.split.cap2img)
        name = type(self.policy).__name__
        if plan.indices is not None:
            idx = np.asarray(plan.indices)
            if idx.ndim != 1 or not np.issubdtype(idx.dtype, np.integer) or len(idx) < 2:
                raise SetupError(f"sample policy {name}: the plan's indices must be >= 2 pair indices [k]")
            if idx.min() < 0 or idx.max() >= n or len(np.unique(idx)) != len(idx):
                raise SetupError(f"sample policy {name}: the plan's indices must be distinct, in 0..{n - 1}")
        for field in ("weights", "soft_labels"):
            a = getattr(plan, field)
            if a is not None and (np.shape(a) != (n,) or not np.isfinite(a).all()):
                raise SetupError(f"sample policy {name}: the plan's {field} must be {n} finite numbers")

    def _agree_across_ranks(self, plan: EpochPlan) -> None:
        if not self.dist.enabled:
            return
        digest = torch.frombuffer(bytearray(bytes.fromhex(plan.digest())), dtype=torch.uint8)
        mine = digest.to(self.device)  # NCCL gathers CUDA tensors only
        every = [torch.empty_like(mine) for _ in range(self.dist.world_size)]
        dist.all_gather(every, mine)
        if any(not torch.equal(mine, o) for o in every):
            raise SetupError(
                "sample policy: the ranks computed different epoch plans (a non-deterministic policy)"
            )

    # ------------------------------------------------------------------------------------ checkpoint
    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The current plan's arrays, for the optimizer file of the checkpoint."""
        if self.plan is None:
            return {}
        return {PLAN_STATE + k: torch.from_numpy(a.copy()) for k, a in self.plan.arrays().items()}

    def state_json(self) -> dict[str, Any] | None:
        """The policy's state, the plan's epoch and digest, for the checkpoint's state file."""
        if self.policy is None:
            return None
        digest = self.plan.digest() if self.plan is not None else None
        return {"state": self.policy.state_dict(), "epoch": self.plan_epoch, "digest": digest}

    def load(self, tensors: dict[str, torch.Tensor], saved: dict[str, Any] | None, where: str) -> None:
        """Take the plan's arrays out of `tensors` (always, so the optimizer never sees them) and restore the
        policy's state; a plan whose digest is not the saved one is a CheckpointError naming `where`."""
        arrays = {
            k[len(PLAN_STATE) :]: tensors.pop(k).numpy() for k in list(tensors) if k.startswith(PLAN_STATE)
        }
        if self.policy is None or not saved:
            return
        self.policy.load_state_dict(saved.get("state", {}))
        if saved.get("digest") is None:
            return
        plan = EpochPlan(**{k: arrays.get(k) for k in PLAN_FIELDS})
        if plan.digest() != saved["digest"]:
            raise CheckpointError(
                f"{where}: the saved epoch plan does not match its digest (sha256 {saved['digest'][:12]}…); "
                "the checkpoint is corrupt: resume from an intact copy or start a new run"
            )
        self._resumed = (int(saved["epoch"]), plan)
