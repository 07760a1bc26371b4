"""The noisy-correspondence protocol (`vsekit.data.noise`, `vse data noise`, `vse data check` naming it).

Parity: the releases' own noise arrays (`nc_noise/` of the reference fixtures: NCR/IN2R caption level, RCL image
level, for the sizes, rates and seed the files record) must come out exactly. The dataset tests compare against
the README's algorithm written inline with numpy's global RNG, as the releases call it, and against the source
dataset's own files.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from conftest import reference_fixture_dir
from vsekit.cli import main
from vsekit.data.noise import caption_level, image_level
from vsekit.data.precomp import load_precomp_split
from vsekit_lab.datasets.synthetic import make_synthetic_precomp


def _nc_noise():
    folder = reference_fixture_dir("nc_noise")
    with np.load(folder / "inputs.npz") as f:
        inputs = {k: f[k] for k in f.files}
    with np.load(folder / "outputs.npz") as f:
        outputs = {k: f[k] for k in f.files}
    return inputs, outputs


def _tag(rate: float) -> str:
    return repr(float(rate)).replace(".", "")  # 0.2 -> "02", as the fixture names its keys


def test_noise_1_caption_level_matches_ncr_release():
    """NCR/IN2R's caption-level t2i and clean labels, exactly, for every recorded rate."""
    inputs, out = _nc_noise()
    n, k, seed = int(inputs["n_images"]), int(inputs["captions_per_image"]), int(inputs["seed"])
    for rate in inputs["rates"]:
        t2i = caption_level(np.arange(n * k) // k, float(rate), seed)
        np.testing.assert_array_equal(t2i, out[f"ncr_t2i_{_tag(rate)}"])
        clean = (t2i == np.arange(n * k) // k).astype(np.int64)
        np.testing.assert_array_equal(clean, out[f"ncr_clean_labels_{_tag(rate)}"])


def test_noise_2_image_level_matches_rcl_release():
    """RCL's image-level noise_inx and the caption -> image map it implies, exactly."""
    inputs, out = _nc_noise()
    n, k, seed = int(inputs["n_images"]), int(inputs["captions_per_image"]), int(inputs["seed"])
    for rate in inputs["rates"]:
        inx = image_level(n, float(rate), seed)
        np.testing.assert_array_equal(inx, out[f"rcl_noisy_inx_{_tag(rate)}"])
        np.testing.assert_array_equal(inx[np.arange(n * k) // k], out[f"rcl_t2i_{_tag(rate)}"])


def _readme_caption_noise(n_caps: int, k: int, rate: float, seed: int) -> np.ndarray:
    """The fixture README's caption-level algorithm, with numpy's global RNG as the releases call it."""
    np.random.seed(seed)
    t2i = np.arange(n_caps) // k
    idx = np.arange(n_caps)
    np.random.shuffle(idx)
    m = int(rate * n_caps)
    s = t2i[idx[:m]]
    np.random.shuffle(s)
    t2i[idx[:m]] = s
    return t2i


def test_noise_3_caption_level_properties():
    """Every image keeps its number of captions; the realised rate is at most the nominal one; rate 0 = clean."""
    base = np.arange(500) // 5
    t2i = caption_level(base, 0.4, 3)
    np.testing.assert_array_equal(np.bincount(t2i, minlength=100), np.full(100, 5))
    realised = float((t2i != base).mean())
    assert 0.3 < realised <= 0.4
    np.testing.assert_array_equal(caption_level(base, 0.0, 3), base)
    np.testing.assert_array_equal(image_level(100, 0.0, 3), np.arange(100))


@pytest.fixture
def src(tmp_path):
    return make_synthetic_precomp(tmp_path / "clean", n_train=100, n_dev=10, n_test=10, regions=3, dim=4)


def _err_line(capsys, argv: list[str]) -> str:
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    lines = [x for x in err.splitlines() if x.startswith("vse ")]
    assert len(lines) == 1 and lines[0].startswith("vse data: error: "), err
    assert "Traceback" not in err and "internal error" not in err
    return lines[0]


def test_noise_4_vse_data_noise_writes_linked_noisy_copy(src, tmp_path, capsys):
    """The train split carries the noise through train_cap2img.txt; features and dev/test are links to the
    source, captions untouched; the ground truth is recorded and `vse data check` names it."""
    out = tmp_path / "noisy"
    assert main(["data", "noise", str(src), "--out", str(out), "--rate", "0.4", "--seed", "7"]) == 0
    clean_split = load_precomp_split(src, "train")
    noisy = load_precomp_split(out, "train")
    expected = _readme_caption_noise(clean_split.n_captions, 5, 0.4, 7)
    np.testing.assert_array_equal(noisy.cap2img, expected)
    assert noisy.captions == clean_split.captions
    for name in ("train_ims.npy", "train_caps.txt", "dev_ims.npy", "dev_caps.txt", "test_ims.npy"):
        assert (out / name).is_symlink() and os.path.samefile(out / name, src / name), name
    np.testing.assert_array_equal(np.asarray(noisy.features), np.asarray(clean_split.features))
    assert noisy.image_ids == clean_split.image_ids
    dev_a, dev_b = load_precomp_split(src, "dev"), load_precomp_split(out, "dev")
    np.testing.assert_array_equal(dev_a.cap2img, dev_b.cap2img)
    clean = np.load(out / "train_noise_clean.npy")
    np.testing.assert_array_equal(clean, expected == np.arange(len(expected)) // 5)
    np.testing.assert_array_equal(np.load(out / "train_noise_index.npy"), expected)
    record = json.loads((out / "manifest.json").read_text())["noise"]
    assert record["level"] == "caption" and record["seed"] == 7 and record["nominal_rate"] == 0.4
    assert record["mismatched"] == int((~clean).sum()) and record["captions"] == len(clean)
    assert record["realised_rate"] == pytest.approx(float((~clean).mean()))
    capsys.readouterr()
    assert main(["data", "check", str(out)]) == 0
    report = capsys.readouterr().out
    assert "caption-level noise (seed 7)" in report and f"{record['mismatched']} of 500" in report
    assert "train_noise_clean.npy" in report and "OK: 0 error(s)" in report


def test_noise_5_image_level_and_released_file(src, tmp_path):
    """--level image moves all captions of a moved image; --from-file applies RCL's noise_inx (the fixture's)."""
    out = tmp_path / "img"
    assert main(["data", "noise", str(src), "--out", str(out), "--rate", "0.5", "--level", "image"]) == 0
    np.random.seed(0)  # RCL's protocol from the README, global RNG
    noisy_inx, inx = np.arange(100), np.arange(100)
    np.random.shuffle(inx)
    sel = inx[:50]
    s = np.array(sel)
    np.random.shuffle(s)
    noisy_inx[sel] = s
    np.testing.assert_array_equal(load_precomp_split(out, "train").cap2img, noisy_inx[np.arange(500) // 5])
    inputs, fixture = _nc_noise()
    n = int(inputs["n_images"])
    src_n = make_synthetic_precomp(tmp_path / f"clean{n}", n_train=n, n_dev=5, n_test=5, regions=2, dim=4)
    tag = _tag(inputs["rates"][0])
    np.save(tmp_path / "noise_inx.npy", fixture[f"rcl_noisy_inx_{tag}"])
    out2 = tmp_path / "fromfile"
    argv = ["data", "noise", str(src_n), "--out", str(out2), "--from-file", str(tmp_path / "noise_inx.npy")]
    assert main(argv) == 0
    np.testing.assert_array_equal(load_precomp_split(out2, "train").cap2img, fixture[f"rcl_t2i_{tag}"])
    assert json.loads((out2 / "manifest.json").read_text())["noise"]["level"] == "image"


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--rate", "1.0"], "--rate must lie in [0, 1), got 1.0"),
        (["--rate", "-0.1"], "--rate must lie in [0, 1)"),
        (["--rate", "nan"], "--rate must lie in [0, 1)"),
        (["--rate", "0.2", "--level", "word"], "--level 'word' is not a noise level"),
        (["--rate", "0.2", "--seed", "-1"], "--seed must lie in 0.."),
        ([], "--rate is required"),
    ],
)
def test_noise_6_bad_options_one_line_nothing_written(src, tmp_path, capsys, extra, needle):
    """A rate outside [0, 1), an unknown level, a bad seed: one line naming it, exit 2, nothing written."""
    out = tmp_path / "noisy"
    line = _err_line(capsys, ["data", "noise", str(src), "--out", str(out), *extra])
    assert needle in line, line
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["clean"]


def test_noise_7_noise_file_of_another_size_refused(src, tmp_path, capsys):
    """A noise file that fits neither the captions nor the images (or leaves an image captionless, or is not an
    integer array): one line naming the file, exit 2, nothing written."""
    out = tmp_path / "noisy"
    cases = {
        "short.npy": (np.arange(99), "99 entries, but the train split has 500 captions"),
        "float.npy": (np.zeros(100), "expected a 1-D integer array"),
        "orphan.npy": (np.zeros(100, dtype=np.int64), "leaves image 1 without a caption"),
        "outside.npy": (np.arange(500) // 5 + 1, "image indices must lie in 0..99"),
    }
    for name, (array, needle) in cases.items():
        np.save(tmp_path / name, array)
        argv = ["data", "noise", str(src), "--out", str(out), "--from-file", str(tmp_path / name)]
        line = _err_line(capsys, argv)
        assert name in line and needle in line, line
        assert not out.exists()
    np.save(tmp_path / "caption_as_image.npy", np.arange(100))
    argv = ["data", "noise", str(src), "--out", str(out), "--level", "caption"]
    line = _err_line(capsys, [*argv, "--from-file", str(tmp_path / "caption_as_image.npy")])
    assert "100 entries" in line and not out.exists()
    (tmp_path / "pickle.npy").write_bytes(b"not an npy file at all")
    line = _err_line(capsys, [*argv[:-2], "--from-file", str(tmp_path / "pickle.npy")])
    assert "pickle.npy" in line and "not a .npy" in line and not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_noise_8_out_and_source_refusals(src, tmp_path, capsys):
    """A non-empty --out, an --out inside the source, or a source that already carries noise: refused, one line,
    nothing changed."""
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("x")
    line = _err_line(capsys, ["data", "noise", str(src), "--out", str(full), "--rate", "0.2"])
    assert str(full) in line and sorted(p.name for p in full.iterdir()) == ["keep.txt"]
    line = _err_line(capsys, ["data", "noise", str(src), "--out", str(src / "inner"), "--rate", "0.2"])
    assert "inside the source" in line and not (src / "inner").exists()
    noisy = tmp_path / "noisy"
    assert main(["data", "noise", str(src), "--out", str(noisy), "--rate", "0.2"]) == 0
    line = _err_line(capsys, ["data", "noise", str(noisy), "--out", str(tmp_path / "twice"), "--rate", "0.2"])
    assert "already carries noise" in line and not (tmp_path / "twice").exists()


def test_noise_9_check_flags_a_ground_truth_that_disagrees(src, tmp_path, capsys):
    """`vse data check` reports a clean-label file that no longer fits the split or the record."""
    out = tmp_path / "noisy"
    assert main(["data", "noise", str(src), "--out", str(out), "--rate", "0.2"]) == 0
    np.save(out / "train_noise_clean.npy", np.ones(499, dtype=bool))
    capsys.readouterr()
    assert main(["data", "check", str(out)]) == 1
    report = capsys.readouterr().out
    assert "499 entries for 500 train captions" in report and "FAILED" in report


def test_noise_10_variable_captions_and_per_caption_ids(tmp_path):
    """A source with its own train_cap2img.txt and one id per caption: each image keeps its caption count, the
    ids come out one per image (per-caption ids would disagree under the new pairing), and the copy loads."""
    src = make_synthetic_precomp(
        tmp_path / "v",
        n_train=40,
        n_dev=5,
        n_test=5,
        regions=2,
        dim=4,
        ids_per_caption=True,
        variable_captions=True,
    )
    out = tmp_path / "noisy"
    assert main(["data", "noise", str(src), "--out", str(out), "--rate", "0.3", "--seed", "1"]) == 0
    a, b = load_precomp_split(src, "train"), load_precomp_split(out, "train")
    np.testing.assert_array_equal(np.bincount(a.cap2img), np.bincount(b.cap2img))
    assert int((a.cap2img != b.cap2img).sum()) <= int(0.3 * a.n_captions)
    assert b.image_ids == a.image_ids and len((out / "train_ids.txt").read_text().split()) == a.n_images
    assert not (out / "train_ids.txt").is_symlink() and (out / "dev_ids.txt").is_symlink()
