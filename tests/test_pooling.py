# Float comparisons: pooled features are weighted sums of <= 9 O(1) float32 values, so a different batch
# shape, padding or order rounds them differently by a few eps: allclose atol 1e-6 + rtol 1e-5 (>= 80 eps);
# weights sum to 1 within <= 9 eps; sorting only moves values, so sorted values and their gradients are exact.
import pytest
import torch

from vsekit.pooling import GPO, AvgPool, KMaxPool, MaxPool


def _batch(b=4, n=9, d=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(b, n, d, generator=g)
    lengths = torch.tensor([9, 5, 1, 7])[:b]
    return x, lengths


def test_gpo_weights_sum_to_one_and_zero_on_padding():
    gpo = GPO()
    x, lengths = _batch()
    _, w = gpo(x, lengths, return_weights=True)
    assert torch.allclose(w.sum(1), torch.ones(len(lengths)), atol=1e-6)
    for i, n in enumerate(lengths.tolist()):
        assert torch.all(w[i, n:] == 0)


def test_gpo_blind_to_padding_content():
    gpo = GPO()
    x, lengths = _batch()
    y = x.clone()
    for i, n in enumerate(lengths.tolist()):
        y[i, n:] = 1e3 * torch.randn_like(y[i, n:])
    assert torch.allclose(gpo(x, lengths), gpo(y, lengths), atol=1e-6)


def test_gpo_permutation_invariant():
    gpo = GPO()
    x, lengths = _batch()
    y = x.clone()
    for i, n in enumerate(lengths.tolist()):
        y[i, :n] = x[i, torch.randperm(n)]
    assert torch.allclose(gpo(x, lengths), gpo(y, lengths), atol=1e-6)


def test_gpo_one_hot_weights_give_max():
    gpo = GPO()
    x, lengths = _batch()
    # a huge positive bias on rank 0 only: make the linear layer score position 0 far above the rest
    with torch.no_grad():
        gpo.linear.weight.zero_()
    w = gpo.weights_for_lengths(lengths, 9)
    assert torch.allclose(w[0], torch.full((9,), 1 / 9), atol=1e-6)  # zero scores -> uniform = average
    one_hot = torch.zeros_like(w)
    one_hot[:, 0] = 1
    gpo.weights_for_lengths = lambda lengths, max_len: one_hot[: len(lengths), :max_len]
    assert torch.allclose(gpo(x, lengths), MaxPool()(x, lengths), atol=1e-6)


def test_gpo_uniform_weights_give_average():
    gpo = GPO()
    with torch.no_grad():
        gpo.linear.weight.zero_()
    x, lengths = _batch()
    assert torch.allclose(gpo(x, lengths), AvgPool()(x, lengths), atol=1e-5)


def test_gpo_per_length_cache_equals_per_sample():
    gpo = GPO()
    x, lengths = _batch()
    lengths = torch.tensor([9, 5, 5, 9])
    batched = gpo(x, lengths)
    single = torch.cat([gpo(x[i : i + 1, : lengths[i]], lengths[i : i + 1]) for i in range(4)])
    assert torch.allclose(batched, single, atol=1e-6)


def test_gpo_parameter_count_matches_reference():
    assert sum(p.numel() for p in GPO(32, 32).parameters()) == 12704


def test_gpo_gradients_flow():
    gpo = GPO()
    x, lengths = _batch()
    x.requires_grad_(True)
    gpo(x, lengths).sum().backward()
    assert x.grad.abs().sum() > 0 and all(
        p.grad is not None and p.grad.abs().sum() > 0 for p in gpo.parameters()
    )


def test_simple_poolings_ignore_padding():
    x, lengths = _batch()
    for pool in (AvgPool(), MaxPool(), KMaxPool(3)):
        y = x.clone()
        y[1, 5:] = 99.0
        assert torch.allclose(pool(x, lengths), pool(y, lengths))
    assert torch.allclose(AvgPool()(x, lengths)[1], x[1, :5].mean(0))
    assert torch.allclose(KMaxPool(3)(x, lengths)[1], x[1, :5].topk(3, dim=0).values.mean(0))
    assert torch.allclose(KMaxPool(3)(x, lengths)[2], x[2, 0])  # k clipped to the set size 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_fast_cpu_sort_matches_torch_sort_values_and_gradients(dtype):
    """The numpy-argsort CPU path must be a drop-in for `sort(dim=1, descending=True).values`."""
    from vsekit.pooling.basic import sort_values_desc

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 7, 5, generator=g).to(dtype)
    x[0, 2, 1] = x[0, 4, 1]  # a tie: equal values, so the sorted values do not depend on who goes first
    upstream = torch.randn(3, 7, 5, generator=g).to(dtype)
    a = x.clone().requires_grad_()
    b = x.clone().requires_grad_()
    fast = sort_values_desc(a)
    ref = b.sort(dim=1, descending=True).values
    assert torch.equal(fast, ref)
    (fast * upstream).sum().backward()
    (ref * upstream).sum().backward()
    untied = torch.ones_like(x, dtype=torch.bool)
    untied[0, [2, 4], 1] = False  # the two tied entries may swap their upstream gradients
    assert torch.equal(a.grad[untied], b.grad[untied])
    assert torch.allclose(a.grad[0, [2, 4], 1].sum().float(), b.grad[0, [2, 4], 1].sum().float())
