"""`vse index RUN DIR --out INDEX --refresh`: a living index. After pictures change, disappear or arrive, a refresh
must leave the index a fresh build of the folder would give, embedding only what changed.

Float comparisons: with `--batch-size 1` every picture is embedded alone, so a kept embedding and a fresh build's
are the same ops on the same shapes on the same thread count: compared bit for bit. Caption embeddings reused by
a refresh come from other batches than a fresh build's (other padded shapes), so they are float32 products of
unit vectors in another order: <= (d + 4) eps apart per value (d <= 64: atol 1e-5). Scores likewise (atol 1e-5).
"""

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from conftest import interrupt_on_call
from vsekit.cli import main
from vsekit.search.engine import SearchEngine
from vsekit.search.index import SearchIndex

pytest.importorskip("faiss")
pytest.importorskip("efficientnet_lite_pytorch")

PICTURES = [
    "red_circle_0",
    "red_circle_1",
    "blue_square_0",
    "green_triangle_0",
    "yellow_circle_1",
    "blue_triangle_0",
    "green_square_1",
    "yellow_square_0",
]


def quiet(*_):
    pass


def make_folder(data: Path, folder: Path, names=PICTURES) -> Path:
    """Shapes test pictures as a folder of x.png + x.txt (its caption), some in a subfolder."""
    for name in names:
        rel = Path("sub" if name.startswith("green") else ".") / f"{name}.png"
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(data / "images" / f"test_{name}.png", folder / rel)
        (folder / rel).with_suffix(".txt").write_text(f"a {name.rsplit('_', 1)[0].replace('_', ' ')}\n")
    return folder


def index_argv(run, folder, out, *extra):
    return [
        "index",
        str(run),
        str(folder),
        "--out",
        str(out),
        "--quiet",
        "--device",
        "cpu",
        "--batch-size",
        "1",
        *extra,
    ]


def snapshot(folder: Path) -> dict:
    return {
        p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }


class Counter:
    """Counts the pictures and caption texts the models embed (wrapping the embedders' methods)."""

    def __init__(self, monkeypatch) -> None:
        import vsekit.search.encode as enc

        self.pictures, self.texts = 0, 0
        real_img, real_txt = enc.ImageEmbedder.embed, enc.TextEmbedder.embed

        def img(embedder, pixels):
            self.pictures += len(pixels)
            return real_img(embedder, pixels)

        def txt(embedder, texts, *args, **kwargs):
            self.texts += len(texts)
            return real_txt(embedder, texts, *args, **kwargs)

        monkeypatch.setattr(enc.ImageEmbedder, "embed", img)
        monkeypatch.setattr(enc.TextEmbedder, "embed", txt)


def assert_same_index(a_dir: Path, b_dir: Path, caption_atol: float = 1e-5) -> None:
    """Two indexes hold the same pictures (records, order, embeddings bit for bit), the same captions and the
    same search results."""
    a, b = SearchIndex(a_dir), SearchIndex(b_dir)
    assert a.pictures == b.pictures
    np.testing.assert_array_equal(a.all_image_emb(), b.all_image_emb())  # one picture per batch: same ops
    assert a.captions == b.captions
    np.testing.assert_allclose(
        a.caption_emb(np.arange(a.n_captions)), b.caption_emb(np.arange(b.n_captions)), atol=caption_atol
    )
    assert a.image_faiss.ntotal == b.image_faiss.ntotal == a.n_pictures
    assert a.caption_faiss.ntotal == b.caption_faiss.ntotal == a.n_captions
    ea, eb = SearchEngine.open(a_dir), SearchEngine.open(b_dir)
    n = a.n_pictures
    for text in sorted({c["text"] for c in a.captions}) + ["a yellow triangle"]:
        ha, hb = ea.search_text(text, n), eb.search_text(text, n)
        assert [h.path for h in ha] == [h.path for h in hb], text
        np.testing.assert_allclose([h.score for h in ha], [h.score for h in hb], atol=1e-5)
    for pid in range(n):
        emb = a.image_emb(np.array([pid]))
        assert [h.path for h in ea.search_image_to_images(_t(emb), n)] == [
            h.path for h in eb.search_image_to_images(_t(emb), n)
        ]


def _t(x):
    import torch

    return torch.from_numpy(np.asarray(x))


@pytest.mark.slow
def test_refresh_after_changes_equals_a_fresh_build(shapes_model, tmp_path, capsys):
    data, run = shapes_model
    folder = make_folder(data, tmp_path / "pics")
    out, fresh = tmp_path / "idx", tmp_path / "fresh"
    assert main(index_argv(run, folder, out)) == 0
    before = SearchIndex(out)
    recorded = {p["path"]: p["sha256"] for p in before.pictures}
    assert recorded == {
        p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in folder.rglob("*.png")
    }
    old_blue = before.image_emb(np.array([[p["path"] for p in before.pictures].index("blue_square_0.png")]))

    # one picture changed (a yellow triangle's bytes at the blue square's path), one deleted, one new, one caption edited
    shutil.copy(data / "images" / "test_yellow_triangle_0.png", folder / "blue_square_0.png")
    (folder / "sub" / "green_triangle_0.png").unlink()
    (folder / "sub" / "green_triangle_0.txt").unlink()
    shutil.copy(data / "images" / "test_red_triangle_1.png", folder / "red_triangle_1.png")
    (folder / "red_triangle_1.txt").write_text("a red triangle\n")
    (folder / "red_circle_1.txt").write_text("a red disc\nround and red\n")
    (folder / "broken.png").write_bytes(
        b"\x89PNG\r\n\x1a\n not really"
    )  # skipped and named, as a fresh build does
    capsys.readouterr()
    assert main(index_argv(run, folder, out, "--refresh")) == 0
    err = capsys.readouterr().err
    assert "6 unchanged, 1 changed, 2 new, 1 deleted" in err
    assert "warning: skipped" in err and "broken.png: cannot read image" in err
    assert main(index_argv(run, folder, fresh)) == 0
    assert_same_index(out, fresh)

    idx = SearchIndex(out)
    paths = [p["path"] for p in idx.pictures]
    assert "sub/green_triangle_0.png" not in paths and "red_triangle_1.png" in paths
    new_blue = idx.image_emb(np.array([paths.index("blue_square_0.png")]))
    assert np.abs(new_blue - old_blue).max() > 0.1  # the changed picture was re-embedded
    assert (
        idx.pictures[paths.index("blue_square_0.png")]["sha256"]
        == hashlib.sha256((folder / "blue_square_0.png").read_bytes()).hexdigest()
    )
    assert [c["text"] for c in idx.captions if idx.pictures[c["image"]]["path"] == "red_circle_1.png"] == [
        "a red disc",
        "round and red",
    ]
    meta = json.loads((out / "index.json").read_text())
    assert meta["generation"] == 2 and meta["counts"] == {"pictures": 8, "captions": 9}
    assert meta["segments"][-1]["refresh"] == {"unchanged": 6, "changed": 1, "new": 2, "deleted": 1}
    assert any("broken.png" in m for m in meta["segments"][-1]["skipped"])
    listed = {s["dir"] for s in meta["segments"]}
    assert {
        f"segments/{d.name}" for d in (out / "segments").iterdir()
    } == listed  # old segment folders removed
    assert sorted(p.name for p in out.glob("*.faiss")) == ["captions.g2.faiss", "images.g2.faiss"]
    assert not (out / ".work").exists() and not (out / ".lock").exists()


@pytest.mark.slow
def test_refresh_when_nothing_changed_embeds_nothing(shapes_model, tmp_path, monkeypatch):
    data, run = shapes_model
    folder = make_folder(data, tmp_path / "pics")
    out = tmp_path / "idx"
    assert main(index_argv(run, folder, out)) == 0
    files = snapshot(out)
    count = Counter(monkeypatch)
    notes = []
    from vsekit.search.refresh import refresh_index

    refresh_index(run, str(folder), out, batch_size=1, progress=False, log=notes.append)
    assert (count.pictures, count.texts) == (0, 0)
    assert snapshot(out) == files  # nothing written
    assert any("is up to date" in n for n in notes)
    # the same bytes written again (a new mtime): still nothing to do, the content is what counts
    (folder / "red_circle_0.png").write_bytes((folder / "red_circle_0.png").read_bytes())
    refresh_index(run, str(folder), out, batch_size=1, progress=False, log=quiet)
    assert (count.pictures, count.texts) == (0, 0) and snapshot(out) == files
    # one picture changed: exactly that one is embedded, and no caption text (all of them are known)
    shutil.copy(data / "images" / "test_blue_circle_0.png", folder / "red_circle_0.png")
    refresh_index(run, str(folder), out, batch_size=1, progress=False, log=quiet)
    assert (count.pictures, count.texts) == (1, 0)
    assert SearchIndex(out).n_pictures == len(PICTURES)


@pytest.mark.slow
def test_old_index_without_hashes_is_re_embedded_once(shapes_model, tmp_path, monkeypatch):
    """An index written before pictures.jsonl recorded sha256s cannot tell unchanged pictures: a refresh re-embeds
    them all once (saying so), giving the fresh build's index; the next refresh has nothing to do."""
    data, run = shapes_model
    folder = make_folder(data, tmp_path / "pics")
    out, fresh = tmp_path / "idx", tmp_path / "fresh"
    assert main(index_argv(run, folder, out)) == 0
    shutil.copytree(out, fresh)
    pics = out / "segments" / "0000" / "pictures.jsonl"
    rows = [json.loads(line) for line in pics.read_text().splitlines()]
    pics.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "sha256"}) + "\n" for r in rows))
    assert "sha256" not in SearchIndex(out).pictures[0]
    count = Counter(monkeypatch)
    notes = []
    from vsekit.search.refresh import refresh_index

    refresh_index(run, str(folder), out, batch_size=1, progress=False, log=notes.append)
    assert any(
        f"{len(PICTURES)} of the {len(PICTURES)} pictures" in n and "without a content hash" in n
        for n in notes
    )
    assert count.pictures == len(PICTURES)
    assert_same_index(out, fresh)
    refresh_index(run, str(folder), out, batch_size=1, progress=False, log=quiet)
    assert count.pictures == len(PICTURES)  # hashed now: nothing more


@pytest.mark.slow
def test_refresh_keeps_the_other_roots_pictures_and_captions(shapes_model, tmp_path):
    """An index of two folders: refreshing the first (which precedes the second) renumbers the second's pictures,
    whose captions must still point at them; refreshing the second leaves the first's segment as it is."""
    data, run = shapes_model
    a = make_folder(data, tmp_path / "a", PICTURES[:4])
    b = make_folder(data, tmp_path / "b", PICTURES[4:])
    (b / "extra.txt").write_text("a picture of nothing\n")
    out = tmp_path / "idx"
    assert main(index_argv(run, a, out)) == 0
    assert main(index_argv(run, b, out, "--captions", str(b / "extra.txt"))) == 0
    before = SearchIndex(out)
    b_emb = before.all_image_emb()[4:].copy()
    (a / "red_circle_0.png").unlink()
    (a / "red_circle_0.txt").unlink()
    assert main(index_argv(run, a, out, "--refresh")) == 0
    idx = SearchIndex(out)
    roots = [str(r) for r in idx.roots]
    assert [(roots[p["root"]], p["path"]) for p in idx.pictures] == [
        (str(a.resolve()), p) for p in ("blue_square_0.png", "red_circle_1.png", "sub/green_triangle_0.png")
    ] + [
        (str(b.resolve()), p)
        for p in (
            "blue_triangle_0.png",
            "sub/green_square_1.png",
            "yellow_circle_1.png",
            "yellow_square_0.png",
        )
    ]
    np.testing.assert_array_equal(idx.all_image_emb()[3:], b_emb)  # kept as stored
    for c in idx.captions:  # every caption still names its own picture ("a red circle" <- red_circle_1.png)
        if c["image"] is None:
            assert c["text"] == "a picture of nothing"
        else:
            assert (
                Path(idx.pictures[c["image"]]["path"]).stem.rsplit("_", 1)[0].replace("_", " ") in c["text"]
            )
    assert sum(c["image"] is None for c in idx.captions) == 1
    hit = SearchEngine.open(out).search_text("a yellow square", 1)[0]
    assert hit.path == "yellow_square_0.png" and hit.file == str((b / "yellow_square_0.png").resolve())
    a_dir = json.loads((out / "index.json").read_text())["segments"][0]["dir"]
    (b / "yellow_square_0.png").unlink()
    assert main(index_argv(run, b, out, "--refresh")) == 0
    meta = json.loads((out / "index.json").read_text())
    assert (
        meta["segments"][0]["dir"] == a_dir and meta["counts"]["pictures"] == 6
    )  # the first root's segment kept


@pytest.mark.slow
def test_failed_or_interrupted_refresh_leaves_the_index_as_it_was(shapes_model, tmp_path, monkeypatch):
    import vsekit.search.encode as enc
    import vsekit.search.refresh as refresh_mod
    import vsekit.search.store as store_mod

    data, run = shapes_model
    folder = make_folder(data, tmp_path / "pics")
    out = tmp_path / "idx"
    assert main(index_argv(run, folder, out)) == 0
    files = snapshot(out)
    shutil.copy(data / "images" / "test_blue_circle_0.png", folder / "red_circle_0.png")
    (folder / "yellow_square_0.png").unlink()
    for name in ("new_a", "new_b", "new_c"):
        shutil.copy(data / "images" / "test_red_square_0.png", folder / f"{name}.png")

    def disk_full(index, path):
        path.write_bytes(b"half a FAISS file")
        raise OSError(28, "No space left on device")

    with monkeypatch.context() as m:
        m.setattr(store_mod, "write_faiss", disk_full)
        with pytest.raises(OSError, match="No space left"):
            refresh_mod.refresh_index(run, str(folder), out, batch_size=1, progress=False, log=quiet)
    assert snapshot(out) == files and SearchIndex(out).n_pictures == len(PICTURES)

    calls = interrupt_on_call(monkeypatch, enc.ImageEmbedder, "embed", 3)  # Ctrl-C in the third chunk
    with pytest.raises(KeyboardInterrupt):
        refresh_mod.refresh_index(
            run, str(folder), out, batch_size=1, chunk_size=1, progress=False, log=quiet
        )
    assert {k: v for k, v in snapshot(out).items() if not k.startswith(".work/")} == files
    assert len(list((out / ".work").glob("*/chunk_*.npz"))) == 2
    calls["n"] = 100
    refresh_mod.refresh_index(run, str(folder), out, batch_size=1, chunk_size=1, progress=False, log=quiet)
    assert calls["n"] == 100 + 4 - 2  # 4 pictures to embed (1 changed, 3 new), 2 finished before Ctrl-C
    assert SearchIndex(out).n_pictures == len(PICTURES) - 1 + 3 and not (out / ".work").exists()


def test_refresh_needs_a_folder(shapes_model, tmp_path, capsys):
    data, run = shapes_model
    capsys.readouterr()
    assert main(index_argv(run, f"{data}:test", tmp_path / "idx", "--refresh")) == 2
    assert "--refresh re-reads a folder of pictures" in capsys.readouterr().err
    assert (
        main(index_argv(run, data / "images" / "test_red_circle_0.png", tmp_path / "idx", "--refresh")) == 2
    )
    assert "is a file; --refresh re-reads a folder of pictures" in capsys.readouterr().err
    assert main(index_argv(run, data, tmp_path / "idx", "--refresh")) == 2
    assert "is a dataset directory" in capsys.readouterr().err
    assert (
        main(["index", "--from-embeddings", str(tmp_path), "--out", str(tmp_path / "idx"), "--refresh"]) == 2
    )
    assert "takes no --from-embeddings" in capsys.readouterr().err
    assert not (tmp_path / "idx").exists()
    from argparse import Namespace

    from vsekit.commands.search import index_command

    # the command a Ctrl-C hint tells the user to rerun keeps --refresh
    assert (
        index_command(Namespace(run="r", source="pics", out="idx", refresh=True))
        == "vse index r pics --out idx --refresh"
    )


@pytest.mark.slow
def test_refresh_without_an_index_builds_it_and_hnsw_is_rebuilt(shapes_model, tmp_path):
    """--refresh into an empty --out is a first build; an HNSW index (FAISS cannot remove from it) is rebuilt
    over the refreshed pictures and, wide enough, ranks like the exact index of a fresh build."""
    data, run = shapes_model
    folder = make_folder(data, tmp_path / "pics")
    out = tmp_path / "idx"
    assert (
        main(
            index_argv(run, folder, out, "--refresh", "--index", "hnsw", "--hnsw-m", "4", "--ef-search", "64")
        )
        == 0
    )
    assert SearchIndex(out).n_pictures == len(PICTURES)
    (folder / "blue_square_0.png").unlink()
    (folder / "sub" / "green_square_1.png").unlink()
    assert main(index_argv(run, folder, out, "--refresh")) == 0
    idx = SearchIndex(out)
    assert type(idx.image_faiss).__name__ == "IndexHNSWFlat" and idx.image_faiss.ntotal == len(PICTURES) - 2
    assert main(index_argv(run, folder, tmp_path / "flat")) == 0
    a, b = SearchEngine.open(out), SearchEngine.open(tmp_path / "flat")
    for text in ("a red circle", "a green triangle", "a yellow square"):
        assert [h.path for h in a.search_text(text, 6)] == [h.path for h in b.search_text(text, 6)]
