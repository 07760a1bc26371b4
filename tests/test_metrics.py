# Float comparisons: recalls / medr / meanr are float64 arithmetic on integer ranks (100 x count / n, means),
# which are counts of comparisons of the given scores: exact where the value is a short binary fraction,
# pytest.approx (rel 1e-6) where it is a mean.
import numpy as np
import pytest

from vsekit.metrics import (
    MetricsInputError,
    cap2img_for_k,
    evaluate_sims,
    retrieval_metrics,
    retrieval_metrics_fold5,
)


def _reference_loop(sims, k=5):
    """The SCAN/VSE∞ i2t/t2i loops, for comparison (argsort-based; no ties in the test data)."""
    n = sims.shape[0]
    r_i2t = np.array(
        [
            min(np.where(np.argsort(sims[i])[::-1] == j)[0][0] for j in range(k * i, k * i + k))
            for i in range(n)
        ]
    )
    r_t2i = np.array([np.where(np.argsort(sims[:, c])[::-1] == c // k)[0][0] for c in range(k * n)])
    return r_i2t, r_t2i


def test_perfect_matrix():
    n = 10
    sims = np.full((n, 5 * n), -1.0)
    for i in range(n):
        sims[i, 5 * i : 5 * i + 5] = 1.0
    m = retrieval_metrics(sims, cap2img_for_k(n, 5 * n, 5))
    assert m["i2t_r1"] == m["t2i_r1"] == 100.0 and m["rsum"] == 600.0
    assert m["i2t_medr"] == m["t2i_medr"] == 1.0 and m["i2t_meanr"] == m["t2i_meanr"] == 1.0


def test_hand_built_ranks():
    # 2 images, 1 caption each. caption 0: image 1 scores higher -> t2i rank 1. caption 1: correct.
    sims = np.array([[0.1, 0.0], [0.5, 0.9]])
    m = retrieval_metrics(sims, np.array([0, 1]))
    assert m["t2i_r1"] == 50.0 and m["t2i_meanr"] == 1.5 and m["t2i_medr"] == 1.0
    # image 0's caption 0 (0.1) is below caption 1 (0.0)? no: 0.1 > 0.0 -> rank 0; image 1: rank 0
    assert m["i2t_r1"] == 100.0
    assert m["rsum"] == pytest.approx(100 + 100 + 100 + 50 + 100 + 100)


def test_matches_reference_loops_on_random_data():
    rng = np.random.default_rng(0)
    n = 40
    sims = rng.normal(size=(n, 5 * n))
    r_i2t, r_t2i = _reference_loop(sims)
    m = retrieval_metrics(sims, cap2img_for_k(n, 5 * n, 5))
    for k in (1, 5, 10):
        assert m[f"i2t_r{k}"] == pytest.approx(100 * np.mean(r_i2t < k))
        assert m[f"t2i_r{k}"] == pytest.approx(100 * np.mean(r_t2i < k))
    assert m["i2t_medr"] == np.floor(np.median(r_i2t)) + 1 and m["t2i_meanr"] == pytest.approx(
        r_t2i.mean() + 1
    )


def test_fold5_rsum_is_mean_of_fold_rsums():
    rng = np.random.default_rng(1)
    n = 50
    sims = rng.normal(size=(n, 5 * n))
    sims[np.arange(n), 5 * np.arange(n)] += 2.0
    m = retrieval_metrics_fold5(sims, cap2img_for_k(n, 5 * n, 5))
    assert len(m["folds"]) == 5
    assert m["rsum"] == pytest.approx(np.mean([f["rsum"] for f in m["folds"]]))
    first = retrieval_metrics(sims[:10, :50], np.arange(50) // 5)
    assert m["folds"][0] == first


def test_variable_captions_per_image():
    sims = np.array([[0.9, 0.8, 0.1], [0.2, 0.3, 0.7]])
    m = evaluate_sims(sims, np.array([0, 0, 1]))
    assert m["i2t_r1"] == 100 and m["t2i_r1"] == 100


def test_ties_rank_pessimistically():
    sims = np.zeros((3, 3))
    m = retrieval_metrics(sims, np.arange(3))
    assert m["i2t_r1"] == 0.0 and m["t2i_r1"] == 0.0  # equal negatives rank above the positive
    assert m["i2t_r5"] == 100.0 and m["i2t_meanr"] == 3.0


@pytest.mark.parametrize(
    "sims,c2i,needle",
    [
        (np.zeros((2, 3, 1)), np.zeros(3, int), "2-D"),
        (np.zeros((2, 4)), np.zeros(3, int), "4 caption columns"),
        (np.zeros((2, 2)), np.array([0, 5]), "outside"),
        (np.array([[np.nan, 0], [0, 0]]), np.array([0, 1]), "NaN"),
        (np.zeros((3, 2)), np.array([0, 1]), "no caption"),
    ],
)
def test_bad_inputs(sims, c2i, needle):
    with pytest.raises(MetricsInputError, match=needle):
        evaluate_sims(sims, c2i)


def test_metrics_read_no_dataset_files():
    """Metrics take arrays: no statement of vsekit/metrics (lazy imports inside functions included) imports
    vsekit.data, the formats layer that reads dataset files; a similarity matrix or a caption->image map file is
    read by `vsekit.data.sims` for the command (`vse eval-sims`)."""
    import ast
    from pathlib import Path

    metrics = Path(__file__).resolve().parents[1] / "src" / "vsekit" / "metrics"
    found = []
    for path in sorted(metrics.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            found += [
                f"{path.name}:{node.lineno}"
                for n in names
                if n == "vsekit.data" or n.startswith("vsekit.data.")
            ]
    assert found == []


def test_similarity_files_are_read_by_the_data_layer(tmp_path):
    """`vsekit.data.sims`: an ensemble is the mean of its matrices; a caption->image map of another length, an
    empty or a 3-D matrix is refused naming the file."""
    from vsekit.data.precomp import DataFormatError
    from vsekit.data.sims import load_sims, read_cap2img

    a, b = np.arange(6, dtype=np.float32).reshape(2, 3), np.ones((2, 3), np.float32)
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    np.testing.assert_array_equal(load_sims([str(tmp_path / "a.npy")]), a)
    np.testing.assert_allclose(load_sims([str(tmp_path / "a.npy"), str(tmp_path / "b.npy")]), (a + b) / 2)
    np.save(tmp_path / "cube.npy", np.zeros((2, 2, 2), np.float32))
    with pytest.raises(DataFormatError, match=r"cube\.npy: expected a 2-D"):
        load_sims([str(tmp_path / "cube.npy")])
    (tmp_path / "c2i.txt").write_text("0\n0\n1\n")
    np.testing.assert_array_equal(read_cap2img(tmp_path / "c2i.txt", 3), [0, 0, 1])
    with pytest.raises(
        DataFormatError, match=r"c2i\.txt: 3 lines but the similarity matrix has 4 caption columns"
    ):
        read_cap2img(tmp_path / "c2i.txt", 4)
