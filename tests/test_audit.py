"""`vse data audit`: every pair of a split scored by a run, ranked, scored against the
dataset's recorded noise.

The end-to-end check builds a small folder dataset of drawn pictures (`vse data folder`, EfficientNet-Lite0 at
64 px as tests/test_own_data.py does), trains the `bow` floor on it, makes a 40 % caption-level noisy copy
(`vse data noise`) and audits that copy; AUC and AP are compared with scikit-learn's on the written CSV and
the recorded ground truth. The rank formulas are compared with scikit-learn on tied and untied scores.
"""

from __future__ import annotations

import csv
import hashlib
import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from vsekit.cli import main
from vsekit.data.precomp import load_precomp_split
from vsekit.evaluation.audit import auc_score, average_precision, loss_probability
from vsekit.losses.noisy_split import fit_gmm, kmeans_labels
from vsekit.runs import BEST_SPLIT_STATE_FILE, SPLIT_STATE_FILE
from vsekit_lab.datasets.synthetic import make_synthetic_precomp

metrics = pytest.importorskip("sklearn.metrics")
pytest.importorskip("efficientnet_lite_pytorch")
from test_own_data import FAST, make_pictures, write_folder  # noqa: E402


def _err_line(capsys, argv: list[str]) -> str:
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    lines = [x for x in err.splitlines() if x.startswith("vse ")]
    assert len(lines) == 1 and lines[0].startswith("vse data: error: "), err
    assert "Traceback" not in err and "internal error" not in err
    return lines[0]


def _train(data: Path, run: Path, epochs: int) -> None:
    argv = ["train", "--recipe", "bow", "--data", str(data), "--out", str(run), "--epochs", str(epochs)]
    assert main([*argv, "--batch-size", "32", "--device", "cpu", "--no-progress"]) == 0


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    """A folder dataset of 100 drawn pictures, a bow run trained on it, its 40 % noisy copy."""
    base = tmp_path_factory.mktemp("audit")
    folder = write_folder(base / "pics", make_pictures(100))
    clean = base / "clean"
    assert (
        main(["data", "folder", str(folder), "--out", str(clean), "--dev", "10", "--test", "10", *FAST]) == 0
    )
    run = base / "run"
    _train(clean, run, 4)
    noisy = base / "noisy"
    assert main(["data", "noise", str(clean), "--out", str(noisy), "--rate", "0.4", "--seed", "3"]) == 0
    return {"clean": clean, "run": run, "noisy": noisy, "base": base}


def _read_csv(path: Path) -> list[dict]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def test_audit_1_auc_and_ap_match_sklearn_with_and_without_ties():
    """The hand-written rank formulas against sklearn.metrics, on continuous scores and on heavily tied ones."""
    rng = np.random.default_rng(0)
    for scores in (rng.random(500), np.round(rng.random(500), 1), rng.integers(0, 3, 500).astype(float)):
        labels = rng.random(500) < 0.3
        assert auc_score(labels, scores) == pytest.approx(metrics.roc_auc_score(labels, scores), abs=1e-12)
        assert average_precision(labels, scores) == pytest.approx(
            metrics.average_precision_score(labels, scores), abs=1e-12
        )
    assert auc_score([True, True, False], [0.9, 0.8, 0.1]) == 1.0  # by hand: every positive above
    assert auc_score([True, False], [0.5, 0.5]) == 0.5  # a tie counts half
    assert average_precision([False, True, True], [0.9, 0.8, 0.1]) == pytest.approx((1 / 2 + 2 / 3) / 2)


def test_audit_2_per_pair_loss_follows_the_ncr_split_pass():
    """The probability of a run without a split: the README's per-sample loss (batches of a seeded order,
    row mean of cost_s + column mean of cost_im) written here in numpy, min-max, the GMM's low-loss posterior."""
    rng = np.random.default_rng(1)
    n_img, k, dim, margin, batch = 30, 3, 8, 0.2, 16
    img = torch.nn.functional.normalize(torch.randn(n_img, dim, dtype=torch.float64), dim=1).float()
    cap2img = np.repeat(np.arange(n_img), k)
    rng.shuffle(cap2img[:20])  # some captions sit with other images
    cap = torch.nn.functional.normalize(
        img[torch.as_tensor(np.repeat(np.arange(n_img), k))] + 0.3 * torch.randn(n_img * k, dim), dim=1
    )
    seed = 5
    order = np.random.RandomState(seed).permutation(len(cap2img))
    want = np.zeros(len(cap2img), dtype=np.float64)
    im, ca = img.double().numpy(), cap.double().numpy()
    for start in range(0, len(order), batch):
        ids = order[start : start + batch]
        s = im[cap2img[ids]] @ ca[ids].T
        d = np.diag(s)
        cost_s = np.maximum(0, margin + s - d[:, None])
        cost_im = np.maximum(0, margin + s - d[None, :])
        np.fill_diagonal(cost_s, 0)
        np.fill_diagonal(cost_im, 0)
        want[ids] = cost_s.mean(1) + cost_im.mean(0)
    norm = (want - want.min()) / (want.max() - want.min())
    expected = fit_gmm(norm, kmeans_labels(norm, seed)).clean_prob

    def cosine(a, b):
        return a @ b.T

    got = loss_probability(img, cap, cosine, cap2img, seed, batch_size=batch, margin=margin)
    np.testing.assert_allclose(got, expected, atol=1e-4)
    clean = cap2img == np.repeat(np.arange(n_img), k)
    assert auc_score(~clean, 1 - got) > 0.8  # the moved captions carry the high losses


def test_audit_3_folder_dataset_noisy_copy_ranked_csv_json_and_montage(built, tmp_path, capsys):
    """The audit of a user's folder dataset: every train pair once, least likely first, AUC / AP of the
    recorded noise equal to sklearn's on the CSV, well above chance; the montage is a picture."""
    out, js, png = tmp_path / "audit.csv", tmp_path / "audit.json", tmp_path / "least.png"
    argv = ["data", "audit", str(built["run"]), "--data", str(built["noisy"]), "--out", str(out)]
    assert main([*argv, "--json-out", str(js), "--png", str(png), "--n", "6", "--device", "cpu"]) == 0
    rows = _read_csv(out)
    split = load_precomp_split(built["noisy"], "train")
    assert sorted(int(r["pair"]) for r in rows) == list(range(split.n_captions))
    prob = np.array([float(r["probability"]) for r in rows])
    assert (np.diff(prob) >= 0).all()  # least likely first
    for r in rows[:5]:
        c = int(r["pair"])
        assert r["caption"] == split.captions[c]
        assert r["picture"] == split.image_paths[split.cap2img[c]]
    clean = np.load(built["noisy"] / "train_noise_clean.npy")
    noisy = np.array([not clean[int(r["pair"])] for r in rows])
    report = json.loads(js.read_text())
    assert report["pairs"] == split.n_captions and report["mismatched"] == int((~clean).sum())
    assert report["auc"] == pytest.approx(metrics.roc_auc_score(noisy, 1 - prob), abs=1e-9)
    assert report["average_precision"] == pytest.approx(
        metrics.average_precision_score(noisy, 1 - prob), abs=1e-9
    )
    assert report["auc"] > 0.7, report
    from PIL import Image

    with Image.open(png) as im:
        assert im.format == "PNG" and im.width > 64


def test_audit_4_without_recorded_noise_no_auc_and_without_pictures_it_says_so(built, tmp_path, capsys):
    """The clean dataset records no noise: counts only. A precomp set with no pictures: no montage, said."""
    js = tmp_path / "a.json"
    argv = [
        "data",
        "audit",
        str(built["run"]),
        "--data",
        str(built["clean"]),
        "--out",
        str(tmp_path / "a.csv"),
    ]
    assert main([*argv, "--json-out", str(js), "--device", "cpu", "--no-progress"]) == 0
    report = json.loads(js.read_text())
    assert "auc" not in report and report["pairs"] > 0
    syn = make_synthetic_precomp(tmp_path / "syn", n_train=20, n_dev=5, n_test=5, regions=3, dim=8)
    run = tmp_path / "synrun"
    _train(syn, run, 1)
    capsys.readouterr()
    png = tmp_path / "m.png"
    argv = [
        "data",
        "audit",
        str(run),
        "--data",
        str(syn),
        "--out",
        str(tmp_path / "s.csv"),
        "--png",
        str(png),
    ]
    assert main([*argv, "--device", "cpu"]) == 0
    assert "no montage" in capsys.readouterr().out and not png.exists()


def test_audit_5_a_run_that_does_not_match_the_dataset_one_line_nothing_written(built, tmp_path, capsys):
    """Feature width, vocabulary, caption count of the run's split, a missing split, an oversized split file:
    one line naming it, exit 2, nothing written."""
    out = tmp_path / "x.csv"
    base = ["--out", str(out), "--json-out", str(tmp_path / "x.json"), "--device", "cpu"]
    other = make_synthetic_precomp(tmp_path / "w", n_train=20, n_dev=5, n_test=5, regions=3, dim=8)
    line = _err_line(capsys, ["data", "audit", str(built["run"]), "--data", str(other), *base])
    assert "8" in line and "1280" in line  # the widths named
    # same width, other words: a dataset whose captions the run's vocabulary does not know
    words = tmp_path / "words"
    words.mkdir()
    for f in built["noisy"].iterdir():
        if f.name != "train_caps.txt" and f.name.startswith("train_"):
            (words / f.name).symlink_to(f.resolve())
    n = len(load_precomp_split(built["noisy"], "train").captions)
    (words / "train_caps.txt").write_text("".join(f"zebra{i} quokka{i}\n" for i in range(n)))
    line = _err_line(capsys, ["data", "audit", str(built["run"]), "--data", str(words), *base])
    assert "vocabulary" in line and str(words) in line
    line = _err_line(
        capsys, ["data", "audit", str(built["run"]), "--data", str(built["noisy"]), "--split", "val", *base]
    )
    assert "val" in line
    # an NCR run's split of another dataset (another number of pairs)
    ncr = shutil.copytree(built["run"], tmp_path / "ncr")
    np.savez(ncr / SPLIT_STATE_FILE, prob_A=np.full(7, 0.5), prob_B=np.full(7, 0.5))
    line = _err_line(capsys, ["data", "audit", str(ncr), "--data", str(built["noisy"]), *base])
    assert SPLIT_STATE_FILE in line and "7" in line
    # a split file that decompresses far beyond one float per caption (a zip bomb) is refused unread
    np.savez_compressed(ncr / SPLIT_STATE_FILE, prob=np.zeros(2_000_000))
    line = _err_line(capsys, ["data", "audit", str(ncr), "--data", str(built["noisy"]), *base])
    assert SPLIT_STATE_FILE in line and "bytes" in line
    assert not out.exists() and not (tmp_path / "x.json").exists()


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _audit_json(run: Path, data: Path, tmp_path: Path, *extra: str) -> tuple[list[dict], dict]:
    out, js = tmp_path / "n.csv", tmp_path / "n.json"
    argv = ["data", "audit", str(run), "--data", str(data), "--out", str(out), "--json-out", str(js)]
    assert main([*argv, *extra, "--device", "cpu", "--no-progress"]) == 0
    return _read_csv(out), json.loads(js.read_text())


def test_audit_6_the_runs_own_ncr_split_is_used_where_it_has_one(built, tmp_path):
    """A run carrying an NCR split made from its best weights (the split file records their sha256): its
    probabilities (mean of both networks) are the ranking, as saved; a split of the best weights beside a
    later last split is the one read."""
    ncr = shutil.copytree(built["run"], tmp_path / "ncr")
    n = load_precomp_split(built["noisy"], "train").n_captions
    a, b = np.linspace(0, 1, n), np.linspace(1, 0, n) ** 2
    best = np.array(_sha256(ncr / "best.safetensors"))
    np.savez(ncr / SPLIT_STATE_FILE, prob_A=a, prob_B=b, weights_sha256=best)
    rows, js = _audit_json(ncr, built["noisy"], tmp_path)
    want = (a + b) / 2
    assert [int(r["pair"]) for r in rows] == np.argsort(want, kind="stable").tolist()
    np.testing.assert_allclose([float(r["probability"]) for r in rows], np.sort(want), rtol=0, atol=1e-15)
    assert js["source"] == "the run's own split"
    # the last split made from other weights, the best checkpoint's split beside it: the best one is read
    np.savez(ncr / SPLIT_STATE_FILE, prob_A=b, prob_B=b, weights_sha256=np.array("0" * 64))
    np.savez(ncr / BEST_SPLIT_STATE_FILE, prob_A=a, prob_B=b, weights_sha256=best)
    rows, js = _audit_json(ncr, built["noisy"], tmp_path)
    assert js["source"] == "the run's own split"
    np.testing.assert_allclose([float(r["probability"]) for r in rows], np.sort(want), rtol=0, atol=1e-15)


def test_audit_6b_a_split_made_from_other_weights_is_not_read(built, tmp_path, caplog):
    """A split file recording other weights than the audited checkpoint's, or none (an older run), is not that
    checkpoint's split: the audit scores the checkpoint's own per-pair losses, as for a run without one, and
    logs why. The best checkpoint's split is not the last checkpoint's."""
    plain, _ = _audit_json(built["run"], built["noisy"], tmp_path)
    ncr = shutil.copytree(built["run"], tmp_path / "ncr")
    n = load_precomp_split(built["noisy"], "train").n_captions
    a = np.linspace(0, 1, n)
    for extra in ({"weights_sha256": np.array("0" * 64)}, {}):
        np.savez(ncr / SPLIT_STATE_FILE, prob_A=a, prob_B=a, **extra)
        with caplog.at_level(logging.INFO, logger="vsekit.evaluation.audit"):
            rows, js = _audit_json(ncr, built["noisy"], tmp_path)
        assert js["source"] == "per-pair loss"
        assert rows == plain
        assert SPLIT_STATE_FILE in caplog.text and "other weights" in caplog.text
        caplog.clear()
    (ncr / SPLIT_STATE_FILE).unlink()
    best = np.array(_sha256(ncr / "best.safetensors"))
    np.savez(ncr / BEST_SPLIT_STATE_FILE, prob_A=a, prob_B=a, weights_sha256=best)
    assert _audit_json(ncr, built["noisy"], tmp_path)[1]["source"] == "the run's own split"
    last = _audit_json(ncr, built["noisy"], tmp_path, "--checkpoint", "last")[1]
    assert last["source"] == "per-pair loss"


def test_audit_7_csv_cells_that_a_spreadsheet_would_run_are_quoted():
    """A caption from elsewhere starting with `=`, `+`, `-`, `@`, tab or CR is written with a leading `'`
    (a spreadsheet would otherwise run it as a formula); every other caption is written as it is."""
    from vsekit.commands.data import spreadsheet_safe

    assert spreadsheet_safe('=HYPERLINK("http://x")') == '\'=HYPERLINK("http://x")'
    assert [spreadsheet_safe(c) for c in ("+1", "-2", "@SUM(A1)", "\tx", "\rx")] == [
        "'+1",
        "'-2",
        "'@SUM(A1)",
        "'\tx",
        "'\rx",
    ]
    assert [spreadsheet_safe(c) for c in ("a dog = a cat", "", "3 dogs")] == ["a dog = a cat", "", "3 dogs"]


def test_audit_8_the_caption_order_is_drawn_from_the_runs_own_seed(built, tmp_path):
    """A pair's loss depends on the negatives that shared its batch, so the per-pair-loss audit of a run with
    seed 7 visits the captions in the order RandomState(7) draws, from the CLI and from `audit_split` called
    without a seed alike (as the experiment scripts call it); seed 0's order gives other probabilities."""
    from vsekit.evaluation import encode_captions, encode_images, image_source_for
    from vsekit.evaluation.audit import audit_split
    from vsekit.models.tokenizers import text_processor_for
    from vsekit.runs import load_run

    run = tmp_path / "seed7"
    argv = ["train", "--recipe", "bow", "--data", str(built["clean"]), "--out", str(run), "--epochs", "2"]
    assert main([*argv, "--seed", "7", "--batch-size", "32", "--device", "cpu", "--no-progress"]) == 0
    model, _ = load_run(run, "best", "cpu")
    split = load_precomp_split(built["noisy"], "train")
    with torch.no_grad():
        img = encode_images(model, image_source_for(model, split), 256, "cpu", False)
        cap = encode_captions(model, split.captions, text_processor_for(model), 256, "cpu", False)
    cap2img = np.asarray(split.cap2img, dtype=np.int64)
    by_seed = {s: loss_probability(img, cap, model.sim, cap2img, s) for s in (7, 0)}
    assert np.abs(by_seed[7] - by_seed[0]).max() > 1e-6  # the order matters: the check below can fail
    rows, js = _audit_json(run, built["noisy"], tmp_path)
    got = np.zeros(len(rows))
    for r in rows:
        got[int(r["pair"])] = float(r["probability"])
    np.testing.assert_allclose(got, by_seed[7], rtol=0, atol=1e-12)
    lib = audit_split(model, run, built["noisy"], progress=False)
    np.testing.assert_allclose(lib.prob, by_seed[7], rtol=0, atol=1e-12)
