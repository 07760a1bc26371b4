"""Cost of the (adaptive) ladder loss: one full training step against a VSE++ step.

The budget: a step with the adaptive ladder costs at most 1.3x a VSE++ step at batch 128. A step
is what the trainer does per batch, timed through the trainer's own `TrainStep`: encode images and captions,
similarity, loss, backward, gradient clipping, AdamW. The
model is the `vsepp` recipe (precomputed region features, BiGRU, average pooling); the three losses run
interleaved on the same batch so that load from other processes hits them alike; medians are reported.
The relevance comes from random clustered "sentence embeddings" (the loss only looks them up, so their
content does not change the cost). On CUDA the adaptive ladder is also timed without its CUDA graph
(`ladder_auto_eager`).

    from vsekit_lab.bench.ladder import bench_ladder_step
    row = bench_ladder_step(batch=128, device="cpu")   # row["ratio_auto"] = adaptive / VSE++ step time
"""

from __future__ import annotations

import statistics
import time

import torch

from vsekit.config import load_recipe
from vsekit.data.batch import Batch
from vsekit.errors import VseInputError
from vsekit.losses import create_loss
from vsekit.models.vse import DataSpec, VSEModel
from vsekit.training.step import TrainStep

LOSSES = {"vsepp": "vsepp", "ladder": "cvsepp", "ladder_auto": "cvsepp_auto"}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_ladder_step(
    batch: int = 128,
    device: str = "cpu",
    repeats: int = 10,
    warmup: int = 2,
    regions: int = 36,
    img_dim: int = 2048,
    embed_dim: int = 1024,
    seq_len: int = 12,
    vocab: int = 10000,
    seed: int = 0,
) -> dict:
    """Median ms of a full training step with the VSE++, ladder and adaptive-ladder losses, the same for
    the loss alone (forward + backward on a fixed similarity matrix), and the ratios to VSE++."""
    if batch < 2 or repeats < 1 or warmup < 0:
        raise VseInputError("batch must be >= 2, repeats >= 1, warmup >= 0")
    dev = torch.device(device)
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(batch, regions, img_dim, generator=g).to(dev)
    img_len = torch.full((batch,), regions, dtype=torch.long).to(dev)
    tokens = torch.randint(1, vocab, (batch, seq_len), generator=g).to(dev)
    tok_len = torch.randint(seq_len // 2, seq_len + 1, (batch,), generator=g)
    tok_len[0] = seq_len
    n_caps = batch * 20
    topics = torch.nn.functional.normalize(torch.randn(16, 384, generator=g), dim=-1)
    emb = topics[torch.randint(0, 16, (n_caps,), generator=g)] + 0.08 * torch.randn(n_caps, 384, generator=g)
    caption_ids = torch.randperm(n_caps, generator=g)[:batch].to(dev)
    image_ids = torch.arange(batch).to(dev)
    words = [f"w{i}" for i in range(vocab)]

    setups = {}
    losses_run = dict(LOSSES)
    if dev.type == "cuda":  # also the adaptive ladder without its CUDA graph, to show what the graph saves
        losses_run["ladder_auto_eager"] = "cvsepp_auto"
    for name, recipe_name in losses_run.items():
        recipe = load_recipe(recipe_name, [f"model.embed_dim={embed_dim}"])
        torch.manual_seed(seed)
        model = VSEModel(recipe, DataSpec(img_dim=img_dim, vocab_words=words)).to(dev)
        loss_fn = create_loss(
            recipe.loss, image_views=recipe.model.image.views, embed_dim=recipe.model.embed_dim
        )
        if name == "ladder_auto_eager":
            loss_fn.cuda_graphs = False
        if hasattr(loss_fn, "set_caption_embeddings"):
            loss_fn.set_caption_embeddings(emb)
        loss_fn.to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=recipe.optim.lr)
        # the trainer's own step body (encode, score, clip, AdamW), past the recipe's warm-up epochs
        setups[name] = (TrainStep(recipe, model, loss_fn, opt, dev), recipe.loss.warmup_epochs, loss_fn)

    batch_of = Batch(
        images=images,
        image_lengths=img_len,
        tokens=tokens,
        token_lengths=tok_len,
        image_index=image_ids,
        caption_index=caption_ids,
    )
    calls = {n: 0 for n in losses_run}

    def step(name: str) -> float:
        step_fn, epoch, _ = setups[name]
        _sync(dev)
        t0 = time.perf_counter()
        step_fn(batch_of, epoch, calls[name])
        calls[name] += 1
        _sync(dev)
        return (time.perf_counter() - t0) * 1e3

    sims0 = torch.rand(batch, batch, generator=g).to(dev)

    def loss_only(name: str) -> float:
        loss_fn = setups[name][2]
        s = sims0.clone().requires_grad_(True)
        _sync(dev)
        t0 = time.perf_counter()
        loss, _ = loss_fn(s, image_ids=image_ids, caption_ids=caption_ids, warmup=False)
        loss.backward()
        _sync(dev)
        return (time.perf_counter() - t0) * 1e3

    steps: dict[str, list[float]] = {n: [] for n in losses_run}
    losses: dict[str, list[float]] = {n: [] for n in losses_run}
    for i in range(warmup + repeats):
        for name in losses_run:  # interleaved: background load hits every loss alike
            t_step, t_loss = step(name), loss_only(name)
            if i >= warmup:
                steps[name].append(t_step)
                losses[name].append(t_loss)
    med = {n: statistics.median(v) for n, v in steps.items()}
    med_loss = {n: statistics.median(v) for n, v in losses.items()}
    return {
        "batch": batch,
        "device": str(dev),
        "threads": torch.get_num_threads(),
        "repeats": repeats,
        "model": f"vsepp recipe, {regions}x{img_dim} precomp regions, BiGRU, embed {embed_dim}",
        **{f"{n}_step_ms": med[n] for n in losses_run},
        **{f"{n}_loss_ms": med_loss[n] for n in losses_run},
        "ratio_fixed": med["ladder"] / med["vsepp"],
        "ratio_auto": med["ladder_auto"] / med["vsepp"],
        **(
            {"ratio_auto_eager": med["ladder_auto_eager"] / med["vsepp"]}
            if "ladder_auto_eager" in med
            else {}
        ),
    }
