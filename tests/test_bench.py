"""`vse bench`: every benchmark runs tiny and returns sane numbers; rows carry machine, date and command;
`--append` adds rows under the benchmark's section without touching other sections.

Float comparisons: timings come from StepClock's exact durations, so medians / ratios / rates are float64
arithmetic on them (pytest.approx's default rel 1e-6); recalls and rank metrics are counts (exact); FAISS top-k
id sets are compared exactly only behind `assert_topk_well_separated` (no near-tie a float32 search could flip).
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest

from conftest import StepClock, assert_topk_well_separated, brute_force_topk, recall_vs, spy_search_ids
from vsekit.cli import main
from vsekit.errors import VseInputError
from vsekit.metrics import cap2img_for_k, evaluate_sims
from vsekit_lab.bench.eval import bench_eval, planted_sims, reference_loop_metrics
from vsekit_lab.bench.train_step import bench_train_step, synthetic_batch
from vsekit_lab.commands.bench import SECTIONS, append_markdown

TINY = dict(regions=5, img_dim=12, embed_dim=16, vocab=60, min_tokens=3, max_tokens=7, steps=1, warmup=1)


def test_synthetic_batch_has_the_requested_shapes():
    b = synthetic_batch(6, 36, 20, 100, 8, 25, seed=1)
    assert b["images"].shape == (6, 36, 20) and (b["image_lengths"] == 36).all()
    assert b["tokens"].shape == (6, 25) and int(b["token_lengths"].max()) == 25
    assert int(b["token_lengths"].min()) >= 8 and int(b["tokens"].max()) < 100
    for i, n in enumerate(b["token_lengths"].tolist()):  # padding after each caption's length, none before
        assert (b["tokens"][i, n:] == 0).all() and (b["tokens"][i, :n] > 0).all()
    with pytest.raises(ValueError, match="at least 2"):
        synthetic_batch(1, 36, 20, 100, 8, 25)


def test_train_step_bench_times_real_steps():
    row = bench_train_step("vse_infty", batch=6, overrides=["model.text.word_dim=8"], **TINY)
    assert row["ms_median"] > 0 and row["ms_min"] <= row["ms_median"]
    assert row["peak_gib"] > 0 and row["params"] > 0 and row["amp"] == "none"
    # the arithmetic, on steps of known length: one untimed 9 s warm-up, then 0.1 s, 0.5 s and 0.2 s
    import vsekit_lab.bench.train_step as module

    with pytest.MonkeyPatch.context() as mp:
        clock = StepClock([9.0, 0.1, 0.5, 0.2]).install(mp, module)
        row = bench_train_step(
            "vse_infty", batch=6, overrides=["model.text.word_dim=8"], **{**TINY, "steps": 3}
        )
    assert clock.calls == 8  # one start/stop pair per step, warm-up included
    assert row["ms_median"] == pytest.approx(200.0) and row["ms_min"] == pytest.approx(100.0)
    assert row["ms_std"] == pytest.approx(208.1666, rel=1e-5)  # sample stdev of 100, 500, 200 ms
    assert row["samples_per_s"] == pytest.approx(30.0)  # 6 samples per 0.2 s
    amp = bench_train_step(
        "vse_infty", batch=6, overrides=["model.text.word_dim=8", "train.amp=bf16"], **TINY
    )
    assert amp["amp"] == "bf16"


def test_train_step_bench_transformer_variant_with_random_bert():
    row = bench_train_step("vse_infty", batch=4, text="transformer", text_model="tiny", **TINY)
    assert row["text"].startswith("transformer") and row["ms_median"] > 0
    with pytest.raises(ValueError, match="unknown BERT shape"):
        bench_train_step("vse_infty", batch=4, text="transformer", text_model="no-such-shape", **TINY)


def test_reference_loop_matches_the_metrics_module():
    sims = planted_sims(40, 5, signal=2.0, seed=3)
    ours = evaluate_sims(sims, cap2img_for_k(40, 200, 5))
    ref = reference_loop_metrics(sims, 5)
    for k, v in ref.items():
        assert ours[k] == pytest.approx(v), k
    assert 0 < ours["rsum"] < 600  # the planted signal makes recalls neither 0 nor 100
    perfect = reference_loop_metrics(np.kron(np.eye(4), np.ones((1, 5))).astype(np.float32) + 0.0, 5)
    assert perfect["i2t_r1"] == 100


def test_eval_bench_times_eval_sims_and_the_reference():
    row = bench_eval(n_images=50, repeats=2)
    assert row["eval_sims_s"] > 0 and row["reference_s"] > 0 and row["max_abs_diff"] < 1e-9
    # known durations: `vse eval-sims` 0.5 s and 0.7 s, in memory 0.1 s, the reference loop 6 s
    import vsekit_lab.bench.eval as module

    with pytest.MonkeyPatch.context() as mp:
        clock = StepClock([0.5, 0.7, 0.1, 6.0]).install(mp, module)
        timed = bench_eval(n_images=20, repeats=2)
    assert clock.calls == 8
    assert timed["eval_sims_s"] == pytest.approx(0.6) and timed["eval_sims_min_s"] == pytest.approx(0.5)
    assert timed["in_memory_s"] == pytest.approx(0.1) and timed["reference_s"] == pytest.approx(6.0)
    assert timed["speedup"] == pytest.approx(10.0)
    fast = bench_eval(n_images=20, repeats=1, reference=False)
    assert math.isnan(fast["reference_s"])


def test_bench_pool_cli_prints_and_appends_rows(tmp_path, capsys):
    out = tmp_path / "bench.md"
    args = [
        "bench",
        "pool",
        "--batch",
        "4",
        "--n",
        "5",
        "--dim",
        "8",
        "--repeats",
        "2",
        "--poolings",
        "avg",
        "gpo",
    ]
    assert main([*args, "--append", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| avg |" in printed and "| gpo |" in printed
    assert "`vse bench pool --batch 4 --n 5 --dim 8 --repeats 2 --poolings avg gpo`" in printed
    assert main([*args, "--append", str(out)]) == 0
    text = out.read_text()
    assert text.count(f"## {SECTIONS['pool']}") == 1
    assert (
        text.count("| pooling |") == 1 and text.count("| gpo |") == 2
    )  # second run: rows under the same table
    assert "UTC" in text and "cores" in text


def test_append_keeps_other_sections(tmp_path):
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\n## AVSE scoring\n\ntheirs\n\n## Search\n\n| a |\n|---|\n| 1 |\n")
    lines = ["| x | y |", "|---|---|", "| 1 | 2 |"]
    append_markdown(doc, "AVSE scoring", lines)
    append_markdown(doc, "AVSE scoring", ["| x | y |", "|---|---|", "| 3 | 4 |"])
    append_markdown(doc, "New", lines)
    text = doc.read_text()
    assert text.index("theirs") < text.index("| 1 | 2 |") < text.index("| 3 | 4 |") < text.index("## Search")
    assert text.count("| x | y |") == 2 and "| a |\n|---|\n| 1 |" in text
    assert text.rstrip().endswith("| 1 | 2 |") and "## New" in text


def test_bench_eval_and_ladder_cli(capsys):
    assert main(["bench", "eval", "--images", "30", "--repeats", "1"]) == 0
    assert (
        main(
            [
                "bench",
                "ladder",
                "--batch",
                "4",
                "--repeats",
                "1",
                "--embed-dim",
                "16",
                "--regions",
                "4",
                "--img-dim",
                "16",
                "--vocab",
                "100",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "| 30 x 150 |" in out and "adaptive / VSE++" in out


@pytest.mark.skipif(importlib.util.find_spec("faiss") is None, reason="needs faiss-cpu")
def test_bench_search_cli(capsys, monkeypatch):
    from vsekit_lab.bench.search import ClusteredVectors

    seen = spy_search_ids(monkeypatch)
    args = [
        "bench",
        "search",
        "--n",
        "3000",
        "--dim",
        "16",
        "--queries",
        "40",
        "--clusters",
        "20",
        "--nlist",
        "8",
        "--nprobe",
        "8",
        "--no-sq8",
        "--exact-queries",
        "30",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| 3,000 x 16")]
    assert len(rows) == 2 and len(seen) == 2  # exact + IVF
    recall = [float(r.split("|")[7]) for r in rows]
    # ground truth by brute force in numpy on the same data (the bench's own truth is FAISS's flat index)
    data = ClusteredVectors(16, 20, 1.0, seed=0)
    db, q = np.concatenate(list(data.chunks(3000, 50_000))), data.queries(40)
    truth = brute_force_topk(q, db, 10)
    # exact set equality below holds on any CPU: no query has a near-tie at its 10th place (float32 bound)
    assert_topk_well_separated(q, db, 10)
    assert [set(r) for r in seen[0]] == [set(t) for t in truth[:30]]  # the flat index is exact
    assert recall_vs(seen[1], truth) == 1.0  # nprobe = nlist searches every list: exact
    assert recall == [1.0, 1.0]


@pytest.mark.skipif(importlib.util.find_spec("faiss") is None, reason="needs faiss-cpu")
def test_bench_search_on_own_vectors_holds_out_queries(tmp_path, capsys):
    rng = np.random.default_rng(0)
    db = tmp_path / "db.npy"
    vectors = rng.standard_normal((500, 8)).astype(np.float32) * 3
    np.save(db, vectors)  # not unit: the bench normalises
    # IVF visiting every list finds the flat index's top 10 (recall 1.0) on any CPU: no near-tie at 10th place
    unit = vectors / np.linalg.norm(vectors, axis=1, keepdims=True)
    assert_topk_well_separated(unit[450:], unit[:450], 10)  # the held-out queries are the last 50 rows
    args = [
        "bench",
        "search",
        "--vectors",
        str(db),
        "--queries",
        "50",
        "--nlist",
        "4",
        "--nprobe",
        "4",
        "--no-sq8",
    ]
    assert main(args) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| 450 x 8, db.npy")]
    assert len(rows) == 2 and float(rows[1].split("|")[7]) == 1.0  # 450 = 500 minus the held-out queries


def test_bench_search_own_vectors_bad_input_names_the_file(tmp_path):
    from vsekit_lab.bench.search import NpyVectors

    bad = tmp_path / "bad.npy"
    np.save(bad, np.ones((10, 4, 2), np.float32))
    with pytest.raises(ValueError, match=r"bad\.npy: expected a non-empty \(N, D\) array"):
        NpyVectors(bad)
    db, q = tmp_path / "db.npy", tmp_path / "q.npy"
    x = np.ones((300, 4), np.float32)
    x[7, 1] = np.nan
    np.save(db, x)
    np.save(q, np.ones((5, 3), np.float32))
    with pytest.raises(ValueError, match="queries are 3-d but .*db.npy holds 4-d"):
        NpyVectors(db, q)
    with pytest.raises(ValueError, match=r"db\.npy: non-finite values in rows 0\.\.99"):
        next(NpyVectors(db, holdout=5).chunks(300, 100))
    with pytest.raises(FileNotFoundError, match="missing.npy"):
        NpyVectors(tmp_path / "missing.npy")


def test_bench_aeom_cli_prints_rows_and_appends(tmp_path, capsys):
    doc = tmp_path / "b.md"
    assert (
        main(
            [
                "bench",
                "aeom",
                "--images",
                "6",
                "--captions",
                "30",
                "--dim",
                "16",
                "--block-dim",
                "8",
                "--repeats",
                "1",
                "--append",
                str(doc),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "| AEOM (s) |" in out and "vse bench aeom --images 6" in out
    assert "## AEOM similarity" in doc.read_text()


@pytest.mark.slow
def test_bench_aeom_model_eval_times_both_recipes():
    from vsekit_lab.bench.aeom import bench_aeom_eval

    row = bench_aeom_eval(
        8,
        2,
        repeats=1,
        regions=3,
        img_dim=16,
        overrides=["model.embed_dim=32", "model.similarity.block_dim=16"],
    )
    assert row["n_captions"] == 16 and row["views"] == 2 and row["block_dim"] == 16
    assert row["aeom_eval_s"] > 0 and row["cosine_eval_s"] > 0
    # known durations: the vse_infty eval takes 2 s, the avse one 5 s (the untimed warm-ups are not counted)
    import vsekit_lab.bench.aeom as module

    with pytest.MonkeyPatch.context() as mp:
        clock = StepClock([2.0, 5.0]).install(mp, module)
        row = bench_aeom_eval(
            8,
            2,
            repeats=1,
            regions=3,
            img_dim=16,
            overrides=["model.embed_dim=32", "model.similarity.block_dim=16"],
        )
    assert clock.calls == 4
    assert row["cosine_eval_s"] == pytest.approx(2.0) and row["aeom_eval_s"] == pytest.approx(5.0)
    assert row["ratio_eval"] == pytest.approx(2.5)


DOCS = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"


def _section(text: str, heading: str) -> str:
    start = text.index(f"## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else len(text)]


@pytest.mark.parametrize("bench", sorted(SECTIONS))
def test_append_lands_in_the_docs_own_section(tmp_path, bench):
    """docs/benchmarks.md has a section for every `vse bench` benchmark, so `--append docs/benchmarks.md`
    adds rows there instead of starting a duplicate section at the end of the file."""
    original = DOCS.read_text(encoding="utf-8")
    heading = SECTIONS[bench]
    assert original.count(f"\n## {heading}\n") == 1, f"docs/benchmarks.md has no section '## {heading}'"
    doc = tmp_path / "benchmarks.md"
    doc.write_text(original, encoding="utf-8")
    rows = ["| x | y |", "|---|---|", f"| {bench}-row | 1 |"]
    append_markdown(doc, heading, rows)
    text = doc.read_text(encoding="utf-8")
    assert text.count("\n## ") == original.count("\n## ")  # no new section
    assert f"| {bench}-row | 1 |" in _section(text, heading)
    assert "\n".join(rows) in _section(text, heading)  # one new table, under the heading
    rest = text.replace("\n".join(rows) + "\n", "", 1)
    assert [x for x in rest.splitlines() if x.strip()] == [
        x for x in original.splitlines() if x.strip()
    ]  # nothing else


def test_bench_pool_append_extends_the_docs_table(tmp_path, capsys):
    doc = tmp_path / "benchmarks.md"
    doc.write_text(DOCS.read_text(encoding="utf-8"), encoding="utf-8")
    before = _section(doc.read_text(), SECTIONS["pool"])
    assert (
        main(
            [
                "bench",
                "pool",
                "--batch",
                "2",
                "--n",
                "3",
                "--dim",
                "4",
                "--repeats",
                "1",
                "--poolings",
                "avg",
                "--append",
                str(doc),
            ]
        )
        == 0
    )
    after = _section(doc.read_text(), SECTIONS["pool"])
    assert (
        after.count("| pooling | B x N x D |") == before.count("| pooling | B x N x D |") == 1
    )  # the same table
    new = [line for line in after.splitlines() if "`vse bench pool --batch 2" in line]
    assert len(new) == 1 and new[0].startswith("| avg | 2x3x4 |")
    table = [line for line in after.splitlines() if line.startswith("|")]
    assert table[-1] == new[0]  # appended after the table's existing rows


def test_bench_search_defaults_are_the_documented_run(monkeypatch, capsys, tmp_path):
    """`vse bench search` runs the documented 1M x 1024 benchmark by default (bench_search's own defaults)."""
    import vsekit_lab.bench.search as module

    calls = []

    def fake_bench_search(**kwargs):
        calls.append({k: v for k, v in kwargs.items() if k != "log"})
        setup = {
            "n": 10,
            "dim": 4,
            "k": 10,
            "queries": 2,
            "clusters": 3,
            "spread": 1.0,
            "threads": 1,
            "faiss": "x",
            "vectors": None,
        }
        return {
            "setup": setup,
            "rows": [
                {
                    "index": "flat (exact)",
                    "params": "",
                    "build_s": 0.1,
                    "bytes_per_vector": 16,
                    "p50_ms": 1.0,
                    "p99_ms": 2.0,
                    "recall_at_k": 1.0,
                }
            ],
        }

    monkeypatch.setattr(module, "bench_search", fake_bench_search)
    assert main(["bench", "search"]) == 0
    expect = {
        "n": 1_000_000,
        "dim": 1024,
        "queries": 200,
        "exact_queries": 30,
        "clusters": 10_000,
        "spread": 1.0,
        "nlist": 0,
        "nprobes": (4, 8, 16, 32),
        "sq8": True,
        "hnsw_m": 0,
        "ef_searches": (32, 64, 128),
        "train_size": 0,
        "kmeans_iters": 10,
        "threads": 1,
        "vectors": None,
        "query_vectors": None,
    }
    assert {k: calls[0][k] for k in expect} == expect
    out = tmp_path / "r.json"
    assert (
        main(["bench", "search", "--n", "5000", "--nprobe", "2", "8", "--hnsw-m", "16", "--json", str(out)])
        == 0
    )
    assert (calls[1]["n"], calls[1]["nprobes"], calls[1]["hnsw_m"]) == (5000, (2, 8), 16)
    assert json.loads(out.read_text())["rows"][0]["index"] == "flat (exact)"
    printed = capsys.readouterr().out
    assert (
        "`vse bench search --n 5000 --nprobe 2 8 --hnsw-m 16`" in printed
    )  # --json is not part of the command


def test_bench_startup_medians_and_torch_detection(monkeypatch):
    import vsekit_lab.bench.startup as startup

    assert startup.imports_torch(["-c", "import torch"]) is True
    assert startup.imports_torch(["-c", "import json"]) is False
    assert (
        startup.imports_torch(["-m", "vsekit.cli", "--help"]) is False
    )  # the verbs that need no model stay light
    # known durations, one (start, stop) pair per timed run: 2 rounds over the 4 commands, alternated
    durations = [0.01, 0.10, 0.20, 0.30, 0.03, 0.14, 0.22, 0.50]
    StepClock(durations).install(monkeypatch, startup)
    monkeypatch.setattr(startup, "_run", lambda argv: None)
    monkeypatch.setattr(startup, "imports_torch", lambda args: args[-1] == "recipes")
    rows = startup.bench_startup(repeats=2)
    assert [r["verb"] for r in rows] == [
        "python -c pass",
        "vse --help",
        "vse recipes",
        "vse eval-sims --help",
    ]
    assert [r["median_s"] for r in rows] == pytest.approx([0.02, 0.12, 0.21, 0.40])
    assert [r["min_s"] for r in rows] == pytest.approx([0.01, 0.10, 0.20, 0.30])
    assert [r["over_python_s"] for r in rows] == pytest.approx([0.0, 0.10, 0.19, 0.38])
    assert [r["imports_torch"] for r in rows] == [False, False, True, False]
    with pytest.raises(VseInputError):
        startup.bench_startup(repeats=0)
