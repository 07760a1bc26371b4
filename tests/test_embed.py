"""`vse embed` (clip-retrieval layout, resumable chunks, torchrun) and `vse index --from-embeddings`."""

import json
import os
import shutil
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch

from vsekit.cli import main
from vsekit.errors import VseInputError
from vsekit.search.index import SearchIndex, build_index, build_index_from_embeddings

pytest.importorskip("faiss")
pytest.importorskip("efficientnet_lite_pytorch")
pq = pytest.importorskip("pyarrow.parquet")


def quiet(*_):
    pass


def embed(run, source, out, *extra):
    return main(
        ["embed", str(run), str(source), "--out", str(out), "--device", "cpu", "--no-progress", *extra]
    )


def folder_bytes(root):
    """Every data file of an embeddings folder (manifest excluded), by relative path."""
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and p.parent.name in ("img_emb", "text_emb", "metadata")
    }


@pytest.fixture(scope="module")
def split_embeddings(shapes_model, tmp_path_factory):
    data, run = shapes_model
    out = tmp_path_factory.mktemp("emb") / "test"
    torch.set_num_threads(1)  # the torchrun comparison runs one thread per rank
    assert embed(run, f"{data}:test", out, "--chunk-size", "5") == 0
    return out


@pytest.mark.slow
def test_split_embeds_into_the_clip_retrieval_layout(shapes_model, split_embeddings, tmp_path):
    data, run = shapes_model
    out = split_embeddings
    names = [
        f"{i}" for i in range(5)
    ]  # 24 rows / 5 per chunk; one digit for 5 chunks, as clip-retrieval pads
    assert sorted(p.name for p in (out / "img_emb").iterdir()) == [f"img_emb_{n}.npy" for n in names]
    assert sorted(p.name for p in (out / "text_emb").iterdir()) == [f"text_emb_{n}.npy" for n in names]
    assert sorted(p.name for p in (out / "metadata").iterdir()) == [f"metadata_{n}.parquet" for n in names]
    img = np.concatenate([np.load(out / "img_emb" / f"img_emb_{n}.npy") for n in names])
    txt = np.concatenate([np.load(out / "text_emb" / f"text_emb_{n}.npy") for n in names])
    meta = [pq.read_table(out / "metadata" / f"metadata_{n}.parquet").to_pydict() for n in names]
    assert [len(m["image_path"]) for m in meta] == [5, 5, 5, 5, 4]
    assert set(meta[0]) == {"image_path", "caption", "id"}
    paths = sum((m["image_path"] for m in meta), [])
    assert paths[0] == str(data.resolve() / "images" / "test_red_circle_0.png")
    assert sum((m["caption"] for m in meta), [])[0] == "a red circle"
    d = json.loads((out / "embed.json").read_text())["model"]["embed_dim"]
    assert img.dtype == np.float32 and img.shape == (24, d) and txt.shape == (24, d)
    info = json.loads((out / "embed.json").read_text())
    assert (
        info["written_rows"] == 24
        and info["chunks"] == 5
        and info["with_text"]
        and info["format"] == "vsekit-embeddings/1"
    )
    # the same embeddings `vse index` stores for the split
    build_index(run, f"{data}:test", tmp_path / "idx", progress=False, log=quiet)
    ref = SearchIndex(tmp_path / "idx")
    np.testing.assert_allclose(img, ref.all_image_emb(), atol=1e-6)
    first = {c["image"]: i for i, c in reversed(list(enumerate(ref.captions)))}
    np.testing.assert_allclose(txt, ref.caption_emb(np.array([first[i] for i in range(24)])), atol=1e-5)


@pytest.mark.slow
def test_folder_of_pictures_with_workers_and_a_captions_file(shapes_model, tmp_path):
    data, run = shapes_model
    pics = tmp_path / "pics"
    pics.mkdir()
    for name in ("test_red_circle_0", "test_blue_square_1", "test_green_triangle_0"):
        shutil.copy(data / "images" / f"{name}.png", pics / f"{name}.png")
    (pics / "broken.png").write_bytes(b"not a picture")
    assert embed(run, pics, tmp_path / "out", "--workers", "1", "--chunk-size", "2") == 0
    info = json.loads((tmp_path / "out" / "embed.json").read_text())
    assert info["written_rows"] == 3 and not info["with_text"] and len(info["skipped"]) == 1
    assert "broken.png" in info["skipped"][0]
    assert not (tmp_path / "out" / "text_emb").exists()  # no captions beside the pictures
    meta = pq.read_table(tmp_path / "out" / "metadata" / "metadata_0.parquet").to_pydict()
    assert meta["image_path"] == [
        str((pics / "test_blue_square_1.png").resolve())
    ]  # chunk 0: broken.png skipped
    # picture -> same embedding as `vse index` of the folder
    build_index(run, pics, tmp_path / "idx", progress=False, log=quiet)
    img = np.concatenate([np.load(p) for p in sorted((tmp_path / "out" / "img_emb").glob("*.npy"))])
    np.testing.assert_allclose(img, SearchIndex(tmp_path / "idx").all_image_emb(), atol=1e-5)

    caps = tmp_path / "caps.txt"
    caps.write_text("a red circle\n\na blue square\n")
    assert embed(run, caps, tmp_path / "caps") == 0
    assert not (tmp_path / "caps" / "img_emb").exists()
    assert np.load(tmp_path / "caps" / "text_emb" / "text_emb_0.npy").shape == (2, img.shape[1])
    assert pq.read_table(tmp_path / "caps" / "metadata" / "metadata_0.parquet").to_pydict()["caption"] == [
        "a red circle",
        "a blue square",
    ]


@pytest.mark.slow
def test_killed_run_resumes_without_recomputing_finished_chunks(
    shapes_model, split_embeddings, tmp_path, monkeypatch
):
    import vsekit.search.embed as embed_mod

    data, run = shapes_model
    # Byte-identical by construction: every chunk is encoded in batches that start at its own first row
    # (`index.chunk_batches`), whatever was finished before, so the killed run, its resumption and the
    # uninterrupted reference feed the model exactly the same tensors, in float32 products of the same shapes.
    # The thread count must match too: a float32 GEMM's rounding depends on how its work is split over
    # threads (on AVX-512 CPUs 1 and 2 threads give different last bits), and `split_embeddings` was made
    # on one thread (conftest's autouse fixture gives each test two).
    torch.set_num_threads(1)
    out = tmp_path / "out"
    real = embed_mod.write_chunk
    written = []

    def dies_after_two(out_dir, name, *args, **kwargs):
        if len(written) == 2:
            raise KeyboardInterrupt  # the kill: chunk 2 is being written
        real(out_dir, name, *args, **kwargs)
        written.append(name)

    monkeypatch.setattr(embed_mod, "write_chunk", dies_after_two)
    assert embed(run, f"{data}:test", out, "--chunk-size", "5") == 130
    assert written == ["0", "1"] and not (out / "embed.json").exists()
    stat = {n: os.stat(out / "img_emb" / f"img_emb_{n}.npy") for n in written}
    # a half-written chunk: its files are there but its manifest entry is not -> redone
    shutil.copy(out / "img_emb" / "img_emb_0.npy", out / "img_emb" / "img_emb_2.npy")
    written.clear()
    monkeypatch.setattr(
        embed_mod, "write_chunk", lambda o, n, *a, **k: (real(o, n, *a, **k), written.append(n))
    )
    rows = {"n": 0}
    import vsekit.search.encode as encode_mod

    real_features = encode_mod.embed_features

    def counting(model, items, device="cpu"):
        rows["n"] += len(items)
        return real_features(model, items, device)

    monkeypatch.setattr(encode_mod, "embed_features", counting)
    assert embed(run, f"{data}:test", out, "--chunk-size", "5") == 0
    assert written == ["2", "3", "4"] and rows["n"] == 14  # only the unfinished chunks' 5 + 5 + 4 rows
    for n, st in stat.items():
        now = os.stat(out / "img_emb" / f"img_emb_{n}.npy")
        assert (now.st_ino, now.st_mtime_ns) == (st.st_ino, st.st_mtime_ns)
    assert folder_bytes(out) == folder_bytes(split_embeddings)  # the resumed folder = an uninterrupted run's
    # a lost manifest entry: that chunk alone is redone
    (out / ".manifest" / "chunk_3.json").unlink()
    written.clear()
    assert embed(run, f"{data}:test", out, "--chunk-size", "5") == 0
    assert written == ["3"] and folder_bytes(out) == folder_bytes(split_embeddings)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_torchrun_two_ranks_write_exactly_the_single_process_folder(shapes_model, split_embeddings, tmp_path):
    data, run = shapes_model
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--master_addr=127.0.0.1",
        f"--master_port={_free_port()}",
        "-m",
        "vsekit.cli",
        "embed",
        str(run),
        f"{data}:test",
        "--out",
        str(tmp_path / "ddp"),
        "--chunk-size",
        "5",
        "--device",
        "cpu",
        "--no-progress",
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ddp, one = folder_bytes(tmp_path / "ddp"), folder_bytes(split_embeddings)
    assert ddp.keys() == one.keys() and len(one) == 15
    for name in one:
        assert ddp[name] == one[name], name  # same files, same rows, same order, byte for byte
    a = json.loads((tmp_path / "ddp" / "embed.json").read_text())
    b = json.loads((split_embeddings / "embed.json").read_text())
    assert a == b


@pytest.mark.slow
def test_index_from_embeddings_searches_like_the_model(shapes_model, split_embeddings, tmp_path, capsys):
    data, run = shapes_model
    out = tmp_path / "idx"
    # the pictures' root embed.json records lies outside the embeddings folder: named with --images-root
    argv = ["index", "--from-embeddings", str(split_embeddings), "--images-root", str(data)]
    assert main([*argv, "--out", str(out)]) == 0
    idx = SearchIndex(out)
    assert idx.n_pictures == 24 and idx.n_captions == 24
    assert idx.pictures[0]["path"] == "images/test_red_circle_0.png" and idx.picture_file(0) is not None
    capsys.readouterr()
    assert main(["search", str(out), "a red circle", "-k", "2", "--json", "--device", "cpu"]) == 0
    hits = json.loads(capsys.readouterr().out)
    assert all("red_circle" in h["path"] for h in hits)
    pq_index = tmp_path / "pq"
    assert main([*argv, "--out", str(pq_index), "--index", "ivfpq"]) == 0
    assert type(SearchIndex(pq_index).image_faiss.base).__name__ == "IndexIVFPQ"  # re-scored by default
    capsys.readouterr()
    assert main(["search", str(pq_index), "a red circle", "-k", "1", "--json", "--device", "cpu"]) == 0
    assert "red_circle" in json.loads(capsys.readouterr().out)[0]["path"]
    # a second build from the same folder adds nothing; the same rows are not duplicated
    msgs = []
    build_index_from_embeddings(split_embeddings, out, log=msgs.append, images_root=data)
    assert SearchIndex(out).n_pictures == 24 and any("already in it" in m for m in msgs)


@pytest.mark.slow
def test_bad_embedding_folders_are_named(shapes_model, split_embeddings, tmp_path, capsys):
    data, run = shapes_model

    def fails(args, match):
        capsys.readouterr()
        assert main(args) == 2
        err = capsys.readouterr().err
        assert match in err and err.count("\n") == 1, err

    fails(
        ["index", "--from-embeddings", str(tmp_path / "nope"), "--out", str(tmp_path / "i0")],
        "nope: no such folder",
    )
    bad = tmp_path / "bad"
    shutil.copytree(split_embeddings, bad)
    np.save(bad / "img_emb" / "img_emb_1.npy", np.load(bad / "img_emb" / "img_emb_1.npy")[:3])
    fails(
        ["index", "--from-embeddings", str(bad), "--out", str(tmp_path / "i1")],
        "metadata_1.parquet: 5 metadata rows, but img_emb_1.npy holds 3 embeddings",
    )
    nan = np.load(split_embeddings / "img_emb" / "img_emb_1.npy")
    nan[2, 4] = np.nan
    np.save(bad / "img_emb" / "img_emb_1.npy", nan)
    fails(
        ["index", "--from-embeddings", str(bad), "--images-root", str(data), "--out", str(tmp_path / "i2")],
        "img_emb_1.npy: row 2 has NaN/inf",
    )
    assert not (tmp_path / "i2").exists()  # a failed first build leaves no --out folder
    wide = tmp_path / "wide"
    shutil.copytree(split_embeddings, wide)
    for p in (wide / "img_emb").glob("*.npy"):
        x = np.load(p)
        np.save(p, np.concatenate([x, x], axis=1))
    info = json.loads((wide / "embed.json").read_text())
    info["image_emb_shape"] = [2 * info["image_emb_shape"][0]]
    (wide / "embed.json").write_text(json.dumps(info))
    argv = ["index", "--from-embeddings", str(split_embeddings), "--images-root", str(data)]
    assert main([*argv, "--out", str(tmp_path / "ok")]) == 0
    fails(
        ["index", "--from-embeddings", str(wide), "--out", str(tmp_path / "ok")],
        "image embeddings, but the index",
    )
    fails(
        ["index", str(run), "x", "--from-embeddings", str(wide), "--out", str(tmp_path / "x")],
        "takes no SOURCE",
    )
    # a folder from another tool (no embed.json): RUN_DIR names its model, and the dimension must be the run's
    foreign = tmp_path / "foreign"
    shutil.copytree(split_embeddings, foreign, ignore=shutil.ignore_patterns("embed.json", ".manifest"))
    fails(
        ["index", "--from-embeddings", str(foreign), "--out", str(tmp_path / "f0")],
        "vse index RUN_DIR --from-embeddings",
    )
    assert main(["index", str(run), "--from-embeddings", str(foreign), "--out", str(tmp_path / "f1")]) == 0
    assert SearchIndex(tmp_path / "f1").n_pictures == 24
    shutil.rmtree(wide / ".manifest")
    (wide / "embed.json").unlink()
    fails(
        ["index", str(run), "--from-embeddings", str(wide), "--out", str(tmp_path / "f2")],
        "embeds to 64 dimensions",
    )
    # vse embed: a folder holding another job, an unfinished folder read as embeddings
    fails(
        [
            "embed",
            str(run),
            f"{data}:test",
            "--out",
            str(split_embeddings),
            "--chunk-size",
            "7",
            "--device",
            "cpu",
        ],
        "holds embeddings of another job (differs in chunk_size)",
    )
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "x.txt").write_text("x")
    fails(
        ["embed", str(run), f"{data}:test", "--out", str(tmp_path / "junk"), "--device", "cpu"],
        "is not empty",
    )
    half = tmp_path / "half"
    shutil.copytree(split_embeddings, half)
    (half / "embed.json").unlink()
    fails(
        ["index", "--from-embeddings", str(half), "--out", str(tmp_path / "i3")], "has not finished writing"
    )
    with pytest.raises(VseInputError, match="no captions"):
        (tmp_path / "empty.txt").write_text("\n\n")
        from vsekit.search.embed import resolve_input

        resolve_input(str(tmp_path / "empty.txt"))


def test_bench_search_ivfpq_from_an_embeddings_folder(tmp_path, monkeypatch):
    """`vse bench search --save-embeddings DIR --ivfpq`: the synthetic set goes through a clip-retrieval folder,
    the queries are its held-out last rows, and every row's recall matches a numpy brute force of the files."""
    from conftest import brute_force_topk, recall_vs, spy_search_ids
    from vsekit_lab.bench.search import ClusteredVectors, bench_search

    seen = spy_search_ids(monkeypatch)
    res = bench_search(
        n=3000,
        dim=32,
        queries=40,
        exact_queries=10,
        clusters=60,
        nlist=32,
        nprobes=(1, 32),
        sq8=False,
        ivfpq=True,
        ivf_flat=False,
        train_size=2000,
        chunk=1000,
        save_embeddings=tmp_path / "emb",
        log=quiet,
    )
    assert sorted(p.name for p in (tmp_path / "emb" / "img_emb").iterdir()) == [
        "img_emb_0.npy",
        "img_emb_1.npy",
        "img_emb_2.npy",
        "img_emb_3.npy",
    ]
    x = np.concatenate([np.load(p) for p in sorted((tmp_path / "emb" / "img_emb").glob("*.npy"))])
    np.testing.assert_array_equal(
        x, np.concatenate(list(ClusteredVectors(32, 60, 1.0, 0).chunks(3040, 1000)))
    )
    truth = brute_force_topk(x[3000:], x[:3000], 10)
    assert [r["index"] for r in res["rows"]] == ["flat (exact)", "IVF-PQ4", "IVF-PQ4"] and res["setup"][
        "pq"
    ] == "m=4 nbits=6"
    for row, ids in zip(res["rows"], seen):
        assert row["recall_at_k"] == pytest.approx(recall_vs(ids, truth[: len(ids)]), abs=1e-4), row
    assert res["rows"][0]["recall_at_k"] == 1.0 and res["rows"][1]["bytes_per_vector"] == 3 + 8  # 4 x 6 bits
    assert res["rows"][1]["recall_at_k"] < res["rows"][2]["recall_at_k"]  # nprobe 1 < nprobe 32
    seen.clear()
    pq = bench_search(
        n=3000,
        queries=40,
        exact_queries=5,
        nlist=32,
        nprobes=(32,),
        sq8=False,
        ivf_flat=False,
        ivfpq=True,
        pq_ms=(8, 16),
        rerank=10,
        embeddings=tmp_path / "emb",
        log=quiet,
    )
    assert [(r["index"], r["bytes_per_vector"]) for r in pq["rows"][1:]] == [
        ("IVF-PQ8", 6 + 8),
        ("IVF-PQ8 + exact re-rank", 6 + 8),
        ("IVF-PQ16", 12 + 8),
        ("IVF-PQ16 + exact re-rank", 12 + 8),
    ]
    for row, ids in zip(pq["rows"][1:], seen[1:]):
        assert row["recall_at_k"] == pytest.approx(recall_vs(ids, truth), abs=1e-4), row
    assert pq["rows"][2]["recall_at_k"] > pq["rows"][1]["recall_at_k"]  # the exact re-rank recovers recall
    again = bench_search(
        n=3000,
        queries=40,
        exact_queries=5,
        nlist=32,
        nprobes=(32,),
        sq8=False,
        ivf_flat=False,
        embeddings=tmp_path / "emb",
        log=quiet,
    )
    assert again["setup"]["dim"] == 32 and again["rows"][0]["recall_at_k"] == 1.0
