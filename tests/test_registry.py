"""A part is a module: a pooling defined and registered here, in a few lines, trains through `vse train` and is
listed by `vse recipes` without a line of vsekit changed; the registry refuses a second part of the same name;
an unknown part name is one line listing the choices; docs/recipe_keys.md is the one the dataclasses give."""

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn

from vsekit import registry
from vsekit.cli import main
from vsekit.config import ConfigError, PoolingConfig, Recipe, load_recipe, recipe_from_dict, to_dict
from vsekit.registry import RegistryError, Settings, setting

DOC = Path(__file__).resolve().parents[1] / "docs" / "recipe_keys.md"
TINY = [
    "--epochs",
    "1",
    "--no-progress",
    "--device",
    "cpu",
    "--recipe",
    "vsepp",
    "--set",
    "model.embed_dim=16",
    "--set",
    "model.text.word_dim=8",
    "--set",
    "train.batch_size=16",
    "--set",
    "optim.lr_decay_epochs=[1]",
]


# ---------------------------------------------------------------- the new part: all it takes


@dataclass
class LSESettings(Settings):
    lse_sharpness: float = setting(
        4.0, "lse: how close to max pooling (-> 0: average)", rule="a positive finite number"
    )


class LSEPool(nn.Module):
    """Log-sum-exp pooling: (1/r) log mean exp(r x) over each set's valid vectors, per dimension."""

    calls = 0

    def __init__(self, sharpness: float) -> None:
        super().__init__()
        self.r = sharpness

    def forward(self, features: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        LSEPool.calls += 1
        valid = torch.arange(features.shape[1], device=features.device)[None, :] < lengths[:, None]
        x = (self.r * features).masked_fill(~valid[..., None], -math.inf)
        return (torch.logsumexp(x, dim=1) - torch.log(lengths.to(features.dtype))[:, None]) / self.r


@pytest.fixture
def lse():
    part = registry.register(
        "pooling",
        "lse",
        LSESettings,
        build=lambda cfg, dim: LSEPool(cfg.lse_sharpness),
        help="log-sum-exp pooling, between average and max",
    )
    LSEPool.calls = 0
    yield part
    registry.unregister("pooling", "lse")


# ----------------------------------------------------------------------------------------- tests


def test_lse_pool_by_hand():
    """The test's pooling itself, against a hand computation (so what trains below is what it claims)."""
    feats = torch.tensor([[[0.0, 1.0], [2.0, -1.0], [9.0, 9.0]]])  # the third vector is padding
    out = LSEPool(2.0)(feats, torch.tensor([2]))
    want = [
        math.log((math.exp(0.0) + math.exp(4.0)) / 2) / 2,
        math.log((math.exp(2.0) + math.exp(-2.0)) / 2) / 2,
    ]
    assert out[0].tolist() == pytest.approx(want, abs=1e-6)


def test_a_pooling_registered_here_trains_and_is_listed(lse, tiny_data, tmp_path, capsys):
    run = tmp_path / "run"
    argv = [
        "train",
        "--data",
        str(tiny_data),
        "--out",
        str(run),
        *TINY,
        "--set",
        "model.image.pooling.name=lse",
        "--set",
        "model.image.pooling.lse_sharpness=2.5",
    ]
    assert main(argv) == 0
    assert LSEPool.calls > 0  # the training step pooled the images with it
    recipe = json.loads((run / "config.json").read_text())["recipe"]
    pool = recipe["model"]["image"]["pooling"]
    assert (
        pool["name"] == "lse"
        and pool["lse_sharpness"] == 2.5
        and recipe["model"]["text"]["pooling"]["name"] == "avg"
    )

    import vsekit

    model = vsekit.load(run)  # the saved run loads back with its pooling, as long as the part is registered
    assert isinstance(model.image_encoder.pool, LSEPool) and model.image_encoder.pool.r == 2.5

    capsys.readouterr()
    assert main(["recipes"]) == 0
    listed = capsys.readouterr().out
    line = next(x for x in listed.splitlines() if x.startswith("model.image.pooling.name"))
    listed_names = line.split(": ", 1)[1].split(", ")
    builtin = [
        "avg",
        "max",
        "kmax",
        "gpo",
        "adpool",
        "cls",
    ]  # in their order; methods' own poolings may join them
    assert [n for n in listed_names if n in builtin] == builtin and listed_names[-1] == "lse"
    assert main(["recipes", "--keys"]) == 0
    assert (
        "| `model.image.pooling.lse_sharpness` | float, a positive finite number | `4.0` | lse |"
        in capsys.readouterr().out
    )


def test_a_registered_part_s_settings_are_checked_and_typed(lse):
    r = load_recipe("vsepp", ["model.image.pooling.name=lse", "model.image.pooling.lse_sharpness=3"])
    assert r.model.image.pooling.lse_sharpness == 3.0 and isinstance(
        r.model.image.pooling.lse_sharpness, float
    )
    assert r.model.image.pooling.part_settings() == LSESettings(lse_sharpness=3.0)
    with pytest.raises(
        ConfigError, match=r"model\.image\.pooling\.lse_sharpness=0\.0: must be a positive finite"
    ):
        load_recipe("vsepp", ["model.image.pooling.name=lse", "model.image.pooling.lse_sharpness=0"])
    with pytest.raises(ConfigError, match="expected a number"):
        load_recipe("vsepp", ["model.image.pooling.lse_sharpness=abc"])


def test_registering_a_taken_name_is_an_error(lse):
    with pytest.raises(RegistryError, match="'lse' is already registered"):
        registry.register("pooling", "lse", build=lambda cfg, dim: nn.Identity(), help="again")
    with pytest.raises(RegistryError, match="'gpo' is already registered"):
        registry.register("pooling", "gpo", build=lambda cfg, dim: nn.Identity(), help="a second gpo")
    assert registry.get("pooling", "gpo").settings.__name__ == "GPOSettings"  # the built-in one is untouched
    assert registry.names("pooling").count("lse") == 1


def test_a_shared_key_must_mean_the_same_thing():
    """A key two poolings share is one key of the flat section: a different default is refused."""

    @dataclass
    class Other(Settings):
        temperature: float = setting(0.5, "another temperature")

    with pytest.raises(RegistryError, match="'temperature' differs from the one 'gpo' declares"):
        registry.register("pooling", "other", Other, build=lambda cfg, dim: nn.Identity(), help="x")
    assert "other" not in registry.names("pooling")


def test_unknown_pooling_is_one_line_listing_the_choices(tiny_data, tmp_path, capsys):
    argv = [
        "train",
        "--data",
        str(tiny_data),
        "--out",
        str(tmp_path / "r"),
        *TINY,
        "--set",
        "model.image.pooling.name=median",
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    head = "vse train: error: model.image.pooling.name='median'; choose one of "
    assert len(err) == 1 and err[0].startswith(head)
    choices = err[0][len(head) :].split(", ")
    assert [n for n in choices if n in ("avg", "max", "kmax", "gpo", "adpool", "cls")] == [
        "avg",
        "max",
        "kmax",
        "gpo",
        "adpool",
        "cls",
    ]
    assert not (tmp_path / "r").exists()


def test_unknown_keys_stay_errors_and_saved_recipes_load_unchanged():
    with pytest.raises(ConfigError, match=r"unknown key\(s\) model\.image\.pooling\.lse_sharpness"):
        load_recipe("vsepp", ["model.image.pooling.lse_sharpness=2"])  # no such pooling registered now
    # a run's config.json holds every key flat, the other poolings' too (what vsekit has always written)
    saved = to_dict(load_recipe("vse_2ad"))
    assert set(
        saved["model"]["image"]["pooling"]
    ) >= {  # the built-in poolings' keys (methods' own add theirs)
        "name",
        "k",
        "d_pe",
        "d_hidden",
        "temperature",
        "token_level",
        "embedding_level",
        "adpool_variant",
        "adpool_mask_padding",
    }
    assert recipe_from_dict(saved) == load_recipe("vse_2ad")


def test_sections_keep_the_dataclass_api():
    cfg = PoolingConfig(name="adpool", adpool_variant="paper")
    assert (cfg.name, cfg.adpool_variant, cfg.k, cfg.d_pe) == ("adpool", "paper", 1, 32)
    copy = dataclasses.replace(cfg, token_level=False)
    assert copy.token_level is False and copy.adpool_variant == "paper" and cfg.token_level is True
    cfg.k = 3
    assert to_dict(cfg)["k"] == 3
    with pytest.raises(AttributeError, match="no recipe key 'kk'"):
        cfg.kk = 3
    with pytest.raises(TypeError, match="unknown recipe key"):
        PoolingConfig(name="gpo", dpe=3)
    assert Recipe() == Recipe() and Recipe().model.image.pooling != cfg


def test_every_recipe_key_has_help_and_the_doc_lists_it_with_its_default():
    """Each key of the default recipe (flattened) has a row in docs/recipe_keys.md with its default and a help."""
    flat: dict[str, object] = {}

    def walk(d: dict, prefix: str = "") -> None:
        for k, v in d.items():
            walk(v, f"{prefix}{k}.") if isinstance(v, dict) else flat.setdefault(prefix + k, v)

    walk(to_dict(Recipe()))
    rows = {}
    for line in DOC.read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip("|").split(" | ")] if line.startswith("| `") else []
        if cells:
            rows[cells[0].strip("`")] = cells
    text_pool = {k for k in flat if k.startswith("model.text.pooling.")}
    assert set(flat) - text_pool == set(rows)  # model.text.pooling: "the same keys as model.image.pooling"
    for key, cells in rows.items():
        assert cells[-1], key  # a help string
        assert cells[2] == (
            f"`{flat[key]}`" if isinstance(flat[key], str) and flat[key] else f"`{json.dumps(flat[key])}`"
        )


def test_ranges_come_before_the_parts_own_rules():
    """AEOM's rule (embed_dim a multiple of block_dim) runs after block_dim's range: 0 is named, not divided by."""
    with pytest.raises(ConfigError, match=r"model\.similarity\.block_dim=0: must be >= 1"):
        load_recipe("avse", ["model.similarity.block_dim=0"])


def test_recipes_keys_takes_no_recipe_name(capsys):
    assert main(["recipes", "vsepp", "--keys"]) == 2
    assert capsys.readouterr().err.strip() == (
        "vse recipes: error: --keys lists every key of every recipe: give no recipe name with it"
    )


def test_the_committed_recipe_keys_doc_is_current():
    from vsekit.parts import recipe_keys_markdown

    assert DOC.read_text(encoding="utf-8") == recipe_keys_markdown(), (
        "regenerate: vse recipes --keys > docs/recipe_keys.md"
    )


class _CountingWords(nn.Module):
    """A caption encoder a test pooling brings: the sum of its words' one-hot counts (known by hand)."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.vocab = vocab

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        valid = torch.arange(tokens.shape[1])[None, :] < lengths[:, None]
        return torch.nn.functional.one_hot(tokens * valid, self.vocab).float().mul(valid[..., None]).sum(1)


def test_a_pooling_can_bring_its_own_encoder_and_only_a_pooling():
    """A pooling registered with `encoders` replaces the caption encoder of the kind it names (as ESA's does),
    and only there: the image side, and the same pooling on another text encoder, stay the built-in ones."""
    from vsekit.models.text import BagOfWordsTextEncoder, BiGRUTextEncoder
    from vsekit.models.vse import DataSpec, VSEModel

    words = [f"w{i}" for i in range(6)]
    registry.register(
        "pooling",
        "counting",
        build=lambda cfg, dim: nn.Identity(),
        help="test",
        encoders={"text:bigru": lambda recipe, spec: _CountingWords(len(spec.vocab_words))},
    )
    try:
        recipe = load_recipe("vsepp", ["model.text.pooling.name=counting", "model.embed_dim=6"])
        model = VSEModel(recipe, DataSpec(img_dim=4, vocab_words=words))
        assert isinstance(model.text_encoder, _CountingWords)
        out = model.text_encoder(torch.tensor([[1, 2, 2, 5]]), torch.tensor([3]))
        assert out.tolist() == [[0.0, 1.0, 2.0, 0.0, 0.0, 0.0]]  # word 5 is past the length
        bow = load_recipe("bow", ["model.text.pooling.name=counting", "model.embed_dim=6"])
        assert isinstance(
            VSEModel(bow, DataSpec(img_dim=4, vocab_words=words)).text_encoder, BagOfWordsTextEncoder
        )
        plain = VSEModel(load_recipe("vsepp", ["model.embed_dim=6"]), DataSpec(img_dim=4, vocab_words=words))
        assert isinstance(plain.text_encoder, BiGRUTextEncoder)
    finally:
        registry.unregister("pooling", "counting")
    with pytest.raises(RegistryError, match="only a pooling brings its own encoders"):
        registry.register(
            "loss", "x", build=lambda cfg: nn.Identity(), help="x", encoders={"text:bigru": print}
        )
    with pytest.raises(RegistryError, match="must read 'image:KIND' or 'text:KIND'"):
        registry.register(
            "pooling", "y", build=lambda cfg, dim: nn.Identity(), help="y", encoders={"bigru": print}
        )
    assert "y" not in registry.names("pooling")
