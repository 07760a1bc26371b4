"""AEOM similarity: dustbin Sinkhorn properties, the readouts (released code's scores on the fixtures), the
fast no-grad path, the bench.

Float comparisons: a block cosine is a float32 dot of two normalised d-dim blocks, and two float32 evaluations
of it (einsum vs matmul, other blocking, other CPU kernels) differ by at most 2 (d + 2) eps (`cos_atol`). The
Sinkhorn scores compared across paths (log space vs scaling form, chunked, sharded, stopped at convergence)
are 20-50 float32 iterations on O(1) scores, a few tens of eps apart: atol 2e-6 / rtol 1e-5. Closed forms
(a sigmoid of the cosine) and the marginals also carry the Sinkhorn's convergence error (1e-5, 1e-4), and the
released-code fixtures use the parity tolerance 1e-5 (as tests/test_parity_losses.py).
"""

import argparse
import json
import math

import numpy as np
import pytest
import torch

from conftest import reference_fixture_dir
from vsekit.config import ConfigError, SimilarityConfig, load_recipe, recipe_from_dict, to_dict
from vsekit.similarity import all_pairs, create_similarity
from vsekit.similarity.aeom import (
    AEOMSimilarity,
    augment_with_dustbin,
    block_affinity,
    log_sinkhorn_dustbin,
    max_sum,
)

EPS32 = torch.finfo(torch.float32).eps


def cos_atol(d: int) -> float:
    """Largest difference of two float32 evaluations of a cosine of d-dim rows, in any summation order: each
    is off by <= d u for the dot and (d / 2 + 2) u per normalised row (u = eps / 2)."""
    return 2 * (d + 2) * EPS32


def make_sim(
    embed_dim=16,
    views=2,
    block_dim=8,
    iters=20,
    use_sinkhorn=True,
    dustbin=1.0,
    readout="plan",
    temperature=1.0,
) -> AEOMSimilarity:
    cfg = SimilarityConfig(
        name="aeom",
        block_dim=block_dim,
        sinkhorn_iters=iters,
        use_sinkhorn=use_sinkhorn,
        dustbin_init=dustbin,
        readout=readout,
        temperature=temperature,
    )
    return AEOMSimilarity(embed_dim, views, cfg)


@pytest.mark.parametrize("p,q", [(4, 2), (2, 1), (3, 3), (1, 5)])
def test_sinkhorn_meets_the_paper_marginals(p, q):
    g = torch.Generator().manual_seed(p * 10 + q)
    scores = torch.rand(6, p, q, generator=g) * 2 - 1
    plan = log_sinkhorn_dustbin(scores, torch.tensor(0.3), iters=300).exp()
    assert plan.shape == (6, p + 1, q + 1)
    a = torch.tensor([1.0] * p + [q])  # rows: 1 per image block, q for the dustbin row
    b = torch.tensor([1.0] * q + [p])  # columns: 1 per caption block, p for the dustbin column
    torch.testing.assert_close(plan.sum(-1), a.expand(6, -1), atol=1e-4, rtol=0)
    torch.testing.assert_close(plan.sum(-2), b.expand(6, -1), atol=1e-4, rtol=0)
    # after only one iteration the rows are visibly off: the test above measures convergence
    one = log_sinkhorn_dustbin(scores, torch.tensor(0.3), iters=1).exp()
    assert (one.sum(-1) - a).abs().max() > 1e-3


def test_constant_shift_of_scores_and_dustbin_leaves_plan_unchanged():
    g = torch.Generator().manual_seed(1)
    scores = torch.randn(5, 4, 2, generator=g)
    z = torch.tensor(0.7)
    base = log_sinkhorn_dustbin(scores, z, iters=20)
    for c in (3.0, -2.5, 10.0):
        shifted = log_sinkhorn_dustbin(scores + c, z + c, iters=20)
        torch.testing.assert_close(shifted.exp(), base.exp(), atol=1e-5, rtol=1e-5)
    # shifting the scores but not the dustbin is a different problem (the test can fail)
    moved = log_sinkhorn_dustbin(scores + 3.0, z, iters=20)
    assert (moved.exp() - base.exp()).abs().max() > 1e-2


def test_one_view_full_block_reduces_to_a_monotone_function_of_cosine():
    """p = q = 1: the 2x2 plan [[x, 1-x], [1-x, x]] has x/(1-x) = exp((cos - z)/2), so S = sigmoid((cos - z)/2)."""
    d, z = 16, 0.4
    g = torch.Generator().manual_seed(2)
    img, txt = torch.randn(9, d, generator=g), torch.randn(13, d, generator=g)
    cos = nn_normalize(img) @ nn_normalize(txt).t()
    plain = make_sim(d, 1, d, use_sinkhorn=False)
    torch.testing.assert_close(plain(img, txt), cos, atol=cos_atol(d), rtol=0)
    sink = make_sim(d, 1, d, iters=20, dustbin=z)
    s = sink(img, txt)
    torch.testing.assert_close(s, torch.sigmoid((cos - z) / 2), atol=1e-5, rtol=0)
    # same ranking as the cosine in both directions
    assert (s.argsort(1) == cos.argsort(1)).all() and (s.argsort(0) == cos.argsort(0)).all()


def nn_normalize(x):
    return torch.nn.functional.normalize(x, dim=-1)


def test_gradients_reach_the_dustbin_and_both_embeddings():
    sim = make_sim()
    img = torch.randn(6, 32, requires_grad=True)
    txt = torch.randn(6, 16, requires_grad=True)
    s = sim(img, txt)
    loss = (0.2 + s - s.diagonal().unsqueeze(1)).clamp_min(0).sum()
    loss.backward()
    assert sim.dustbin.grad is not None and torch.isfinite(sim.dustbin.grad) and sim.dustbin.grad.abs() > 0
    assert img.grad.abs().sum() > 0 and txt.grad.abs().sum() > 0


def test_released_variant_is_block_max_sum_of_cosines():
    sim = make_sim(use_sinkhorn=False)
    g = torch.Generator().manual_seed(3)
    img, txt = torch.randn(4, 32, generator=g), torch.randn(5, 16, generator=g)
    expected = torch.empty(4, 5)
    for a in range(4):
        for b in range(5):
            ib = nn_normalize(img[a].view(4, 8))
            tb = nn_normalize(txt[b].view(2, 8))
            expected[a, b] = (ib @ tb.t()).max(0).values.sum()
    # a sum of q = 2 block maxima of 8-d cosines
    torch.testing.assert_close(sim(img, txt), expected, atol=2 * cos_atol(8), rtol=0)
    torch.testing.assert_close(sim.score_no_grad(img, txt), expected, atol=2 * cos_atol(8), rtol=0)


def test_block_affinity_and_dustbin_layout():
    g = torch.Generator().manual_seed(4)
    img, txt = torch.randn(2, 24, generator=g), torch.randn(3, 8, generator=g)
    a = block_affinity(img, txt, 4)
    assert a.shape == (2, 3, 6, 2)
    torch.testing.assert_close(
        a[1, 2, 5, 1], torch.nn.functional.cosine_similarity(img[1, 20:24], txt[2, 4:8], dim=0)
    )
    aug = augment_with_dustbin(a, torch.tensor(0.5))
    assert aug.shape == (2, 3, 7, 3)
    assert (aug[..., -1, :] == 0.5).all() and (aug[..., :, -1] == 0.5).all()


@pytest.mark.parametrize("readout", ["plan", "log_plan"])
@pytest.mark.parametrize(
    "z,temperature", [(1.0, 1.0), (-3.0, 1.0), (45.0, 1.0), (-45.0, 1.0), (0.5, 0.1), (2.0, 0.02)]
)
def test_fast_no_grad_path_matches_log_space(z, temperature, readout):
    sim = make_sim(dustbin=z, readout=readout, temperature=temperature)
    g = torch.Generator().manual_seed(5)
    img, txt = torch.randn(7, 32, generator=g), torch.randn(11, 16, generator=g)
    with torch.enable_grad():
        ref = sim(img, txt.requires_grad_())
    assert ref.requires_grad
    for chunk in (8, 100, 1 << 20):  # 1, a few, or all images per chunk
        fast = sim.score_no_grad(img, txt.detach(), chunk_elems=chunk)
        torch.testing.assert_close(fast, ref.detach(), atol=2e-6, rtol=1e-5)


def test_all_pairs_shards_and_create_similarity():
    from vsekit.config import SimilarityConfig

    sim = create_similarity(SimilarityConfig(name="aeom", block_dim=8, sinkhorn_iters=5), 16, views=2)
    assert isinstance(sim, AEOMSimilarity) and (sim.p, sim.q) == (4, 2)
    g = torch.Generator().manual_seed(6)
    img, txt = torch.randn(10, 32, generator=g), torch.randn(23, 16, generator=g)
    full = sim(img, txt).detach().numpy()
    sharded = all_pairs(sim, img, txt, image_shard=3, text_shard=7)
    # the same 20 log-space Sinkhorn iterations on 3 x 7 shards instead of all pairs: other tensor shapes
    np.testing.assert_allclose(sharded, full, atol=2e-6, rtol=1e-5)


def test_bad_shapes_and_configs_are_clear_errors():
    sim = make_sim()
    with pytest.raises(ValueError, match=r"image embeddings \[N, 32\]"):
        sim(torch.randn(3, 16), torch.randn(3, 16))
    with pytest.raises(ValueError, match=r"caption embeddings \[N, 16\]"):
        sim(torch.randn(3, 32), torch.randn(3, 32))
    with pytest.raises(ValueError, match="multiple of"):
        make_sim(embed_dim=12, block_dim=8)
    with pytest.raises(ValueError, match="sinkhorn_iters"):
        make_sim(iters=0)
    with pytest.raises(ValueError, match="need model.similarity.name=aeom"):
        create_similarity(SimilarityConfig(name="cosine"), 16, views=2)


def test_bench_aeom_runs_and_reports_ratio():
    from vsekit_lab.bench.aeom import bench_aeom

    out = bench_aeom(n_images=20, n_captions=100, dim=32, device="cpu", repeats=1, block_dim=16)
    assert out["n_images"] == 20 and out["p"] == 4 and out["q"] == 2
    for key in ("cosine_s", "aeom_s", "aeom_nosinkhorn_s", "ratio", "ratio_end_to_end"):
        assert out[key] > 0 and math.isfinite(out[key])
    assert out["max_abs_diff_vs_log_space"] < 1e-4


def test_converged_stop_matches_running_every_iteration():
    """No-grad scoring may stop at the Sinkhorn fixed point; the scores equal those of all `iters` iterations."""
    from vsekit.similarity.aeom import _scaled_sinkhorn_scores

    sim = make_sim(dustbin=1.0)
    sim.iters = 50
    g = torch.Generator().manual_seed(9)
    img, txt = torch.randn(9, 32, generator=g), torch.randn(13, 16, generator=g)
    early = sim.score_no_grad(img, txt)
    sim.converged_tol = 0.0
    torch.testing.assert_close(early, sim.score_no_grad(img, txt), atol=1e-6, rtol=1e-6)
    k = torch.rand(4, 2, 50, generator=g).exp()  # the stop is real: 2 iterations from a fixed point differ
    assert not torch.allclose(
        _scaled_sinkhorn_scores(k.clone(), 1.0, 4, 2, 1),
        _scaled_sinkhorn_scores(k.clone(), 1.0, 4, 2, 50, 1e-6),
    )


# ------------------------------------------------------------------------------------------ readouts


def avse_fixture():
    """(img_emb, cap_emb, outputs, block width, dustbin score) of the released-code AVSE fixture."""
    folder = reference_fixture_dir("avse")
    out = dict(np.load(folder / "outputs.npz"))
    meta = json.loads((folder / "meta.json").read_text())
    block = int(np.ravel(meta["block_dim"])[0])
    torch.serialization.add_safe_globals([argparse.Namespace])
    ckpt = torch.load(folder / "model_best.pth", map_location="cpu", weights_only=True)
    z = float(ckpt["model"]["sim_enc.bin_score"])
    return torch.from_numpy(out["img_emb"]), torch.from_numpy(out["cap_emb"]), out, block, z


@pytest.mark.parametrize("readout,key", [("log_plan", "sims_ot_variant"), ("maxsum", "sims")])
def test_readouts_give_the_released_code_scores(readout, key):
    """log_plan = the released Sinkhorn line (max/sum of the log plan), maxsum = its active line; both paths."""
    img, cap, out, block, z = avse_fixture()
    embed = cap.shape[1]
    views = img.shape[1] // embed
    cfg = SimilarityConfig(name="aeom", block_dim=block, sinkhorn_iters=20, readout=readout, dustbin_init=z)
    sim = AEOMSimilarity(embed, views, cfg)
    expected = torch.from_numpy(out[key])
    with torch.enable_grad():
        graded = sim(img, cap.clone().requires_grad_(True))
    assert graded.requires_grad
    torch.testing.assert_close(graded.detach(), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sim.score_no_grad(img, cap), expected, atol=1e-5, rtol=1e-5)
    if readout == "log_plan":  # per block pair, the log plan is the released `dbg_ot_logits`
        released_log_plan = torch.from_numpy(out["dbg_ot_logits"])
        torch.testing.assert_close(
            sim.matched_affinity(img, cap).detach(), released_log_plan, atol=1e-5, rtol=1e-5
        )
        # the plan readout (Eq. 2 read literally) scores the same plan's probabilities: not the released scores
        plan = AEOMSimilarity(
            embed, views, SimilarityConfig(name="aeom", block_dim=block, readout="plan", dustbin_init=z)
        )
        torch.testing.assert_close(
            plan.score_no_grad(img, cap), max_sum(released_log_plan.exp()), atol=1e-5, rtol=1e-5
        )
        assert (plan.score_no_grad(img, cap) - expected).abs().max() > 0.1


def test_use_sinkhorn_false_is_the_maxsum_readout():
    g = torch.Generator().manual_seed(11)
    img, txt = torch.randn(5, 32, generator=g), torch.randn(6, 16, generator=g)
    a = make_sim(use_sinkhorn=False, readout="log_plan")
    b = make_sim(readout="maxsum")
    assert a.readout == b.readout == "maxsum" and not a.use_sinkhorn and not b.use_sinkhorn
    torch.testing.assert_close(a(img, txt), b(img, txt))


def test_readout_spread_on_random_embeddings():
    """The plan's probabilities barely vary; the log plan and the block max-sum spread ~8-10x more (docs/avse.md)."""
    g = torch.Generator().manual_seed(0)
    img, txt = torch.randn(64, 2048, generator=g), torch.randn(64, 1024, generator=g)
    std = {
        r: float(make_sim(1024, 2, 512, readout=r).score_no_grad(img, txt).std())
        for r in ("plan", "log_plan", "maxsum")
    }
    assert std["plan"] < 0.008 and 0.02 < std["log_plan"] < 0.04 and 0.03 < std["maxsum"] < 0.06
    assert std["log_plan"] > 5 * std["plan"]


def test_temperature_divides_the_cosines_before_sinkhorn():
    """One view, one block: S_plan = sigmoid((cos / t - z) / 2) (the t = 1 case is tested above), S_log = its log."""
    d, z, t = 16, 0.4, 0.25
    g = torch.Generator().manual_seed(12)
    img, txt = torch.randn(7, d, generator=g), torch.randn(9, d, generator=g)
    cos = nn_normalize(img) @ nn_normalize(txt).t()
    expect = torch.sigmoid((cos / t - z) / 2)
    plan = make_sim(d, 1, d, dustbin=z, temperature=t, iters=50)
    torch.testing.assert_close(plan(img, txt), expect, atol=1e-5, rtol=0)
    torch.testing.assert_close(plan.score_no_grad(img, txt), expect, atol=1e-5, rtol=0)
    log = make_sim(d, 1, d, dustbin=z, temperature=t, iters=50, readout="log_plan")
    torch.testing.assert_close(log(img, txt), expect.log(), atol=1e-5, rtol=0)
    # the block max-sum has no Sinkhorn, so no temperature
    torch.testing.assert_close(
        make_sim(d, 1, d, temperature=t, readout="maxsum")(img, txt), cos, atol=cos_atol(d), rtol=0
    )


def test_readout_and_temperature_config():
    r = load_recipe("avse")
    sim = r.model.similarity
    assert (sim.readout, sim.temperature, sim.use_sinkhorn) == ("log_plan", 1.0, True)
    assert load_recipe("avse", ["model.similarity.readout=plan"]).model.similarity.readout == "plan"
    with pytest.raises(ConfigError, match="readout"):
        load_recipe("avse", ["model.similarity.readout=exp"])
    with pytest.raises(ConfigError, match="temperature"):
        load_recipe("avse", ["model.similarity.temperature=0"])
    with pytest.raises(ValueError, match="readout"):
        make_sim(readout="nope")
    # a run saved before `readout` existed was trained with the plan readout and is read back with it
    saved = to_dict(r)
    del saved["model"]["similarity"]["readout"]
    assert recipe_from_dict(saved).model.similarity.readout == "plan"
    assert recipe_from_dict(to_dict(r)).model.similarity.readout == "log_plan"
