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


def _frozen(cache_mb: int) -> TransformerTextEncoder:
    torch.manual_seed(0)
    cfg = TextEncoderConfig(kind="transformer", freeze=True, frozen_cache_mb=cache_mb, length_sorted_chunk=3)
    return TransformerTextEncoder(16, cfg)


def _count_body_rows(enc: TransformerTextEncoder) -> list[int]:
    seen: list[int] = []
    enc.body.register_forward_hook(lambda module, args, kwargs, out: seen.append(len(kwargs["input_ids"])), with_kwargs=True)
    return seen


def test_frozen_body_stays_in_eval_mode_and_is_deterministic_in_training():
    enc = _frozen(0).train()
    assert enc.training and enc.proj.training and not enc.body.training
    tokens, lengths = _batch()
    torch.testing.assert_close(enc(tokens, lengths), enc(tokens, lengths))  # no dropout in the body


def test_frozen_state_cache_gives_the_uncached_embeddings_and_gradients_and_skips_the_body():
    tokens, lengths = _batch()
    cached, plain = _frozen(64).train(), _frozen(0).train()
    plain.proj.load_state_dict(cached.proj.state_dict())
    plain.pool.load_state_dict(cached.pool.state_dict())
    rows = _count_body_rows(cached)
    for step in range(2):
        order = torch.randperm(len(CAPTIONS), generator=torch.Generator().manual_seed(step))
        outs, grads = [], []
        for enc in (cached, plain):
            enc.zero_grad()
            x = enc(tokens[order], lengths[order])
            x.square().sum().backward()
            outs.append(x.detach())
            grads.append(enc.proj.weight.grad.clone())
        torch.testing.assert_close(outs[0], outs[1], atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(grads[0], grads[1], atol=2e-4, rtol=1e-3)
    assert sum(rows) == len(CAPTIONS)  # the second step came from memory
    assert len(cached.frozen_cache) == len(CAPTIONS)


def test_frozen_state_cache_respects_its_budget_and_is_dropped_with_new_weights():
    tokens, lengths = _batch()
    enc = _frozen(64)
    enc.frozen_cache.capacity_bytes = int(lengths[:3].sum()) * enc.body.config.hidden_size * 4  # room for 3
    expected = _frozen(0)(tokens, lengths)
    torch.testing.assert_close(enc(tokens, lengths), expected, atol=2e-5, rtol=1e-4)
    assert 0 < len(enc.frozen_cache) < len(CAPTIONS)
    assert enc.frozen_cache.used_bytes <= enc.frozen_cache.capacity_bytes
    enc.load_state_dict(enc.state_dict())
    assert len(enc.frozen_cache) == 0 and enc.frozen_cache.used_bytes == 0


def test_nltk_tokenizer_gives_the_treebank_tokens_scan_vocabularies_hold():
    from vsekit.data.text import Vocabulary, tokenize_words

    caption = "A man's black-and-white T-shirt doesn't fit."
    assert tokenize_words(caption, "nltk") == ["a", "man", "'s", "black-and-white", "t-shirt", "does", "n't", "fit", "."]
    assert tokenize_words(caption, "regex") == ["a", "man's", "black", "-", "and", "-", "white", "t", "-", "shirt",
                                                "doesn't", "fit", "."]  # fmt: skip
    vocab = Vocabulary(["<pad>", "<start>", "<end>", "<unk>", "man", "'s", "t-shirt", "<mask>"], tokenizer="nltk")
    assert vocab.encode("man's t-shirt") == [1, 4, 5, 6, 2]
    with pytest.raises(ValueError, match="unknown tokenizer"):
        Vocabulary(["<pad>", "<start>", "<end>", "<unk>", "<mask>"], tokenizer="spacy")
