# Float comparisons: pooling then projecting vs projecting then pooling sums <= 7 rows of 24-d features in
# another order: a few eps on O(1) embeddings (rtol 1e-5 / atol 1e-6, measured 2 eps) and on gradients, whose
# every entry sums terms up to the size of the largest ones (atol 32 eps x max |grad|, measured 1.4 eps x it);
# padding (set to 1e3) leaking into either path would be off by O(1).
import pytest
import torch

from vsekit.config import ImageEncoderConfig, PoolingConfig
from vsekit.models.image import PrecompImageEncoder


@pytest.mark.parametrize("feature_type", ["grid", "region"])
def test_precomp_encoder_equals_pooling_the_projected_set(feature_type):
    """The grid + average shortcut (pool, then project) must give the projected-then-pooled embedding."""
    torch.manual_seed(0)
    cfg = ImageEncoderConfig(feature_type=feature_type, pooling=PoolingConfig(name="avg"))
    enc = PrecompImageEncoder(24, 8, cfg).eval()
    feats = torch.randn(5, 7, 24)
    lengths = torch.tensor([7, 3, 1, 5, 7])
    feats[1, 3:] = 1e3  # padding must not leak into either path
    # a random probe, as the embeddings the model makes of these are unit vectors
    probe = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))
    fast = enc(feats, lengths)
    (fast * probe).sum().backward()
    fast_grad = enc.fc.weight.grad.clone()
    enc.zero_grad()
    ref = enc.pool(enc.embed_set(feats, lengths), lengths)
    (ref * probe).sum().backward()
    torch.testing.assert_close(fast, ref, atol=1e-6, rtol=1e-5)
    ref_grad = enc.fc.weight.grad
    grad_atol = 32 * torch.finfo(torch.float32).eps * float(ref_grad.abs().max())
    torch.testing.assert_close(fast_grad, ref_grad, atol=grad_atol, rtol=1e-5)
