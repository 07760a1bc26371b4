"""The GPO synthetic experiment: ground-truth patterns, the four coefficient generators, the RMSE, training
that actually learns, and `vse experiment gpo-synthetic`.

Float comparisons: weights and coefficients are float32 softmax / normalised rows of <= 120 entries, so sums
are 1 within n eps (the rounding bound of a float32 sum of n terms <= 1) and RMSEs match float64 formulas at
rel 1e-5; the worker-process test compares runs of identical ops on one thread each, exactly.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from vsekit.cli import main
from vsekit.pooling.gpo import GPO
from vsekit_lab.experiments.gpo_synthetic import (
    DESIGNS,
    GROUPS,
    PAPER,
    coefficient_rmse,
    format_table,
    make_generator,
    ranking_summary,
    train_generator,
    true_weights,
)

EPS32 = torch.finfo(torch.float32).eps


def test_true_weights_of_each_pattern():
    assert torch.allclose(true_weights("A", 8), torch.full((8,), 1 / 8))
    m10 = true_weights("M-10", 20)
    assert torch.allclose(m10[:10], torch.full((10,), 0.1)) and (m10[10:] == 0).all()
    assert torch.allclose(true_weights("M-1", 30)[0], torch.tensor(1.0))
    t50 = true_weights("T-50%", 11)  # ceil(5.5) = 6 largest
    assert torch.allclose(t50[:6], torch.full((6,), 1 / 6)) and (t50[6:] == 0).all()
    lin = true_weights("L", 5)  # proportional to 4, 3, 2, 1, 0
    assert torch.allclose(lin, torch.tensor([4, 3, 2, 1, 0]) / 10.0)
    for p in ("A", "M-1", "M-10", "T-50%", "L"):
        for n in (10, 57, 120):
            assert float(true_weights(p, n).sum()) == pytest.approx(1.0, abs=n * EPS32)
    with pytest.raises(ValueError, match="unknown pattern"):
        true_weights("Q", 10)


@pytest.mark.parametrize("design", DESIGNS)
def test_generators_give_normalised_coefficients_for_any_size(design):
    torch.manual_seed(0)
    gen = make_generator(design)
    sizes = torch.tensor([10, 33, 100, 120])
    theta = gen(sizes, 120)
    assert theta.shape == (4, 120)
    torch.testing.assert_close(theta.sum(1), torch.ones(4))
    for i, n in enumerate(sizes.tolist()):
        assert (theta[i, n:] == 0).all() and (theta[i, :n] > 0).all()


def test_cos_sin_bigru_is_vsekit_gpo():
    torch.manual_seed(0)
    gen = make_generator("Cos/Sin+BiGRU")
    assert isinstance(gen.gpo, GPO)
    sizes = torch.tensor([12, 40])
    torch.testing.assert_close(gen(sizes, 40), gen.gpo.weights_for_lengths(sizes, 40))


def test_rmse_is_zero_for_the_truth_and_matches_a_hand_computation():
    class Fixed(torch.nn.Module):
        def __init__(self, pattern):
            super().__init__()
            self.pattern = pattern

        def forward(self, sizes, max_len):
            rows = [
                torch.nn.functional.pad(true_weights(self.pattern, int(n)), (0, max_len - int(n)))
                for n in sizes
            ]
            return torch.stack(rows)

    assert coefficient_rmse(Fixed("M-10"), "M-10") == {"seen": 0.0, "smaller": 0.0, "larger": 0.0}
    # average weights judged against max pooling: per size N, mse = ((1 - 1/N)^2 + (N - 1) / N^2) / N
    got = coefficient_rmse(Fixed("A"), "M-1")
    for group, (lo, hi) in GROUPS.items():
        mse = [((1 - 1 / n) ** 2 + (n - 1) / n**2) / n for n in range(lo, hi + 1)]
        assert got[group] == pytest.approx(math.sqrt(sum(mse) / len(mse)), rel=1e-5)


def test_interp_at_initialisation_is_exact_average_pooling():
    assert coefficient_rmse(make_generator("Index+Interp."), "A") == {
        "seen": 0.0,
        "smaller": 0.0,
        "larger": 0.0,
    }


@pytest.fixture
def one_thread():
    """Tiny recurrent nets run fastest (and least disturbed by other load) on one thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("design", DESIGNS)
def test_training_learns_the_pattern(design, one_thread):
    """Trained on small sets (sizes 4-12, to stay fast), the coefficients of those sizes get much closer."""

    def err(gen):
        with torch.no_grad():
            theta = gen(torch.arange(4, 13), 12)
        return float(
            sum(((theta[i, :n] - true_weights("M-1", n)) ** 2).sum() for i, n in enumerate(range(4, 13)))
        )

    torch.manual_seed(0)
    before = err(make_generator(design))
    after = err(train_generator(design, "M-1", steps=30, lr=3e-2, sets_per_size=4, sizes=(4, 12)))
    assert after < 0.3 * before


def test_table_and_summary_put_ours_next_to_the_paper():
    res = {
        d: {p: {"seen": 0.01 * (i + 1), "smaller": 0.03, "larger": 0.02} for p in ("A", "M-1")}
        for i, d in enumerate(DESIGNS)
    }
    result = {"results": res}
    table = format_table(result)
    assert table.count("| paper |") == 4 and table.count("| vsekit |") == 4
    assert f"| {_f(PAPER['Index+Interp.']['M-1'][0])} |" in table
    summary = ranking_summary(result)
    assert summary["best_overall"] == "Index+Interp."  # the smallest numbers above
    assert all(summary["smaller_harder_than_larger"].values())


def _f(x: float) -> str:
    return f"{x:.3f}".lstrip("0")


def test_cli_runs_and_writes_json(tmp_path, capsys):
    out = tmp_path / "gpo.json"
    args = [
        "experiment",
        "gpo-synthetic",
        "--steps",
        "2",
        "--designs",
        "Index+Interp.",
        "Cos/Sin+MLP",
        "--patterns",
        "A",
        "L",
        "--json",
        str(out),
        "--quiet",
    ]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "| Cos/Sin+MLP | paper |" in printed and "best overall" in printed
    saved = json.loads(out.read_text())
    assert set(saved["results"]) == {"Index+Interp.", "Cos/Sin+MLP"}
    assert set(saved["results"]["Cos/Sin+MLP"]["L"]) == {"seen", "smaller", "larger"}
    assert main(["experiment", "gpo-synthetic", "--designs", "Nope"]) == 2
    assert main(["experiment", "gpo-synthetic", "--patterns", "Q"]) == 2


@pytest.mark.slow
def test_worker_processes_give_the_same_numbers(tmp_path, one_thread):
    # Exact equality holds by construction only at one thread in both runs: each worker runs its training on one
    # thread, so the in-process run must too (at two threads, GEMMs and reductions may split and round otherwise).
    base = [
        "experiment",
        "gpo-synthetic",
        "--steps",
        "2",
        "--designs",
        "Index+Interp.",
        "Cos/Sin+MLP",
        "--patterns",
        "A",
        "L",
        "--quiet",
    ]
    assert main([*base, "--json", str(tmp_path / "one.json")]) == 0
    assert main([*base, "--json", str(tmp_path / "two.json"), "--jobs", "2"]) == 0
    one, two = (json.loads((tmp_path / f).read_text())["results"] for f in ("one.json", "two.json"))
    assert one == two
