"""openclipart builder on a handful of SVGs written by the test (no network, no Debian package needed)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

from vsekit.utils.io import sha256_file
from vsekit_lab.datasets import openclipart as oc

pytest.importorskip("PIL")

RDF_HEAD = (
    '<metadata><rdf:RDF xmlns:rdf="http://www.w3.org/1999/02/22-rdf-syntax-ns#" '
    'xmlns:dc="http://purl.org/dc/elements/1.1/" xmlns:cc="http://web.resource.org/cc/">'
    '<cc:Work rdf:about="">'
)


def svg(
    body: str,
    title: str | None,
    description: str = "",
    keywords: tuple[str, ...] = (),
    creator: str = "Test Artist",
) -> str:
    """A small SVG with openclipart-style Dublin Core metadata (title None: no metadata at all)."""
    meta = ""
    if title is not None:
        lis = "".join(f"<rdf:li>{k}</rdf:li>" for k in keywords)
        meta = (
            f"{RDF_HEAD}<dc:title>{title}</dc:title><dc:description>{description}</dc:description>"
            f"<dc:subject><rdf:Bag>{lis}<rdf:li></rdf:li><rdf:li>hash</rdf:li></rdf:Bag></dc:subject>"
            f"<dc:creator><cc:Agent><dc:title>{creator}</dc:title></cc:Agent></dc:creator>"
            '<cc:license rdf:resource="http://web.resource.org/cc/PublicDomain"/>'
            "</cc:Work></rdf:RDF></metadata>"
        )
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        '<svg xmlns="http://www.w3.org/2000/svg" width="600" height="800" viewBox="0 0 600 800">'
        f"{meta}{body}</svg>"
    )


CIRCLE = '<circle cx="100" cy="120" r="60" fill="#d01010"/>'
BOAT = '<polygon points="300,100 300,400 450,400" fill="#2050c0"/><rect x="200" y="420" width="300" height="40"/>'
HOUSE = (
    '<rect x="50" y="300" width="200" height="200" fill="#a06020"/><polygon points="30,300 150,180 270,300"/>'
)
SUN = '<circle cx="400" cy="500" r="90" fill="#f0c000"/>'
STAR = '<polygon points="100,10 40,198 190,78 10,78 160,198" fill="#000"/>'
LEAF = '<ellipse cx="300" cy="400" rx="80" ry="30" fill="#20a020"/>'
TREE = '<rect x="280" y="400" width="40" height="200"/><circle cx="300" cy="350" r="120" fill="#108010"/>'


def write_fixture(root: Path) -> None:
    files = {
        "food/fruit/red_apple.svg": svg(
            CIRCLE, "Red apple", "A shiny red apple with a green leaf.", ("fruit", "food")
        ),
        "transportation/sail_boat.svg": svg(BOAT, "Sail boat", "", ("boat", "sailing", "sea")),
        # the same drawing in two folders, with different metadata -> one image, merged text
        "buildings/house_01.svg": svg(HOUSE, "House", "", ("building",)),
        "people/home/house_01.svg": svg(HOUSE, "Small house", "A small brown house with a roof.", ("home",)),
        "weather/sun.svg": svg(SUN, "Sun", "A bright yellow sun in the sky.", ("weather",)),
        "plants/green_leaf.svg": svg(LEAF, "Green leaf", "", ("plant", "nature")),
        "plants/oak_tree.svg": svg(TREE, "Oak tree", "A tall oak tree in summer.", ("plant", "tree")),
        # generic collection title, readable stem -> renamed "yellow sun"
        "computer/icons/yellow_sun_01.svg": svg(
            SUN.replace("f0c000", "e0b000"),
            "Part of the Flat Icon Collection (Wed Aug 25 23:29:46 2004)",
            "",
            ("hash", "icons"),
        ),
        # generic title, unreadable stem -> dropped
        "computer/icons/kxq_zzv.svg": svg(BOAT.replace("2050c0", "00ff00"), "Lemon SVG theme", "", ("icon",)),
        # generic collection that is always dropped
        "shapes/stars/star_12pt05step.svg": svg(STAR, "gramastar", "", ("stars", "shapes")),
        # nothing drawn -> blank render
        "special/empty_page.svg": svg("", "Empty page", "", ("paper",)),
        # broken XML and no metadata -> warned, skipped, counted
        "unsorted/broken.svg": svg(CIRCLE, "Broken")[:-30] + "<g><unclosed",
        "unsorted/no_meta.svg": svg(LEAF.replace("20a020", "a02020"), None),
    }
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text, encoding="utf-8")


@pytest.fixture(scope="module")
def svg_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("svg")
    write_fixture(root)
    return root


@pytest.fixture(scope="module")
def built(svg_root, tmp_path_factory):
    out = tmp_path_factory.mktemp("out")
    manifest = oc.build_openclipart(out, svg_root=svg_root, workers=1, progress=False)
    return out, manifest


def test_parse_metadata_and_errors(svg_root, caplog):
    meta = oc.parse_svg_metadata((svg_root / "food/fruit/red_apple.svg").read_bytes())
    assert meta["title"] == "Red apple"
    assert meta["description"] == "A shiny red apple with a green leaf."
    assert meta["keywords"][:2] == ["fruit", "food"]
    assert meta["creator"] == "Test Artist"
    assert meta["license"].endswith("PublicDomain")
    with pytest.raises(oc.SvgMetadataError) as e:
        oc.parse_svg_metadata((svg_root / "unsorted/broken.svg").read_bytes())
    assert e.value.kind == "malformed"
    with pytest.raises(oc.SvgMetadataError) as e:
        oc.parse_svg_metadata((svg_root / "unsorted/no_meta.svg").read_bytes())
    assert e.value.kind == "no_metadata"

    rels, _ = oc.find_svgs(svg_root)
    with caplog.at_level(logging.WARNING, logger="vsekit_lab.datasets.openclipart"):
        ok, errors = oc.parse_all(svg_root, rels, svg_root.parent / "meta_cache.json", progress=False)
    assert set(errors) == {"unsorted/broken.svg", "unsorted/no_meta.svg"}
    assert "unsorted/broken.svg" in caplog.text and "unsorted/no_meta.svg" in caplog.text
    assert len(ok) == len(rels) - 2


def test_dedup_and_labels(svg_root):
    rels, _ = oc.find_svgs(svg_root)
    ok, _ = oc.parse_all(svg_root, rels, svg_root.parent / "meta_cache2.json", progress=False)
    drawings, n_dup = oc.merge_duplicates(ok)
    assert n_dup == 1
    house = [d for d in drawings if "buildings/house_01.svg" in d.files]
    assert len(house) == 1 and len(house[0].files) == 2
    assert house[0].title == "Small house"  # longest non-generic title among copies
    assert house[0].description == "A small brown house with a roof."
    assert house[0].keywords == ["building", "home"]  # union; "hash" and empty keywords dropped

    kept, stats = oc.assign_labels(drawings)
    labels = {d.label: d for d in kept}
    assert "yellow sun" in labels and labels["yellow sun"].label_source == "file_stem"
    assert not any("Collection" in d.label or "Lemon" in d.label or "gramastar" in d.label for d in kept)
    assert stats["generic_titles"] == 3
    assert stats["renamed_from_file_stem"] == 1
    assert stats["generic_dropped_collection"] == 1 and stats["generic_dropped_unreadable_stem"] == 1
    apple = labels["Red apple"]
    assert apple.captions == ["Red apple", "A shiny red apple with a green leaf.", "Red apple (fruit, food)"]
    assert labels["Sail boat"].captions == ["Sail boat", "Sail boat (sailing, sea)"]  # "boat" is in the label


def test_stem_label_rules():
    vocab = {"bullet", "hole", "air", "transportation", "red", "apple"}
    assert oc.stem_label("bullet_hole_linda_kim_r", "Linda Kim", vocab) == "bullet hole"
    assert oc.stem_label("aiga_air_transportation1", "", vocab, "AIGA Symbol Signs") == "air transportation"
    assert oc.stem_label("star_79pt30step", "", vocab | {"star"}) is None
    assert oc.stem_label("kaboodleloop", "", vocab) is None
    assert oc.stem_label("RedApple", "", vocab) == "red apple"


def test_split_deterministic_and_scaled():
    ids = [f"{i:012x}" for i in range(2000)]
    a = oc.assign_splits(ids, seed=0, n_test=500, n_dev=300)
    b = oc.assign_splits(list(reversed(ids)), seed=0, n_test=500, n_dev=300)
    c = oc.assign_splits(ids, seed=1, n_test=500, n_dev=300)
    assert a == b
    assert a["test"] != c["test"]
    assert (len(a["test"]), len(a["dev"]), len(a["train"])) == (500, 300, 1200)
    assert not set(a["test"]) & set(a["dev"]) and not set(a["test"]) & set(a["train"])
    assert oc.split_sizes(20, 500, 300) == (5, 3)  # tiny builds: test+dev capped at 40 %
    assert oc.split_sizes(3400, 500, 300) == (500, 300)


def test_render_crop_square(svg_root):
    img = oc.render_svg(str(svg_root / "food/fruit/red_apple.svg"))
    assert img.size == (oc.RENDER_SIZE, oc.RENDER_SIZE)
    out = oc.crop_square(img)
    assert out.size == (224, 224) and out.mode == "RGB"
    arr = np.asarray(out)
    assert arr[112, 112, 0] > 150 and arr[112, 112, 1] < 80  # the red disc fills the middle after the crop
    assert arr[:4].min() >= 240  # white margin (antialiasing may leave a faint tint)
    assert oc.crop_square(oc.render_svg(str(svg_root / "special/empty_page.svg"))) is None


def test_build_layout_roundtrip(built):
    out, m = built
    from PIL import Image

    c = m["counts"]
    assert m["format"] == "vsekit-precomp/1"
    assert c["svg_files"] == 13 and c["malformed_skipped"] == 1 and c["no_metadata_skipped"] == 1
    assert c["duplicates"] == 1 and c["unique_drawings"] == 10
    assert c["generic_dropped"] == 2 and c["blank"] == 1 and c["render_failures"] == 0
    assert c["images"] == 7
    total_imgs = total_caps = 0
    seen_ids: set[str] = set()
    for split in oc.SPLITS:
        ims = np.load(out / f"{split}_ims.npy", mmap_mode="r")
        caps = (out / f"{split}_caps.txt").read_text(encoding="utf-8").split("\n")
        assert caps[-1] == ""
        caps = caps[:-1]
        c2i = [int(x) for x in (out / f"{split}_cap2img.txt").read_text().split()]
        ids = (out / f"{split}_ids.txt").read_text().split()
        paths = (out / f"{split}_images.txt").read_text().split("\n")[:-1]
        assert (
            ims.dtype == np.float16 and ims.shape[1:] == (49, 1280) and ims.shape[0] == len(ids) == len(paths)
        )
        assert len(caps) == len(c2i) and all(x.strip() for x in caps)
        assert c2i == sorted(c2i) and set(c2i) == set(
            range(len(ids))
        )  # consecutive, every image has captions
        assert m["splits"][split] == {**m["splits"][split], "images": len(ids), "captions": len(caps)}
        for p in paths:
            with Image.open(out / p) as im:
                assert im.size == (224, 224)
        assert np.isfinite(np.asarray(ims, dtype=np.float32)).all()
        seen_ids |= set(ids)
        total_imgs += len(ids)
        total_caps += len(caps)
    assert total_imgs == len(seen_ids) == 7 and total_caps == c["captions"]
    assert (
        len(m["splits"]["test"]) and m["splits"]["test"]["images"] >= 1 and m["splits"]["dev"]["images"] >= 1
    )
    assert m["features"]["name"] == "efficientnet_lite0_grid" and m["features"]["image_size"] == 224
    for name, digest in m["files_sha256"].items():
        assert sha256_file(out / name) == digest
    assert json.loads((out / "manifest.json").read_text()) == m
    # the reader of the core understands the layout
    from vsekit.data.precomp import load_precomp_split

    sp = load_precomp_split(out, "train")
    assert sp.n_images == m["splits"]["train"]["images"] and sp.n_captions == m["splits"]["train"]["captions"]


def test_rebuild_reuses_cache(built, svg_root):
    out, m1 = built
    m2 = oc.build_openclipart(out, svg_root=svg_root, workers=1, progress=False)
    assert m2["cache"]["png_rendered"] == 0 and m2["cache"]["features_computed"] == 0
    assert m2["files_sha256"] == m1["files_sha256"]
    m3 = oc.build_openclipart(out, svg_root=svg_root, workers=1, progress=False, seed=3, limit=5)
    assert m3["counts"]["selected"] == 5 and m3["counts"]["images"] in (4, 5)  # the blank one may be drawn
    assert m3["cache"]["png_rendered"] == 0


def test_missing_root_message(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such folder"):
        oc.build_openclipart(tmp_path / "out", svg_root=tmp_path / "nope", progress=False)


def test_preprocess_image_alpha_on_white():
    from PIL import Image

    from vsekit.features import preprocess_image

    x = preprocess_image(Image.new("RGBA", (50, 30), (0, 0, 0, 0)))
    assert x.shape == (3, 224, 224) and str(x.dtype) == "torch.float32"
    white = (1 - np.array([0.485, 0.456, 0.406])) / np.array([0.229, 0.224, 0.225])
    assert np.allclose(x[:, 0, 0].numpy(), white, atol=1e-5)  # two float32 ops on values <= 2.6: <= 3e-7


@pytest.mark.slow  # spawned workers re-import everything: ~1.5 s idle, 10+ s on a busy machine
def test_build_with_worker_processes(svg_root, tmp_path):
    m = oc.build_openclipart(tmp_path / "out", svg_root=svg_root, workers=2, progress=False)
    assert m["counts"]["images"] == 7 and m["counts"]["blank"] == 1


def test_show_montage(built, tmp_path):
    """`vse data show`: a montage with one cell per image, pictures pasted in, captions drawn below."""
    from PIL import Image

    from vsekit.cli import main

    out, m = built
    n_train = m["splits"]["train"]["images"]
    png = tmp_path / "montage.png"
    assert main(["data", "show", str(out), "--split", "train", "--n", "4", "--out", str(png)]) == 0
    with Image.open(png) as im:
        arr = np.asarray(im.convert("RGB"))
    cols = 2 if min(4, n_train) > 1 else 1
    assert arr.shape[1] == cols * (224 + 16)
    assert arr.shape[0] > 224 + 16  # room for the captions under the pictures
    assert len(np.unique(arr.reshape(-1, 3), axis=0)) > 20  # drawings and text, not a blank sheet
    with pytest.raises(FileNotFoundError, match="train_images.txt"):
        (out / "renamed.txt").write_text("")
        from vsekit.datasets.show import show_dataset

        show_dataset(out / "nowhere", tmp_path / "x.png", split="train")


@pytest.mark.slow
def test_end_to_end_backbone_recipe_unfreezes_after_first_epoch(built, tmp_path):
    """vse_infty_grid_e2e trains from the PNGs: backbone frozen in epoch 1, its last blocks move in epoch 2."""
    import torch

    from vsekit.config import load_recipe
    from vsekit.training.trainer import Trainer

    out, _ = built
    recipe = load_recipe(
        "vse_infty_grid_e2e",
        [
            "train.epochs=2",
            "train.batch_size=4",
            "model.embed_dim=32",
            "model.text.word_dim=16",
            "model.text.vocab_min_count=1",
            "data.captions_per_image=1",
            "train.log_every=0",
            "optim.lr=0.01",
            "model.image.backbone_trainable_blocks=2",
            "model.image.image_size=96",
        ],
    )
    trainer = Trainer(recipe, out, tmp_path / "run", progress=False)
    enc = trainer.model.image_encoder
    before = {k: v.detach().clone() for k, v in enc.cnn.state_dict().items()}
    trainer.fit(max_steps=trainer_steps_in_first_epoch(trainer))
    after_e1 = enc.cnn.state_dict()
    assert all(torch.equal(before[k], after_e1[k]) for k in before), (
        "backbone moved while frozen"
    )  # not written
    trainer.fit()
    moved = [k for k, v in enc.cnn.state_dict().items() if not torch.equal(before[k], v)]
    assert moved, "no backbone weight moved after unfreezing"
    assert not any(k.startswith(("net._conv_stem", "net._bn0", "net._blocks.0.")) for k in moved), (
        moved
    )  # early layers fixed
    assert any(k.startswith("net._conv_head") for k in moved)


def trainer_steps_in_first_epoch(trainer) -> int:
    return len(trainer.sampler.batches())


# ------------------------------------------------------------------- rsvg-convert, the fallback rasteriser


def _no_cairosvg(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "cairosvg", None)  # `import cairosvg` raises ImportError


def _failing_cairosvg(monkeypatch):
    import sys
    import types

    fake = types.ModuleType("cairosvg")

    def svg2png(**_):
        raise ValueError("unsupported element")

    fake.svg2png = svg2png
    monkeypatch.setitem(sys.modules, "cairosvg", fake)


def _fake_rsvg(tmp_path, monkeypatch, body: str) -> Path:
    """An `rsvg-convert` on an otherwise empty PATH: a Python script that logs its arguments to argv.json."""
    import sys

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    exe = bin_dir / "rsvg-convert"
    exe.write_text(
        f"#!{sys.executable}\nimport json, sys, time\n"
        f"json.dump(sys.argv[1:], open({str(tmp_path / 'argv.json')!r}, 'w'))\n{body}\n"
    )
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    return tmp_path / "argv.json"


DRAW_BLUE_SQUARE = """
from PIL import Image
img = Image.new("RGBA", (512, 512), (0, 0, 0, 0))
img.paste((20, 40, 200, 255), (156, 156, 356, 356))
img.save(sys.stdout.buffer, format="PNG")
"""


@pytest.mark.parametrize("cairo", ["missing", "failing"])
def test_rsvg_convert_is_used_when_cairosvg_cannot_render(svg_root, tmp_path, monkeypatch, cairo):
    (_no_cairosvg if cairo == "missing" else _failing_cairosvg)(monkeypatch)
    argv_log = _fake_rsvg(tmp_path, monkeypatch, DRAW_BLUE_SQUARE)
    svg = str(svg_root / "food/fruit/red_apple.svg")
    img = oc.render_svg(svg)
    assert json.loads(argv_log.read_text()) == [
        "-a",
        "-w",
        "512",
        "-h",
        "512",
        svg,
    ]  # aspect kept, 512 px box
    assert img.mode == "RGBA" and img.size == (512, 512)
    assert img.getpixel((256, 256)) == (20, 40, 200, 255) and img.getpixel((10, 10))[3] == 0
    out = np.asarray(oc.crop_square(img))  # the square, cropped and padded: blue in the middle, white margin
    assert tuple(out[112, 112]) == (20, 40, 200) and out[:4].min() >= 250


def test_render_errors_name_every_rasteriser(svg_root, tmp_path, monkeypatch):
    svg = str(svg_root / "food/fruit/red_apple.svg")
    _failing_cairosvg(monkeypatch)
    _fake_rsvg(tmp_path, monkeypatch, "sys.stderr.write('boom: bad svg'); sys.exit(3)")
    with pytest.raises(
        RuntimeError, match=r"cairosvg: ValueError: unsupported element; rsvg-convert: exit 3: boom"
    ):
        oc.render_svg(svg)
    (tmp_path / "bin" / "rsvg-convert").write_text(
        f"#!{__import__('sys').executable}\nimport time\ntime.sleep(30)\n"
    )
    with pytest.raises(RuntimeError, match="rsvg-convert: timeout after 1s"):
        oc.render_svg(svg, timeout=1)
    _no_cairosvg(monkeypatch)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(RuntimeError, match="no rasteriser: pip install cairosvg"):
        oc.render_svg(svg)


def test_real_rsvg_convert_renders_like_cairosvg(svg_root, monkeypatch):
    import shutil

    if shutil.which("rsvg-convert") is None:
        pytest.skip("rsvg-convert is not installed (apt-get install librsvg2-bin)")
    pytest.importorskip("cairosvg")
    svg = str(svg_root / "food/fruit/red_apple.svg")
    cairo = np.asarray(oc.crop_square(oc.render_svg(svg)), dtype=float)
    _no_cairosvg(monkeypatch)
    rsvg = np.asarray(oc.crop_square(oc.render_svg(svg)), dtype=float)
    assert rsvg[112, 112, 0] > 150 and rsvg[112, 112, 1] < 80  # the red disc, as in test_render_crop_square
    assert np.abs(cairo - rsvg).mean() < 3


# -------------------------------------------------------------- the real Debian openclipart-svg files

REAL_ROOT = Path(oc.DEFAULT_SVG_ROOT)
REAL_CATEGORIES = (
    "animals",
    "buildings",
    "containers",
    "education",
    "food",
    "plants",
    "shapes",
    "transportation",
)


def _real_handful() -> list[str]:
    """One drawing per category (the middle one, by name, of those under 40 kB): a fixed, varied handful."""
    if not REAL_ROOT.is_dir():
        pytest.skip(f"{REAL_ROOT} is missing (scripts/setup.sh installs openclipart-svg as root)")
    rel, _ = oc.find_svgs(REAL_ROOT)
    pick = []
    for cat in REAL_CATEGORIES:
        files = sorted(r for r in rel if r.startswith(cat + "/") and (REAL_ROOT / r).stat().st_size < 40_000)
        if files:
            pick.append(files[len(files) // 2])
    if len(pick) < 4:
        pytest.skip(f"{REAL_ROOT}: fewer than 4 of the expected categories")
    return pick


def test_real_openclipart_files_render_alike_with_both_rasterisers(monkeypatch):
    import shutil

    pick = _real_handful()
    if shutil.which("rsvg-convert") is None:
        pytest.skip("rsvg-convert is not installed (apt-get install librsvg2-bin)")
    pytest.importorskip("cairosvg")
    for rel in pick:
        meta = oc.parse_svg_metadata((REAL_ROOT / rel).read_bytes())
        assert meta["title"], rel  # real Dublin Core text inside every picked drawing
        cairo = oc.crop_square(oc.render_svg(str(REAL_ROOT / rel)))
        with monkeypatch.context() as m:
            _no_cairosvg(m)
            rsvg = oc.crop_square(oc.render_svg(str(REAL_ROOT / rel)))
        assert cairo is not None and rsvg is not None, rel
        a, b = np.asarray(cairo), np.asarray(rsvg)
        ink_a, ink_b = (255 - a.astype(int)).max(2) > 10, (255 - b.astype(int)).max(2) > 10
        assert (ink_a & ink_b).sum() / (ink_a | ink_b).sum() > 0.9, rel  # the same drawing, the same place
        assert np.abs(a.astype(float) - b).mean() < 15, rel


def test_build_on_a_handful_of_real_openclipart_files(tmp_path):
    import shutil

    from vsekit.data.precomp import load_precomp_split

    pick = _real_handful()
    root = tmp_path / "svg"
    for rel in pick:  # a copy: the builder walks the whole tree it is given
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REAL_ROOT / rel, root / rel)
    m = oc.build_openclipart(tmp_path / "out", svg_root=root, workers=1, progress=False)
    c = m["counts"]
    assert c["svg_files"] == len(pick) and c["parsed"] == len(pick) and c["render_failures"] == 0
    assert c["images"] >= len(pick) - 2  # a generic title ("... Clipart") may be dropped
    assert sum(s["images"] for s in m["splits"].values()) == c["images"]
    titles = {oc.parse_svg_metadata((root / rel).read_bytes())["title"].strip() for rel in pick}
    for split in oc.SPLITS:
        s = load_precomp_split(tmp_path / "out", split)
        if not s.n_images:
            continue
        feats = np.asarray(s.image_features(0))
        assert feats.shape == (49, 1280) and np.isfinite(feats).all()
        assert all(
            any(cap.startswith(t) for t in titles) for cap in s.captions
        )  # captions come from the titles
        for p in s.image_paths:
            from PIL import Image

            with Image.open(tmp_path / "out" / p) as im:
                assert im.size == (224, 224)
