"""The Wesnoth unit-animation builder on a hand-written data tree (no .deb, no CNN)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from vsekit.data.frames import load_frames
from vsekit.data.validate import check_dataset
from vsekit.errors import VseInputError
from vsekit_lab.datasets.wesnoth import (
    assign_splits,
    build_wesnoth,
    collect_macros,
    drop_repeated_captions,
    expand,
    expand_image_value,
    families,
    locate_source,
    make_clips,
    parse_units,
    parse_wml,
    render_frame,
)

MACROS = """#textdomain wesnoth-units
# shared animation macros (core/macros)
#define UNIT_ATTACK NAME FRAMES
    [attack_anim]
        [filter_attack]
            name={NAME}
        [/filter_attack]
        [frame]
            image={FRAMES}
        [/frame]
    [/attack_anim]
#enddef

#define DEFEND_HITS BASE
    [defend]
        [if]
            hits=yes
            [frame]
                image={BASE}-defend-[1~2].png:100
            [/frame]
        [/if]
        [else]
            hits=no
            [frame]
                image={BASE}-defend-[2,1].png
            [/frame]
        [/else]
    [/defend]
#enddef
"""

SPEARMAN = """#textdomain wesnoth-units
[unit_type]
    id=Spearman
    name= _ "Spearman"
    race=human
    advances_to=Pikeman
    description= _ "Spearmen carry spears. They fight in the front line."
    [attack]
        name=spear
        description= _"spear"
        type=pierce
        range=melee
    [/attack]
    [attack]
        name=javelin
        description=_ "javelin"
        type=pierce
        range=ranged
    [/attack]
    {UNIT_ATTACK spear "units/spearman-attack-[1~3].png:[100*3]"}
    [attack_anim]
        [filter_attack]
            name=javelin
        [/filter_attack]
        [if]
            direction=s,se,sw
            [frame]
                image="units/spearman-throw-s-[1~2].png"
            [/frame]
        [/if]
        [else]
            direction=n,ne,nw
            [frame]
                image="units/spearman-throw-n-[1~2].png"
            [/frame]
        [/else]
    [/attack_anim]
    {DEFEND_HITS units/spearman}
    [standing_anim]  # one frame: static, dropped
        [frame]
            image="units/spearman.png"
        [/frame]
    [/standing_anim]
    [death]  # the attack's frame sequence again: a duplicate, dropped
        [frame]
            image="units/spearman-attack-[1~3].png"
        [/frame]
    [/death]
    [idle_anim]  # files that do not exist: dropped
        [frame]
            image="units/spearman-missing-[1~2].png"
        [/frame]
    [/idle_anim]
[/unit_type]
"""

PIKEMAN = """[unit_type]
    id=Pikeman
    name= _ "Pikeman"
    race=human
    advances_to=null
    description= _ "Pikemen " +
        _ "hold the line."
    [attack]
        name=pike
        description=_"pike"
        type=pierce
        range=melee
    [/attack]
    {UNIT_ATTACK pike units/pikeman-[1~2,1].png}
    [female]
        name= _ "female^Pikeman"
        [attack_anim]
            [filter_attack]
                name=pike
            [/filter_attack]
            [frame]
                image=units/pikeman+female-[1~2].png
            [/frame]
        [/attack_anim]
    [/female]
[/unit_type]
"""

BAT = """[unit_type]
    id=Vampire Bat
    name= _ "Vampire Bat"
    race=bats
    advances_to=Blood Bat
    description= _ "Bats fly."
    [standing_anim]
        direction=se,sw
        [frame]
            image=units/bat-se-[1~4].png
        [/frame]
    [/standing_anim]
#ifdef __UNDEFINED__
    [healing_anim]
        [frame]
            image=units/bat-se-[1~2].png
        [/frame]
    [/healing_anim]
#else
    [death]
        [frame]
            image=units/bat-se-[4~1].png
        [/frame]
    [/death]
#endif
[/unit_type]
"""

MAGE = """#define MAGE_ANIM KIND
#arg FRAMES
units/mage-idle-[1~2].png
#endarg
    [{KIND}]
        [frame]
            image={FRAMES}
        [/frame]
    [/{KIND}]
#enddef
[unit_type]
    id=Mage
    name= _ "Mage"
    race=human
    description= _ "Mages study."
    {MAGE_ANIM idle_anim}
    {MAGE_ANIM death FRAMES=units/mage-die-[1~3].png}
[/unit_type]
"""

SPRITES = (
    ["spearman.png"]
    + [f"spearman-attack-{i}.png" for i in (1, 2, 3)]
    + [f"spearman-throw-{d}-{i}.png" for d in "sn" for i in (1, 2)]
    + [f"spearman-defend-{i}.png" for i in (1, 2)]
    + ["pikeman-1.png", "pikeman-2.png", "pikeman+female-1.png", "pikeman+female-2.png"]
    + [f"bat-se-{i}.png" for i in (1, 2, 3, 4)]
    + ["mage-idle-1.png", "mage-idle-2.png"]
    + [f"mage-die-{i}.png" for i in (1, 2, 3)]
)


def make_tree(root: Path) -> Path:
    """A package root holding usr/share/games/wesnoth/1.16/data with 4 unit types; returns the data folder."""
    data = root / "usr/share/games/wesnoth/1.16/data"
    (data / "core/macros").mkdir(parents=True)
    (data / "core/macros/anims.cfg").write_text(MACROS)
    units = data / "core/units"
    for sub, name, text in (
        ("humans", "Spearman", SPEARMAN),
        ("humans", "Pikeman", PIKEMAN),
        ("monsters", "Bat", BAT),
        ("humans", "Mage", MAGE),
    ):
        (units / sub).mkdir(parents=True, exist_ok=True)
        (units / sub / f"{name}.cfg").write_text(text)
    images = data / "core/images/units"
    images.mkdir(parents=True)
    for i, name in enumerate(SPRITES):
        im = Image.new("RGBA", (12, 10), (0, 0, 0, 0))
        for x in range(3, 9):
            for y in range(2, 8):
                im.putpixel((x, y), (20 * i % 256, 255 - 10 * i, 7 * i % 256, 255))
        im.save(images / name)
    (data / "COPYING.txt").write_text("GNU GENERAL PUBLIC LICENSE Version 2\n")
    doc = root / "usr/share/doc/wesnoth-1.16-data"
    doc.mkdir(parents=True)
    (doc / "copyright").write_text("Files: *\nLicense: GPL-2+\n")
    return data


class MeanColour:
    """A cheap stand-in for the CNN: mean RGB of the rendered frame plus a constant."""

    def __call__(self, frames: list[Image.Image]) -> np.ndarray:
        rgb = np.stack([np.asarray(f, dtype=np.float32).mean(axis=(0, 1)) / 255.0 for f in frames])
        return np.concatenate([rgb, np.ones((len(frames), 1), np.float32)], axis=1)

    def describe(self) -> dict:
        return {"name": "mean_colour", "dim": 4}


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    make_tree(tmp_path / "pkg")
    return tmp_path / "pkg"


def test_image_paths():
    assert expand_image_value("a-[1~3].png:[100*3]") == ["a-1.png", "a-2.png", "a-3.png"]
    assert expand_image_value("x-[01~03].png") == ["x-01.png", "x-02.png", "x-03.png"]
    assert expand_image_value("b-[1~2,1].png") == ["b-1.png", "b-2.png", "b-1.png"]
    assert expand_image_value("c-[3~1].png") == ["c-3.png", "c-2.png", "c-1.png"]
    assert expand_image_value("d-[1*2,2].png") == ["d-1.png", "d-1.png", "d-2.png"]
    assert expand_image_value("e.png~RC(magenta>red):100,f.png:50") == ["e.png", "f.png"]
    assert expand_image_value("g-[n,s]-[1~2].png") == ["g-n-1.png", "g-s-2.png"]


def test_macros_and_wml():
    macros = collect_macros(MACROS + MAGE.split("[unit_type]")[0])
    assert set(macros) == {"UNIT_ATTACK", "DEFEND_HITS", "MAGE_ANIM"}
    assert macros["UNIT_ATTACK"].params == ("NAME", "FRAMES")
    assert macros["MAGE_ANIM"].defaults == {"FRAMES": "units/mage-idle-[1~2].png"}
    text = expand("{MAGE_ANIM death FRAMES=x-[1~2].png}\n{UNKNOWN_MACRO a}\n{MAGE_ANIM idle_anim}", macros)
    tree = parse_wml(text)
    assert [c.tag for c in tree.children] == ["death", "idle_anim"]
    assert tree.children[0].kids("frame")[0].attrs["image"] == "x-[1~2].png"
    assert tree.children[1].kids("frame")[0].attrs["image"] == "units/mage-idle-[1~2].png"
    node = parse_wml(
        '[u]\n  a= _ "x # not a comment" # a comment\n  b= _ "one" +\n  _ " two"\n[/u]'
    ).children[0]
    assert node.attrs == {"a": "x # not a comment", "b": "one two"}


def test_parse_clips_captions_and_splits(tree: Path):
    data = tree / "usr/share/games/wesnoth/1.16/data"
    units, anims = parse_units(data)
    assert sorted(units) == ["Mage", "Pikeman", "Spearman", "Vampire Bat"]
    assert units["Pikeman"].description == "Pikemen hold the line."
    assert units["Pikeman"].advances_to == [] and units["Vampire Bat"].advances_to == ["Blood Bat"]
    # Spearman 8 branches (attack, 2 javelin, 2 defend, standing, death, idle), Pikeman 2, Bat 2 (not the #ifdef), Mage 2
    assert len(anims) == 14
    clips, stats = make_clips(data, units, anims)
    assert stats == {
        "frames_referenced": 35,
        "frames_missing": 2,
        "dropped_static_or_missing": 2,
        "dropped_duplicate_sequence": 1,
    }
    by_id = {c.id: c for c in clips}
    assert list(by_id) == [
        "Mage/idle/-/-/-",
        "Mage/death/-/-/-",
        "Pikeman/attack/pike/-/-",
        "Pikeman+female/attack/pike/-/-",
        "Spearman/attack/spear/-/-",
        "Spearman/attack/javelin/s/-",
        "Spearman/attack/javelin/n/-",
        "Spearman/defend/-/-/hit",
        "Spearman/defend/-/-/miss",
        "Vampire Bat/standing/-/se/-",
        "Vampire Bat/death/-/-/-",
    ]
    caption = {k: c.captions for k, c in by_id.items()}
    assert caption["Spearman/attack/spear/-/-"] == [
        "a spearman (human) attacking with its spear (melee pierce attack)"
    ]
    assert caption["Spearman/attack/javelin/n/-"] == [
        "a spearman (human) attacking with its javelin (ranged pierce attack), facing north"
    ]
    assert caption["Spearman/defend/-/-/hit"] == ["a spearman (human) defending against a blow, being hit"]
    assert caption["Spearman/defend/-/-/miss"] == [
        "a spearman (human) defending against a blow, being missed"
    ]
    assert caption["Pikeman+female/attack/pike/-/-"] == [
        "a female pikeman (human) attacking with its pike (melee pierce attack)"
    ]
    assert caption["Vampire Bat/standing/-/se/-"] == ["a vampire bat standing, facing south-east"]
    assert caption["Mage/idle/-/-/-"] == ["a mage (human) idling"]
    frames = {k: [Path(f).name for f in c.frames] for k, c in by_id.items()}
    assert frames["Pikeman/attack/pike/-/-"] == ["pikeman-1.png", "pikeman-2.png", "pikeman-1.png"]
    assert frames["Spearman/defend/-/-/miss"] == ["spearman-defend-2.png", "spearman-defend-1.png"]
    assert frames["Vampire Bat/death/-/-/-"] == [f"bat-se-{i}.png" for i in (4, 3, 2, 1)]
    assert frames["Mage/death/-/-/-"] == [f"mage-die-{i}.png" for i in (1, 2, 3)]
    assert sum(len(c.frames) for c in clips) == 29
    # families: Spearman -> Pikeman is one; md5 order: 'Vampire Bat' (test), 'Pikeman' (dev), 'Mage' (train)
    assert families(units) == {
        "Spearman": "Pikeman",
        "Pikeman": "Pikeman",
        "Vampire Bat": "Vampire Bat",
        "Mage": "Mage",
    }
    splits = assign_splits(clips, units)
    assert {s: len(v) for s, v in splits.items()} == {"train": 2, "dev": 7, "test": 2}
    assert {c.unit for c in splits["dev"]} == {"Spearman", "Pikeman"}
    assert drop_repeated_captions(splits) == {"dev": 0, "test": 0}
    with_desc, _ = make_clips(data, units, anims, descriptions=True)
    assert with_desc[0].captions[1] == "Mages study."


def test_repeated_captions_dropped_in_eval_splits_only(tree: Path):
    data = tree / "usr/share/games/wesnoth/1.16/data"
    units, anims = parse_units(data)
    clips, _ = make_clips(data, units, anims)
    splits = assign_splits(clips, units)
    twin = splits["dev"][0]
    splits["dev"].append(type(twin)(**{**twin.__dict__, "id": twin.id + "#2"}))
    splits["train"].append(type(twin)(**{**splits["train"][0].__dict__, "id": "x#2"}))
    assert drop_repeated_captions(splits) == {"dev": 1, "test": 0}
    assert len(splits["dev"]) == 7 and len(splits["train"]) == 3


def test_render_frame(tree: Path):
    sprite = tree / "usr/share/games/wesnoth/1.16/data/core/images/units/bat-se-1.png"
    img = render_frame(sprite)
    assert img.size == (224, 224) and img.mode == "RGB"
    assert img.getpixel((0, 0)) == (128, 128, 128)
    assert img.getpixel((112, 112)) != (128, 128, 128)  # the opaque square sits in the middle


def test_locate_source(tree: Path, tmp_path: Path):
    src = locate_source(tree)
    assert src.data_dir == tree / "usr/share/games/wesnoth/1.16/data"
    assert (src.package, src.version, src.origin) == ("wesnoth-1.16-data", "1.16", "folder")
    assert locate_source(src.data_dir).data_dir == src.data_dir
    with pytest.raises(VseInputError, match="no Wesnoth data"):
        locate_source(tmp_path)
    with pytest.raises(VseInputError, match="must be a"):
        locate_source(tmp_path / "nowhere")


def test_build_end_to_end(tree: Path, tmp_path: Path):
    out = tmp_path / "set"
    manifest = build_wesnoth(out, source=tree, extractor=MeanColour(), progress=False, batch_size=4)
    assert {s: v["clips"] for s, v in manifest["splits"].items()} == {"train": 2, "dev": 7, "test": 2}
    assert manifest["counts"]["clips"] == 11 and manifest["counts"]["distinct_sprites"] == 22
    assert manifest["license"] == "GPL-2.0-or-later"
    assert manifest["source"]["package"] == "wesnoth-1.16-data"
    report = check_dataset(out)
    assert report.ok, report.format()
    frames = load_frames(out, "dev")
    assert frames.shape == (7, 3, 4) and frames.dtype == np.float16
    assert list(frames.lengths) == [3, 2, 3, 2, 2, 2, 2]
    assert (out / "dev_ids.txt").read_text().splitlines()[0] == "Pikeman/attack/pike/-/-"
    assert (out / "test_caps.txt").read_text().splitlines() == [
        "a vampire bat standing, facing south-east",
        "a vampire bat dying",
    ]
    assert (out / "test_cap2img.txt").read_text().split() == ["0", "1"]
    meta = [json.loads(line) for line in (out / "train_clips.jsonl").read_text().splitlines()]
    assert [m["unit"] for m in meta] == ["Mage", "Mage"]
    assert (out / "COPYING.txt").is_file() and (out / "debian-copyright.txt").is_file()
    assert "GPL-2.0-or-later" in (out / "README.md").read_text()
    # the same frame sprite gives the same feature row wherever it is used
    dev = np.asarray(frames.frames, dtype=np.float32)
    assert np.array_equal(dev[0], dev[2])  # pikeman-1.png first and last (one frame at a time: the same ops)
    with pytest.raises(VseInputError, match="--overwrite"):
        build_wesnoth(out, source=tree, extractor=MeanColour(), progress=False)
    again = build_wesnoth(out, source=tree, extractor=MeanColour(), progress=False, overwrite=True)
    assert again["splits"] == manifest["splits"]


def test_cli_refuses_non_empty_out(tree: Path, tmp_path: Path, capsys):
    from vsekit.cli import main

    out = tmp_path / "busy"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    assert main(["data", "wesnoth", "--out", str(out), "--source", str(tree), "--no-progress"]) == 2
    assert "not empty" in capsys.readouterr().err
    assert (out / "keep.txt").read_text() == "x"
