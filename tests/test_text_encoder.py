import pytest
import torch

from vsekit.config import PoolingConfig, TextEncoderConfig
from vsekit.models.text import TransformerTextEncoder, default_transformer_path, load_tokenizer

CAPTIONS = ["cat", "a red fire truck with a long ladder and flashing lights on a city street at night",
            "tree", "an old sailing ship", "sun", "a bicycle leaning against a brick wall", "x", "two dogs"]  # fmt: skip


def _batch():
    tok = load_tokenizer(default_transformer_path())
    enc = tok(CAPTIONS, padding=True, return_tensors="pt")
    return enc["input_ids"], enc["attention_mask"].sum(1)


@pytest.mark.parametrize("pool", ["gpo", "avg"])
def test_length_sorted_chunks_give_the_padded_batch_embeddings_and_gradients(pool):
    tokens, lengths = _batch()
    assert lengths.max() > 3 * lengths.min()  # padding would dominate the short captions
    out, grads = [], []
    for chunk in (0, 3):
        torch.manual_seed(0)
        cfg = TextEncoderConfig(kind="transformer", length_sorted_chunk=chunk, pooling=PoolingConfig(name=pool))
        enc = TransformerTextEncoder(16, cfg).eval()
        x = enc(tokens, lengths)
        x.square().sum().backward()
        out.append(x.detach())
        grads.append(enc.proj.weight.grad.clone())
    torch.testing.assert_close(out[0], out[1], atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(grads[0], grads[1], atol=2e-4, rtol=1e-3)
    assert out[0].shape == (len(CAPTIONS), 16)
