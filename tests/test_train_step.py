"""One training step: the typed batch both data paths make, the step's parts (encode / score / update) that
gradient caching and CUDA graphs run instead of copying them, every setting the step cannot run refused in
one function called once, and the losses' optional hooks declared by one base class."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import vsekit.training.step as step_mod
import vsekit.training.trainer as trainer_mod
from vsekit.config import ConfigError, LossConfig, load_recipe
from vsekit.data.batch import Batch, CaptionBatch, ImageBatch
from vsekit.data.datasets import CaptionDataset, Collate, FeatureSource, ImageDataset, PairDataset
from vsekit.data.precomp import load_precomp_split
from vsekit.data.text import Vocabulary
from vsekit.distributed import DistContext
from vsekit.losses import create_loss
from vsekit.losses.adopt import ADOPTLoss
from vsekit.losses.base import InBatchLoss
from vsekit.losses.ladder import LadderLoss
from vsekit.losses.view_reg import ViewRegularisedLoss
from vsekit.models.vse import DataSpec, VSEModel
from vsekit.pooling import length_mask
from vsekit.training.data_path import EpochBatches, make_train_data, train_feature_source, train_pairs
from vsekit.training.grad_cache import GradCacheError
from vsekit.training.step import TrainStep
from vsekit.training.step_setup import StepSetup, check_step_setup
from vsekit.training.trainer import Trainer

SRC = Path(__file__).resolve().parents[1] / "src" / "vsekit"
FIELDS = ("images", "image_lengths", "tokens", "token_lengths", "image_index", "caption_index")
SMALL = ["model.embed_dim=16", "model.text.word_dim=8", "model.image.mlp_hidden=16"]


def _pairs(data: Path) -> PairDataset:
    split = load_precomp_split(data, "train", 5)
    text = Vocabulary.build(split.captions, 1, "regex")
    return PairDataset(FeatureSource(split, None), split.captions, split.cap2img, text, train=False)


# ------------------------------------------------------------------------------------------ the batch
def test_collate_makes_typed_batches_that_still_read_like_the_old_dicts(tiny_data):
    pairs = _pairs(tiny_data)
    items = [pairs[i] for i in (0, 1, 7)]
    b = Collate(pad_id=0).pairs(items)
    assert isinstance(b, Batch) and tuple(b.keys()) == FIELDS and len(b) == 6
    assert b["tokens"] is b.tokens and dict(b)["caption_index"] is b.caption_index
    assert b.caption_index.tolist() == [0, 1, 7] and b.image_index.tolist() == [
        int(pairs.cap2img[i]) for i in (0, 1, 7)
    ]
    assert b.tokens.shape == (3, int(b.token_lengths.max())) and b.images.shape[:2] == (3, 4)
    assert "ids" not in b and b.get("ids") is None
    with pytest.raises(KeyError):
        b["to"]  # a method's name is not a field
    part = b.rows(1, 3)
    assert isinstance(part, Batch) and part.caption_index.tolist() == [1, 7]
    assert part.tokens.data_ptr() == b.tokens[1].data_ptr()  # views, no copy
    # the evaluation side: one kind per side, with their own fields
    split = load_precomp_split(tiny_data, "train", 5)
    img = Collate().images([ImageDataset(FeatureSource(split, None))[i] for i in (2, 3)])
    cap = Collate().captions([CaptionDataset(split.captions, pairs.text)[i] for i in (4, 5)])
    assert isinstance(img, ImageBatch) and tuple(img) == ("images", "image_lengths", "image_index")
    assert isinstance(cap, CaptionBatch) and cap.caption_index.tolist() == [4, 5]


def test_batch_of_a_mapping_names_what_is_missing():
    t = {k: torch.arange(3) for k in FIELDS}
    b = Batch.of({**t, "extra": torch.zeros(1)})
    assert all(b[k] is t[k] for k in FIELDS) and Batch.of(b) is b
    with pytest.raises(KeyError, match="missing: tokens, token_lengths"):
        Batch.of({k: v for k, v in t.items() if not k.startswith("token")})


def test_batches_cross_dataloader_workers_as_batches(tiny_data):
    """The collate function runs in worker processes: the batch travels back pickled, typed."""
    loader = DataLoader(_pairs(tiny_data), batch_size=4, collate_fn=Collate().pairs, num_workers=1)
    first = next(iter(loader))
    assert isinstance(first, Batch) and first.caption_index.tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize("on_device", ["true", "false"])
def test_both_data_paths_yield_typed_batches(tiny_data, on_device):
    """The trainer's data path (built here as the trainer builds it) on the device and through the DataLoader."""
    r = load_recipe("vse_infty", [f"train.data_on_device={on_device}", "train.batch_size=16"])
    split = load_precomp_split(tiny_data, "train", 5)
    text = Vocabulary.build(split.captions, 1, "regex")
    pairs = train_pairs(r, split, text, train_feature_source(r, split))
    sampler = EpochBatches(len(pairs), 16, r.train.seed)
    data = make_train_data(r, split, pairs, sampler, torch.device("cpu"))
    assert data.on_device == (on_device == "true")
    batches = list(data.epoch(0))
    assert len(batches) == 15 and all(isinstance(b, Batch) for b in batches)  # 48 images x 5 captions
    assert all(b.images.dtype == torch.float32 for b in batches)
    seen = np.sort(np.concatenate([b.caption_index.numpy() for b in batches]))
    assert seen.tolist() == list(range(240))


# ------------------------------------------------------------------------------------ the step's parts
def _optimizer_step_calls(path: Path) -> int:
    """Calls `<something>.optimizer.step()` or `optimizer.step()` in the code of `path` (not its comments)."""
    n = 0
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "step":
            owner = node.func.value
            name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", None)
            n += name == "optimizer"
    return n


def test_the_weights_change_in_one_place():
    """The eager step, gradient caching and the CUDA graphs all update through `StepParts.update`."""
    calls = {p.name: _optimizer_step_calls(p) for p in sorted((SRC / "training").glob("*.py"))}
    assert {name: n for name, n in calls.items() if n} == {"step_parts.py": 1}


@pytest.mark.parametrize("chunk", [0, 5])
def test_every_strategy_updates_once_per_step_through_the_parts(chunk, monkeypatch):
    r = load_recipe("vsepp", [*SMALL, f"train.grad_cache_chunk={chunk}"])
    torch.manual_seed(0)
    model = VSEModel(r, DataSpec(img_dim=8, vocab_words=[f"w{i}" for i in range(30)]))
    opt = torch.optim.AdamW(model.parameter_groups(r.optim.lr), lr=r.optim.lr)
    step = TrainStep(r, model, create_loss(r.loss), opt, torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(2, 7, (12,), generator=g)
    data = Batch(
        images=torch.randn(12, 5, 8, generator=g),
        image_lengths=torch.full((12,), 5),
        tokens=torch.randint(4, 30, (12, 6), generator=g).masked_fill(~length_mask(lengths, 6), 0),
        token_lengths=lengths,
        image_index=torch.arange(12),
        caption_index=torch.arange(12),
    )
    epoch = r.loss.warmup_epochs
    assert (step.grad_cache is not None) == (chunk > 0)
    if step.grad_cache is not None:
        assert step.grad_cache.parts is step.parts  # the strategy runs the step's own parts
    updates, steps = [], []
    real_update, real_step = step.parts.update, step.optimizer.step
    monkeypatch.setattr(step.parts, "update", lambda: (updates.append(1), real_update())[1])
    monkeypatch.setattr(step.optimizer, "step", lambda *a, **k: (steps.append(1), real_step(*a, **k))[1])
    before = [p.detach().clone() for p in step.model.parameters()]
    step(data, epoch=epoch, step=0)
    assert updates == [1] and steps == [1]
    assert any(not torch.equal(a, p) for a, p in zip(before, step.model.parameters()))


# ------------------------------------------------------------------------------------------ refusals
def test_one_function_refuses_the_settings_with_one_message():
    cpu, two = torch.device("cpu"), DistContext(rank=0, world_size=2)
    assert check_step_setup(load_recipe("vse_infty"), cpu) == StepSetup(graph=None, grad_cache_chunk=0)
    assert check_step_setup(load_recipe("vse_infty"), cpu, graph="eager").graph == "eager"  # nothing captured
    assert check_step_setup(load_recipe("vsepp", ["train.grad_cache_chunk=4"]), cpu).grad_cache_chunk == 4
    with pytest.raises(ConfigError) as e:  # every part a graph cannot capture, named at once
        check_step_setup(
            load_recipe("vse_infty", ["train.cuda_graph=true", "model.text.kind=transformer"]), cpu, two
        )
    assert all(s in str(e.value) for s in ("the run is on cpu", "torchrun", "model.text.kind=transformer"))
    assert not isinstance(e.value, GradCacheError)
    with pytest.raises(GradCacheError, match="torchrun"):
        check_step_setup(load_recipe("vsepp", ["train.grad_cache_chunk=4"]), cpu, two)
    with pytest.raises(ValueError, match="graph must be"):
        check_step_setup(load_recipe("vsepp"), cpu, graph="yes")


def test_the_trainer_checks_once_before_reading_the_data(tiny_data, tmp_path, monkeypatch):
    calls = []
    real = trainer_mod.check_step_setup

    def counted(*args, **kwargs):
        calls.append(args[0].name)
        return real(*args, **kwargs)

    monkeypatch.setattr(trainer_mod, "check_step_setup", counted)
    monkeypatch.setattr(step_mod, "check_step_setup", counted)
    t = Trainer(
        load_recipe("vsepp", [*SMALL, "train.epochs=1"]),
        tiny_data,
        tmp_path / "run",
        progress=False,
        log=lambda *_: None,
    )
    assert calls == ["vsepp"] and t.step_fn.setup is t.step_setup
    monkeypatch.setattr(trainer_mod, "load_precomp_split", lambda *_a, **_k: pytest.fail("the data was read"))
    monkeypatch.setattr(trainer_mod, "init_from_env", lambda _device: DistContext(rank=0, world_size=2))
    with pytest.raises(GradCacheError, match="torchrun"):  # refused before the split is read
        Trainer(
            load_recipe("vsepp", [*SMALL, "train.grad_cache_chunk=4"]),
            tiny_data,
            tmp_path / "other",
            progress=False,
            log=lambda *_: None,
        )
    assert not (tmp_path / "other").exists()


# --------------------------------------------------------------------------------------- loss hooks
def test_every_loss_declares_the_hooks_with_do_nothing_defaults():
    cfgs = [
        LossConfig(name="triplet"),
        LossConfig(name="infonce"),
        LossConfig(name="adopt"),
        LossConfig(name="ladder"),
        LossConfig(name="triplet", view_reg_weight=0.1),
    ]
    for cfg in cfgs:
        loss = create_loss(cfg, image_views=2)
        assert isinstance(loss, InBatchLoss), cfg.name
        assert isinstance(loss.step_log_keys, tuple) and loss.host_diag is True
        assert loss.needs_caption_embeddings == isinstance(loss, LadderLoss)
        loss.set_caption_embeddings(torch.randn(4, 8))  # accepted by all (a no-op where unused)
    plain = create_loss(LossConfig(name="triplet"))
    assert plain.threshold_share is None and plain.derived_thresholds is None
    with pytest.raises(RuntimeError, match="no threshold share"):
        plain.set_derived_threshold(0.4)


def test_the_view_regulariser_passes_every_hook_to_its_loss():
    """AVSE's wrapper: the hooks reach the loss it wraps (setting `host_diag` on the wrapper used to leave
    ADOPT reading its K back to the host every step)."""
    adopt = create_loss(LossConfig(name="adopt", view_reg_weight=0.1), image_views=2)
    assert isinstance(adopt, ViewRegularisedLoss) and isinstance(adopt.base, ADOPTLoss)
    assert adopt.step_log_keys == ADOPTLoss.step_log_keys
    adopt.host_diag = False
    assert adopt.base.host_diag is False and adopt.host_diag is False
    sims = torch.randn(6, 6)
    _, diag = adopt(sims, image_ids=torch.arange(6), image_emb=torch.randn(6, 2 * 4))
    assert torch.is_tensor(diag["K_i2t"])  # kept on the device: no host read in the loss
    ladder = create_loss(
        LossConfig(name="ladder", view_reg_weight=0.1, ladder_threshold_share=0.2), image_views=2
    )
    assert ladder.needs_caption_embeddings and ladder.threshold_share == 0.2
    ladder.set_caption_embeddings(torch.randn(5, 8))
    assert ladder.base.caption_emb is not None
    ladder.set_derived_threshold(0.3)
    assert ladder.derived_thresholds == [0.3] == ladder.base.derived_thresholds
