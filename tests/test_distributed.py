"""Data-parallel training equals a single process on the global batch (2 gloo processes on CPU).

The workers join through the torchrun environment variables (`init_from_env`), train two steps of each
loss on their shard of a global batch, and save loss, gradients and weights; the parent runs the same two
steps in one process on the whole batch. Without the gradient-carrying all-gather, the global BatchNorm
statistics or the gradient averaging, gradients differ by far more than the tolerance.

Tolerances: the two runs are the same float32 mathematics rounded differently (each rank encodes its shard
with other GEMM shapes and paddings, on any CPU kernel level), so each comparison allows a few hundred eps
of the scale of the terms that were summed, derived next to the assertions; a real bug moves a gradient
by O(its size), 100x or more past every bound.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from vsekit.config import load_recipe
from vsekit.data.text import SPECIALS
from vsekit.distributed import (
    DistContext,
    GlobalBatchNorm1d,
    convert_batchnorm,
    init_from_env,
    shard_sizes,
    shard_slice,
)
from vsekit.losses import create_loss
from vsekit.models.vse import DataSpec, VSEModel
from vsekit.training.trainer import EpochBatches, Trainer, TrainStep

WORLD = 2
GLOBAL_B = 11  # uneven shards: 6 + 5
LR = 0.05  # SGD step size of `_build`
EPS32 = torch.finfo(torch.float32).eps  # 1.19e-7
SMALL = ["model.embed_dim=32", "model.text.word_dim=16", "model.image.mlp_hidden=16"]
VARIANTS = {
    "triplet_hardest": ("vse_infty", ["loss.warmup_epochs=0"]),  # GPO, region MLP with BatchNorm, BiGRU
    "triplet_warmup": ("vse_infty", []),  # epoch 0: sum over all negatives
    "adopt": ("vse_2ad", []),
    "ladder": ("cvsepp", []),
    "ladder_auto": ("cvsepp_auto", []),
    # ESA: two rows per sample on each side (its views); with the view draws turned off the two views are
    # equal, so the shards' draws cannot differ from the single process's and only the gather is tested
    "sel_two_views": (
        "esa",
        [
            "model.image.pooling.esa_region_drop=0",
            "model.text.pooling.esa_word_dropout=0",
            "model.text.pooling.esa_caption_augment=0",
            "loss.warmup_epochs=0",
        ],
    ),
}
if importlib.util.find_spec("vsekit.similarity.aeom") is not None:
    VARIANTS["aeom"] = ("vse_infty", ["model.similarity.name=aeom", "model.similarity.block_dim=16"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _build(variant: str, ctx: DistContext) -> TrainStep:
    recipe_name, extra = VARIANTS[variant]
    # no gradient clipping here: it would hide a gradient that is off by a constant factor
    recipe = load_recipe(recipe_name, SMALL + extra + ["optim.grad_clip=0"])
    torch.manual_seed(0)
    # the special words first (ESA's caption copies look them up), 50 words in all as the tokens need
    words = list(SPECIALS) + [f"w{i}" for i in range(50 - len(SPECIALS))]
    model = VSEModel(recipe, DataSpec(img_dim=16, vocab_words=words))
    convert_batchnorm(model, ctx)
    loss_fn = create_loss(recipe.loss, image_views=recipe.model.image.views)
    if hasattr(loss_fn, "set_caption_embeddings"):
        loss_fn.set_caption_embeddings(torch.randn(40, 24, generator=torch.Generator().manual_seed(5)))
    # SGD rather than the trainer's AdamW: a bias right before BatchNorm has a zero gradient up to rounding,
    # which Adam would blow up into lr-sized steps of either sign in both runs alike.
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    return TrainStep(recipe, model, loss_fn, opt, torch.device("cpu"), ctx)


def _global_batch(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    img_len = torch.randint(2, 7, (GLOBAL_B,), generator=g)
    tok_len = torch.randint(3, 10, (GLOBAL_B,), generator=g)
    tokens = torch.randint(1, 50, (GLOBAL_B, 9), generator=g)
    tokens[torch.arange(9)[None, :] >= tok_len[:, None]] = 0
    images = torch.randn(GLOBAL_B, 6, 16, generator=g)
    images[torch.arange(6)[None, :] >= img_len[:, None]] = 0
    return {
        "images": images,
        "image_lengths": img_len,
        "tokens": tokens,
        "token_lengths": tok_len,
        "image_index": torch.tensor([0, 0, 1, 2, 3, 3, 4, 5, 6, 7, 8]) + seed,  # same-image captions
        "caption_index": (torch.arange(GLOBAL_B) * 3 + seed) % 40,
    }


def _shard(batch: dict, rank: int) -> dict:
    """What the collate function gives a rank: its rows, padded to its own longest set/caption."""
    rows = shard_slice(GLOBAL_B, rank, WORLD)
    out = {k: v[rows] for k, v in batch.items()}
    out["images"] = out["images"][:, : int(out["image_lengths"].max())]
    out["tokens"] = out["tokens"][:, : int(out["token_lengths"].max())]
    return out


def _run(step_fn: TrainStep, rank: int | None) -> dict:
    losses = []
    for s in range(2):
        batch = _global_batch(s)
        if rank is not None:
            batch = _shard(batch, rank)
        out = step_fn(
            batch, epoch=0, step=s, shard_sizes=shard_sizes(GLOBAL_B, WORLD) if rank is not None else None
        )
        losses.append(float(out["loss"]))
    model = step_fn.model
    return {
        "loss": losses,
        "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
        "state": {k: v.clone() for k, v in model.state_dict().items()},
    }


def _worker(rank: int, port: int, out_dir: str, variants: list[str]) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    ctx = init_from_env("cpu")
    assert ctx.world_size == WORLD and ctx.rank == rank
    results = {v: _run(_build(v, ctx), rank) for v in variants}
    torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    torch.distributed.destroy_process_group()


def _record_dustbin_abs_grads(monkeypatch) -> list[float]:
    """Per training step, Σ|∂L/∂cell| over every dustbin cell of every pair of AEOM's augmented score matrix.

    The dustbin score z is one scalar copied into all Ni·Nt·(p+q+1) dustbin cells, so ∂L/∂z is the sum of
    these cells' gradients; this is the sum of their absolute values (the hook only reads the gradient).
    """
    import vsekit.similarity.aeom as aeom

    sums: list[float] = []
    augment = aeom.augment_with_dustbin

    def recording(scores: torch.Tensor, dustbin: torch.Tensor) -> torch.Tensor:
        p, q = scores.shape[-2:]
        out = augment(scores, dustbin)
        if out.requires_grad:
            out.register_hook(
                lambda g: sums.append(float(g[..., :p, q].abs().sum() + g[..., p, :].abs().sum()))
            )
        return out

    monkeypatch.setattr(aeom, "augment_with_dustbin", recording)
    return sums


def _record_bn_input_abs_grads(model: torch.nn.Module) -> list[float]:
    """Per training step, Σ|∂L/∂x| over the input x of the region MLP's BatchNorm (the hook only reads it).

    fc1's bias is added to every row of x right before BatchNorm subtracts their mean, so its gradient, the
    sum of the rows' gradients, is 0 in exact arithmetic: in float32, rounding noise of the size eps Σ|∂L/∂x|.
    """
    sums: list[float] = []

    def hook(module, args, out):
        if args[0].requires_grad:
            args[0].register_hook(lambda g: sums.append(float(g.abs().sum())))

    model.image_encoder.mlp.bn.register_forward_hook(hook)
    return sums


def test_two_process_step_equals_single_process_on_global_batch(tmp_path, monkeypatch):
    variants = list(VARIANTS)
    mp.spawn(_worker, args=(_free_port(), str(tmp_path), variants), nprocs=WORLD, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]
    dustbin_abs = _record_dustbin_abs_grads(monkeypatch)  # in this (single) process only
    for v in variants:
        dustbin_abs.clear()
        step_fn = _build(v, DistContext())
        bn_input_abs = _record_bn_input_abs_grads(step_fn.model)
        single = _run(step_fn, None)
        # Gradient tolerance per tensor (the stored grads are the last step's). Every element of a gradient
        # is a sum of backward terms of the size of the tensor's largest entries, each rounded a little
        # differently in the two runs (more where a gradient flows back through AEOM's Sinkhorn): measured
        # differences are <= 140 eps x max|g| on native, default and avx2 kernels (<= 2e-7 where max|g| is
        # below 0.05); we allow 512 eps x max|g| (6e-5 relative to the tensor), plus rtol 1e-4 per element
        # and atol 1e-6, which also covers a gradient that is zero in exact arithmetic with small terms
        # (ADPool's softmax-shift-invariant balance bias: rounding noise, measured <= 4e-8).
        # Two gradients are sums whose terms cancel, so their rounding scales with the sum of the terms'
        # absolute values S instead: kappa x eps x S, with kappa measured <= 0.19 and allowed 4.
        # - fc1's bias before BatchNorm: exactly 0, S = Σ|∂L/∂x| over BatchNorm's input (12-24): <= 1e-5.
        # - the dustbin z: its gradient (0.1) is the sum of ~600 cell gradients whose absolute values add up
        #   to ~800 (condition ~1e4), each out of 20 Sinkhorn iterations on inputs that differ by rounding:
        #   ~4e-4.
        # Still, a missing gather/average or a doubled gradient moves any of them by O(|g|) (~0.1 for z).
        grad_atol = {name: 1e-6 + 512 * EPS32 * float(g.abs().max()) for name, g in single["grads"].items()}
        grad_atol["image_encoder.mlp.fc1.bias"] += 4 * EPS32 * bn_input_abs[-1]
        if "sim.dustbin" in grad_atol:
            grad_atol["sim.dustbin"] += 4 * EPS32 * dustbin_abs[-1]
        for r, res in enumerate(ranks):
            got = res[v]
            # the loss is a sum of O(B^2) O(1) terms of nearly equal embeddings: measured <= 3 eps apart
            np.testing.assert_allclose(got["loss"], single["loss"], rtol=1e-5, err_msg=f"{v} rank {r}")
            assert got["grads"].keys() == single["grads"].keys()
            for name, g in single["grads"].items():
                torch.testing.assert_close(
                    got["grads"][name], g, rtol=1e-4, atol=grad_atol[name], msg=f"{v} rank {r} grad {name}"
                )
            # weights after two SGD steps, w0 - LR (g1 + g2): they inherit 2 LR x the gradient tolerance;
            # BatchNorm running stats are means/variances of nearly equal activations (rtol 1e-4 = 840 eps)
            for name, t in single["state"].items():
                atol = 1e-6 + 2 * LR * grad_atol.get(name, 0.0)
                torch.testing.assert_close(
                    got["state"][name], t, rtol=1e-4, atol=atol, msg=f"{v} rank {r} {name}"
                )


def test_shards_cover_the_global_batch_in_order():
    assert (
        shard_sizes(11, 2) == [6, 5]
        and shard_sizes(8, 4) == [2, 2, 2, 2]
        and shard_sizes(3, 4) == [1, 1, 1, 0]
    )
    for n, w in ((11, 2), (7, 3), (128, 8)):
        idx = list(range(n))
        assert sum((idx[shard_slice(n, r, w)] for r in range(w)), []) == idx
    # each rank iterates its part of the same global batches; batches too small to shard are dropped
    full = EpochBatches(23, 5, seed=3)
    parts = [EpochBatches(23, 5, seed=3, rank=r, world_size=2) for r in range(2)]
    assert [a + b for a, b in zip(*[list(p) for p in parts])] == full.batches()[: len(parts[0].batches())]
    assert len(full.batches()) == 5 and len(EpochBatches(23, 5, seed=3, world_size=4).batches()) == 4


def test_global_batchnorm_is_plain_batchnorm_outside_distributed():
    bn = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    assert convert_batchnorm(bn, DistContext()) is bn and type(bn[1]) is torch.nn.BatchNorm1d
    conv = convert_batchnorm(bn, DistContext(rank=0, world_size=2))
    assert isinstance(conv[1], GlobalBatchNorm1d) and conv[1].weight is bn[1].weight
    assert set(conv.state_dict()) == {
        "0.weight",
        "0.bias",
        "1.weight",
        "1.bias",
        "1.running_mean",
        "1.running_var",
        "1.num_batches_tracked",
    }


@pytest.mark.slow
def test_vse_train_under_torchrun_matches_single_process(synthetic_dir, tmp_path):
    """`torchrun --nproc_per_node 2 vse train` ≈ `vse train`: same weights, rank 0 alone writes."""
    sets = SMALL[:2] + ["train.batch_size=32", "train.log_every=2", "train.epochs=1", "loss.warmup_epochs=0"]
    args = ["--data", str(synthetic_dir), "--recipe", "vse_infty", "--no-progress", "--device", "cpu"]
    for s in sets:
        args += ["--set", s]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={WORLD}",
        "-m",
        "vsekit.cli",
        "train",
        "--out",
        str(tmp_path / "ddp"),
        *args,
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    single = Trainer(
        load_recipe("vse_infty", sets + ["train.device=cpu"]),
        synthetic_dir,
        tmp_path / "one",
        progress=False,
        log=lambda *_: None,
    )
    single.fit()
    a, b = load_file(tmp_path / "ddp" / "last.safetensors"), load_file(tmp_path / "one" / "last.safetensors")
    assert a.keys() == b.keys()
    steps = single.state.global_step
    for k in a:
        # An epoch of AdamW on both sides, with the same float rounding noise as the test above: weights agree
        # to rtol 1e-3 / atol 1e-4 (Adam's update is lr x a ratio of moments, a few eps relative each step).
        # The bias before the region MLP's BatchNorm has a zero gradient up to rounding; AdamW turns rounding
        # noise into steps of up to lr, in any two runs that round differently. It (and the running mean that
        # contains it) can only agree to steps x lr; every other weight agrees to float tolerance.
        drift = k in ("image_encoder.mlp.fc1.bias", "image_encoder.mlp.bn.running_mean")
        torch.testing.assert_close(a[k], b[k], rtol=1e-3, atol=steps * 5e-4 if drift else 1e-4, msg=k)
    ra = [json.loads(x) for x in (tmp_path / "ddp" / "metrics.jsonl").read_text().splitlines()]
    rb = [json.loads(x) for x in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in ra] == [r["step"] for r in rb]  # one writer: no duplicated records
    # the logged losses of the same steps (measured <= 0.2% of rtol 1e-4 apart)
    np.testing.assert_allclose(
        [r["loss"] for r in ra if r["kind"] == "train"],
        [r["loss"] for r in rb if r["kind"] == "train"],
        rtol=1e-4,
    )
