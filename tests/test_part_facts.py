"""Parts declare what consumers need to know: facts at registration (`vsekit.registry.FACTS`).

No module of vsekit decides by a part's or recipe's name (an AST scan of src/vsekit finds 0 such comparisons),
and a part registered here, from the test module alone, gets what a built-in part with the same facts gets: a
pixel encoder its pictures (trainer, evaluation, search, CLIP_benchmark, `encode_image`), a word-vocabulary text
encoder the vocabulary (trainer, a loaded model), an inner-product similarity no re-rank in search, and a loss
the collapse alarm at its equal-score value (and a CUDA graph where it declares one)."""

from __future__ import annotations

import ast
import json
import types
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from PIL import Image
from torch import nn

import vsekit
from conftest import constant_dataset
from vsekit import registry
from vsekit.config import builtin_recipes, load_recipe
from vsekit.losses.base import InBatchLoss
from vsekit.models.text_parts import WordSettings
from vsekit.models.vse import DataSpec, VSEModel
from vsekit.registry import RegistryError, Settings
from vsekit.training.collapse import CollapseMonitor, negatives_per_row

SRC = Path(vsekit.__file__).resolve().parent  # the library imported (PYTHONPATH may name another checkout)
SMALL = ["model.embed_dim=8", "model.text.word_dim=4"]

# ------------------------------------------------------------------ the scan: 0 sites decide by a part's name

# Comparisons of a string naming something other than a part: the released-checkpoint importer's `kind`
# (which release family a checkpoint is: vse_infty, vse_2ad, avse) shares words with recipe names.
NOT_PARTS = {("interop/released.py", "kind")}


def _strings(node: ast.AST, constants: dict[str, list[str]]) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    if isinstance(node, ast.Name):
        return constants.get(node.id, [])
    return []


def name_tests(source: str, names: set[str]) -> list[tuple[int, str, str]]:
    """(line, subject, code) of each comparison (==, !=, in, not in) of a `.kind` / `.name` (an attribute chain
    such as `recipe.model.image.kind`, `cfg.name`, or a variable assigned from one) with a string, or a tuple /
    module constant of strings, that names a registered part or a built-in recipe."""
    tree = ast.parse(source)
    constants: dict[str, list[str]] = {}
    aliases = {"kind", "name"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            targets = [t.id for t in node.targets if isinstance(t, ast.Name)]
            if isinstance(node.value, (ast.Tuple, ast.List, ast.Set)):
                constants.update({t: _strings(node.value, {}) for t in targets})
            if isinstance(node.value, ast.Attribute) and node.value.attr in ("kind", "name"):
                aliases.update(targets)
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        subjects = [
            s.attr if isinstance(s, ast.Attribute) else s.id
            for s in sides
            if (isinstance(s, ast.Attribute) and s.attr in ("kind", "name"))
            or (isinstance(s, ast.Name) and s.id in aliases)
        ]
        if subjects and any(set(_strings(s, constants)) & names for s in sides):
            out.append((node.lineno, subjects[0], ast.unparse(node)))
    return out


def run_records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _part_and_recipe_names() -> set[str]:
    return {n for kind in registry.KINDS for n in registry.names(kind)} | set(builtin_recipes())


def test_f1_the_scan_finds_what_it_looks_for():
    """The scanner itself flags the patterns that decided by name (so the 0 below is not the scanner's blindness)."""
    code = (
        "COCO = ('vsepp', 'vse_infty')\n"
        "def f(model, recipe, cfg, r):\n"
        "    if model.recipe.model.image.kind in ('backbone', 'vit'): pass\n"
        "    if r.model.text.kind not in ('bigru', 'bow'): pass\n"
        "    if model.recipe.model.similarity.name != 'cosine': pass\n"
        "    if cfg.name == 'infonce': pass\n"
        "    if recipe.name not in COCO: pass\n"
        "    pooling = recipe.model.image.pooling.name\n"
        "    if pooling != 'none': pass\n"
        "    if params.kind == 'ivfpq' or p.name == 'segments': pass\n"  # not parts: not flagged
    )
    found = name_tests(code, _part_and_recipe_names())
    assert [line for line, _, _ in found] == [3, 4, 5, 6, 7, 9]


def test_f1_no_consumer_decides_by_a_part_or_recipe_name():
    """Consumers decided by name on 857c500 (this scan finds 27 comparisons there: `kind in ("backbone", "vit")`,
    `similarity.name != "cosine"`, the capturable-loss list, the collapse value by loss name, the small-data
    recipe list, ...): 0 are left."""
    names = _part_and_recipe_names()
    sites = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        for line, subject, code in name_tests(path.read_text(encoding="utf-8"), names):
            if (rel, subject) not in NOT_PARTS:
                sites.append(f"{rel}:{line}: {code}")
    assert sites == []


def test_f1_a_fact_must_be_one_the_kind_knows():
    with pytest.raises(RegistryError, match="unknown fact 'reads_pixel'"):
        registry.register(
            "image_encoder", "typo", build=lambda r, s: None, help="x", facts={"reads_pixel": True}
        )
    with pytest.raises(RegistryError, match="must be bool"):
        registry.register(
            "similarity", "typo", build=lambda c, d, v: None, help="x", facts={"inner_product": 1}
        )
    assert "typo" not in registry.names("image_encoder") + registry.names("similarity")
    with pytest.raises(RegistryError, match="declares no fact"):
        registry.has_fact("loss", "triplet", "reads_pixels")
    facts = registry.part_facts("similarity", "cosine")
    assert dict(facts) == {"inner_product": True}
    with pytest.raises(TypeError):
        facts["inner_product"] = False  # read-only: the registration is the one owner


# ------------------------------------------------------------------ parts registered here


class PixelProbe(nn.Module):
    """An image encoder on pixels [B, 3, S, S] that records what it was given."""

    seen: list[tuple[int, ...]] = []

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(3, dim)

    def forward(self, images: torch.Tensor, lengths: torch.Tensor, generator=None) -> torch.Tensor:
        PixelProbe.seen.append(tuple(images.shape))
        return nn.functional.normalize(self.proj(images.mean((2, 3))), dim=-1)


class WordProbe(nn.Module):
    """A text encoder over word ids: the mean of learned word embeddings (its vocabulary from the spec)."""

    def __init__(self, words: int, dim: int) -> None:
        super().__init__()
        self.embed = nn.EmbeddingBag(words, dim)

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return nn.functional.normalize(self.embed(tokens), dim=-1)


class Dot(nn.Module):
    def forward(self, img: torch.Tensor, txt: torch.Tensor) -> torch.Tensor:
        return img @ txt.T


class AllPairsHinge(InBatchLoss):
    """VSE0's hinge, summed over every negative pair in both directions (other captions of an image masked)."""

    def __init__(self, margin: float) -> None:
        super().__init__()
        self.margin = margin

    def forward(self, sims: torch.Tensor, image_ids: torch.Tensor | None = None, **_: object):
        d = sims.diagonal()
        ids = image_ids if image_ids is not None else torch.arange(sims.shape[0], device=sims.device)
        neg = ids[:, None] != ids[None, :]
        cost = (self.margin + sims - d[:, None]).clamp(min=0) + (self.margin + sims - d[None, :]).clamp(min=0)
        return (cost * neg).sum(), {}


def _all_pairs_equal_score(cfg, negatives, hardest, k=None):
    return "all-pairs hinge of the test", 2 * cfg.margin * negatives.sum()


@dataclass
class ProbeSettings(Settings):
    pass


@pytest.fixture
def probes():
    from vsekit.models.image_parts import PixelSettings  # the picture side, `image_size`

    made = [
        (
            "image_encoder",
            "test_pixels",
            PixelSettings,
            lambda r, s: PixelProbe(r.model.embed_dim),
            {"reads_pixels": True},
        ),
        ("image_encoder", "test_pixels_plain", PixelSettings, lambda r, s: PixelProbe(r.model.embed_dim), {}),
        (
            "text_encoder",
            "test_words",
            WordSettings,
            lambda r, s: WordProbe(len(s.vocab_words), r.model.embed_dim),
            {"word_vocabulary": True},
        ),
        ("similarity", "test_dot", ProbeSettings, lambda c, d, v: Dot(), {"inner_product": True}),
        ("similarity", "test_dot_plain", ProbeSettings, lambda c, d, v: Dot(), {}),
        (
            "loss",
            "test_hinge",
            ProbeSettings,
            lambda c: AllPairsHinge(c.margin),
            {"equal_score": _all_pairs_equal_score, "cuda_graph": True},
        ),
    ]
    for kind, name, settings, build, facts in made:
        registry.register(kind, name, settings, build=build, help=f"{name}: a part of the test", facts=facts)
    PixelProbe.seen = []
    yield
    for kind, name, *_ in made:
        registry.unregister(kind, name)


def _model(*overrides: str) -> VSEModel:
    recipe = load_recipe("vsepp", [*SMALL, *overrides])
    from vsekit.data.text import Vocabulary

    words = Vocabulary.build(["a red dog"]).idx2word
    return VSEModel(recipe, DataSpec(img_dim=4, vocab_words=words)).eval()


def test_f1_a_pixel_encoder_registered_here_gets_pixels(probes, tmp_path):
    from vsekit.data.raw_images import PixelSource
    from vsekit.evaluation import image_source_for
    from vsekit.interop.clip_benchmark import ClipBenchmarkModel
    from vsekit.models.inputs import encode_image
    from vsekit.search.encode import ImageEmbedder
    from vsekit.training.trainer import Trainer

    model = _model("model.image.kind=test_pixels", "model.image.image_size=32")
    split = types.SimpleNamespace(image_paths=["a.png"], n_images=1, root=tmp_path, split="test")
    for source in (
        image_source_for(model, split),  # evaluation
        Trainer._image_source(
            types.SimpleNamespace(recipe=model.recipe, model=model), split, True
        ),  # training
    ):
        assert isinstance(source, PixelSource) and source.image_size == 32
    assert ImageEmbedder(model, {}).mode == "backbone"  # search: pictures in, no feature extractor needed
    ClipBenchmarkModel(model, {})  # CLIP_benchmark feeds pictures: accepted without a recorded extractor
    out = encode_image(model, Image.new("RGB", (50, 20), (200, 10, 10)))
    assert PixelProbe.seen == [(1, 3, 32, 32)] and out.shape == (1, 8)

    plain = _model("model.image.kind=test_pixels_plain")  # the same module without the fact: features
    with pytest.raises(Exception, match="precomputed features"):
        encode_image(plain, Image.new("RGB", (50, 20)))


def test_f1_a_vocabulary_text_encoder_registered_here_gets_the_word_tokenizer(probes):
    from vsekit.data.text import Vocabulary
    from vsekit.evaluation import text_processor_for
    from vsekit.training.trainer import load_text_processor

    recipe = load_recipe("vsepp", [*SMALL, "model.text.kind=test_words", "model.text.vocab_min_count=1"])
    spec = DataSpec(img_dim=4)
    vocab = load_text_processor(recipe, ["a red dog", "a dog on the grass"], spec)
    assert isinstance(vocab, Vocabulary)
    assert {"a", "red", "dog", "on", "the", "grass"} <= set(spec.vocab_words)  # built from the captions
    model = VSEModel(recipe, spec).eval()
    loaded = text_processor_for(model)  # a loaded model reads its vocabulary from its spec
    assert isinstance(loaded, Vocabulary) and loaded.idx2word == spec.vocab_words
    assert model.text_encoder.embed.num_embeddings == len(spec.vocab_words)


def test_f1_an_inner_product_similarity_registered_here_is_not_reranked(probes):
    from vsekit.search.encode import needs_rerank, proxy_vectors

    dot = _model("model.similarity.name=test_dot")
    assert needs_rerank(dot) is False  # the index is exact
    emb = torch.tensor([[3.0, 4.0] + [0.0] * 6])
    assert torch.equal(proxy_vectors(dot, emb), emb)  # the embedding itself is the index's vector
    assert needs_rerank(_model("model.similarity.name=test_dot_plain")) is True  # no fact: shortlist only
    assert (
        needs_rerank(_model()) is False
        and needs_rerank(_model("model.similarity.name=aeom", "model.similarity.block_dim=4")) is True
    )


def test_f1_a_loss_registered_here_gets_the_collapse_alarm_and_a_graph(probes, tiny_data, tmp_path):
    from vsekit.config import LossConfig
    from vsekit.training.cuda_graph import cuda_graph_blockers
    from vsekit.training.trainer import Trainer

    cfg = LossConfig(name="test_hinge", margin=0.2)
    monitor = CollapseMonitor(cfg, steps=2)
    ids = torch.tensor([0, 0, 1, 2])  # n_i = 2, 2, 3, 3: 2 * 0.2 * 10 = 4.0 by hand
    assert negatives_per_row(ids, 4).tolist() == [2.0, 2.0, 3.0, 3.0]
    for step in (1, 2):
        monitor.update(
            {"loss": torch.tensor(4.0), "spread": torch.tensor(1.0)}, ids, 4, hardest=True, step=step
        )
    report = monitor.poll()
    assert report is not None and report.by_loss and report.collapse_value == pytest.approx(4.0)
    assert "all-pairs hinge of the test" in report.message()

    # through the trainer, on a set whose embeddings are one point: 16 captions of 16 images per batch
    data = constant_dataset(tiny_data, tmp_path / "data")
    r = load_recipe(
        "vsepp",
        [
            "model.embed_dim=16",
            "model.text.word_dim=8",
            "model.image.mlp_hidden=16",
            "train.batch_size=16",
            "train.epochs=1",
            "train.log_every=1",
            "loss.name=test_hinge",
            "loss.warmup_epochs=0",
            "data.text_augment_prob=0",
            "train.collapse_steps=3",
        ],
    )
    messages: list[str] = []
    Trainer(r, data, tmp_path / "run", progress=False, log=messages.append).fit()
    alarms = [rec for rec in run_records(tmp_path / "run") if rec["kind"] == "collapse"]
    assert len(alarms) == 1 and alarms[0]["step"] == 3 and alarms[0]["by_loss"]
    # m per negative pair and direction: 2 * 0.2 * (pairs of different images among the batch's 16 captions),
    # what the loss module itself computed on the batch
    pairs = alarms[0]["collapse_value"] / (2 * 0.2)
    assert pairs == pytest.approx(round(pairs), abs=1e-3) and 16 * 13 <= round(pairs) <= 16 * 15
    assert alarms[0]["loss"] == pytest.approx(alarms[0]["collapse_value"], rel=1e-5)
    assert sum("all-pairs hinge of the test" in m for m in messages) == 1

    blockers = cuda_graph_blockers(r, torch.device("cpu"))
    assert not any(b.startswith("loss.name=") for b in blockers)  # its `cuda_graph` fact
    plain = load_recipe("vsepp", ["loss.name=ladder"])
    named = [
        b for b in cuda_graph_blockers(plain, torch.device("cpu")) if b.startswith("loss.name=ladder (only ")
    ]
    assert len(named) == 1
    capturable = named[0].split("(only ", 1)[1].split(" are checked")[0].split(", ")
    assert capturable[:3] == ["triplet", "adopt", "infonce"] and "test_hinge" in capturable


def test_h4_one_name_for_no_progress_bar_with_the_old_one_an_alias():
    """Hygiene: `--no-progress` is every verb's name for 'no progress bar'; `vse index --quiet` is its alias (the
    global `vse -q` stays the log level)."""
    from vsekit.cli import build_parser

    parser = build_parser()
    for flag in ("--no-progress", "--quiet"):
        args = parser.parse_args(["index", "run", "pics", "--out", "idx", flag])
        assert args.no_progress is True
    assert parser.parse_args(["index", "run", "pics", "--out", "idx"]).no_progress is False
    assert parser.parse_args(["-q", "index", "run", "pics", "--out", "idx"]).no_progress is False
