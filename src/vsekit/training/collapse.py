"""The collapse alarm (`train.collapse_steps`, `train.stop_on_collapse`): a run stuck in the collapsed state
of a ranking loss is named, once, with the known remedies, instead of training on silently.

The symptom (vsepp #27, vse_infty #2): every image and caption maps to (nearly) the same point, all
similarities are equal, and the loss sits at the value it takes on a constant similarity matrix, epoch after
epoch. That value follows from the loss definition and the batch (n_i = the negatives of query i: B - 1
without `mask_same_image`, fewer when other captions of the same image are in the batch); with all s_ij = s:

- hardest-negative triplet (VSE++, sum over the batch, both directions): each query with a negative pays
  [m + s - s]_+ = m in each direction: 2 m #{i: n_i > 0} = 2 B m;
- triplet summed over all negatives (VSE0, the warm-up epochs): m per negative pair and direction:
  2 m sum_i n_i = 2 m B (B - 1);
- InfoNCE over all negatives (mean over queries, both directions): -log(e^s / (e^s + n_i e^s)) =
  log(1 + n_i) per query: 2 mean_i log(1 + n_i) = 2 log B, whatever the temperature;
- ADOPT with the K hardest negatives (the K the loss used in that step): paper variant 2 mean_i
  log(1 + min(K, n_i)); reference variant (+ margin m on the negatives' logits, temperature tau, the two
  directions averaged) mean_i log(1 + min(K, n_i) e^{m / tau});
- AVSE: the base loss above (the view regulariser's part is taken off);
- ladder losses: their value depends on the batch's relevance levels, so only the spread criterion applies.

The loss criterion is |loss - collapse value| <= 1 % of the collapse value. The spread criterion looks at the
embeddings themselves: the sum over dimensions of the batch variance of the L2-normalised embeddings (their
mean squared distance from their centroid, = 1 - the mean cosine over all pairs of the batch): 1 for
directions spread evenly, 0 for a single point (the smaller of the image and caption sides). It fires when the
spread falls below `SPREAD_DROP` (10 %) of the highest spread of the run so far, or below `SPREAD_FLOOR`.
A step counts as collapsed when either criterion holds; `collapse_steps` consecutive collapsed steps raise
the alarm.

No host synchronisation per step: the counters live on the loss's device and are updated with tensor
operations; the trainer reads them (`poll`, one small read) only where it already reads the loss back (log
intervals, checkpoints, the end of an epoch), so the alarm is raised at the first such point after the run
of collapsed steps. The counters restart with a resumed process.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vsekit import registry
from vsekit.config import LossConfig
from vsekit.models.image import to_device_async

TOLERANCE = 0.01  # |loss - collapse value| <= 1 % of it
# the spread criterion: below SPREAD_DROP x the highest spread this run has had (embeddings that spread out and
# then fell back to a point), or below SPREAD_FLOOR outright (a point from the start). VSE embeddings start
# concentrated (spread ~0.003-0.01 at initialisation on the runs measured in tests/test_collapse.py) and spread
# out as they train (0.1 and more), so an absolute floor alone would either miss collapses or flag every start
SPREAD_DROP = 0.1
SPREAD_FLOOR = 1e-4
# each remedy changes the recipe, which `vse train --resume` keeps (only the lr schedule may change there, and
# a collapsed state rarely recovers): the advice is a new run, with the `--set` that `vse train` takes
REMEDIES = (
    "start a new run (vse train --out NEW_RUN ... --set KEY=VALUE; --resume keeps the recipe) with a lower "
    "learning rate (--set optim.lr=..., e.g. a tenth of this run's); a warm-up with all negatives before the "
    "hardest ones (--set loss.warmup_epochs=1, or --set loss.max_violation=false); for pixel runs, a "
    "longer frozen-backbone phase (--set model.image.backbone_frozen_epochs=...)"
)


class TrainingCollapsed(FloatingPointError):
    """Raised by the trainer when `train.stop_on_collapse` stops a collapsed run (after saving its state)."""


def embedding_spread(*embeddings: torch.Tensor) -> torch.Tensor:
    """Smallest spread of the given [B, D] embeddings (0-d float32 tensor on their device).

    Per side: the mean squared distance of the L2-normalised rows from their centroid, i.e. the sum over
    dimensions of their batch variance, = 1 - |mean row|^2 = 1 - the mean cosine over all pairs (i, j): 1 for
    directions spread evenly (any number of dimensions), 0 when every row is the same point."""
    out = []
    for e in embeddings:
        x = torch.nn.functional.normalize(e.detach().float().reshape(e.shape[0], -1), dim=1)
        out.append((1.0 - x.mean(0).square().sum()).clamp_min(0.0))  # rounding can dip below 0
    return torch.stack(out).min()


def negatives_per_row(
    image_ids: torch.Tensor | None, batch: int, mask_same_image: bool = True
) -> torch.Tensor:
    """[B] float64: how many in-batch negatives each query has (captions of the query's own image excluded
    when `mask_same_image`), on the ids' device (CPU for the DataLoader's batches: no device work)."""
    if image_ids is None or not mask_same_image:
        device = image_ids.device if image_ids is not None else None
        return torch.full((batch,), float(batch - 1), dtype=torch.float64, device=device)
    ids = image_ids.reshape(-1)
    same = (ids.unsqueeze(0) == ids.unsqueeze(1)).sum(1)  # includes the query itself
    n = (batch - same).to(torch.float64 if ids.device.type != "mps" else torch.float32)
    return n


def equal_score(
    cfg: LossConfig, negatives: torch.Tensor, hardest: bool = True, k: float | torch.Tensor | None = None
) -> tuple[str, torch.Tensor] | None:
    """(label, value): the loss `cfg` names, in a step (hardest: past the warm-up), when all similarities of the
    batch are equal, from the loss's registered fact `equal_score` (module docstring); None for a loss without
    one (the ladder losses: relevance-dependent). The value is on the device of `negatives`, or of `k` (ADOPT's
    K when it is a device tensor: the counts go there, without a host sync)."""
    value_of = registry.fact("loss", cfg.name, "equal_score")
    if value_of is None:
        return None
    if torch.is_tensor(k):
        negatives = to_device_async(negatives, k.device)
    return value_of(cfg, negatives, hardest, k)


def collapse_value(
    cfg: LossConfig, negatives: torch.Tensor, hardest: bool = True, k: float | torch.Tensor | None = None
) -> torch.Tensor | None:
    """The loss `cfg` takes when all similarities of the batch are equal (module docstring), as a 0-d tensor
    on the device of `negatives` (or of `k`, ADOPT's K when it is a device tensor); None for the ladder losses."""
    found = equal_score(cfg, negatives, hardest, k)
    return None if found is None else found[1]


@dataclass
class CollapseReport:
    """What the alarm saw at the step it fired."""

    step: int  # global step (from 1) at which `steps` consecutive collapsed steps were reached
    steps: int
    loss: float
    collapse_value: float  # NaN when the loss kind has none
    spread: float
    by_loss: bool
    by_spread: bool
    kind: str

    def message(self) -> str:
        why = []
        if self.by_loss:
            why.append(
                f"the loss stayed within {TOLERANCE:.0%} of {self.collapse_value:.4g}, its value when every "
                f"similarity in the batch is equal ({self.kind}), now {self.loss:.4g}"
            )
        if self.by_spread:
            why.append(
                f"the embeddings' spread (1 - mean cosine between the batch's embeddings) stayed below "
                f"{SPREAD_DROP:.0%} of its highest value in this run or below {SPREAD_FLOOR:g}, now {self.spread:.3g}"
            )
        return (
            f"training looks collapsed at step {self.step}: for {self.steps} consecutive steps "
            f"{' and '.join(why)}. Known remedies: {REMEDIES}"
        )


class CollapseMonitor:
    """Counts consecutive collapsed steps on the device; `poll` reads the result (once it fired: once)."""

    def __init__(self, cfg: LossConfig, steps: int) -> None:
        if steps < 1:
            raise ValueError(f"collapse_steps must be >= 1, got {steps}")
        self.cfg, self.steps = cfg, steps
        self._run: torch.Tensor | None = None  # consecutive collapsed steps so far
        self._fired: torch.Tensor | None = None  # global step (from 1) where the run reached `steps`, or -1
        self._snap: torch.Tensor | None = None  # [loss, value, spread, by_loss, by_spread, kind] at that step
        self._top: torch.Tensor | None = None  # highest spread so far
        self._labels: list[str] = []  # the equal-score labels seen (their index is the snapshot's kind code)
        self._valued = registry.fact("loss", cfg.name, "equal_score") is not None  # else: the spread alone
        self.reported = False

    def update(
        self,
        out: dict,
        image_ids: torch.Tensor | None,
        batch: int,
        *,
        hardest: bool,
        step: int,
        scale: float = 1.0,
    ) -> None:
        """One training step: `TrainStep`'s output (loss, spread, the loss's diagnostics), the batch's image ids
        (None, or this process's shard under torchrun: the rows are then taken as distinct images), the batch
        size the loss saw, whether the hardest negatives were in use, the loss's ramp factor and the 1-based
        global step. Tensor operations only: nothing is read back from the device."""
        if self.reported:
            return
        loss = out["loss"].detach().to(torch.float32)
        dev = loss.device
        if self._run is None:
            self._run = torch.zeros((), dtype=torch.long, device=dev)
            self._fired = torch.full((), -1, dtype=torch.long, device=dev)
            self._snap = torch.zeros(6, dtype=torch.float32, device=dev)
            self._top = torch.zeros((), dtype=torch.float32, device=dev)
        cfg = self.cfg
        base = loss
        if cfg.view_reg_weight > 0 and "view_reg" in out:  # AVSE: the ranking loss alone
            base = loss - scale * cfg.view_reg_weight * _on(out["view_reg"], dev)
        ids = image_ids if image_ids is not None and image_ids.numel() == batch else None
        found = None
        if self._valued:
            n = negatives_per_row(ids, batch, cfg.mask_same_image)
            found = equal_score(cfg, n, hardest, out.get("K_i2t"))
        nan = torch.full((), float("nan"), device=dev)
        kind = None
        if found is not None:
            label, value = found
            if label not in self._labels:
                self._labels.append(label)
            kind = self._labels.index(label)
            v = _on(value, dev) * scale
            by_loss = ((base - v).abs() <= TOLERANCE * v) & (v > 0)
        else:
            v, by_loss = nan, torch.zeros((), dtype=torch.bool, device=dev)
        spread = _on(out["spread"], dev) if "spread" in out else nan
        self._top = torch.fmax(self._top, spread)  # fmax: a NaN spread leaves it
        by_spread = (spread < SPREAD_DROP * self._top) | (spread < SPREAD_FLOOR)  # False for NaN
        hit = by_loss | by_spread
        self._run = torch.where(hit, self._run + 1, 0)
        newly = (self._fired < 0) & (self._run >= self.steps)
        self._fired = torch.where(newly, step, self._fired)
        snap = torch.stack(
            [
                loss,
                v,
                spread,
                by_loss.float(),
                by_spread.float(),
                torch.full((), float(-1 if kind is None else kind), device=dev),
            ]
        )
        self._snap = torch.where(newly, snap, self._snap)

    def poll(self) -> CollapseReport | None:
        """The report the first time the alarm has fired (one host read), else None."""
        if self.reported or self._fired is None:
            return None
        values = torch.cat([self._fired.reshape(1).to(torch.float64), self._snap.to(torch.float64)]).tolist()
        step = int(values[0])
        if step < 0:
            return None
        self.reported = True
        loss, value, spread, by_loss, by_spread, kind = values[1:]
        return CollapseReport(
            step,
            self.steps,
            loss,
            value,
            spread,
            bool(by_loss),
            bool(by_spread),
            self._labels[int(kind)] if kind >= 0 else self.cfg.name,
        )


def _on(x: float | torch.Tensor, device: torch.device) -> torch.Tensor:
    """A 0-d float32 tensor on `device`: a CPU value is read on the host (no device work) and filled there."""
    if torch.is_tensor(x) and x.device == device:
        return x.detach().to(torch.float32)
    value = float(x) if not torch.is_tensor(x) or x.device.type == "cpu" else None
    if value is None:  # another device (not expected): copy
        return x.detach().to(device, torch.float32)
    return torch.full((), value, dtype=torch.float32, device=device)
