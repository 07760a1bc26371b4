"""CLIP_benchmark's own zero-shot retrieval on a vsekit run gives the recalls of `vse eval`.

CLIP_benchmark (PyPI clip-benchmark 1.6.2, installed by scripts/setup.sh with --no-deps: its retrieval
module needs only torch and tqdm, while the package's requirements would pull torchvision and open_clip)
scores the shapes set's test split through `vsekit.interop.clip_benchmark`; the numbers are compared with
`vsekit.evaluation.evaluate_model` on the same split, key by key:

    image_retrieval_recall@k (per caption)          = t2i_r{k} / 100
    text_retrieval_recall@k  (per picture, any cap) = i2t_r{k} / 100

exactly, except where scores tie across the top-k boundary (vsekit counts a tie against the query,
`torch.topk` breaks it by position). The shapes set has such ties by construction: the two test pictures of a
(colour, shape) pair carry the same two captions, so a picture's best caption ties with its twin's copy.
"""

import json
import shutil

import numpy as np
import pytest
import torch

from vsekit.errors import VseInputError
from vsekit.interop.clip_benchmark import (
    CLIP_BENCHMARK_KEYS,
    lengths_from_padding,
    load_for_clip_benchmark,
    retrieval_dataloader,
    to_vsekit_keys,
)

KS = (1, 5, 10)


def tie_bounds(sims: np.ndarray, positives: np.ndarray, k: int, eps: float) -> tuple[float, float]:
    """(pessimistic, optimistic) recall@k in % of queries = rows of `sims`, positives a boolean mask: a query
    is a sure hit when fewer than k negatives score at least its best positive minus eps, a possible hit when
    fewer than k score above it plus eps."""
    best = np.where(positives, sims, -np.inf).max(1, keepdims=True)
    neg = ~positives
    sure = ((sims >= best - eps) & neg).sum(1) < k
    possible = ((sims > best + eps) & neg).sum(1) < k
    return 100.0 * sure.mean(), 100.0 * possible.mean()


@pytest.fixture(scope="module")
def scored(shapes_model):
    retrieval = pytest.importorskip("clip_benchmark.metrics.zeroshot_retrieval")
    import vsekit
    from vsekit.evaluation import evaluate_model

    data, run = shapes_model
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, transform, tokenizer = load_for_clip_benchmark(run)
        loader = retrieval_dataloader(data, "test", transform, batch_size=8)
        # amp=True is CLIP_benchmark's default (bfloat16 autocast on a CPU): the wrapper still runs in float32
        theirs = retrieval.evaluate(model, loader, tokenizer, "cpu", amp=True, recall_k_list=list(KS))
        ours, sims, cap2img = evaluate_model(vsekit.load(run), data, "test", progress=False)
        pictures = torch.cat([model.encode_image(x) for x, _ in loader])
        captions = [c for caps in loader.dataset.captions for c in caps]
        wrapped = (pictures @ model.encode_text(tokenizer(captions)).T).numpy()
    finally:
        torch.set_num_threads(threads)
    return theirs, ours, sims, cap2img, wrapped, loader.dataset


def test_wrapper_embeds_like_vse_eval(scored):
    _, _, sims, cap2img, wrapped, dataset = scored
    order = np.concatenate([np.nonzero(cap2img == i)[0] for i in range(len(dataset))])  # captions by picture
    assert wrapped.shape == sims.shape == (24, 48)
    # two float32 evaluations of cosines of 64-d unit embeddings (other batching): <= 2 (64 + 2) eps = 1.6e-5
    # apart (measured 0); a wrong picture or caption order moves them by O(0.1)
    np.testing.assert_allclose(
        wrapped, sims[:, order], atol=2e-5
    )  # pictures via the extractor = stored features


def test_clip_benchmark_recalls_equal_vse_eval_up_to_ties(scored):
    theirs, ours, sims, cap2img, _, _ = scored
    assert set(theirs) == {f"{name}_recall@{k}" for name in ("image_retrieval", "text_retrieval") for k in KS}
    converted = to_vsekit_keys(theirs)
    positives = cap2img[None, :] == np.arange(sims.shape[0])[:, None]  # [images, captions]
    exact = []
    for k in KS:
        for key, queries, mask in ((f"i2t_r{k}", sims, positives), (f"t2i_r{k}", sims.T, positives.T)):
            lo, hi = tie_bounds(queries, mask, k, eps=1e-5)
            assert lo == pytest.approx(ours[key], abs=1e-9), key  # the tie rule is vsekit's
            assert lo - 1e-4 <= converted[key] <= hi + 1e-4, (key, converted[key], lo, hi)
            if lo == hi:  # no tie at the boundary: the two must agree exactly
                assert converted[key] == pytest.approx(ours[key], abs=1e-4), key
                exact.append(key)
    # picture scores never tie (every t2i key is compared exactly); caption scores tie only among the twins'
    # shared captions, which leaves i2t R@10 tie-free on this set (R@1 and R@5 are checked within the bounds)
    assert {"t2i_r1", "t2i_r5", "t2i_r10", "i2t_r10"} <= set(exact), exact
    assert (
        converted["t2i_r1"] == pytest.approx(50.0) and ours["i2t_r1"] == 0.0
    )  # twins: half of t2i, ties at i2t@1


def test_key_map_and_units():
    assert CLIP_BENCHMARK_KEYS == {
        "image_retrieval_recall@{k}": "t2i_r{k}",
        "text_retrieval_recall@{k}": "i2t_r{k}",
    }
    got = to_vsekit_keys({"image_retrieval_recall@5": 0.25, "text_retrieval_recall@10": 1.0, "other@5": 0.3})
    assert got == {"t2i_r5": 25.0, "i2t_r10": 100.0}


def test_tokenizer_pads_with_the_runs_pad_id_and_lengths_come_back(shapes_model):
    _, run = shapes_model
    model, _, tokenizer = load_for_clip_benchmark(run)
    texts = ["a red circle", "green square on a white background", "blue"]
    tokens = tokenizer(texts)
    assert tokens.dtype == torch.long and tokens.shape[0] == 3 and tokenizer.pad_id == 0
    ids, lengths = model.vse.tokenize(texts)  # vsekit's own (ids, lengths)
    assert torch.equal(tokens, ids) and torch.equal(lengths_from_padding(tokens, tokenizer.pad_id), lengths)
    by_ids = model.encode_text(tokens)
    by_text = model.encode_text(texts)
    one = model.encode_text(tokenizer(["blue"]))  # alone, without padding: the same vector
    # ids and strings give the same tokens (bit-identical); alone, the caption goes through batch-1 GEMMs without
    # padding: O(0.1) entries of a 64-d unit vector, rtol 1e-5 + atol 1e-6 ~ 20 eps of them (measured 4% of it)
    assert (
        by_ids.shape == (3, 64)
        and torch.allclose(by_ids, by_text)
        and torch.allclose(by_ids[2:], one, atol=1e-6)
    )


def test_feature_run_without_extractor_cannot_take_pictures(shapes_model, tmp_path):
    _, run = shapes_model
    bare = shutil.copytree(run, tmp_path / "bare")
    cfg = json.loads((bare / "config.json").read_text())
    cfg.pop("extractor")
    cfg["data_dir"] = str(tmp_path / "gone")  # nor a dataset manifest to find one in
    (bare / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(VseInputError, match="cannot take pictures.*CLIP_benchmark"):
        load_for_clip_benchmark(bare)


def test_wrong_inputs_are_named(shapes_model):
    _, run = shapes_model
    model, _, _ = load_for_clip_benchmark(run)
    with pytest.raises(VseInputError, match="pixels"):
        model.encode_image(torch.zeros(2, 49, 1280))
    with pytest.raises(VseInputError, match="token ids"):
        model.encode_text(torch.zeros(2, 5))


def test_pixel_run_takes_pictures_with_its_backbone_transform(tmp_path):
    """A backbone run (here an untrained VSE∞ end-to-end model on the packaged EfficientNet-Lite0) takes the
    pictures themselves: the transform is `preprocess`'s, `encode_image` is the model's own on those pixels."""
    pytest.importorskip("efficientnet_lite_pytorch")
    from vsekit.api import preprocess
    from vsekit.config import load_recipe
    from vsekit.data.text import SPECIALS
    from vsekit.interop.clip_benchmark import ClipBenchmarkModel
    from vsekit.models.vse import DataSpec, VSEModel
    from vsekit_lab.datasets.shapes import draw_shape

    torch.manual_seed(0)
    recipe = load_recipe(
        "vse_infty_grid_e2e", ["model.embed_dim=32", "model.text.word_dim=16", "model.image.image_size=64"]
    )
    vse = VSEModel(recipe, DataSpec(vocab_words=list(SPECIALS) + ["a", "red", "circle"])).eval()
    model = ClipBenchmarkModel(vse, {})
    rng = np.random.default_rng(0)
    pictures = [draw_shape("red", "circle", rng), draw_shape("blue", "square", rng).convert("RGBA")]
    path = tmp_path / "p.png"
    pictures[0].save(path)
    pixels = torch.stack([model.transform(p) for p in pictures])
    assert pixels.shape == (2, 3, 64, 64)
    assert torch.equal(pixels[1], preprocess(vse, pictures[1])) and torch.equal(
        model.transform(path), pixels[0]
    )
    with torch.autocast("cpu", enabled=True):  # CLIP_benchmark's amp=True: the wrapper stays in float32
        emb = model.encode_image(pixels)
    with torch.no_grad():
        own = vse.encode_images(pixels, torch.full((2,), -1, dtype=torch.long))
    assert emb.dtype == torch.float32 and emb.shape == (2, 32)
    torch.testing.assert_close(emb, own)  # the wrapper turns autocast off: the same float32 ops, identical
