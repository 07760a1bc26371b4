# Float comparisons: float32 losses of <= 8x8 similarity matrices against float64 Python formulas at rel 1e-5
# (84 eps: a log-sum-exp over <= 8 terms of |s / tau| <= 10 rounds to a few eps; measured <= 1.5e-7 relative),
# analytic bounds where tau -> 0 (abs 4 B tau log 2, atol 1e-3), and exact equality only where both sides are
# the same ops on the same values (K from the logged gammas, all-zero inputs).
import dataclasses
import math

import pytest
import torch

from vsekit.config import LossConfig, load_recipe
from vsekit.losses import create_loss, triplet_loss
from vsekit.losses.adopt import ADOPTLoss, adopt_gammas, adopt_k, topk_infonce


def _sims(diag: float, off: float, b: int) -> torch.Tensor:
    return torch.full((b, b), off) + (diag - off) * torch.eye(b)


def _random_sims(b=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.nn.functional.normalize(torch.randn(b, 16, generator=g), dim=1)
    y = torch.nn.functional.normalize(x + 0.8 * torch.randn(b, 16, generator=g), dim=1)
    return (x @ y.t()).requires_grad_(True)


# ------------------------------------------------------------------------------------- the K rule
def test_k_rule_paper_start_is_batch_minus_one():
    # random init: every cosine ~ 0 -> align 0, uniform log(mean e^0) = 0 -> K' = B cos(0) = B -> B-1
    assert adopt_gammas(_sims(0.0, 0.0, 128)) == (0.0, 0.0)
    assert adopt_k(0.0, 0.0, 128) == 127


def test_k_rule_paper_late_is_one():
    # align 1 and uniform log(mean e^1) = 1 -> angle pi/2 -> K' = floor(128 * 6e-17) = 0 -> K = 1
    a, u = adopt_gammas(_sims(1.0, 1.0, 128))
    assert a == pytest.approx(1.0) and u == pytest.approx(1.0)
    assert adopt_k(a, u, 128) == 1
    assert adopt_k(0.999, 0.999, 128) == 1  # B cos(0.999 pi/2) = 0.2 -> 0 -> clamped up to 1


def test_k_rule_paper_hand_computed_middle():
    # B = 10, positives 0.9, negatives 0.5:
    # align = 0.9; uniform = log((10 e^0.9 + 90 e^0.5) / 100) = log((24.5960 + 148.3849) / 100) = 0.548011
    # angle = (0.9 + 0.548011) pi / 4 = 1.137266; cos = 0.420042; K' = floor(4.2004) = 4
    a, u = adopt_gammas(_sims(0.9, 0.5, 10))
    assert a == pytest.approx(0.9) and u == pytest.approx(0.548011, abs=1e-5)
    assert adopt_k(a, u, 10) == 4


def test_k_rule_paper_clips_gammas_to_their_stated_range():
    a, u = adopt_gammas(_sims(-0.5, -0.3, 6))  # negative cosines: both gammas clip to 0 -> K = B - 1
    assert (a, u) == (0.0, 0.0) and adopt_k(a, u, 6) == 5


def test_k_rule_reference_hand_computed():
    # released rule K = min(max(trunc(cos(t^1.25) B) + 1, 1), B - 1), t = align + mean exp(-cos'), diag' = 0
    # all cosines 0: t = 0 + 1 -> cos(1) * 128 = 69.16 -> 69 + 1 = 70
    a, u = adopt_gammas(_sims(0.0, 0.0, 128), "reference")
    assert (a, u) == (0.0, 1.0) and adopt_k(a, u, 128, "reference", 1.25) == 70
    # t = 1.4: 1.4^1.25 = 1.5229, cos = 0.0479 -> 6 + 1 = 7; t >= (pi/2)^(1/1.25) = 1.435 -> 1
    assert adopt_k(1.4, 0.0, 128, "reference", 1.25) == 7
    assert adopt_k(1.5, 0.0, 128, "reference", 1.25) == 1
    assert adopt_k(0.0, 0.0, 128, "reference", 1.25) == 127  # t = 0 -> 128 + 1 -> clamped to B - 1
    # the diagonal is excluded from exp(-cos) (set to 0 -> e^0 = 1): positives 1, negatives 0 -> u = 1
    assert adopt_gammas(_sims(1.0, 0.0, 4), "reference") == (1.0, 1.0)


def _maturing_batch(align: float, b: int = 128) -> torch.Tensor:
    """Positives at cosine `align`, negatives spread around 0 (a model that is learning without collapsing)."""
    g = torch.Generator().manual_seed(0)
    off = 0.05 * torch.randn(b, b, generator=g)
    return off + (align - off) * torch.eye(b)


def test_default_k_falls_as_the_model_matures():
    """The recipe's default rule (the released code's) lowers K as gamma_align + gamma_uniform rises, to a
    handful of negatives, as the paper's Fig. C-2 shows; the printed Eq. 6 keeps K near |B| (docs/vse_2ad.md)."""
    cfg = load_recipe("vse_2ad").loss
    assert cfg.adopt_variant == "reference" and LossConfig().adopt_variant == "reference"
    loss_fn = create_loss(cfg)
    ks, ts = [], []
    for align in (0.0, 0.2, 0.3, 0.4, 0.5, 0.7):
        _, d = loss_fn(_maturing_batch(align), image_ids=torch.arange(128))
        ks.append(d["K_i2t"])
        ts.append(d["align"] + d["uniform"])
    assert ts == sorted(ts) and ks == sorted(ks, reverse=True) and len(set(ks)) >= 4, ks
    assert ks[0] >= 64 and ks[-1] <= 5
    printed = create_loss(dataclasses.replace(cfg, adopt_variant="paper"))
    _, d = printed(_maturing_batch(0.7), image_ids=torch.arange(128))
    assert d["K_i2t"] >= 0.7 * 128  # Eq. 6 as printed: K stays large for the same batch


def test_k_is_logged_and_follows_the_batch():
    loss_fn = ADOPTLoss()
    _, d = loss_fn(_sims(0.0, 0.0, 16))
    assert d["K_i2t"] == d["K_t2i"] == 15 and d["align"] == 0.0 and d["uniform"] == 0.0
    _, d = loss_fn(_sims(0.9, 0.5, 10))
    assert d["K_i2t"] == 4 and d["align"] == pytest.approx(0.9)
    assert all(isinstance(d[k], float) for k in ("K_i2t", "K_t2i", "align", "uniform"))


# ----------------------------------------------------------------------------------- the objective
def _explicit_infonce(sims, k, tau, margin=0.0, mask=None):
    """Row by row, no vectorisation: -log e^{p/t} / (e^{p/t} + sum of the k largest valid negatives)."""
    b = sims.shape[0]
    total = 0.0
    for i in range(b):
        negs = sorted(
            (float(sims[i, j]) for j in range(b) if j != i and (mask is None or not mask[i, j])), reverse=True
        )
        negs = negs[:k]
        p = float(sims[i, i])
        total += -(p / tau - math.log(math.exp(p / tau) + sum(math.exp((n + margin) / tau) for n in negs)))
    return total / b


@pytest.mark.parametrize("k", [1, 3, 7])
def test_loss_matches_explicit_formula_both_directions(k):
    s = _random_sims().detach()
    loss, d = ADOPTLoss(temperature=0.1, fixed_k=k)(s)
    expect = _explicit_infonce(s, k, 0.1) + _explicit_infonce(s.t(), k, 0.1)
    assert float(loss) == pytest.approx(expect, rel=1e-5)
    assert float(d["loss_i2t"]) == pytest.approx(_explicit_infonce(s, k, 0.1), rel=1e-5)
    ref, _ = ADOPTLoss(temperature=0.1, fixed_k=k, variant="reference", margin=0.2)(s)
    expect_ref = (_explicit_infonce(s, k, 0.1, 0.2) + _explicit_infonce(s.t(), k, 0.1, 0.2)) / 2
    assert float(ref) == pytest.approx(expect_ref, rel=1e-5)


def test_adaptive_loss_uses_rule_k():
    s = _random_sims().detach()
    loss, d = ADOPTLoss(temperature=0.1)(s)
    k = int(d["K_i2t"])
    assert k == adopt_k(*adopt_gammas(s), 8)
    assert float(loss) == pytest.approx(
        _explicit_infonce(s, k, 0.1) + _explicit_infonce(s.t(), k, 0.1), rel=1e-5
    )


def test_positive_is_never_a_negative():
    # every off-diagonal cosine is far below 0 and the positive is 0: the released code (diagonal filled
    # with 0, then top-K) would pick the positive itself; ours must only see the true negatives.
    s = _sims(0.0, -0.9, 5)
    loss, _ = ADOPTLoss(temperature=0.1, fixed_k=1)(s)
    one_direction = -math.log(1 / (1 + math.exp(-9.0)))
    assert float(loss) == pytest.approx(2 * one_direction, abs=1e-6)
    assert float(loss) < 0.01  # with the positive counted as a negative it would be 2 log 2 = 1.39


def test_same_image_captions_optionally_excluded():
    s = _random_sims(6, seed=2).detach()
    image_ids = torch.tensor([0, 0, 1, 2, 2, 3])
    same = (image_ids[:, None] == image_ids[None, :]) & ~torch.eye(6, dtype=torch.bool)
    masked, _ = ADOPTLoss(temperature=0.1, fixed_k=5)(s, image_ids=image_ids)
    expect = _explicit_infonce(s, 5, 0.1, mask=same) + _explicit_infonce(s.t(), 5, 0.1, mask=same.t())
    assert float(masked) == pytest.approx(expect, rel=1e-5)
    kept, _ = ADOPTLoss(temperature=0.1, fixed_k=5, mask_same_image=False)(s, image_ids=image_ids)
    assert float(kept) == pytest.approx(
        _explicit_infonce(s, 5, 0.1) + _explicit_infonce(s.t(), 5, 0.1), rel=1e-5
    )
    assert float(kept) != pytest.approx(float(masked))


def test_k1_small_tau_is_hardest_negative_triplet():
    """K = 1, tau -> 0: tau * softplus((n - p) / tau) -> [n - p]_+, so B * tau * L_ADOPT equals the VSE++
    hardest-negative triplet loss with margin 0 (paper variant) or margin alpha (reference variant, whose
    negatives carry +alpha; its loss is halved). Checked on values and on gradients."""
    tau = 1e-4
    b = 8
    for variant, margin, scale in (("paper", 0.0, 1.0), ("reference", 0.2, 2.0)):
        s = _random_sims(b, seed=4)
        loss, _ = ADOPTLoss(temperature=tau, fixed_k=1, variant=variant, margin=0.2)(s)
        (g_adopt,) = torch.autograd.grad(b * tau * scale * loss, s)
        trip, _ = triplet_loss(s, margin=margin, hardest=True)
        (g_trip,) = torch.autograd.grad(trip, s)
        assert float(trip.detach()) > 0.1  # the batch really has violations, so the check is not 0 == 0
        assert float(b * tau * scale * loss.detach()) == pytest.approx(
            float(trip.detach()), abs=4 * b * tau * math.log(2)
        )
        assert torch.allclose(g_adopt, g_trip, atol=1e-3)
        # only the hardest negative of each row/column gets gradient, as in the hardest-negative loss
        assert torch.equal(g_adopt.abs() > 1e-6, g_trip.abs() > 0)


def test_k1_ignores_all_but_the_hardest_negative():
    s = _random_sims(8, seed=5).detach()
    loss_fn = ADOPTLoss(temperature=0.05, fixed_k=1)
    base, _ = loss_fn(s)
    hardest_row = s.masked_fill(torch.eye(8, dtype=torch.bool), -2).argmax(1)
    hardest_col = s.masked_fill(torch.eye(8, dtype=torch.bool), -2).argmax(0)
    t = s.clone()
    for i in range(8):
        for j in range(8):
            if i != j and j != hardest_row[i] and i != hardest_col[j]:
                t[i, j] = s[i, j] - 0.5  # make easy negatives easier: K = 1 must not notice
    assert float(loss_fn(t)[0]) == pytest.approx(float(base), rel=1e-6)
    assert float(ADOPTLoss(temperature=0.05, fixed_k=3)(t)[0]) != pytest.approx(
        float(ADOPTLoss(temperature=0.05, fixed_k=3)(s)[0])
    )


def test_infonce_uses_every_negative():
    s = _random_sims().detach()
    loss_fn = create_loss(LossConfig(name="infonce", temperature=0.07))
    loss, d = loss_fn(s)
    expect = torch.nn.functional.cross_entropy(s / 0.07, torch.arange(8)) + torch.nn.functional.cross_entropy(
        s.t() / 0.07, torch.arange(8)
    )
    assert float(loss) == pytest.approx(float(expect), rel=1e-5)
    assert d["K_i2t"] == 7


def test_gradients_reach_positive_and_selected_negatives_only():
    s = _random_sims(8, seed=6)
    loss, _ = ADOPTLoss(temperature=0.1, fixed_k=2)(s)
    loss.backward()
    assert torch.all(s.grad.diagonal() < 0)  # pulls positives up
    # each row/column sends gradient to at most 2 negatives: <= 4 nonzero off-diagonal entries per row
    off = (s.grad.abs() > 0) & ~torch.eye(8, dtype=torch.bool)
    assert int(off.sum()) <= 8 * 2 * 2 and int(off.sum()) >= 8 * 2


def test_topk_infonce_row_without_negatives_is_finite():
    s = torch.tensor([[0.5, 0.2], [0.1, 0.4]])
    none = torch.zeros(2, 2, dtype=torch.bool)
    assert float(topk_infonce(s, none, 1, 0.05)) == pytest.approx(0.0, abs=1e-7)


def test_create_loss_and_errors():
    loss_fn = create_loss(
        LossConfig(name="adopt", adopt_variant="reference", adopt_scale=1.5, margin=0.3, temperature=0.1)
    )
    assert isinstance(loss_fn, ADOPTLoss)
    assert (loss_fn.variant, loss_fn.scale, loss_fn.margin, loss_fn.temperature) == (
        "reference",
        1.5,
        0.3,
        0.1,
    )
    assert (
        create_loss(LossConfig(name="adopt", adopt_variant="paper")).margin == 0.0
    )  # the paper's objective has no margin
    assert create_loss(LossConfig(name="adopt")).margin == 0.2  # the default, the released rule: + margin
    with pytest.raises(ValueError, match="square"):
        ADOPTLoss()(torch.zeros(3, 4))
    with pytest.raises(ValueError, match="variant"):
        ADOPTLoss(variant="x")
    with pytest.raises(ValueError, match="temperature"):
        ADOPTLoss(temperature=0)


def test_vse_2ad_trains_and_logs_k_every_iteration(synthetic_dir, tmp_path):
    """K, align, uniform reach metrics.jsonl (kind "step") and TensorBoard at every iteration, even with
    train.log_every = 4, and follow the rule: many negatives for an immature model."""
    import json

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from vsekit.training.trainer import Trainer

    over = [
        "model.embed_dim=32",
        "train.batch_size=32",
        "train.log_every=4",
        "model.text.word_dim=16",
        "model.image.mlp_hidden=32",
    ]
    recipe = load_recipe("vse_2ad", over)
    trainer = Trainer(recipe, synthetic_dir, tmp_path / "run", progress=False, log=lambda *_: None)
    rule = (recipe.loss.adopt_variant, recipe.loss.adopt_scale)
    trainer.fit(max_steps=6)
    recs = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if r["kind"] == "step"]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]  # one record per iteration
    assert [r["step"] for r in recs if r["kind"] == "train"] == [4]  # the regular log keeps its interval
    for r in steps:
        # paper: both gammas clipped to [0, 1]; reference: align unclipped, uniform = mean e^-cos in [1/e, e]
        assert (
            1 <= r["K_i2t"] <= 31
            and r["K_i2t"] == r["K_t2i"]
            and -1 <= r["align"] <= 1
            and 0 <= r["uniform"] <= math.e
        )
        assert r["K_i2t"] == adopt_k(r["align"], r["uniform"], 32, *rule)  # the logged K is the rule's K
    assert steps[0]["K_i2t"] >= 16  # immature model: many negatives
    trainer._tb.flush()
    acc = EventAccumulator(str(tmp_path / "run" / "tb"))
    acc.Reload()
    assert [e.step for e in acc.Scalars("step/K_i2t")] == [1, 2, 3, 4, 5, 6]
    assert [e.value for e in acc.Scalars("step/K_i2t")] == [r["K_i2t"] for r in steps]


@pytest.mark.slow
def test_losses_without_step_keys_write_no_step_records(synthetic_dir, tmp_path):
    import json

    from vsekit.training.trainer import Trainer

    over = [
        "model.embed_dim=16",
        "train.batch_size=32",
        "train.log_every=2",
        "model.text.word_dim=8",
        "model.image.mlp_hidden=16",
    ]
    trainer = Trainer(
        load_recipe("vse_infty", over), synthetic_dir, tmp_path / "run", progress=False, log=lambda *_: None
    )
    trainer.fit(max_steps=2)
    kinds = [
        json.loads(line)["kind"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert kinds == ["train"]
