"""Video clips of frames: the ragged reader, `vse data check` on frame splits, and `vse data convert-video`.

Every expected value is written out by hand (offsets, frame counts, caption maps) or is the input array
itself, never recomputed with the code under test's own formula.

Float arrays are compared exactly: they are written and read back (or concatenated) without arithmetic.
"""

import io
import json
import sys

import numpy as np
import pytest

from vsekit.cli import main
from vsekit.data.frames import RaggedFrames, load_frames
from vsekit.data.precomp import DataFormatError, load_precomp_split, write_frames
from vsekit.data.validate import check_dataset, check_split_features
from vsekit.errors import MissingPackageError
from vsekit_lab.datasets.video_convert import VideoConvertError, convert_video

# three clips of 3, 1 and 2 frames, 4 wide: frame rows 0-2, 3, 4-5
CLIP0 = np.arange(12, dtype=np.float32).reshape(3, 4)
CLIP1 = np.full((1, 4), -1.5, dtype=np.float32)
CLIP2 = np.array([[9, 8, 7, 6], [5, 4, 3, 2]], dtype=np.float32)
FRAMES = np.array([*CLIP0.tolist(), *CLIP1.tolist(), *CLIP2.tolist()], dtype=np.float32)  # (6, 4)
OFFSETS = np.array([0, 3, 4, 6], dtype=np.int64)
CAPS = ["a dog runs", "a dog plays", "a cat", "two birds", "birds fly"]
CAP2IMG = [0, 0, 1, 2, 2]


def _write_split(root, split="test", frames=FRAMES, offsets=OFFSETS, caps=CAPS, cap2img=CAP2IMG):
    """The files by hand (np.save + text), independent of write_frames."""
    root.mkdir(parents=True, exist_ok=True)
    np.save(root / f"{split}_frames.npy", frames)
    (root / f"{split}_frame_offsets.npy").unlink(missing_ok=True)
    if offsets is not None:
        np.save(root / f"{split}_frame_offsets.npy", offsets)
    (root / f"{split}_caps.txt").write_text("".join(c + "\n" for c in caps))
    (root / f"{split}_cap2img.txt").unlink(missing_ok=True)
    if cap2img is not None:
        (root / f"{split}_cap2img.txt").write_text("".join(f"{i}\n" for i in cap2img))
    return root


def _found(report, path_end, where, text):
    return any(p.path.endswith(path_end) and p.where == where and text in p.message for p in report.problems)


# ------------------------------------------------------------------------------------------ ragged reader


def test_ragged_frames_indexing_and_shape(tmp_path):
    _write_split(tmp_path)
    feats = load_frames(tmp_path, "test")
    assert (
        isinstance(feats, RaggedFrames) and feats.shape == (3, 3, 4) and len(feats) == 3 and feats.ndim == 3
    )
    assert feats.dtype == np.float32
    assert isinstance(feats.frames, np.memmap)
    for i, clip in enumerate([CLIP0, CLIP1, CLIP2]):
        np.testing.assert_array_equal(feats[i], clip)
        np.testing.assert_array_equal(feats[np.int64(i)], clip)
    np.testing.assert_array_equal(feats[-1], CLIP2)
    np.testing.assert_array_equal(feats[-3], CLIP0)
    with pytest.raises(IndexError):
        feats[3]
    with pytest.raises(IndexError):
        feats[-4]
    with pytest.raises(TypeError, match="one clip index"):
        feats[0:2]


def test_write_frames_matches_hand_built_layout(tmp_path):
    write_frames(tmp_path, "train", [CLIP0, CLIP1, CLIP2])
    np.testing.assert_array_equal(np.load(tmp_path / "train_frames.npy"), FRAMES)
    np.testing.assert_array_equal(np.load(tmp_path / "train_frame_offsets.npy"), [0, 3, 4, 6])


def test_precomp_split_reads_clips(tmp_path):
    _write_split(tmp_path)
    s = load_precomp_split(tmp_path, "test")
    assert s.n_images == 3 and s.n_captions == 5 and s.feature_shape == (3, 4)
    assert list(s.cap2img) == CAP2IMG
    np.testing.assert_array_equal(s.image_features(1), CLIP1)
    np.testing.assert_array_equal(s.image_features(2), CLIP2)


@pytest.mark.parametrize(
    "offsets,file,message",
    [
        (np.array([0, 3, 2, 6]), "test_frame_offsets.npy", "offsets decrease at clip 1 (3 then 2"),
        (np.array([1, 3, 4, 6]), "test_frame_offsets.npy", "the first offset must be 0, got 1"),
        (
            np.array([0, 3, 4, 5]),
            "test_frame_offsets.npy",
            "the last offset is 5 but test_frames.npy has 6 frame rows",
        ),
        (np.array([0, 3, 3, 6]), "test_frame_offsets.npy", "clip 1 has no frames"),
        (np.array([0.0, 3.0, 4.0, 6.0]), "test_frame_offsets.npy", "expected a 1-D integer array"),
        (np.array([[0, 3], [4, 6]]), "test_frame_offsets.npy", "expected a 1-D integer array"),
        (np.array([6]), "test_frame_offsets.npy", "needs at least 2 offsets"),
    ],
)
def test_bad_offsets_name_the_file(tmp_path, offsets, file, message):
    _write_split(tmp_path, offsets=offsets)
    with pytest.raises(DataFormatError, match=file) as e:
        load_precomp_split(tmp_path, "test")
    assert message in str(e.value)


@pytest.mark.parametrize(
    "frames,message",
    [
        (FRAMES.reshape(6, 2, 2), "expected shape (frames, dim), got (6, 2, 2)"),
        (FRAMES.astype(np.int32), "expected float16 or float32 features, got int32"),
    ],
)
def test_bad_frames_array_names_the_file(tmp_path, frames, message):
    _write_split(tmp_path, frames=frames)
    with pytest.raises(DataFormatError, match="test_frames.npy") as e:
        load_precomp_split(tmp_path, "test")
    assert message in str(e.value)


def test_missing_offsets_file(tmp_path):
    _write_split(tmp_path, offsets=None)
    with pytest.raises(DataFormatError, match="test_frame_offsets.npy: missing"):
        load_precomp_split(tmp_path, "test")


@pytest.mark.parametrize("extra", ["test_ims.npy", "test_ims_lengths.txt"])
def test_split_with_images_and_frames_is_refused(tmp_path, extra):
    _write_split(tmp_path)
    if extra.endswith(".npy"):
        np.save(tmp_path / extra, np.zeros((3, 2, 4), np.float32))
    else:
        (tmp_path / extra).write_text("1\n1\n1\n")
    with pytest.raises(DataFormatError, match=f"{extra}: a split holds either"):
        load_precomp_split(tmp_path, "test")


@pytest.mark.parametrize(
    "cap2img,message",
    [
        ([0, 0, 1, 2], "test_cap2img.txt: 4 lines but test_caps.txt has 5 captions"),
        ([0, 0, 1, 2, 3], "test_cap2img.txt:5: clip 3 outside 0..2"),
        ([0, 0, 2, 2, 2], "test_cap2img.txt: clip 1 has no caption (1 such clips)"),
    ],
)
def test_mismatched_caption_map(tmp_path, cap2img, message):
    _write_split(tmp_path, cap2img=cap2img)
    with pytest.raises(DataFormatError) as e:
        load_precomp_split(tmp_path, "test")
    assert message in str(e.value)


@pytest.mark.parametrize("chunk_rows", [1, 2, 4, 2048])
def test_nan_frame_is_traced_to_its_clip(tmp_path, chunk_rows):
    frames = FRAMES.copy()
    frames[5, 2] = np.nan  # frame row 5 = clip 2's second frame
    _write_split(tmp_path, frames=frames)
    with pytest.raises(DataFormatError, match="test_frames.npy: clip 2 has NaN or inf features") as e:
        check_split_features(load_precomp_split(tmp_path, "test"), chunk_rows=chunk_rows)
    assert "frame row 5, frame 1 of the clip" in str(e.value)
    frames = FRAMES.copy()
    frames[3, 0] = np.inf  # clip 1, its only frame
    _write_split(tmp_path, frames=frames)
    with pytest.raises(DataFormatError, match="clip 1 has NaN or inf features"):
        check_split_features(load_precomp_split(tmp_path, "test"), chunk_rows=chunk_rows)


def test_clean_frames_pass_the_feature_check(tmp_path):
    _write_split(tmp_path)
    check_split_features(load_precomp_split(tmp_path, "test"), chunk_rows=2)


# ---------------------------------------------------------------------------------------- vse data check


def test_check_reports_a_good_frame_set(tmp_path, capsys):
    _write_split(tmp_path, split="train")
    _write_split(
        tmp_path,
        split="test",
        frames=FRAMES[:4],
        offsets=np.array([0, 1, 4]),
        caps=["x", "y"],
        cap2img=[0, 1],
    )
    report = check_dataset(tmp_path)
    assert report.ok and report.problems == []
    assert report.splits["train"] == {
        "feature_shape": (6, 4),
        "clips": 3,
        "frames_per_clip": (1, 2.0, 3),
        "captions": 5,
    }
    assert report.splits["test"] == {
        "feature_shape": (4, 4),
        "clips": 2,
        "frames_per_clip": (1, 2.0, 3),
        "captions": 2,
    }
    assert main(["data", "check", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "train: 3 clips, 5 captions, frames x dim 6x4, frames per clip min 1 / median 2 / max 3" in out
    assert "OK: 0 error(s), 0 warning(s)" in out


def test_check_reports_every_offset_problem(tmp_path):
    _write_split(tmp_path, offsets=np.array([0, 3, 3, 7]))  # F = 6
    report = check_dataset(tmp_path)
    assert _found(
        report,
        "test_frame_offsets.npy",
        " row 3",
        "the last offset is 7 but test_frames.npy has 6 frame rows",
    )
    assert _found(report, "test_frame_offsets.npy", " row 3", "offset 7 outside 0..6")
    assert _found(
        report,
        "test_frame_offsets.npy",
        " row 1",
        "clip 1 has no frames (offsets[1] = offsets[2] = 3); 1 empty clip(s)",
    )
    assert report.splits["test"]["clips"] == 3 and "frames_per_clip" not in report.splits["test"]
    _write_split(tmp_path, offsets=np.array([2, 4, 1, 6]))
    report = check_dataset(tmp_path)
    assert _found(report, "test_frame_offsets.npy", " row 0", "the first offset must be 0, got 2")
    assert _found(report, "test_frame_offsets.npy", " row 1", "offsets decrease at clip 1 (4 then 1")


@pytest.mark.parametrize(
    "offsets,message",
    [
        (np.array([0.0, 3.0, 4.0, 6.0]), "expected a 1-D integer array (N + 1 clip offsets), got float64"),
        (np.array([[0, 3], [4, 6]]), "expected a 1-D integer array (N + 1 clip offsets), got int64 (2, 2)"),
        (None, "missing; test_frames.npy needs it"),
    ],
)
def test_check_unreadable_offsets(tmp_path, offsets, message):
    _write_split(tmp_path, offsets=offsets)
    report = check_dataset(tmp_path)
    assert not report.ok and _found(report, "test_frame_offsets.npy", "", message)
    assert "? clips" in report.format()


def test_check_nan_frames_named_by_clip(tmp_path):
    frames = FRAMES.copy()
    frames[1, 0] = np.nan  # clip 0, frame 1
    frames[5, 3] = -np.inf  # clip 2, frame 1
    frames[4] = 0  # clip 2, frame 0: all zeros
    _write_split(tmp_path, frames=frames)
    report = check_dataset(tmp_path, chunk_rows=2)
    assert _found(
        report,
        "test_frames.npy",
        " row 1",
        "NaN or inf features in clip 0 (its frame 1); 2 bad frame row(s) in 2 clip(s) in all",
    )
    assert _found(report, "test_frames.npy", "", "1 frame row(s) in 1 clip(s) are all zeros")
    _write_split(tmp_path, frames=frames, offsets=np.array([0, 3, 4, 9]))  # broken offsets: rows only
    assert _found(
        check_dataset(tmp_path), "test_frames.npy", " row 1", "clips unknown while the offsets are broken"
    )


def test_check_caption_maps_of_clips(tmp_path):
    _write_split(tmp_path, cap2img=[0, 0, 1, 2])
    assert _found(
        check_dataset(tmp_path),
        "test_cap2img.txt",
        "",
        "4 lines but test_caps.txt has 5 captions (one clip per caption)",
    )
    _write_split(tmp_path, cap2img=[0, 0, 1, 2, 5])
    assert _found(check_dataset(tmp_path), "test_cap2img.txt", ":5", "clip 5 outside 0..2")
    _write_split(tmp_path, cap2img=[0, 0, 0, 2, 2])
    assert _found(check_dataset(tmp_path), "test_cap2img.txt", "", "clip 1 has no caption (1 such clips)")
    _write_split(tmp_path, cap2img=None)  # 5 captions, 3 clips, 5 per clip by default
    assert _found(
        check_dataset(tmp_path), "test_caps.txt", "", "5 captions do not fit 3 clips with 5 captions per clip"
    )


def test_check_refuses_images_beside_frames_and_exits_1(tmp_path, capsys):
    _write_split(tmp_path)
    np.save(tmp_path / "test_ims.npy", np.zeros((3, 2, 4), np.float32))
    report = check_dataset(tmp_path)
    assert _found(report, "test_ims.npy", "", "a split holds either test_ims.npy or test_frames.npy")
    assert main(["data", "check", str(tmp_path)]) == 1
    assert "FAILED" in capsys.readouterr().out


def test_frame_and_image_splits_compare_feature_size(tmp_path):
    _write_split(tmp_path, split="train")
    np.save(tmp_path / "test_ims.npy", np.ones((2, 3, 5), np.float32))
    (tmp_path / "test_caps.txt").write_text("".join(f"c{i}\n" for i in range(10)))
    report = check_dataset(tmp_path)
    assert _found(report, "", "", "feature size differs between splits (train 4, test 5)")
    assert not any("regions per image differ" in p.message for p in report.problems)


# ------------------------------------------------------------------------------------------- converters

# five videos of 3, 5, 2, 4 and 1 frames, 6 wide
VIDEO_LEN = {"video0": 3, "video1": 5, "video2": 2, "video3": 4, "video4": 1}


@pytest.fixture
def videos():
    rng = np.random.default_rng(7)
    return {vid: rng.normal(size=(t, 6)).astype(np.float32) for vid, t in VIDEO_LEN.items()}


def _msrvtt_json(path, splits=("train", "train", "validate", "test", "test"), n_caps=(2, 1, 3, 2, 2)):
    info = {
        "info": {},
        "videos": [{"video_id": f"video{i}", "split": s, "id": i} for i, s in enumerate(splits)],
        "sentences": [
            {"video_id": f"video{i}", "caption": f"clip {i} caption {j}", "sen_id": 0}
            for i in range(len(splits))
            for j in range(n_caps[i])
        ],
    }
    path.write_text(json.dumps(info))
    return path


def _npy_dir(root, videos):
    root.mkdir()
    for vid, arr in videos.items():
        np.save(root / f"{vid}.npy", arr)
    return root


def _assert_split(out, split, ids, videos, offsets, caps, cap2img, dtype=np.float32):
    frames = np.load(out / f"{split}_frames.npy")
    assert frames.dtype == dtype
    np.testing.assert_array_equal(frames, np.concatenate([videos[v] for v in ids]).astype(dtype))
    np.testing.assert_array_equal(np.load(out / f"{split}_frame_offsets.npy"), offsets)
    assert (out / f"{split}_caps.txt").read_text().splitlines() == caps
    assert (out / f"{split}_cap2img.txt").read_text().splitlines() == [str(i) for i in cap2img]
    assert (out / f"{split}_ids.txt").read_text().splitlines() == ids
    s = load_precomp_split(out, split)
    for i, vid in enumerate(ids):
        np.testing.assert_array_equal(s.image_features(i), videos[vid].astype(dtype).astype(np.float32))


def test_convert_npy_folder_with_msrvtt_json(tmp_path, videos):
    feats = _npy_dir(tmp_path / "feats", videos)
    summary = convert_video(
        feats, [_msrvtt_json(tmp_path / "videodatainfo.json")], tmp_path / "out", progress=False
    )
    out = tmp_path / "out"
    _assert_split(
        out,
        "train",
        ["video0", "video1"],
        videos,
        [0, 3, 8],
        ["clip 0 caption 0", "clip 0 caption 1", "clip 1 caption 0"],
        [0, 0, 1],
    )
    _assert_split(
        out, "dev", ["video2"], videos, [0, 2], [f"clip 2 caption {j}" for j in range(3)], [0, 0, 0]
    )
    _assert_split(
        out,
        "test",
        ["video3", "video4"],
        videos,
        [0, 4, 5],
        ["clip 3 caption 0", "clip 3 caption 1", "clip 4 caption 0", "clip 4 caption 1"],
        [0, 0, 1, 1],
    )
    assert summary["train"] == {
        "clips": 2,
        "captions": 3,
        "frames": 8,
        "frames_per_clip": (3, 4.0, 5),
        "dim": 6,
    }
    assert summary["test"]["frames_per_clip"] == (1, 2.5, 4)
    assert check_dataset(out).ok
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []  # no temp files left


def test_convert_hdf5_with_tsv_and_split_files(tmp_path, videos):
    h5py = pytest.importorskip("h5py")
    with h5py.File(tmp_path / "feats.h5", "w") as f:
        for vid, arr in videos.items():
            f[vid] = arr
    (tmp_path / "caps.tsv").write_text(
        "video3\tthe third\nvideo1\tone\n\nvideo3\t  the   third again \nvideo4\tlast\n"
    )
    (tmp_path / "train.txt").write_text("video3\nvideo1\n")
    np.save(tmp_path / "test_names.npy", np.array(["video4"]))  # HGR's public_split/*_names.npy
    convert_video(
        tmp_path / "feats.h5",
        [tmp_path / "caps.tsv"],
        tmp_path / "out",
        progress=False,
        split_files=[f"train:{tmp_path / 'train.txt'}", f"test:{tmp_path / 'test_names.npy'}"],
    )
    out = tmp_path / "out"
    _assert_split(
        out,
        "train",
        ["video3", "video1"],
        videos,
        [0, 4, 9],
        ["the third", "the third again", "one"],
        [0, 0, 1],
    )
    _assert_split(out, "test", ["video4"], videos, [0, 1], ["last"], [0])


def test_convert_hdf5_key_with_slash_and_float16(tmp_path, videos):
    h5py = pytest.importorskip("h5py")
    with h5py.File(tmp_path / "feats.hdf5", "w") as f:
        f["a_b"] = videos["video0"]  # HGR stores name "a/b" under "a_b"
        f["video2"] = videos["video2"][None]  # (1, T, D): one batch of one video
    (tmp_path / "caps.json").write_text(
        json.dumps({"a/b": ["x", "y"], "video2": ["z"]})
    )  # HGR ref_captions.json
    (tmp_path / "ids.json").write_text(json.dumps(["a/b", "video2"]))
    convert_video(
        tmp_path / "feats.hdf5",
        [tmp_path / "caps.json"],
        tmp_path / "out",
        dtype="float16",
        split_files=[f"test:{tmp_path / 'ids.json'}"],
        progress=False,
    )
    vids = {"a/b": videos["video0"], "video2": videos["video2"]}
    _assert_split(
        tmp_path / "out", "test", ["a/b", "video2"], vids, [0, 3, 5], ["x", "y", "z"], [0, 0, 1], np.float16
    )


@pytest.mark.parametrize("encoding", ["npy", "raw"])
def test_convert_lmdb_round_trip(tmp_path, videos, encoding):
    lmdb = pytest.importorskip("lmdb")
    env = lmdb.open(str(tmp_path / "feats.lmdb"), map_size=1 << 24)
    with env.begin(write=True) as txn:
        for vid, arr in videos.items():
            if encoding == "npy":
                buf = io.BytesIO()
                np.save(buf, arr)
                txn.put(vid.encode(), buf.getvalue())
            else:
                txn.put(vid.encode(), arr.astype("<f4").tobytes())
    env.close()
    vatex = [
        {"videoID": "video2", "enCap": ["a", "b"], "chCap": ["甲"]},
        {"videoID": "video1", "enCap": ["c"]},
    ]
    (tmp_path / "vatex.json").write_text(json.dumps(vatex))
    (tmp_path / "test.txt").write_text("video1\nvideo2\n")
    kw = {"lmdb_dim": 6} if encoding == "raw" else {}
    convert_video(
        tmp_path / "feats.lmdb",
        [tmp_path / "vatex.json"],
        tmp_path / "out",
        split_files=[f"test:{tmp_path / 'test.txt'}"],
        progress=False,
        **kw,
    )
    _assert_split(
        tmp_path / "out", "test", ["video1", "video2"], videos, [0, 5, 7], ["c", "a", "b"], [0, 1, 1]
    )
    if encoding == "raw":
        with pytest.raises(VideoConvertError, match=r"feats.lmdb\['video1'\]: raw bytes .* --lmdb-dim"):
            convert_video(
                tmp_path / "feats.lmdb",
                [tmp_path / "vatex.json"],
                tmp_path / "out2",
                split_files=[f"test:{tmp_path / 'test.txt'}"],
                progress=False,
            )
        with pytest.raises(
            VideoConvertError, match=r"120 bytes are not whole float32 frames of --lmdb-dim 7"
        ):
            convert_video(
                tmp_path / "feats.lmdb",
                [tmp_path / "vatex.json"],
                tmp_path / "out2",
                lmdb_dim=7,
                split_files=[f"test:{tmp_path / 'test.txt'}"],
                progress=False,
            )


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda v: v.pop("video4"), "feats: no features for video 'video4' (split 'test'"),
        (
            lambda v: v["video1"].__setitem__((2, 3), np.nan),
            "video1.npy: video 'video1' frame 2 has NaN or inf features",
        ),
        (lambda v: v.__setitem__("video3", np.ones((4, 7), np.float32)), "video3.npy: frames are 7 wide but"),
        (
            lambda v: v.__setitem__("video2", np.ones((0, 6), np.float32)),
            "video2.npy: video 'video2' has no frames",
        ),
        (
            lambda v: v.__setitem__("video2", np.ones(6, np.float32)),
            "video2.npy: expected (frames, dim) features, got shape (6,)",
        ),
    ],
)
def test_convert_refuses_bad_features_and_writes_nothing(tmp_path, videos, change, message):
    change(videos)
    feats = _npy_dir(tmp_path / "feats", videos)
    out = tmp_path / "out"
    with pytest.raises(VideoConvertError) as e:
        convert_video(feats, [_msrvtt_json(tmp_path / "info.json")], out, progress=False)
    assert message in str(e.value)
    assert not out.exists()  # no split, no temp file, not even the folder


def test_convert_refuses_bad_annotations(tmp_path, videos):
    feats = _npy_dir(tmp_path / "feats", videos)
    (tmp_path / "caps.tsv").write_text("video0\tone\nvideo1 two\n")
    with pytest.raises(VideoConvertError, match=r"caps.tsv:2: expected 'video_id<TAB>caption'"):
        convert_video(
            feats, [tmp_path / "caps.tsv"], tmp_path / "out", split_files=["train:x"], progress=False
        )
    (tmp_path / "caps.tsv").write_text("video0\tone\nvideo1\ttwo\n")
    (tmp_path / "train.txt").write_text("video0\nvideo2\n")
    with pytest.raises(
        VideoConvertError, match=r"train.txt: video 'video2' \(split 'train'\) has no captions in"
    ):
        convert_video(
            feats, [tmp_path / "caps.tsv"], tmp_path / "out", split_files=[f"train:{tmp_path / 'train.txt'}"]
        )
    (tmp_path / "train.txt").write_text("video0\n")
    (tmp_path / "test.txt").write_text("video1\nvideo0\n")
    with pytest.raises(
        VideoConvertError, match=r"test.txt: video 'video0' is in split 'train' .* and in split 'test'"
    ):
        convert_video(
            feats,
            [tmp_path / "caps.tsv"],
            tmp_path / "out",
            split_files=[f"train:{tmp_path / 'train.txt'}", f"test:{tmp_path / 'test.txt'}"],
        )
    with pytest.raises(VideoConvertError, match="no split membership"):
        convert_video(feats, [tmp_path / "caps.tsv"], tmp_path / "out")
    (tmp_path / "caps.tsv").write_text("video0\t   \n")
    with pytest.raises(VideoConvertError, match=r"caps.tsv: video 'video0' has an empty caption"):
        convert_video(
            feats, [tmp_path / "caps.tsv"], tmp_path / "out", split_files=[f"train:{tmp_path / 'train.txt'}"]
        )
    assert not (tmp_path / "out").exists()


def test_convert_overwrite(tmp_path, videos):
    feats = _npy_dir(tmp_path / "feats", videos)
    info = _msrvtt_json(tmp_path / "info.json")
    out = tmp_path / "out"
    out.mkdir()
    np.save(out / "train_ims.npy", np.zeros((2, 1, 6), np.float32))  # an older image-layout split
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(VideoConvertError, match=r"out/train_ims.npy: exists .* pass --overwrite"):
        convert_video(feats, [info], out, progress=False)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt", "train_ims.npy"]
    convert_video(feats, [info], out, overwrite=True, progress=False)
    assert not (out / "train_ims.npy").exists() and (out / "notes.txt").read_text() == "keep me"
    assert check_dataset(out).ok
    videos["video0"] = videos["video0"] * 2
    np.save(feats / "video0.npy", videos["video0"])
    convert_video(feats, [info], out, overwrite=True, progress=False)
    np.testing.assert_array_equal(np.load(out / "train_frames.npy")[:3], videos["video0"])


def test_missing_hdf5_package_is_named(tmp_path, monkeypatch):
    (tmp_path / "feats.h5").write_bytes(b"\x89HDF\r\n\x1a\n")
    (tmp_path / "caps.tsv").write_text("v\tc\n")
    (tmp_path / "ids.txt").write_text("v\n")
    monkeypatch.setitem(sys.modules, "h5py", None)  # import h5py raises ImportError
    with pytest.raises(MissingPackageError, match=r"needs the h5py package: pip install h5py"):
        convert_video(
            tmp_path / "feats.h5",
            [tmp_path / "caps.tsv"],
            tmp_path / "out",
            split_files=[f"test:{tmp_path / 'ids.txt'}"],
            progress=False,
        )


def test_convert_video_cli(tmp_path, videos, capsys):
    feats = _npy_dir(tmp_path / "feats", videos)
    info = _msrvtt_json(tmp_path / "info.json")
    args = [
        "data",
        "convert-video",
        "--features",
        str(feats),
        "--captions",
        str(info),
        "--out",
        str(tmp_path / "out"),
    ]
    assert main([*args, "--splits", "train", "test"]) == 0
    out = capsys.readouterr().out
    assert "train: 2 clips, 3 captions, 8 x 6 frames (per clip min 3 / median 4 / max 5)" in out
    assert sorted(p.name for p in (tmp_path / "out").iterdir() if p.name.startswith("dev")) == []
    assert main(args) == 2
    assert "exists" in capsys.readouterr().err


def test_float16_overflow_is_an_error_not_inf(tmp_path, videos):
    videos["video3"][1, 2] = 1e6  # fine in float32, inf in float16
    feats = _npy_dir(tmp_path / "feats", videos)
    with pytest.raises(
        VideoConvertError, match=r"video3.npy: video 'video3' frame 1 is too large for float16"
    ):
        convert_video(
            feats, [_msrvtt_json(tmp_path / "info.json")], tmp_path / "out", dtype="float16", progress=False
        )
    assert not (tmp_path / "out").exists()
