# Float comparisons: pooled features are O(1) sums of <= 12 float32 terms (softmax-weighted set elements), so a
# different batch shape, padding or element order changes them by a few eps; allclose's atol 1e-6 plus its
# default rtol 1e-5 (>= 80 eps of the value) covers that and still fails on any leak of padding or wrong
# weight. Softmax weights sum to 1 within <= N eps (N <= 9). Analytic limits (1e4 scores, x100) use their own
# looser tolerances. The cancelling balance bias is checked against the float32 noise of its own gradient.
import pytest
import torch

from vsekit.config import PoolingConfig, load_recipe
from vsekit.pooling import AvgPool, KMaxPool, MaxPool, create_pooling
from vsekit.pooling.adpool import ADPool
from vsekit_lab.bench.pool import POOLINGS, bench_pool

LENGTHS = torch.tensor([9, 5, 1, 7])
EPS32 = torch.finfo(torch.float32).eps


def _batch(b=4, n=9, d=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, n, d, generator=g), LENGTHS[:b].clone()


def _pools(d=6):
    torch.manual_seed(0)
    out = []
    for variant in ("paper", "reference"):
        for tok, emb in ((True, True), (True, False), (False, True)):
            out.append(ADPool(d, token_level=tok, embedding_level=emb, variant=variant))
    return out


def _randomise(pool: ADPool, seed: int = 1) -> ADPool:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in pool.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return pool


@pytest.mark.parametrize("pool", _pools(), ids=lambda p: p.extra_repr())
def test_balance_weights_sum_to_one(pool):
    x, lengths = _batch()
    _randomise(pool)
    _, w = pool(x, lengths, return_weights=True)
    bal = w["balance"]
    assert bal.shape == (4, 2)
    assert torch.allclose(bal.sum(1), torch.ones(4), atol=1e-6)
    assert torch.all(bal >= 0)
    if pool.token_level and pool.embedding_level:
        assert torch.all((bal > 0) & (bal < 1))  # a real mixture, not a switch
        assert not torch.allclose(bal[:, 0], bal[0, 0].expand(4))  # per-sample, input dependent
    else:
        assert torch.all(bal[:, 0 if pool.token_level else 1] == 1)


@pytest.mark.parametrize("pool", _pools(), ids=lambda p: p.extra_repr())
def test_padding_never_changes_the_output(pool):
    _randomise(pool)
    x, lengths = _batch()
    y = x.clone()
    for i, n in enumerate(lengths.tolist()):
        y[i, n:] = 1e4 * torch.randn_like(y[i, n:])
    y[3, 8] = float("nan")
    ref = pool(x, lengths)
    assert torch.allclose(ref, pool(y, lengths), atol=1e-6)
    # extra padding columns beyond the longest set change nothing either
    z = torch.cat([y, 1e4 * torch.ones(4, 3, 6)], dim=1)
    assert torch.allclose(ref, pool(z, lengths), atol=1e-6)
    # and each sample equals itself pooled alone without padding
    single = torch.cat([pool(x[i : i + 1, : lengths[i]], lengths[i : i + 1]) for i in range(4)])
    assert torch.allclose(ref, single, atol=1e-6)


@pytest.mark.parametrize("variant", ["paper", "reference"])
def test_token_weights_zero_on_padding(variant):
    pool = _randomise(ADPool(6, variant=variant))
    x, lengths = _batch()
    _, w = pool(x, lengths, return_weights=True)
    theta = w["token"]
    for i, n in enumerate(lengths.tolist()):
        assert torch.all(theta[i, n:] == 0)
        assert torch.allclose(theta[i, :n].sum(0), torch.ones_like(theta[i, 0]), atol=1e-6)


def test_permutation_invariant():
    pool = _randomise(ADPool(6))
    x, lengths = _batch()
    y = x.clone()
    for i, n in enumerate(lengths.tolist()):
        y[i, :n] = x[i, torch.randperm(n)]
    assert torch.allclose(pool(x, lengths), pool(y, lengths), atol=1e-6)


def test_token_branch_spans_mean_max_kmax():
    """Eq. 3 generalises the simple poolings: zero scorer = mean; a rank-0 bump = max."""
    x, lengths = _batch()
    x = x.abs() + 0.1  # positive features, so a scorer along +1 ranks the largest row first
    pool = ADPool(6, token_level=True, embedding_level=False)
    with torch.no_grad():
        pool.token_scorer.weight.zero_()
    assert torch.allclose(pool(x, lengths), AvgPool()(x, lengths), atol=1e-6)
    with torch.no_grad():
        pool.token_scorer.weight.fill_(1e4)  # rank 0 holds the per-dim maxima: highest score by far
    assert torch.allclose(pool(x, lengths), MaxPool()(x, lengths), atol=1e-4)
    assert not torch.allclose(MaxPool()(x, lengths), KMaxPool(3)(x, lengths))


def test_embedding_branch_is_softmax_weighted_per_dimension():
    x, lengths = _batch()
    pool = ADPool(6, token_level=False, embedding_level=True)
    out = pool(x, lengths)
    for i, n in enumerate(lengths.tolist()):
        xi = x[i, :n]
        expect = (torch.softmax(xi, 0) * xi).sum(0)
        assert torch.allclose(out[i], expect, atol=1e-6)
    # a scaled-up set approaches max pooling (soft max)
    assert torch.allclose(pool(100 * x, lengths) / 100, MaxPool()(x, lengths), atol=1e-2)


def test_balance_combines_branches_as_eq5():
    pool = _randomise(ADPool(6))
    x, lengths = _batch()
    out, w = pool(x, lengths, return_weights=True)
    tok = ADPool(6, embedding_level=False)
    tok.token_scorer.load_state_dict(pool.token_scorer.state_dict())
    emb = ADPool(6, token_level=False)
    t, e = tok(x, lengths), emb(x, lengths)
    logits = torch.stack([t @ pool.balance.weight[0], e @ pool.balance.weight[0]], 1)
    assert torch.allclose(w["balance"], torch.softmax(logits, 1), atol=1e-6)
    assert torch.allclose(out, w["balance"][:, :1] * t + w["balance"][:, 1:] * e, atol=1e-6)


@pytest.mark.parametrize("variant", ["paper", "reference"])
def test_gradients_flow_to_every_parameter(variant):
    pool = ADPool(6, variant=variant)
    x, lengths = _batch()
    x.requires_grad_(True)
    target = torch.randn(4, 6, generator=torch.Generator().manual_seed(3))
    out, w = pool(x, lengths, return_weights=True)
    loss = ((out - target) ** 2).sum()
    omega = w["balance"]
    (g_omega,) = torch.autograd.grad(loss, omega, retain_graph=True)
    loss.backward()
    # the balance bias enters both logits of every sample: its gradient is a sum of 2B logit gradients that
    # cancel in pairs, each the softmax backward omega * (g - omega . g); in float32 it is rounding noise of a
    # few eps x the absolute sum of the terms before they cancel
    om = omega.detach()
    terms_abs = float((om * g_omega).abs().sum() + (om * (om * g_omega).sum(1, keepdim=True)).abs().sum())
    names = dict(pool.named_parameters())
    released = {"token_scorer.bias", "balance.bias"} if variant == "reference" else set()
    expected = {"token_scorer.weight", "balance.weight"} | released
    assert set(names) == expected
    for name, p in names.items():
        if name == "balance.bias":  # the released layout's balance bias shifts both logits: it cancels
            # measured <= 0.32 eps x terms_abs over 300 random initialisations, on native, default and avx2
            assert p.grad is not None and p.grad.abs().max() <= 4 * EPS32 * terms_abs
            continue
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert x.grad.abs().sum() > 0
    for i, n in enumerate(LENGTHS.tolist()):
        assert torch.all(x.grad[i, n:] == 0)  # no gradient leaks into padding


def test_parameter_counts():
    assert sum(p.numel() for p in ADPool(1024).parameters()) == 2 * 1024
    # released layout: D x D scorer + bias, balance weight + bias
    assert (
        sum(p.numel() for p in ADPool(1024, variant="reference").parameters())
        == 1024 * 1024 + 1024 + 1024 + 1
    )
    assert sum(p.numel() for p in ADPool(1024, embedding_level=False).parameters()) == 1024
    assert sum(p.numel() for p in ADPool(1024, token_level=False).parameters()) == 0


def test_bad_input_errors():
    with pytest.raises(ValueError, match="at least one branch"):
        ADPool(6, token_level=False, embedding_level=False)
    with pytest.raises(ValueError, match="variant"):
        ADPool(6, variant="nope")
    pool = ADPool(6)
    with pytest.raises(ValueError, match=r"\[B, N, 6\]"):
        pool(torch.zeros(2, 3, 5), torch.tensor([3, 3]))
    with pytest.raises(ValueError, match="length is 0"):
        pool(torch.zeros(2, 3, 6), torch.tensor([3, 0]))


def test_create_pooling_and_recipe_wire_adpool():
    cfg = PoolingConfig(name="adpool", token_level=False, adpool_variant="reference")
    pool = create_pooling(cfg, 8)
    assert (
        isinstance(pool, ADPool)
        and not pool.token_level
        and pool.embedding_level
        and pool.variant == "reference"
    )
    r = load_recipe("vse_2ad")
    # defaults: the released code's forms behind the paper's tables and figures (docs/reproduce.md)
    assert PoolingConfig().adpool_variant == "reference"
    for p in (r.model.image.pooling, r.model.text.pooling):
        assert p.name == "adpool" and p.token_level and p.embedding_level and p.adpool_variant == "reference"
        assert p.adpool_mask_padding  # the released padding leak is not a default
    assert r.loss.name == "adopt" and r.loss.temperature == 0.05 and r.loss.adopt_variant == "reference"
    assert not r.loss.adopt_zero_fill_negatives  # nor is its positive-as-negative pick
    paper = load_recipe("vse_2ad", ["model.image.pooling.adpool_variant=paper"]).model.image.pooling
    assert create_pooling(paper, 8).token_scorer.weight.shape == (1, 8)  # one weight per rank
    assert create_pooling(r.model.image.pooling, 8).token_scorer.weight.shape == (
        8,
        8,
    )  # per rank and dimension
    assert r.optim.lr == 5e-4 and r.optim.lr_decay_epochs == [15] and r.optim.lr_decay == 0.1
    assert r.train.epochs == 25 and r.train.batch_size == 128 and r.model.embed_dim == 1024


def test_lr_decays_once_not_compounding():
    from vsekit.training.trainer import lr_at_epoch

    r = load_recipe("vse_2ad")
    lrs = [lr_at_epoch(r.optim.lr, e, r.optim.lr_decay_epochs, r.optim.lr_decay) for e in range(25)]
    assert lrs[14] == pytest.approx(5e-4) and all(lr == pytest.approx(5e-5) for lr in lrs[15:])


def test_bench_pool_times_every_pooling():
    rows = bench_pool(batch=4, n=5, dim=8, repeats=2, warmup=1, variable_lengths=True)
    assert [r["pooling"] for r in rows] == list(POOLINGS)
    for r in rows:
        assert r["ms_median"] > 0 and r["ms_min"] <= r["ms_median"] and r["batch"] == 4 and r["dim"] == 8
    assert rows[0]["vs_avg"] == pytest.approx(1.0)
    params = {r["pooling"]: r["params"] for r in rows}
    assert params["adpool"] == 16 and params["adpool-ref"] == 8 * 8 + 8 + 8 + 1 and params["avg"] == 0
    with pytest.raises(ValueError, match="unknown pooling"):
        bench_pool(poolings=("nope",))


def test_bench_pool_cli_prints_table_and_writes_json(tmp_path, capsys):
    import json

    from vsekit.cli import main as vse_main

    def main(argv):
        return vse_main(["bench", "pool", *argv])

    out = tmp_path / "bench.json"
    assert (
        main(
            [
                "--batch",
                "3",
                "--n",
                "4",
                "--dim",
                "8",
                "--repeats",
                "1",
                "--warmup",
                "0",
                "--poolings",
                "avg",
                "adpool",
                "--json-out",
                str(out),
            ]
        )
        == 0
    )
    table = capsys.readouterr().out
    assert "| pooling |" in table and "| adpool | 3x4x8 | 16 |" in table
    assert "`vse bench pool --batch 3 --n 4 --dim 8 --repeats 1 --warmup 0 --poolings avg adpool`" in table
    rows = json.loads(out.read_text())["rows"]
    assert [r["pooling"] for r in rows] == ["avg", "adpool"] and rows[0]["vs_avg"] == 1.0
    assert main(["--batch", "3", "--n", "4", "--dim", "8", "--poolings", "nope"]) == 2
    assert "unknown pooling" in capsys.readouterr().err
