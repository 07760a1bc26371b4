"""A GPU-ready step: the model's forward + backward and the losses have no host sync and no data-dependent
shape, so they compile whole (`fullgraph=True`) and can be captured as one CUDA graph.

- the sync-free parts equal what they replace: the masked BatchNorm (`ResidualMLP`) equals `nn.BatchNorm1d`
  on `x[mask]` (outputs, gradients, running statistics), GPO's one-table weights equal the packed reference
  per sample, and the unpacked BiGRU equals torch's packed one (private copies of the previous code below);
- grid size augmentation and multi-view grouping draw the same numbers and keep the same elements as before;
- a batch padded to its own longest set gives the embeddings of the same batch padded 7 wider;
- vsepp / vse_infty / vse_2ad (and avse): the forward, the similarity and the loss compiled with
  `fullgraph=True` (aot_eager on the CPU: dynamo + AOT autograd, no codegen) give the eager loss and gradients;
- on a GPU, a few forward + backward steps run under `torch.cuda.set_sync_debug_mode("error")`.

Tolerances: everything here is float32. A sync-free part computes the same sums as the part it replaces over
the same numbers, in a different order or GEMM shape (a mask-weighted sum over all rows instead of a sum over
the valid rows, a [B, T] GRU batch instead of packed time steps), so the results differ by float rounding:
a few ulps per sum of O(hidden) terms, i.e. ~1e-6 relative after normalisation. We allow rtol 1e-5 /
atol 1e-6 on values (unit-scale embeddings, BatchNorm outputs) and rtol 1e-4 / atol 1e-5 on gradients, which
sum such differences over every row of the batch; the differences actually seen are 10-100x below.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from vsekit.config import load_recipe
from vsekit.losses import create_loss
from vsekit.models.image import ResidualMLP
from vsekit.models.norm import MaskedBatchNorm1d
from vsekit.models.vse import DataSpec, VSEModel
from vsekit.pooling import GPO, length_mask, sort_desc_per_dim
from vsekit.pooling.rnn import bigru_unpacked

VALUES = {"rtol": 1e-5, "atol": 1e-6}
GRADS = {"rtol": 1e-4, "atol": 1e-5}
RECIPES = ["vsepp", "vse_infty", "vse_2ad"]
COMPILED = [*RECIPES, "avse"]  # avse: multi-view groups + AEOM Sinkhorn + the view regulariser
SMALL = ["model.embed_dim=32", "model.text.word_dim=16", "model.image.mlp_hidden=16", "loss.warmup_epochs=0"]
IMG_DIM, VOCAB = 12, 40


# ---- private copies of the previous (host-syncing) implementations ------------------------------------


class BooleanIndexResidualMLP(nn.Module):
    """The previous `ResidualMLP`: nn.BatchNorm1d on `x[mask]`, scattered back with a boolean index."""

    def __init__(self, d_in: int, d_hidden: int, d_out: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.bn = nn.BatchNorm1d(d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_out)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        rows = self.fc2(torch.relu(self.bn(self.fc1(x[mask]))))
        out = rows.new_zeros(*x.shape[:-1], self.fc2.out_features)
        out[mask] = rows
        return out


def previous_gpo(
    gpo: GPO, features: torch.Tensor, lengths: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The previous GPO forward: cut to the batch's longest set, the reference's packed-BiGRU weights per
    sample (`weights_packed`), weights [B, lengths.max()]."""
    max_len = int(lengths.max())
    features = features[:, :max_len]
    weights = gpo.weights_packed(lengths, max_len).to(features.dtype)
    ordered = sort_desc_per_dim(features, lengths)
    return (ordered * weights.unsqueeze(-1)).sum(1), weights


def packed_bigru(gru: nn.GRU, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The previous BiGRU text path: pack (lengths on the CPU, at least 1), run, pad back with zeros."""
    packed = pack_padded_sequence(x, lengths.cpu().clamp(min=1), batch_first=True, enforce_sorted=False)
    out, _ = gru(packed)
    return pad_packed_sequence(out, batch_first=True, total_length=x.shape[1])[0]


def previous_grid_size_augment(feats, lengths, generator, drop_max=0.2):
    """The previous `grid_size_augment`: boolean-index fix-up, cut to the longest kept set."""
    b, n, _ = feats.shape
    r = torch.rand(b, 1, generator=generator)
    cell = torch.rand(b, n, generator=generator)
    keep = (r <= 0.2) | (cell >= drop_max * r)
    keep &= length_mask(lengths, n)
    keep[keep.sum(1) == 0, 0] = True
    order = torch.sort((~keep).to(torch.int8), dim=1, stable=True).indices
    packed = torch.gather(feats, 1, order.unsqueeze(-1).expand_as(feats))
    new_len = keep.sum(1)
    packed = packed.masked_fill(~length_mask(new_len, n).unsqueeze(-1), 0.0)
    return packed[:, : int(new_len.max())], new_len


def previous_view_groups(lengths, views, keep, max_len, generator=None, deterministic=False):
    """The previous `view_groups` (test grouping by `torch.unique` over the lengths on the CPU)."""
    from vsekit.models.multiview import EVAL_GROUPING_SEED, kept_count
    from vsekit.utils.runtime import derived_seed

    b = len(lengths)
    if deterministic:
        prio = torch.empty(b, views, max_len)
        for n in torch.unique(lengths).tolist():
            for k in range(views):
                g = torch.Generator().manual_seed(derived_seed(EVAL_GROUPING_SEED, k, int(n)))
                prio[lengths == n, k] = torch.rand(max_len, generator=g)
    else:
        prio = torch.rand(b, views, max_len, generator=generator)
    prio = prio.masked_fill(~length_mask(lengths, max_len).unsqueeze(1), 2.0)
    return prio.argsort(dim=-1, stable=True), kept_count(lengths, keep).unsqueeze(1).expand(b, views)


def _grads(out: torch.Tensor, probe: torch.Tensor, inputs: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    return torch.autograd.grad((out * probe).sum(), inputs, allow_unused=False)


# ---- masked BatchNorm / ResidualMLP -------------------------------------------------------------------


@pytest.mark.parametrize("momentum", [0.1, None])
def test_masked_batchnorm_equals_batchnorm_on_the_valid_rows(momentum):
    g = torch.Generator().manual_seed(0)
    masked, ref = MaskedBatchNorm1d(5, momentum=momentum), nn.BatchNorm1d(5, momentum=momentum)
    with torch.no_grad():
        masked.weight.copy_(torch.rand(5, generator=g) + 0.5)
        masked.bias.copy_(torch.randn(5, generator=g))
    ref.load_state_dict(masked.state_dict())
    assert list(masked.state_dict()) == list(ref.state_dict())  # checkpoints load either way
    lengths = torch.tensor([4, 1, 6, 3])
    mask = length_mask(lengths, 6)
    for step in range(3):
        x = (3 * torch.randn(4, 6, 5, generator=g) + 2).requires_grad_(True)
        with torch.no_grad():
            x[~mask] = float("nan") if step == 1 else 1e6  # padding content never reaches the statistics
        probe = torch.randn(4, 6, 5, generator=g)
        out = masked(x, mask)
        want = ref(x[mask])
        torch.testing.assert_close(out[mask], want, **VALUES)
        got_g = _grads(torch.where(mask.unsqueeze(-1), out, 0.0), probe, [x, masked.weight, masked.bias])
        want_g = _grads(want, probe[mask], [x, ref.weight, ref.bias])
        torch.testing.assert_close(got_g[0][mask], want_g[0][mask], **GRADS)
        assert torch.equal(got_g[0][~mask], torch.zeros_like(got_g[0][~mask]))
        for a, b in zip(got_g[1:], want_g[1:]):
            torch.testing.assert_close(a, b, **GRADS)
        for name in ("running_mean", "running_var"):
            torch.testing.assert_close(getattr(masked, name), getattr(ref, name), **VALUES)
        assert int(masked.num_batches_tracked) == int(ref.num_batches_tracked) == step + 1
    masked.eval(), ref.eval()
    x = torch.randn(4, 6, 5, generator=g)
    # eval: torch's own kernel on every row (vectorised over a different row count: rounding only)
    torch.testing.assert_close(masked(x, mask)[mask], ref(x[mask]), **VALUES)


def test_residual_mlp_equals_the_boolean_index_version():
    torch.manual_seed(0)
    new, old = ResidualMLP(7, 6, 5), BooleanIndexResidualMLP(7, 6, 5)
    old.load_state_dict(new.state_dict(), strict=True)  # same keys: bn.weight, bn.running_mean, ...
    g = torch.Generator().manual_seed(1)
    mask = length_mask(torch.tensor([5, 2, 8, 1, 8]), 8)
    for train in (True, True, False):
        new.train(train), old.train(train)
        x = torch.randn(5, 8, 7, generator=g).masked_fill(~mask.unsqueeze(-1), 50.0).requires_grad_(True)
        probe = torch.randn(5, 8, 5, generator=g)
        a, b = new(x, mask), old(x, mask)
        torch.testing.assert_close(a, b, **VALUES)
        assert torch.equal(a[~mask], torch.zeros_like(a[~mask]))
        ga = _grads(a, probe, [x, *new.parameters()])
        gb = _grads(b, probe, [x, *old.parameters()])
        for u, v in zip(ga, gb):
            torch.testing.assert_close(u, v, **GRADS)
    torch.testing.assert_close(new.bn.running_mean, old.bn.running_mean, **VALUES)
    torch.testing.assert_close(new.bn.running_var, old.bn.running_var, **VALUES)


def test_masked_batchnorm_under_bf16_autocast_follows_fp32():
    torch.manual_seed(0)
    mlp = ResidualMLP(7, 6, 5)
    mask = length_mask(torch.tensor([5, 2, 8]), 8)
    x = torch.randn(3, 8, 7)
    ref = mlp(x, mask)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = mlp(x, mask)
    assert low.dtype == torch.bfloat16 and torch.equal(low[~mask].float(), torch.zeros_like(ref[~mask]))
    torch.testing.assert_close(low.float(), ref, rtol=0.05, atol=0.05)  # bf16: 8 bits of mantissa


# ---- GPO ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "batch", [4, 12]
)  # fewer samples than the width (per-sample weights), and more (table)
@pytest.mark.parametrize("train", [True, False])
def test_gpo_one_table_equals_the_previous_per_sample_weights(batch, train):
    torch.manual_seed(0)
    gpo = GPO(16, 8).train(train)
    g = torch.Generator().manual_seed(2)
    lengths = torch.randint(1, 10, (batch,), generator=g)
    lengths[0] = 9
    feats = torch.randn(batch, 9, 6, generator=g).requires_grad_(True)
    probe = torch.randn(batch, 6, generator=g)
    pooled, weights = gpo(feats, lengths, return_weights=True)
    ref_pooled, ref_weights = previous_gpo(gpo, feats, lengths)
    torch.testing.assert_close(pooled, ref_pooled, **VALUES)
    torch.testing.assert_close(weights, ref_weights, **VALUES)
    for a, b in zip(
        _grads(pooled, probe, [feats, *gpo.parameters()]),
        _grads(ref_pooled, probe, [feats, *gpo.parameters()]),
    ):
        torch.testing.assert_close(a, b, **GRADS)
    # padded 5 wider: the same pooling, the extra columns weigh 0
    wide = torch.cat([feats.detach(), torch.full((batch, 5, 6), 1e3)], dim=1)
    pooled_w, weights_w = gpo(wide, lengths, return_weights=True)
    torch.testing.assert_close(pooled_w, pooled.detach(), **VALUES)
    assert weights_w.shape == (batch, 14) and torch.equal(weights_w[:, 9:], torch.zeros(batch, 5))


def test_gpo_positional_encoding_is_cached_per_width_and_device():
    gpo = GPO(8, 8)
    gpo(torch.randn(3, 5, 4), torch.tensor([5, 2, 1]))
    gpo(torch.randn(3, 5, 4), torch.tensor([1, 3, 4]))
    gpo(torch.randn(2, 7, 4), torch.tensor([7, 2]))
    assert sorted(gpo._pe_cache) == [(5, torch.device("cpu")), (7, torch.device("cpu"))]


# ---- BiGRU ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("train", [True, False])
def test_unpacked_bigru_equals_torch_packed(layers, train):
    torch.manual_seed(0)
    gru = nn.GRU(6, 5, num_layers=layers, batch_first=True, bidirectional=True).train(train)
    g = torch.Generator().manual_seed(3)
    lengths = torch.tensor([9, 1, 4, 0, 9, 6, 2])  # 0 is read as 1, as the packed path clamps it
    x = torch.randn(7, 9, 6, generator=g).requires_grad_(True)
    probe = torch.randn(7, 9, 10, generator=g)
    got, want = bigru_unpacked(gru, x, lengths), packed_bigru(gru, x, lengths)
    torch.testing.assert_close(got, want, **VALUES)
    padding = got[~length_mask(lengths.clamp(min=1), 9)]
    assert padding.shape == (7 * 9 - 32, 10) and torch.equal(padding, torch.zeros_like(padding))  # as padded
    for a, b in zip(_grads(got, probe, [x, *gru.parameters()]), _grads(want, probe, [x, *gru.parameters()])):
        torch.testing.assert_close(a, b, **GRADS)


def test_bigru_text_encoder_equals_the_packed_version():
    recipe = load_recipe("vse_infty", SMALL)
    torch.manual_seed(0)
    model = VSEModel(recipe, DataSpec(img_dim=IMG_DIM, vocab_words=[f"w{i}" for i in range(VOCAB)]))
    enc = model.text_encoder
    tokens, lengths = _captions(6, 11, seed=4)
    got = enc.token_features(tokens, lengths)
    out = packed_bigru(enc.gru, enc.embed(tokens), lengths)
    half = out.shape[-1] // 2
    torch.testing.assert_close(got, (out[..., :half] + out[..., half:]) / 2, **VALUES)


# ---- random draws: the same numbers from the same generator --------------------------------------------


def test_grid_size_augment_draws_and_keeps_as_before():
    from vsekit.models.image import grid_size_augment

    feats = torch.randn(64, 10, 3, generator=torch.Generator().manual_seed(0))
    lengths = torch.randint(1, 11, (64,), generator=torch.Generator().manual_seed(1))
    for drop_max in (0.2, 1.0):  # 1.0: some sets lose every cell and keep their first one
        got, got_len = grid_size_augment(feats, lengths, torch.Generator().manual_seed(7), drop_max)
        want, want_len = previous_grid_size_augment(
            feats, lengths, torch.Generator().manual_seed(7), drop_max
        )
        assert torch.equal(got_len, want_len) and got.shape == feats.shape
        assert torch.equal(got[:, : want.shape[1]], want)
        assert torch.equal(got[:, want.shape[1] :], torch.zeros_like(got[:, want.shape[1] :]))


@pytest.mark.parametrize("deterministic", [False, True])
def test_view_groups_equal_the_previous_ones(deterministic):
    from vsekit.models.multiview import view_groups

    lengths = torch.tensor([9, 1, 4, 9, 6, 2, 4, 7])
    got = view_groups(lengths, 3, 0.75, 9, torch.Generator().manual_seed(5), deterministic)
    want = previous_view_groups(lengths, 3, 0.75, 9, torch.Generator().manual_seed(5), deterministic)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# ---- whole models: padding width, compile, CUDA ---------------------------------------------------------


def _model(name: str) -> tuple[VSEModel, nn.Module]:
    recipe = load_recipe(name, SMALL + (["model.similarity.block_dim=16"] if name == "avse" else []))
    torch.manual_seed(0)
    model = VSEModel(recipe, DataSpec(img_dim=IMG_DIM, vocab_words=[f"w{i}" for i in range(VOCAB)]))
    loss_fn = create_loss(recipe.loss, recipe.model.image.views)
    if hasattr(loss_fn, "host_diag"):
        loss_fn.host_diag = False  # ADOPT's logged K and gammas as device tensors: no host read
    return model, loss_fn


def _captions(b: int, width: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, width + 1, (b,), generator=g)
    lengths[1] = width
    tokens = torch.randint(1, VOCAB, (b, width), generator=g)
    return tokens.masked_fill(~length_mask(lengths, width), 0), lengths


def _batch(b: int = 10, seed: int = 5, pad: int = 0) -> dict:
    """A collated batch padded to its longest set, plus `pad` more columns (zeros, as collation pads)."""
    g = torch.Generator().manual_seed(seed)
    img_len = torch.randint(2, 7, (b,), generator=g)
    img_len[0] = 6
    images = torch.randn(b, 6, IMG_DIM, generator=g).masked_fill(~length_mask(img_len, 6).unsqueeze(-1), 0.0)
    tokens, tok_len = _captions(b, 9, seed + 1)
    return {
        "images": torch.cat([images, images.new_zeros(b, pad, IMG_DIM)], 1),
        "image_lengths": img_len,
        "tokens": torch.cat([tokens, tokens.new_zeros(b, pad)], 1),
        "token_lengths": tok_len,
        "ids": torch.arange(b) // 2,  # two captions per image
    }


@pytest.mark.parametrize("train", [True, False])
@pytest.mark.parametrize("name", RECIPES)
def test_padding_wider_than_the_batch_gives_the_same_embeddings(name, train):
    model, _ = _model(name)
    wide = copy.deepcopy(model)
    model.train(train), wide.train(train)
    tight, padded = _batch(), _batch(pad=7)
    assert padded["images"].shape[1] == tight["images"].shape[1] + 7
    for m, batch in ((model, tight), (wide, padded)):
        batch["img"] = m.encode_images(batch["images"], batch["image_lengths"])
        batch["txt"] = m.encode_texts(batch["tokens"], batch["token_lengths"])
    torch.testing.assert_close(padded["img"], tight["img"], **VALUES)
    torch.testing.assert_close(padded["txt"], tight["txt"], **VALUES)
    for (k, a), b in zip(model.state_dict().items(), wide.state_dict().values()):  # running statistics too
        torch.testing.assert_close(a, b, **VALUES, msg=k)


def _step_fn(model: VSEModel, loss_fn: nn.Module, generator: torch.Generator | None = None):
    def step(images, image_lengths, tokens, token_lengths, ids):
        img = model.encode_images(images, image_lengths, generator=generator)
        txt = model.encode_texts(tokens, token_lengths)
        sims = model.similarity(img, txt).float()
        loss, diag = loss_fn(sims, image_ids=ids, warmup=False, image_emb=img, text_emb=txt)
        return loss, img, txt

    return step


def _loss_and_grads(model: VSEModel, fn, batch: dict) -> tuple[torch.Tensor, ...]:
    model.zero_grad(set_to_none=True)
    loss, img, txt = fn(
        batch["images"], batch["image_lengths"], batch["tokens"], batch["token_lengths"], batch["ids"]
    )
    loss.backward()
    params = [p for p in model.parameters() if p.requires_grad]
    assert all(p.grad is not None for p in params)
    return (loss.detach(), img.detach(), txt.detach(), *(p.grad.clone() for p in params))


@pytest.mark.parametrize("name", COMPILED)
def test_compiled_fullgraph_step_equals_eager(name):
    """Forward + similarity + loss compile as ONE graph (fullgraph raises on any graph break: a host sync
    such as `.item()`/`int(tensor)`, a data-dependent shape, `pack_padded_sequence`), and match eager.
    AVSE's training views are random: both runs draw them from the global generator, seeded alike."""
    model, loss_fn = _model(name)
    compiled_model = copy.deepcopy(model)
    torch._dynamo.reset()
    try:
        with torch._dynamo.config.patch(allow_rnn=True):
            compiled = torch.compile(_step_fn(compiled_model, loss_fn), fullgraph=True, backend="aot_eager")
            for seed in (5, 6):  # two steps: the running statistics move the same way
                batch = _batch(seed=seed)
                torch.manual_seed(seed)
                want = _loss_and_grads(model, _step_fn(model, loss_fn), batch)
                torch.manual_seed(seed)
                got = _loss_and_grads(compiled_model, compiled, batch)
                torch.testing.assert_close(got[0], want[0], **VALUES)
                for a, b in zip(got[1:3], want[1:3]):
                    torch.testing.assert_close(a, b, **VALUES)
                for a, b in zip(got[3:], want[3:]):
                    torch.testing.assert_close(a, b, **GRADS)
    finally:
        torch._dynamo.reset()
    for (k, a), b in zip(compiled_model.state_dict().items(), model.state_dict().values()):
        torch.testing.assert_close(a, b, **VALUES, msg=k)
    assert math.isfinite(float(want[0]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", COMPILED)
def test_cuda_steps_have_no_host_sync(name):
    """No sync in forward + backward. AVSE's training views are drawn from a generator on the GPU, as the
    trainer's `TrainStep` holds one there (re-seeded per step: no copy from the host)."""
    model, loss_fn = _model(name)
    dev = torch.device("cuda")
    model.to(dev).train()
    loss_fn.to(dev)
    gen = torch.Generator(device=dev)
    fn = _step_fn(model, loss_fn, gen)
    batches = [{k: v.to(dev) for k, v in _batch(seed=s).items()} for s in range(4)]
    gen.manual_seed(0)
    _loss_and_grads(model, fn, batches[0])  # warm-up: caches (positional encodings), cuDNN plans
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        losses = []
        for s, batch in enumerate(batches[1:]):
            gen.manual_seed(s + 1)
            model.zero_grad(set_to_none=True)
            loss, _, _ = fn(
                batch["images"], batch["image_lengths"], batch["tokens"], batch["token_lengths"], batch["ids"]
            )
            loss.backward()
            losses.append(loss.detach())
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert all(math.isfinite(float(v)) for v in losses)
