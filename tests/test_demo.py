import json

import pytest

from vsekit.config import load_recipe
from vsekit_lab.datasets.openclipart import CAPTION_RULES, RENDER_VERSION
from vsekit_lab.datasets.synthetic import make_synthetic_precomp
from vsekit_lab.demo import VARIANTS, dataset_outdated, demo_overrides, results_table, run_demo


def _manifest(tmp_path, **changes):
    manifest = {"caption_rules": CAPTION_RULES, "build": {"render": RENDER_VERSION}} | changes
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))


def test_outdated_set_is_named_with_its_manifest(tmp_path):
    assert dataset_outdated(tmp_path) is None  # no manifest: not ours, nothing to compare
    _manifest(tmp_path)
    assert dataset_outdated(tmp_path) is None
    _manifest(tmp_path, caption_rules=CAPTION_RULES[:-1])
    assert "caption rules" in dataset_outdated(tmp_path) and "manifest.json" in dataset_outdated(tmp_path)
    _manifest(tmp_path, build={"render": "old-render"})
    assert "old-render" in dataset_outdated(tmp_path)


def test_results_table_means_and_stds_over_seeds():
    def run(rsum: float, t: float) -> dict:
        keys = ("i2t_r1", "i2t_r5", "i2t_r10", "t2i_r1", "t2i_r5", "t2i_r10")
        return {"metrics": {k: rsum / 6 for k in keys} | {"rsum": rsum}, "train_time_s": t}

    table = results_table({"vsepp_bigru": [run(200, 10), run(210, 30)]}, seeds=2)
    row = table.splitlines()[2]
    assert row.startswith("| VSE++ (avg pool), BiGRU |") and "205.0 ± 7.1" in row and row.endswith("| 20 |")
    assert "±" not in results_table({"vsepp_bigru": [run(200, 10)]}, seeds=1)


def test_demo_recipes_differ_only_in_pooling_and_decay_late():
    recipes = {v.name: load_recipe(v.recipe, demo_overrides(v, 8)) for v in VARIANTS}
    gpo, avg = recipes["vse_infty_bigru"], recipes["vsepp_bigru"]
    assert (gpo.train.epochs, gpo.optim.lr_decay_epochs, gpo.model.text.kind) == (8, [6], "bigru")
    assert (gpo.model.image.pooling.name, avg.model.image.pooling.name) == ("gpo", "avg")
    avg.model.image.pooling = gpo.model.image.pooling
    avg.model.text.pooling = gpo.model.text.pooling
    assert avg.model == gpo.model and avg.loss == gpo.loss and avg.optim == gpo.optim
    assert (
        recipes["vse_infty_minilm"].model.text.freeze
        and recipes["vse_infty_minilm"].model.text.kind == "transformer"
    )


@pytest.mark.slow
def test_demo_trains_reports_and_reuses_finished_runs(tmp_path, capsys):
    data = make_synthetic_precomp(tmp_path / "data", n_train=64, n_dev=16, n_test=16, regions=6, dim=16)
    out = tmp_path / "demo"
    variants = ["vsepp_bigru", "vse_infty_bigru"]
    first = run_demo(data, out, seeds=2, epochs=1, device="cpu", variants=variants)
    md = (out / "results.md").read_text()
    assert "VSE++ (avg pool), BiGRU" in md and "VSE∞ (GPO), BiGRU" in md and md.count("±") >= 14
    saved = json.loads((out / "results.json").read_text())
    assert saved["seeds"] == 2 and [len(saved["runs"][v]) for v in variants] == [2, 2]
    assert all(len(r["dev_rsum"]) == 1 for v in variants for r in saved["runs"][v])
    assert (out / "dev_rsum.png").stat().st_size > 1000
    assert "vse index" in capsys.readouterr().out  # tells the user how to search
    stamp = (out / "vsepp_bigru" / "seed0" / "best.safetensors").stat().st_mtime_ns
    again = run_demo(data, out, seeds=2, epochs=1, device="cpu", variants=variants)
    assert (out / "vsepp_bigru" / "seed0" / "best.safetensors").stat().st_mtime_ns == stamp  # not retrained
    assert again["vsepp_bigru"][1]["metrics"] == first["vsepp_bigru"][1]["metrics"]
