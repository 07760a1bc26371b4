# Float comparisons: a small transformer run on length-sorted chunks (other batch shapes and paddings) or from
# a cache differs by attention-softmax and GEMM rounding through a few layers: atol 2e-5 / rtol 1e-4 on O(1)
# embeddings, atol 2e-4 / rtol 1e-3 on gradients summed over the batch (measured <= 2% of them).
import pytest
import torch

from vsekit.config import PoolingConfig, TextEncoderConfig
from vsekit.models.text import TransformerTextEncoder, default_transformer_path, load_tokenizer

CAPTIONS = [
    "cat",
    "a red fire truck with a long ladder and flashing lights on a city street at night",
    "tree",
    "an old sailing ship",
    "sun",
    "a bicycle leaning against a brick wall",
    "x",
    "two dogs",
]


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
        cfg = TextEncoderConfig(
            kind="transformer", length_sorted_chunk=chunk, pooling=PoolingConfig(name=pool)
        )
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
    enc.body.register_forward_hook(
        lambda module, args, kwargs, out: seen.append(len(kwargs["input_ids"])), with_kwargs=True
    )
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
    assert tokenize_words(caption, "nltk") == [
        "a",
        "man",
        "'s",
        "black-and-white",
        "t-shirt",
        "does",
        "n't",
        "fit",
        ".",
    ]
    assert tokenize_words(caption, "regex") == [
        "a",
        "man's",
        "black",
        "-",
        "and",
        "-",
        "white",
        "t",
        "-",
        "shirt",
        "doesn't",
        "fit",
        ".",
    ]
    vocab = Vocabulary(
        ["<pad>", "<start>", "<end>", "<unk>", "man", "'s", "t-shirt", "<mask>"], tokenizer="nltk"
    )
    assert vocab.encode("man's t-shirt") == [1, 4, 5, 6, 2]
    with pytest.raises(ValueError, match="unknown tokenizer"):
        Vocabulary(["<pad>", "<start>", "<end>", "<unk>", "<mask>"], tokenizer="spacy")


# ------------------------------------------------------------------- BiGRU tokenisation and vocabularies
BIGRU_RECIPES = ("vse_infty", "vsepp", "vse_2ad", "cvsepp", "cvsepp_auto", "avse", "vse_infty_grid_e2e")


def test_nltk_tokens_are_the_treebank_ones_and_regex_is_unchanged():
    from nltk.tokenize import TreebankWordTokenizer

    from vsekit.data.text import tokenize_words

    caption = "A man's black-and-white dog doesn't run."
    treebank = TreebankWordTokenizer().tokenize(caption.lower())
    assert treebank == ["a", "man", "'s", "black-and-white", "dog", "does", "n't", "run", "."]
    assert tokenize_words(caption, "nltk") == treebank
    assert tokenize_words(caption, "regex") == [
        "a",
        "man's",
        "black",
        "-",
        "and",
        "-",
        "white",
        "dog",
        "doesn't",
        "run",
        ".",
    ]


def test_nltk_tokens_split_sentences_as_the_released_word_tokenize():
    """`nltk.word_tokenize` runs punkt first, so a period inside a caption is its own token (on one line the
    Treebank tokenizer would keep "bike." whole); a known abbreviation keeps its period. No punkt data used."""
    from vsekit.data.text import tokenize_words

    assert tokenize_words("A man rides a bike. He wears a helmet.", "nltk") == [
        "a",
        "man",
        "rides",
        "a",
        "bike",
        ".",
        "he",
        "wears",
        "a",
        "helmet",
        ".",
    ]
    assert tokenize_words("Crowds on St. Patrick's day", "nltk") == [
        "crowds",
        "on",
        "st.",
        "patrick",
        "'s",
        "day",
    ]
    assert tokenize_words("", "nltk") == []


def test_scan_vocabulary_keeps_possessives_and_negations(tmp_path, recwarn):
    import json

    from vsekit.config import load_recipe
    from vsekit.data.text import UNK, Vocabulary
    from vsekit.training.trainer import DataSpec, load_text_processor

    words = ["<pad>", "<start>", "<end>", "<unk>", "a", "man", "'s", "dog", "does", "n't", "run", "."]
    path = tmp_path / "f30k_precomp_vocab.json"
    path.write_text(
        json.dumps(
            {
                "word2idx": {w: i for i, w in enumerate(words)},
                "idx2word": {str(i): w for i, w in enumerate(words)},
                "idx": len(words),
            }
        )
    )
    caption = "A man's dog doesn't run."
    vocab = Vocabulary.load(path)
    ids = vocab.encode(caption)
    assert vocab.tokenizer == "nltk" and vocab.word2idx[UNK] not in ids
    assert ids == [1, 4, 5, 6, 7, 8, 9, 10, 11, 2] and vocab.idx2word[-1] == "<mask>"
    with pytest.warns(UserWarning, match="SCAN vocabulary holds nltk"):
        forced = Vocabulary.load(path, "regex")
    assert forced.tokenizer == "nltk" and forced.encode(caption) == ids
    # the trainer records the tokenizer it used, which `vse eval` rebuilds the vocabulary with
    recipe = load_recipe("vse_infty", ["model.text.tokenizer=regex", f"model.text.vocab_path={path}"])
    spec = DataSpec(img_dim=8)
    with pytest.warns(UserWarning):
        text = load_text_processor(recipe, ["unused"], spec)
    assert (
        recipe.model.text.tokenizer == "nltk"
        and text.encode(caption) == ids
        and spec.vocab_words == words + ["<mask>"]
    )


@pytest.mark.parametrize("name", BIGRU_RECIPES)
def test_bigru_recipes_default_to_the_releases_tokens_and_scan_min_count(name):
    from vsekit.config import load_recipe

    text = load_recipe(name).model.text
    assert (text.kind, text.tokenizer, text.vocab_min_count) == ("bigru", "nltk", 4)
    assert (
        load_recipe(name, ["model.text.tokenizer=regex"]).model.text.tokenizer == "regex"
    )  # still an option


def test_small_data_keeps_min_count_one():
    from vsekit.config import load_recipe
    from vsekit_lab.demo import DEMO_OVERRIDES

    assert "model.text.vocab_min_count=1" in DEMO_OVERRIDES
    assert load_recipe("bow").model.text.vocab_min_count == 1


def test_vocabulary_min_count_and_cached_ids():
    from vsekit.data.text import Vocabulary

    captions = ["a dog runs.", "a dog sits.", "a dog's toy.", "a cat runs."]
    vocab = Vocabulary.build(captions, min_count=3, tokenizer="nltk")
    assert vocab.idx2word[5:] == [".", "a", "dog"]  # "a" 4x, "dog" 3x, "." 4x; the rest < 3
    first = vocab.encode("a dog's run")
    assert first == vocab.encode("a dog's run") == [1, 6, 7, 3, 3, 2]  # "'s" and "run" are <unk>
    assert "a dog's run" in vocab._ids  # nltk tokens are computed once per caption
