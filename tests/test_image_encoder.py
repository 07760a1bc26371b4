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
    fast = enc(feats, lengths)
    fast.square().sum().backward()
    fast_grad = enc.fc.weight.grad.clone()
    enc.zero_grad()
    ref = torch.nn.functional.normalize(enc.pool(enc.embed_set(feats, lengths), lengths), dim=-1)
    ref.square().sum().backward()
    torch.testing.assert_close(fast, ref, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(fast_grad, enc.fc.weight.grad, atol=1e-6, rtol=1e-5)
