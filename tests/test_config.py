import pytest

from vsekit.config import ConfigError, builtin_recipes, load_recipe


def test_builtin_recipes_load():
    names = builtin_recipes()
    assert {"vsepp", "vse_infty"} <= set(names)
    for name in names:
        load_recipe(name)


def test_vsepp_inherits_vse_infty_but_pools_with_avg():
    r = load_recipe("vsepp")
    assert r.model.image.pooling.name == "avg" and r.model.text.pooling.name == "avg"
    assert r.optim.lr == 5e-4 and r.optim.lr_decay_epochs == [15] and r.train.epochs == 25


def test_overrides_are_typed():
    r = load_recipe(
        "vse_infty", ["model.embed_dim=256", "optim.lr_decay_epochs=[3, 5]", "loss.max_violation=false"]
    )
    assert r.model.embed_dim == 256 and r.optim.lr_decay_epochs == [3, 5] and r.loss.max_violation is False


@pytest.mark.parametrize(
    "override,needle",
    [
        ("model.embed_dimm=3", "model.embed_dimm"),
        ("model.embed_dim=abc", "expected an integer"),
        ("loss.name=nope", "loss.name"),
        ("model.image.pooling.name=median", "pooling.name"),
        ("noequals", "key.path=value"),
    ],
)
def test_bad_overrides_name_the_problem(override, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.") if "=" not in needle else "key"):
        load_recipe("vse_infty", [override])


def test_unknown_key_in_yaml_file(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("base: vsepp\nmodel:\n  imagee: {}\n")
    with pytest.raises(ConfigError, match="model.imagee"):
        load_recipe(str(p))


def test_unknown_recipe_lists_choices():
    with pytest.raises(ConfigError, match="vse_infty"):
        load_recipe("no_such_recipe")


def test_bigru_recipes_use_the_released_weight_decay():
    """The released BiGRU codes (vse_infty branch bigru, region features; vse_2ad bigru + project) build AdamW
    without weight_decay, i.e. PyTorch's default 0.01; their CNN-backbone settings pass 1e-4 (docs/reproduce.md)."""
    for name in ("vse_infty", "vsepp", "vse_2ad", "avse"):
        r = load_recipe(name)
        assert r.model.text.kind == "bigru" and r.optim.weight_decay == 0.01, name  # a parsed literal: exact
    assert load_recipe("vse_infty_grid_e2e").optim.weight_decay == 1e-4
