"""AEOM vs cosine: time to score every image against every caption, and then to evaluate the matrix.

AVSE claims its block matching stays within a small factor of a global (cosine) method's inference time.
This times, on the same machine and thread settings, with the two interleaved repeat by repeat so that
load from other processes hits both alike:

- `cosine_s`: `all_pairs` with the inner product of [n_images, dim] and [n_captions, dim] embeddings;
- `aeom_s`: `all_pairs` with AEOM on [n_images, views*dim] image embeddings (c Sinkhorn iterations);
- `aeom_nosinkhorn_s`: the released code's block max-sum (no Sinkhorn);
- `*_e2e_s`: the same plus the retrieval metrics (`evaluate_sims`), i.e. embeddings -> R@K.

Medians over `repeats`; `ratio` = aeom_s / cosine_s, `ratio_end_to_end` = aeom_e2e_s / cosine_e2e_s.
`max_abs_diff_vs_log_space` checks the fast scoring path against the differentiable log-space one on
the first few images.

    from vsekit_lab.bench.aeom import bench_aeom
    bench_aeom(1000, 5000, 1024, "cpu", 3)

or `vse bench aeom --images 1000 --captions 5000 --dim 1024`. `bench_aeom_eval` (`--model-eval`)
times the whole `vse eval` path instead: encoders + scoring + metrics, AVSE recipe vs VSE∞ recipe.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from vsekit.config import SimilarityConfig
from vsekit.errors import VseInputError
from vsekit.metrics import evaluate_sims
from vsekit.similarity import CosineSimilarity, all_pairs
from vsekit.similarity.aeom import AEOMSimilarity


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device) -> tuple[float, np.ndarray]:
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    return time.perf_counter() - t0, out


def bench_aeom(
    n_images: int = 1000,
    n_captions: int = 5000,
    dim: int = 1024,
    device: str = "cpu",
    repeats: int = 3,
    *,
    views: int = 2,
    block_dim: int = 512,
    iters: int = 20,
    dustbin: float = 1.0,
    seed: int = 0,
) -> dict:
    """Median wall-clock seconds of cosine vs AEOM all-pairs scoring (and + metrics); see module doc."""
    if min(n_images, n_captions, dim, repeats, views, block_dim, iters) < 1:
        raise VseInputError("n_images, n_captions, dim, repeats, views, block_dim and iters must be positive")
    if dim % block_dim:
        raise VseInputError(f"dim={dim} must be a multiple of block_dim={block_dim}")
    dev = torch.device(device)
    g = torch.Generator().manual_seed(seed)
    img = torch.nn.functional.normalize(torch.randn(n_images, views, dim, generator=g), dim=-1).reshape(
        n_images, -1
    )
    txt = torch.nn.functional.normalize(torch.randn(n_captions, dim, generator=g), dim=-1)
    img_single = img[:, :dim].contiguous()  # a global method's image embedding has the caption's size
    cap2img = np.arange(n_captions) % n_images  # every image has a caption
    cosine = CosineSimilarity()
    cfg = SimilarityConfig(
        name="aeom", block_dim=block_dim, sinkhorn_iters=iters, use_sinkhorn=True, dustbin_init=dustbin
    )
    aeom = AEOMSimilarity(dim, views, cfg).to(dev)
    plain = AEOMSimilarity(
        dim, views, SimilarityConfig(name="aeom", block_dim=block_dim, use_sinkhorn=False)
    ).to(dev)
    img, txt, img_single = img.to(dev), txt.to(dev), img_single.to(dev)

    def score(sim, im):
        return lambda: all_pairs(sim, im, txt, dev)

    times: dict[str, list[float]] = {
        k: [] for k in ("cosine", "aeom", "aeom_nosinkhorn", "cosine_e2e", "aeom_e2e")
    }
    score(cosine, img_single)()  # warm-up (allocator, thread pool)
    score(aeom, img[: min(n_images, 8)])()
    for _ in range(repeats):
        for name, sim, im in (
            ("cosine", cosine, img_single),
            ("aeom", aeom, img),
            ("aeom_nosinkhorn", plain, img),
        ):
            t, sims = _timed(score(sim, im), dev)
            times[name].append(t)
            if name in ("cosine", "aeom"):
                t0 = time.perf_counter()
                evaluate_sims(sims, cap2img)
                times[f"{name}_e2e"].append(t + time.perf_counter() - t0)
    with torch.enable_grad():
        k = min(n_images, 4)
        ref = aeom(img[:k], txt.requires_grad_(True)).detach()
        txt.requires_grad_(False)
    fast = aeom.score_no_grad(img[:k], txt)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "n_images": n_images,
        "n_captions": n_captions,
        "dim": dim,
        "views": views,
        "block_dim": block_dim,
        "p": aeom.p,
        "q": aeom.q,
        "iters": iters,
        "device": str(dev),
        "threads": torch.get_num_threads(),
        "repeats": repeats,
        **{f"{k}_s": v for k, v in med.items()},
        "ratio": med["aeom"] / med["cosine"],
        "ratio_nosinkhorn": med["aeom_nosinkhorn"] / med["cosine"],
        "ratio_end_to_end": med["aeom_e2e"] / med["cosine_e2e"],
        "max_abs_diff_vs_log_space": float((fast - ref).abs().max()),
    }


def bench_aeom_eval(
    n_images: int = 1000,
    captions_per_image: int = 5,
    device: str = "cpu",
    repeats: int = 3,
    *,
    regions: int = 36,
    img_dim: int = 2048,
    overrides: list[str] | None = None,
    seed: int = 0,
) -> dict:
    """`vse eval` end to end (encode images and captions, score all pairs, metrics) under recipe `avse`
    (2 views, AEOM) and `vse_infty` (cosine), both at their default sizes, on one synthetic precomp split of
    `n_images` x `n_images*captions_per_image`; timed through `evaluate_model`, the path `vse eval` takes.
    Weights are random: the time does not depend on them."""
    import tempfile

    from vsekit.config import load_recipe
    from vsekit.data.precomp import load_precomp_split
    from vsekit.data.text import SPECIALS
    from vsekit.evaluation import evaluate_model
    from vsekit.models.vse import DataSpec, VSEModel
    from vsekit_lab.datasets.synthetic import ATTRIBUTES, FILLERS, make_synthetic_precomp

    if min(n_images, captions_per_image, repeats, regions, img_dim) < 1:
        raise VseInputError("n_images, captions_per_image, repeats, regions and img_dim must be positive")
    dev = torch.device(device)
    with tempfile.TemporaryDirectory(prefix="vse-bench-aeom-") as tmp:
        make_synthetic_precomp(
            tmp,
            n_train=1,
            n_dev=1,
            n_test=n_images,
            regions=regions,
            dim=img_dim,
            captions_per_image=captions_per_image,
            seed=seed,
        )
        n_caps = len(load_precomp_split(tmp, "test", captions_per_image).captions)
        spec = DataSpec(img_dim=img_dim, vocab_words=[*SPECIALS, *sorted(set(ATTRIBUTES) | set(FILLERS))])
        models = {}
        for name in ("vse_infty", "avse"):
            recipe = load_recipe(name, [f"data.captions_per_image={captions_per_image}", *(overrides or [])])
            torch.manual_seed(seed)
            models[name] = VSEModel(recipe, spec).to(dev).eval()
        times: dict[str, list[float]] = {name: [] for name in models}
        for model in models.values():  # warm-up
            evaluate_model(model, tmp, "test", device=dev, progress=False, max_images=min(n_images, 16))
        for _ in range(repeats):
            for name, model in models.items():
                _sync(dev)
                t0 = time.perf_counter()
                evaluate_model(model, tmp, "test", device=dev, progress=False)
                _sync(dev)
                times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    sim = models["avse"].sim
    return {
        "n_images": n_images,
        "n_captions": n_caps,
        "regions": regions,
        "img_dim": img_dim,
        "embed_dim": models["avse"].recipe.model.embed_dim,
        "views": sim.views,
        "block_dim": sim.block_dim,
        "iters": sim.iters,
        "device": str(dev),
        "threads": torch.get_num_threads(),
        "repeats": repeats,
        "cosine_eval_s": med["vse_infty"],
        "aeom_eval_s": med["avse"],
        "ratio_eval": med["avse"] / med["vse_infty"],
    }
