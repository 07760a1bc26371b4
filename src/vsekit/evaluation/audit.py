"""`vse data audit`: how likely each pair of a split is to be a true pair, under a trained run.

Users' own data hold mismatched pairs; the NCR split already computes, for every training pair, the
probability that it is clean. A run that carries that split (`SPLIT_STATE_FILE`, written by an NCR / IN2R
run) made from the audited checkpoint's weights gives it directly; any other run, or one whose splits were
made from other weights, gets the same computation here: the split is encoded through the one evaluation
path (`encode_images` / `encode_captions`), its captions visit in a seeded order in batches of `SPLIT_BATCH`
(the NCR release's split pass), each batch scored with the run's own similarity, and each pair's hinge loss
(`vsekit.losses.noisy_split.pair_losses`) min-max normalised, fitted by the two-component GMM started from
seeded k-means labels, the clean probability being the low-loss component's posterior.

Where the dataset records its noise (`vsekit.data.noise`: `train_noise_clean.npy`), the audit is scored: the
mismatched pairs are the positives, `1 - probability` the score, and AUC (Mann-Whitney, average ranks for
ties) and average precision (sklearn's step-wise definition) are computed here by their rank formulas.
"""

from __future__ import annotations

import logging
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from vsekit.data.noise import read_noise_record
from vsekit.data.precomp import load_precomp_split
from vsekit.data.text import Vocabulary
from vsekit.errors import VseInputError
from vsekit.evaluation import encode_captions, encode_images, image_source_for
from vsekit.losses.noisy_split import clean_probability, split_losses
from vsekit.models.tokenizers import text_processor_for
from vsekit.models.vse import VSEModel
from vsekit.runs import BEST_SPLIT_STATE_FILE, SPLIT_STATE_FILE, SPLIT_WEIGHTS_KEY, loaded_weights_file
from vsekit.similarity import all_pairs
from vsekit.utils.io import open_npy, sha256_file

log = logging.getLogger(__name__)

SPLIT_BATCH = 128  # the NCR release's batch size, which its split pass uses
SPLIT_MARGIN = 0.2  # the NCR release's --margin
MAX_UNKNOWN_SHARE = 0.5  # above this share of <unk> words, the run's vocabulary is not the dataset's
STATE_HEADER_BYTES = 4096  # an .npy header's room in the split state's size bound
SEED_MOD = 2**32  # numpy's RandomState takes 0 .. 2**32 - 1; a run's seed may be larger


class AuditInputError(VseInputError):
    """A run that does not fit the dataset, or a split / state file the audit cannot use; names it."""


@dataclass
class Audit:
    """Per-caption clean probability of a split and what it was computed from."""

    prob: np.ndarray  # float64 [captions]
    cap2img: np.ndarray  # caption -> image it is paired with
    source: str  # "the run's own split" or "per-pair loss"
    clean: np.ndarray | None  # the dataset's ground truth (True = still with its own image), when recorded

    def ranked(self) -> np.ndarray:
        """Caption ids, least likely pair first (ties by caption id)."""
        return np.lexsort((np.arange(len(self.prob)), self.prob))


def auc_score(labels: np.ndarray, scores: np.ndarray) -> float:
    """ROC AUC by the Mann-Whitney rank formula: (sum of the positives' ranks - P(P+1)/2) / (P N), ties
    taking their average rank. NaN when either class is empty."""
    y = np.asarray(labels, dtype=bool)
    s = np.asarray(scores, dtype=np.float64)
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(s, kind="mergesort")
    sorted_s = s[order]
    ranks = np.empty(len(s), dtype=np.float64)
    starts = np.flatnonzero(np.r_[True, sorted_s[1:] != sorted_s[:-1]])
    ends = np.r_[starts[1:], len(s)]
    for a, b in zip(starts, ends):
        ranks[order[a:b]] = (a + 1 + b) / 2.0  # mean of ranks a+1 .. b
    return float((ranks[y].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def average_precision(labels: np.ndarray, scores: np.ndarray) -> float:
    """AP = sum over distinct score thresholds (high to low) of (recall step) x precision at that threshold,
    tied scores entering together (scikit-learn's definition). NaN without positives."""
    y = np.asarray(labels, dtype=bool)
    s = np.asarray(scores, dtype=np.float64)
    n_pos = int(y.sum())
    if n_pos == 0:
        return float("nan")
    order = np.argsort(-s, kind="mergesort")
    sorted_s, sorted_y = s[order], y[order]
    last = np.r_[np.flatnonzero(sorted_s[1:] != sorted_s[:-1]), len(s) - 1]  # last index of each tie group
    tp = np.cumsum(sorted_y)[last]
    precision = tp / (last + 1.0)
    recall = tp / n_pos
    return float(np.sum(np.diff(np.r_[0.0, recall]) * precision))


def scores_of(audit: Audit) -> dict:
    """Counts, and AUC / AP of finding the mismatched pairs where the dataset records them."""
    out: dict = {"pairs": int(len(audit.prob)), "source": audit.source}
    if audit.clean is not None:
        noisy = ~audit.clean
        out.update(
            mismatched=int(noisy.sum()),
            clean=int(audit.clean.sum()),
            auc=auc_score(noisy, 1.0 - audit.prob),
            average_precision=average_precision(noisy, 1.0 - audit.prob),
        )
    return out


def loss_probability(
    img: torch.Tensor,
    cap: torch.Tensor,
    sim,
    cap2img: np.ndarray,
    seed: int,
    batch_size: int = SPLIT_BATCH,
    margin: float = SPLIT_MARGIN,
    device: str | torch.device = "cpu",
    progress: bool = False,
) -> np.ndarray:
    """Clean probability per caption from embeddings: the NCR split pass (captions in a seeded order, batches
    scored by `sim`, `pair_losses`), min-max, the GMM from seeded k-means labels, the low-loss posterior."""
    cap2img = np.asarray(cap2img, dtype=np.int64)
    order = np.random.RandomState(seed % SEED_MOD).permutation(len(cap2img))
    losses = split_losses(
        img,
        cap,
        cap2img,
        order,
        batch_size,
        margin,
        score=lambda im, ca: all_pairs(sim, im, ca, device),
        progress=progress,
    )
    return clean_probability(losses, seed % SEED_MOD)[0]


def read_split_state(
    run_dir: str | Path, n_captions: int, where: str, checkpoint: str = "best"
) -> np.ndarray | None:
    """The run's own split probabilities made from the `checkpoint` weights (mean of both networks' when it has
    two), or None when it has none made from them. A split file is used only when the sha256 it records of the
    weights that made it is the audited weights file's: an NCR run's last split comes from its last epoch's
    start, and its best checkpoint is often many epochs before that. AuditInputError when a split file is for
    another number of captions than `where` holds, or larger than that many float64 (a run folder may come
    from elsewhere: bounded before it is read)."""
    run_dir = Path(run_dir)
    names = [BEST_SPLIT_STATE_FILE, SPLIT_STATE_FILE] if checkpoint == "best" else [SPLIT_STATE_FILE]
    paths = [run_dir / n for n in names if (run_dir / n).is_file()]
    if not paths:
        return None
    weights = loaded_weights_file(run_dir, checkpoint)
    digest = sha256_file(weights)
    for path in paths:
        prob, made_from = _read_split_file(path, n_captions, where)
        if made_from == digest:
            log.info("%s: the run's own split made from %s (%s)", run_dir, weights.name, path.name)
            return prob
    log.info(
        "%s: %s made from other weights than %s (or not recorded); the audit scores that checkpoint's own "
        "per-pair losses",
        run_dir,
        " and ".join(p.name for p in paths),
        weights.name,
    )
    return None


def _read_split_file(path: Path, n_captions: int, where: str) -> tuple[np.ndarray, str | None]:
    """(mean clean probability, sha256 of the weights that made it or None) of one split file, bounded."""
    try:
        with np.load(path, allow_pickle=False) as z:
            keys = [k for k in ("prob",) if k in z.files] or [k for k in ("prob_A", "prob_B") if k in z.files]
            if not keys:
                raise AuditInputError(f"{path}: holds no 'prob' (or 'prob_A', 'prob_B') array")
            for k in keys:  # bounded before anything is decompressed: a float64 per caption and a header
                size = z.zip.getinfo(f"{k}.npy").file_size
                if size > STATE_HEADER_BYTES + 8 * n_captions:
                    raise AuditInputError(
                        f"{path}: '{k}' holds {size:,} bytes, more than {n_captions} probabilities take"
                    )
            arrays = [np.asarray(z[k], dtype=np.float64) for k in keys]
            made_from = None
            weights_entry = f"{SPLIT_WEIGHTS_KEY}.npy"
            if SPLIT_WEIGHTS_KEY in z.files and z.zip.getinfo(weights_entry).file_size <= STATE_HEADER_BYTES:
                value = z[SPLIT_WEIGHTS_KEY]
                if value.ndim == 0 and value.dtype.kind == "U":
                    made_from = str(value[()])
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as e:
        raise AuditInputError(f"{path}: unreadable ({e})") from None
    for a in arrays:
        if a.ndim != 1 or len(a) != n_captions:
            raise AuditInputError(
                f"{path}: its split scores {a.shape[0] if a.ndim else 0} pairs but {where} has {n_captions} "
                "captions: the run was trained on another dataset"
            )
    prob = np.mean(arrays, axis=0)
    if not np.isfinite(prob).all():
        raise AuditInputError(f"{path}: non-finite probabilities")
    return prob, made_from


def read_ground_truth(data_dir: str | Path, split: str, n_captions: int) -> np.ndarray | None:
    """The dataset's recorded clean labels of `split` (vsekit.data.noise), or None when it records none."""
    record = read_noise_record(data_dir)
    if record is None or record.get("split") != split:
        return None
    path = Path(data_dir) / str(record.get("clean_file"))
    clean = np.asarray(open_npy(path, AuditInputError))
    if clean.ndim != 1 or clean.dtype != np.bool_ or len(clean) != n_captions:
        raise AuditInputError(
            f"{path}: expected {n_captions} bools (one per {split} caption), got shape {tuple(clean.shape)} "
            f"dtype {clean.dtype}"
        )
    return clean


def check_vocabulary(text, captions: list[str], where: str) -> None:
    """A word-vocabulary run on captions whose words it mostly does not know: AuditInputError naming both."""
    if not isinstance(text, Vocabulary):
        return
    unk = text.word2idx["<unk>"]
    total = unknown = 0
    for c in captions:
        ids = text.word_ids(c)
        total += len(ids)
        unknown += sum(1 for i in ids if i == unk)
    if total and unknown / total > MAX_UNKNOWN_SHARE:
        raise AuditInputError(
            f"{where}: {100 * unknown / total:.0f}% of its words are not in the run's vocabulary: the run was "
            "trained on another dataset"
        )


def prepare(
    model: VSEModel, run_dir: str | Path, data_dir: str | Path, split_name: str, checkpoint: str = "best"
):
    """Every check before any encoding: the split reads, fits the run's input and vocabulary, and the run's
    split state (made from the `checkpoint` weights `model` holds) and the dataset's ground truth have the
    split's length. Returns (split, source, state, clean)."""
    where = f"{data_dir} split {split_name!r}"
    split = load_precomp_split(data_dir, split_name, model.recipe.data.captions_per_image)
    if split.n_captions == 0:
        raise AuditInputError(f"{where}: no captions")
    source = image_source_for(model, split)  # feature width, NaN features: named
    check_vocabulary(text_processor_for(model), split.captions, where)
    state = read_split_state(run_dir, split.n_captions, where, checkpoint) if split_name == "train" else None
    clean = read_ground_truth(data_dir, split_name, split.n_captions)
    return split, source, state, clean


def audit_seed(model: VSEModel) -> int:
    """The seed of the audit's caption order for a run: its training seed (a pair's loss depends on the
    negatives that shared its batch, so the order is part of what a run's audit is)."""
    return int(model.recipe.train.seed)


def audit_split(
    model: VSEModel,
    run_dir: str | Path,
    data_dir: str | Path,
    split_name: str = "train",
    seed: int | None = None,
    batch_size: int = 256,
    device: str | torch.device = "cpu",
    progress: bool = True,
    prepared: tuple | None = None,
    checkpoint: str = "best",
) -> Audit:
    """Clean probability of every pair of a split under a run's `checkpoint` (best | last: the weights `model`
    holds), its own NCR split where it has one made from those weights; `prepared` is `prepare`'s result when
    the caller checked the inputs already. The split pass's caption order is drawn from `seed`, by default the
    run's own training seed, so every caller scores a run as `vse data audit` does."""
    split, source, state, clean = prepared or prepare(model, run_dir, data_dir, split_name, checkpoint)
    seed = audit_seed(model) if seed is None else seed
    cap2img = np.asarray(split.cap2img, dtype=np.int64)
    if state is not None:
        return Audit(state, cap2img, "the run's own split", clean)
    img = encode_images(model, source, batch_size, device, progress)
    cap = encode_captions(model, split.captions, text_processor_for(model), batch_size, device, progress)
    prob = loss_probability(img, cap, model.sim, cap2img, seed, device=device, progress=progress)
    return Audit(np.asarray(prob, dtype=np.float64), cap2img, "per-pair loss", clean)
