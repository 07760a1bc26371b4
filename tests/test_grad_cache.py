"""Gradient caching (train.grad_cache_chunk, vsekit.training.grad_cache): one cached step gives the gradients
and the loss of the unchunked step on the same batch and weights.

Tolerance 1e-5 (absolute, on gradients of at most ~0.5 and losses of ~7-60): the two steps do the same
float32 arithmetic in another order (chunked matmuls and sums, BatchNorm statistics combined from chunk sums),
so they differ by a few float32 roundings (~1e-7 relative; measured <= 3e-7 on gradients, <= 4e-6 on the
largest loss); an error in the method (a chunk's own BatchNorm statistics, a missed gradient path, randomness
not replayed) moves them by 1e-2 or more (the control test below measures one).
"""

import copy

import pytest
import torch
from torch import nn

from vsekit.config import ConfigError, load_recipe
from vsekit.distributed import DistContext
from vsekit.training import grad_cache as gc
from vsekit.training.grad_cache import GradCache, GradCacheError
from vsekit.training.step_parts import StepParts
from vsekit.training.step_setup import check_step_setup
from vsekit.training.trainer import TrainStep
from vsekit_lab.bench.train_step import build_train_step

TOL = 1e-5
SMALL = ["model.embed_dim=32", "model.text.word_dim=16", "model.image.mlp_hidden=24"]
SHAPES = {"regions": 5, "img_dim": 20, "embed_dim": 32, "vocab": 50, "min_tokens": 3, "max_tokens": 7}


def twin_steps(recipe: str, chunk: int, batch: int = 12, overrides=()):
    """(unchunked TrainStep, grad-cached TrainStep on an identical copy of model, loss and optimizer, batch, epoch)."""
    full, data, epoch = build_train_step(recipe, batch=batch, overrides=[*SMALL, *overrides], **SHAPES)
    r = copy.deepcopy(full.recipe)
    r.train.grad_cache_chunk = chunk
    model = copy.deepcopy(full.model)
    opt = torch.optim.AdamW(
        model.parameter_groups(r.optim.lr), lr=r.optim.lr, weight_decay=r.optim.weight_decay
    )
    cached = TrainStep(r, model, copy.deepcopy(full.loss_fn), opt, torch.device("cpu"))
    return full, cached, data, epoch


def assert_same_step(full: TrainStep, cached: TrainStep, out_full: dict, out_cached: dict) -> None:
    assert abs(float(out_full["loss"]) - float(out_cached["loss"])) <= TOL * max(
        1.0, abs(float(out_full["loss"]))
    )
    n_grads = 0
    for (name, p), q in zip(full.model.named_parameters(), cached.model.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None:
            n_grads += 1
            assert (p.grad - q.grad).abs().max().item() <= TOL, name
    assert n_grads > 4
    assert (
        sum(p.grad.abs().sum().item() for p in full.model.parameters() if p.grad is not None) > 0.1
    )  # not all zero
    # BatchNorm running statistics updated once, with the whole batch's statistics (not once per pass or chunk)
    for (name, a), b in zip(full.model.named_buffers(), cached.model.buffers(), strict=True):
        assert (a.double() - b.double()).abs().max().item() <= TOL, name


@pytest.mark.parametrize(
    ("recipe", "overrides", "chunk", "warmup"),
    [
        ("vsepp", [], 5, False),  # hardest-negative triplet; 5 does not divide 12
        ("vse_infty", [], 4, False),  # GPO; 4 divides 12
        ("vse_infty", [], 5, True),  # the warm-up epoch: triplet over all negatives
        ("vse_infty", ["loss.name=infonce"], 5, False),
        ("vse_2ad", [], 5, False),  # ADOPT (adaptive K from the full batch's matrix), ADPOOL
        ("vse_2ad", [], 4, False),
    ],
)
def test_cached_step_equals_the_full_batch_step(recipe, overrides, chunk, warmup):
    full, cached, data, epoch = twin_steps(recipe, chunk, overrides=overrides)
    epoch = 0 if warmup else epoch
    if warmup:
        assert full.recipe.loss.warmup_epochs > 0
    out_full, out_cached = full(data, epoch=epoch, step=0), cached(data, epoch=epoch, step=0)
    assert_same_step(full, cached, out_full, out_cached)
    chunks = -(-12 // chunk)
    # region features: the masked BatchNorm's extra passes (statistics; their gradient), image side only
    assert cached.grad_cache.passes == 2 * chunks + 2 * chunks + chunks + chunks
    if recipe == "vse_2ad":
        assert out_full["K_i2t"] == out_cached["K_i2t"]


@pytest.mark.parametrize(
    ("recipe", "overrides"),
    [
        (
            "avse",
            ["model.similarity.block_dim=16"],
        ),  # 2 random views (step generator), AEOM, view regulariser
        ("cvsepp", []),  # ladder loss: relevance looked up by the full batch's caption ids
        ("vse_infty", ["model.image.feature_type=grid"]),  # no BatchNorm: the plain two-pass GradCache
    ],
)
def test_cached_step_with_views_ladder_and_without_batchnorm(recipe, overrides):
    full, cached, data, epoch = twin_steps(recipe, 5, overrides=overrides)
    assert_same_step(full, cached, full(data, epoch=epoch, step=0), cached(data, epoch=epoch, step=0))
    has_bn = recipe != "vse_infty"
    assert cached.grad_cache.passes == (18 if has_bn else 12)


def test_without_the_batchnorm_handling_the_gradients_differ(monkeypatch):
    """Control: chunks normalised with their own statistics (what naive caching does) miss the tolerance by
    orders of magnitude, so the comparisons above can fail."""
    full, cached, data, epoch = twin_steps("vse_infty", 5)
    real_init = gc.FullBatchNorm.__init__

    def without_modules(self, model):
        real_init(self, model)
        self.modules = []

    monkeypatch.setattr(gc.FullBatchNorm, "__init__", without_modules)
    full(data, epoch=epoch, step=0)
    cached(data, epoch=epoch, step=0)
    worst = max(
        (p.grad - q.grad).abs().max().item()
        for p, q in zip(full.model.parameters(), cached.model.parameters())
        if p.grad is not None
    )
    assert worst > 100 * TOL


def test_randomness_is_replayed_between_the_passes():
    """Dropout (2-layer BiGRU, global CPU generator) and the step's generator: the cached step's gradient is
    the gradient of the loss on the embeddings its first pass computed, i.e. autograd through the same chunks
    drawn in the same order. Without replaying the random state the re-encoded chunks draw other masks."""
    full, data, epoch = build_train_step(
        "vse_infty",
        batch=12,
        overrides=[*SMALL, "model.image.feature_type=grid", "model.text.num_layers=2"],
        **SHAPES,
    )
    model = full.model
    model.text_encoder.gru.dropout = 0.5
    model.train()
    ref_model = copy.deepcopy(model)
    # reference: the chunks encoded once, with their graph, in the cached step's order; then the loss and backward
    torch.manual_seed(123)
    gen = torch.Generator().manual_seed(7)
    imgs, txts = [], []
    for s in range(0, 12, 5):
        e = min(s + 5, 12)
        imgs.append(ref_model.encode_images(data["images"][s:e], data["image_lengths"][s:e], generator=gen))
        txts.append(ref_model.encode_texts(data["tokens"][s:e], data["token_lengths"][s:e]))
    img, txt = torch.cat(imgs), torch.cat(txts)
    ref_loss, _ = full.loss_fn(ref_model.similarity(img, txt), image_ids=data["image_index"], warmup=False)
    ref_loss.backward()
    ref_loss = ref_loss.detach()
    after_ref = torch.get_rng_state()
    # the cached step, from the same random states
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    step = GradCache(StepParts(model, full.loss_fn, opt, torch.device("cpu"), grad_clip=0.0), 5)
    torch.manual_seed(123)
    loss, _, _, _ = step(data, torch.Generator().manual_seed(7))
    assert abs(float(loss) - ref_loss.item()) <= TOL * ref_loss.item()
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters(), strict=True):
        if q.grad is not None:
            assert (p.grad - q.grad).abs().max().item() <= TOL, name
    # one pass's worth of random numbers consumed: a resumed run replays the same draws
    assert torch.equal(torch.get_rng_state(), after_ref)
    # and dropout was live: the same chunks without replay (fresh draws) give another loss
    torch.manual_seed(999)
    with torch.no_grad():
        other = torch.cat(
            [
                model.encode_texts(data["tokens"][s : s + 5], data["token_lengths"][s : s + 5])
                for s in range(0, 12, 5)
            ]
        )
    assert (other - txt.detach()).abs().max().item() > 1e-3


def test_refused_settings_are_named():
    with pytest.raises(ConfigError, match="grad_cache_chunk.*compile"):
        load_recipe("vsepp", ["train.grad_cache_chunk=8", "train.compile=true"])
    with pytest.raises(ConfigError, match="train.grad_cache_chunk=-1"):
        load_recipe("vsepp", ["train.grad_cache_chunk=-1"])
    two_ranks, cpu = DistContext(rank=0, world_size=2), torch.device("cpu")
    with pytest.raises(GradCacheError, match="torchrun"):
        check_step_setup(load_recipe("vsepp", ["train.grad_cache_chunk=8"]), cpu, two_ranks)
    check_step_setup(load_recipe("vsepp", ["train.compile=true"]), cpu, two_ranks)  # off: nothing to refuse
    # a recipe changed after it was read is checked again where the step is set up
    r = load_recipe("vsepp", ["train.grad_cache_chunk=8"])
    r.train.compile = True
    with pytest.raises(ConfigError, match="grad_cache_chunk.*compile"):
        check_step_setup(r, cpu)

    class PlainBN(nn.Module):
        def __init__(self):
            super().__init__()
            self.image_encoder, self.text_encoder = nn.BatchNorm1d(4), nn.Identity()

    with pytest.raises(GradCacheError, match="BatchNorm1d.*batch statistics"):
        gc.FullBatchNorm(PlainBN())
    frozen = PlainBN().eval()  # running statistics: rows independent, nothing to do
    assert not gc.FullBatchNorm(frozen)


@pytest.mark.slow
def test_trainer_runs_with_grad_cache(tiny_data, tmp_path):
    """A real run with caching trains the same as without it (per-step losses within float rounding)."""
    import json

    from vsekit.training.trainer import Trainer

    base = [
        "model.embed_dim=16",
        "model.text.word_dim=8",
        "model.image.mlp_hidden=16",
        "train.batch_size=16",
        "train.epochs=1",
        "train.log_every=1",
        "loss.warmup_epochs=0",
    ]
    losses = {}
    for chunk in (0, 6):
        r = load_recipe("vse_infty", [*base, f"train.grad_cache_chunk={chunk}"])
        Trainer(r, tiny_data, tmp_path / f"run{chunk}", progress=False, log=lambda *_: None).fit()
        recs = [
            json.loads(line) for line in (tmp_path / f"run{chunk}" / "metrics.jsonl").read_text().splitlines()
        ]
        losses[chunk] = [rec["loss"] for rec in recs if rec["kind"] == "train"]
    assert len(losses[0]) >= 10
    # AdamW turns the ~1e-7 gradient rounding into ~lr * 1e-7 relative weight differences per step: after a
    # dozen steps the losses (~5) agree to ~1e-5 relative; a wrong gradient would change them by > 1e-2
    assert losses[6] == pytest.approx(losses[0], rel=1e-4)
