"""`vse data link-images`: a COCO / Flickr30K precomp folder's rows mapped back to picture files by their ids."""

import json
from pathlib import Path

from PIL import Image

from vsekit.cli import main
from vsekit.data.precomp import load_precomp_split
from vsekit_lab.datasets.synthetic import make_synthetic_precomp


def _picture(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (4, 4), (200, 10, 10)).save(path)


def _with_ids(tmp_path: Path, ids: dict[str, list[str]]) -> Path:
    data = make_synthetic_precomp(tmp_path / "coco_precomp", n_train=4, n_dev=2, n_test=3, regions=2, dim=4)
    for split, rows in ids.items():
        (data / f"{split}_ids.txt").write_text("".join(f"{i}\n" for i in rows))
    return data


def test_coco_and_flickr_ids_find_their_pictures_and_the_split_reads_them(tmp_path, capsys):
    coco = {"train": ["9", "25", "30", "42"], "dev": ["73", "74"], "test": ["1000092795", "42", "77"]}
    data = _with_ids(tmp_path, coco)
    pics = tmp_path / "pictures"
    for n in (9, 25, 30, 73, 74):
        _picture(pics / "train2014" / f"COCO_train2014_{n:012d}.jpg")
    _picture(pics / "val2014" / f"COCO_val2014_{42:012d}.jpg")
    _picture(pics / "val2017" / f"{77:012d}.jpg")  # the 2017 naming
    _picture(pics / "flickr" / "1000092795.jpg")  # a Flickr30K id
    assert main(["data", "link-images", str(data), "--images", str(pics)]) == 0
    assert "test_images.txt lists 3 pictures" in capsys.readouterr().out
    assert (data / "test_images.txt").read_text().splitlines() == [
        "flickr/1000092795.jpg",
        "val2014/COCO_val2014_000000000042.jpg",
        "val2017/000000000077.jpg",
    ]
    assert json.loads((data / "manifest.json").read_text())["images_root"] == str(pics.resolve())
    split = load_precomp_split(data, "test", 5)
    assert split.abs_image_path(1) == (pics / "val2014" / "COCO_val2014_000000000042.jpg").resolve()


def test_a_missing_picture_is_named_and_nothing_is_written(tmp_path, capsys):
    data = _with_ids(tmp_path, {"test": ["42", "43", "44"]})
    pics = tmp_path / "pictures"
    _picture(pics / f"COCO_val2014_{42:012d}.jpg")
    before = sorted(p.name for p in data.iterdir())
    assert main(["data", "link-images", str(data), "--images", str(pics), "--splits", "test"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "2 of the 3 ids" in err and "43, 44" in err
    assert sorted(p.name for p in data.iterdir()) == before  # no manifest, no images file
    assert main(["data", "link-images", str(data), "--images", str(tmp_path / "nope")]) == 2
    assert "no such folder" in capsys.readouterr().err
