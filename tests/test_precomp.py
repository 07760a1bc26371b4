# Float arrays are compared after a write / memory-mapped read without arithmetic: exact (allclose's
# tolerances are never used).
import numpy as np
import pytest

from vsekit.data.precomp import DataFormatError, load_precomp_split, write_precomp_split


def _write(tmp_path, n=4, k=5, **kw):
    feats = np.random.default_rng(0).normal(size=(n, 3, 8)).astype(np.float32)
    caps = [f"caption {i} of image {i // k}" for i in range(n * k)]
    write_precomp_split(tmp_path, "test", feats, caps, image_ids=[f"id{i}" for i in range(n)], **kw)
    return feats, caps


@pytest.mark.parametrize("per_caption", [False, True])
def test_both_ids_layouts(tmp_path, per_caption):
    _write(tmp_path, ids_per_caption=per_caption)
    s = load_precomp_split(tmp_path, "test")
    assert s.n_images == 4 and s.n_captions == 20
    assert s.image_ids == ["id0", "id1", "id2", "id3"]
    assert list(s.cap2img[:6]) == [0, 0, 0, 0, 0, 1]
    assert s.feature_shape == (3, 8)


def test_features_are_memory_mapped_and_dims_read_from_file(tmp_path):
    feats, _ = _write(tmp_path)
    s = load_precomp_split(tmp_path, "test")
    assert isinstance(s.features, np.memmap)
    assert np.allclose(s.image_features(2), feats[2])


def test_one_feature_row_per_caption(tmp_path):
    feats = np.repeat(np.arange(3, dtype=np.float32), 5)[:, None, None] * np.ones((1, 2, 4), np.float32)
    write_precomp_split(tmp_path, "dev", feats, [f"c{i}" for i in range(15)])
    s = load_precomp_split(tmp_path, "dev")
    assert s.n_images == 3 and list(s.image_rows) == [0, 5, 10]
    assert s.image_features(2)[0, 0] == 2.0


def test_variable_captions_with_cap2img(tmp_path):
    feats = np.zeros((3, 2, 4), np.float32)
    write_precomp_split(tmp_path, "train", feats, ["a", "b", "c", "d"], cap2img=np.array([0, 0, 1, 2]))
    s = load_precomp_split(tmp_path, "train")
    assert list(s.cap2img) == [0, 0, 1, 2]
    assert s.truncate(2).n_captions == 3


def test_count_mismatch_names_file(tmp_path):
    feats = np.zeros((4, 2, 4), np.float32)
    write_precomp_split(tmp_path, "test", feats, [f"c{i}" for i in range(19)])
    with pytest.raises(DataFormatError, match="test_caps.txt.*19 captions do not fit 4"):
        load_precomp_split(tmp_path, "test")


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(DataFormatError, match="does not exist"):
        load_precomp_split(tmp_path / "nope", "test")
    _write(tmp_path)
    (tmp_path / "test_ims.npy").unlink()
    with pytest.raises(DataFormatError, match="test_ims.npy: missing"):
        load_precomp_split(tmp_path, "test")
    np.save(tmp_path / "test_ims.npy", np.zeros((4, 8), np.float32))
    with pytest.raises(DataFormatError, match="expected shape"):
        load_precomp_split(tmp_path, "test")
    np.save(tmp_path / "test_ims.npy", np.zeros((4, 2, 8), np.int32))
    with pytest.raises(DataFormatError, match="float16 or float32"):
        load_precomp_split(tmp_path, "test")


def test_ids_of_wrong_length(tmp_path):
    _write(tmp_path)
    (tmp_path / "test_ids.txt").write_text("a\nb\n")
    with pytest.raises(DataFormatError, match="test_ids.txt: 2 lines"):
        load_precomp_split(tmp_path, "test")


def test_nan_features_are_reported(tmp_path):
    from vsekit.data.validate import check_split_features

    feats, caps = _write(tmp_path)
    feats[2, 1, 3] = np.nan
    write_precomp_split(tmp_path, "test", feats, caps)
    with pytest.raises(DataFormatError, match="image row 2 has NaN"):
        check_split_features(load_precomp_split(tmp_path, "test"))


def test_set_sizes_file_trims_padding_rows(tmp_path):
    feats, _ = _write(tmp_path)
    (tmp_path / "test_ims_lengths.txt").write_text("3\n1\n2\n3\n")
    s = load_precomp_split(tmp_path, "test")
    assert [s.image_features(i).shape[0] for i in range(4)] == [3, 1, 2, 3]
    assert np.allclose(s.image_features(2), feats[2, :2])
    assert s.truncate(2).image_features(1).shape[0] == 1


@pytest.mark.parametrize(
    "text,message",
    [
        ("3\n1\n2\n", "3 lines for 4 feature rows"),
        ("3\n0\n2\n3\n", ":2: set size 0"),
        ("3\n1\n9\n3\n", ":3: set size 9 outside 1..3"),
        ("3\nx\n2\n3\n", ":2: expected one integer"),
    ],
)
def test_bad_set_sizes_name_the_file_and_line(tmp_path, text, message):
    _write(tmp_path)
    (tmp_path / "test_ims_lengths.txt").write_text(text)
    with pytest.raises(DataFormatError, match="test_ims_lengths.txt") as e:
        load_precomp_split(tmp_path, "test")
    assert message in str(e.value)
