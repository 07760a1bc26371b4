"""The seams per-sample training needs: the losses' per-pair terms and their one reduction
(per-sample weights, per-pair margins), `Batch.weights`, and the `StepContext` handed to the loss.

Ids: i45-ctx (the loss gets a StepContext, not a bare warm-up flag), i45-red (per-pair terms + one
reduction; weights all 1 reproduce today's loss and gradients bit for bit; weight 0 removes exactly a pair's
terms; a constant per-pair margin equals the scalar one), i45-bw (Batch.weights, default ones, reaches the
loss in every strategy: eager, gradient caching, the CUDA-graph machinery run eagerly on the CPU).

Float comparisons: bit-for-bit ones use torch.equal (x * 1.0 is exact and the reduction kernels see the same
values); hand values on 3x3 matrices use torch.isclose at its default rel 1e-5 (a float32 sum of <= 12 terms
rounds to ~1e-7 relative)."""

from __future__ import annotations

import pytest
import torch

from vsekit.config import load_recipe
from vsekit.data.batch import Batch
from vsekit.losses.adopt import ADOPTLoss
from vsekit.losses.base import StepContext
from vsekit.losses.triplet import TripletLoss, hinge_terms, positive_mask, reduce_hinge
from vsekit.models.vse import DataSpec, VSEModel
from vsekit.pooling import length_mask
from vsekit.training.step import TrainStep

SMALL = ["model.embed_dim=16", "model.text.word_dim=8", "model.image.mlp_hidden=16"]
# the 3x3 matrix of test_losses' hand values (margin 0.2): hinge terms by hand, cost_caption[i, j] (image i's
# query) and cost_image[i, j] (caption j's query); every other entry is 0
S3 = torch.tensor([[0.9, 0.5, 0.1], [0.8, 0.6, 0.0], [0.2, 0.3, 0.4]])
# cost_caption: [1, 0] = 0.2+0.8-0.6 = 0.4, [2, 1] = 0.2+0.3-0.4 = 0.1
# cost_image:   [1, 0] = 0.2+0.8-0.9 = 0.1, [0, 1] = 0.2+0.5-0.6 = 0.1


def old_hinge(s: torch.Tensor, margin: float, hardest: bool, positives: torch.Tensor) -> torch.Tensor:
    """The VSE++ hinge as written on 857c500, independently of the library (the reference to match)."""
    d = s.diagonal()
    cc = (margin + s - d.unsqueeze(1)).clamp_min(0).masked_fill(positives, 0)
    ci = (margin + s - d.unsqueeze(0)).clamp_min(0).masked_fill(positives, 0)
    return cc.amax(1).sum() + ci.amax(0).sum() if hardest else cc.sum() + ci.sum()


def _loss_and_grad(fn, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = s.clone().requires_grad_(True)
    loss = fn(x)
    loss.backward()
    return loss.detach(), x.grad


@pytest.mark.parametrize("hardest", [True, False])
def test_i45_red_weights_one_reproduce_the_hinge_and_its_gradient_bit_for_bit(hardest):
    """i45-red: with weights all 1 (and None) the loss and d loss / d sims equal the 857c500 formula exactly,
    and the loss equals its per-pair-terms path (hinge_terms + reduce_hinge) exactly."""
    g = torch.Generator().manual_seed(3)
    s = torch.randn(8, 8, generator=g).tanh()
    ids = torch.tensor([0, 0, 1, 2, 3, 3, 4, 5])  # captions of the same image are not negatives
    pos = positive_mask(ids, 8, s.device)
    ref_loss, ref_grad = _loss_and_grad(lambda x: old_hinge(x, 0.2, hardest, pos), s)
    loss_fn = TripletLoss(0.2, max_violation=True)
    for weights in (None, torch.ones(8)):
        loss, grad = _loss_and_grad(
            lambda x, w=weights: loss_fn(
                x, image_ids=ids, context=StepContext(warmup=not hardest), weights=w
            )[0],
            s,
        )
        assert torch.equal(loss, ref_loss) and torch.equal(grad, ref_grad)
        terms = _loss_and_grad(lambda x, w=weights: reduce_hinge(*hinge_terms(x, 0.2, pos), hardest, w), s)
        assert torch.equal(terms[0], loss) and torch.equal(terms[1], grad)


@pytest.mark.parametrize(
    ("hardest", "weights", "expected"),
    [
        (True, [1.0, 1.0, 1.0], 0.7),  # rows 0 + 0.4 + 0.1, columns 0.1 + 0.1 + 0
        (True, [1.0, 0.0, 1.0], 0.2),  # pair 1 as a query gone: row 1 (0.4) and column 1 (0.1)
        (True, [1.0, 0.5, 2.0], 0.55),  # rows 0 + 0.2 + 0.2, columns 0.1 + 0.05 + 0
        (False, [1.0, 0.0, 1.0], 0.2),  # all negatives: cc[1, 0] = 0.4 and ci[0, 1] = 0.1 gone
        (False, [0.0, 1.0, 1.0], 0.6),  # ci[1, 0] = 0.1 (caption 0's query) gone
    ],
)
def test_i45_red_weight_zero_removes_exactly_the_pairs_terms(hardest, weights, expected):
    """i45-red: per-sample weights multiply the terms where the pair is the query (hand values on 3x3)."""
    loss, _ = TripletLoss(0.2)(S3, context=StepContext(warmup=not hardest), weights=torch.tensor(weights))
    assert torch.isclose(loss, torch.tensor(expected))


def test_i45_red_weight_zero_leaves_no_gradient_on_the_pairs_positive():
    """i45-red: s[1, 1] is only pair 1's positive: with weight 0 its gradient is exactly 0, the others' not."""
    w = torch.tensor([1.0, 0.0, 1.0])
    _, grad = _loss_and_grad(
        lambda x: TripletLoss(0.2)(x, context=StepContext(warmup=True), weights=w)[0], S3
    )
    assert grad[1, 1] == 0 and grad[0, 0] == -1 and grad[1, 0] == 1  # s[1, 0]: caption 0's query only


def test_i45_red_per_pair_margins():
    """i45-red: a constant margin matrix equals the scalar margin bit for bit; one changed entry changes
    exactly its two terms (hand values)."""
    g = torch.Generator().manual_seed(5)
    s = torch.randn(6, 6, generator=g).tanh()
    for hardest in (True, False):
        ctx = StepContext(warmup=not hardest)
        scalar, _ = TripletLoss(0.2)(s, context=ctx)
        matrix, _ = TripletLoss(0.2)(s, context=ctx, margins=torch.full((6, 6), 0.2))
        assert torch.equal(scalar, matrix)
    m = torch.full((3, 3), 0.2)
    m[1, 0] = 0.0  # cc[1, 0] = 0+0.8-0.6 = 0.2 (was 0.4); ci[1, 0] = 0+0.8-0.9 < 0 (was 0.1)
    loss, _ = TripletLoss(0.2)(S3, margins=m)  # rows 0 + 0.2 + 0.1, columns 0 + 0.1 + 0
    assert torch.isclose(loss, torch.tensor(0.4))
    with pytest.raises(ValueError, match="per-pair margins"):
        TripletLoss(0.2)(S3, margins=torch.zeros(2, 2))


def _infonce_by_hand(s: torch.Tensor, tau: float, w: torch.Tensor) -> torch.Tensor:
    """Symmetric InfoNCE in float64: per query -s_ii/tau + logsumexp_j s_ij/tau, weighted, mean over B."""
    s = s.double() / tau
    rows = torch.logsumexp(s, 1) - s.diagonal()
    cols = torch.logsumexp(s, 0) - s.diagonal()
    return (w.double() * rows).mean() + (w.double() * cols).mean()


def test_i45_red_infonce_weights():
    """i45-red: InfoNCE's per-query terms and reduction: weights 1 = no weights bit for bit (loss and
    gradient); weight 0 removes the query's term in both directions (float64 hand formula)."""
    g = torch.Generator().manual_seed(7)
    s = torch.randn(5, 5, generator=g).tanh()
    loss_fn = ADOPTLoss(0.1, adaptive=False)
    plain = _loss_and_grad(lambda x: loss_fn(x)[0], s)
    ones = _loss_and_grad(lambda x: loss_fn(x, weights=torch.ones(5))[0], s)
    assert torch.equal(plain[0], ones[0]) and torch.equal(plain[1], ones[1])
    assert torch.isclose(plain[0].double(), _infonce_by_hand(s, 0.1, torch.ones(5)))
    w = torch.tensor([1.0, 0.0, 1.0, 2.0, 1.0])
    weighted, _ = loss_fn(s, weights=w)
    assert torch.isclose(weighted.double(), _infonce_by_hand(s, 0.1, w))


def _batch(n: int = 12, weights: torch.Tensor | None = None) -> Batch:
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(2, 7, (n,), generator=g)
    return Batch(
        images=torch.randn(n, 5, 8, generator=g),
        image_lengths=torch.full((n,), 5),
        tokens=torch.randint(4, 30, (n, 6), generator=g).masked_fill(~length_mask(lengths, 6), 0),
        token_lengths=lengths,
        image_index=torch.arange(n),
        caption_index=torch.arange(n),
        weights=weights,
    )


def test_i45_bw_batch_weights_default_to_ones_and_move_with_the_batch():
    """i45-bw: ones by default (float32 [B]), sliced and moved with the batch, not one of the mapping's keys
    (the dict view is unchanged); a wrong shape is refused naming the field."""
    b = _batch(4)
    assert b.weights.dtype == torch.float32 and torch.equal(b.weights, torch.ones(4))
    assert "weights" not in b and len(b) == 6
    w = torch.tensor([1.0, 0.0, 0.5, 2.0])
    assert torch.equal(_batch(4, w).rows(1, 3).weights, w[1:3])
    assert torch.equal(Batch.of({**dict(b), "weights": w}).weights, w)
    with pytest.raises(ValueError, match="Batch.weights"):
        _batch(4, torch.ones(3))


class _Recording(TripletLoss):
    """The vsepp loss, recording what the step hands it."""

    def __init__(self) -> None:
        super().__init__(0.2)
        self.seen: list[tuple] = []

    def forward(self, sims, image_ids=None, *, context=None, weights=None, **kw):
        self.seen.append((context, None if weights is None else weights.detach().clone()))
        return super().forward(sims, image_ids, context=context, weights=weights, **kw)


@pytest.mark.parametrize("strategy", ["eager", "grad_cache", "graph"])
def test_i45_ctx_bw_the_step_hands_the_loss_its_context_and_the_batch_weights(strategy):
    """i45-ctx + i45-bw: every strategy hands the loss a StepContext (epoch, step, steps, global step, warm-up,
    ramp) and the batch's weights; the CUDA-graph machinery (run eagerly: CPU) keys on the warm-up flag."""
    sets = [*SMALL, "train.grad_cache_chunk=5"] if strategy == "grad_cache" else SMALL
    r = load_recipe("vsepp", sets)
    torch.manual_seed(0)
    model = VSEModel(r, DataSpec(img_dim=8, vocab_words=[f"w{i}" for i in range(30)]))
    opt = torch.optim.AdamW(model.parameter_groups(r.optim.lr), lr=r.optim.lr)
    loss_fn = _Recording()
    step = TrainStep(
        r, model, loss_fn, opt, torch.device("cpu"), graph="eager" if strategy == "graph" else None
    )
    assert (step.graphs is not None) == (strategy == "graph")
    assert (step.grad_cache is not None) == (strategy == "grad_cache")
    w = torch.linspace(0.0, 2.0, 12)
    epoch = r.loss.warmup_epochs
    step(_batch(12, w), epoch=epoch, step=3, steps_in_epoch=9, global_step=21)
    (context, weights), *_ = loss_fn.seen
    assert context == StepContext(epoch=epoch, step=3, steps_in_epoch=9, global_step=21, warmup=False)
    assert torch.equal(weights, w)
    if strategy != "graph":  # a graph refuses the ramp (cuda_graph_blockers)
        loss_fn.seen.clear()
        step(_batch(12), epoch=0, step=4, steps_in_epoch=10, loss_warmup=True)
        context = loss_fn.seen[0][0]
        assert context.warmup and context.ramp == (5, 10) and context.ramp_scale == 0.5
        assert context.global_step == -1  # not given


def test_i45_red_losses_say_whether_their_reduction_takes_weights():
    """i45-red: the losses with a per-sample reduction declare it (a sample policy that weights pairs must
    refuse the others); AVSE's wrapper says what the loss it wraps says."""
    from vsekit.config import LossConfig
    from vsekit.losses import create_loss

    declared = {
        name: create_loss(LossConfig(name=name)).takes_weights
        for name in ("triplet", "infonce", "adopt", "ladder")
    }
    assert declared == {"triplet": True, "infonce": True, "adopt": True, "ladder": False}
    wrapped = create_loss(LossConfig(name="ladder", view_reg_weight=0.1), image_views=2)
    assert wrapped.takes_weights is False
    assert create_loss(LossConfig(name="triplet", view_reg_weight=0.1), image_views=2).takes_weights
