"""Compositional probes: `vse eval RUN --probe order | sugarcrepe DIR`, the scores of
`vsekit.metrics.probes`, the builders of `vsekit.data.probes` and the text-only baseline of
`vsekit.data.text_only`.

Independent values: Wilson intervals against scipy's `binomtest`; Kneser-Ney probabilities worked out by hand
(in the test's comments); SugarCrepe's clean / contaminated counts counted by hand from the ids the test
writes; a bag-of-words similarity built by hand from random word vectors.
"""

from __future__ import annotations

import json
import math
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.stats import binomtest

from vsekit.cli import main
from vsekit.data import probes as dp
from vsekit.data.text_only import KneserNeyTrigram
from vsekit.metrics.probes import pairwise_accuracy, precision_at_1, wilson_interval

CAPTIONS = [
    "a small dog runs on the green grass near a red house",
    "two men ride old bikes down a long street",
    "a cat sleeps",
    "dog",
    "the the the",
]


@pytest.fixture(autouse=True)
def _one_thread(_threads):
    torch.set_num_threads(1)


# ---------------------------------------------------------------- scores


@pytest.mark.parametrize("k,n", [(0, 10), (3, 10), (10, 10), (517, 1000), (1, 3)])
def test_wilson_interval_matches_scipy(k, n):
    lo, hi = wilson_interval(k, n)
    ci = binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
    assert lo == pytest.approx(ci.low, abs=1e-12) and hi == pytest.approx(ci.high, abs=1e-12)


def test_true_similarity_scores_100_and_ties_count_as_failures():
    """A hand-built 'true' similarity (positive 1, negatives 0) is 100 %; the same with every negative equal
    to the positive is 0 %, never chance."""
    pos, neg = np.ones(50), np.zeros((50, 4))
    r = precision_at_1(pos, neg)
    assert (r["precision_at_1"], r["n"]) == (100.0, 50) and r["chance"] == pytest.approx(20.0)
    assert r["ci_high"] == 100.0 and r["ci_low"] < 100.0
    tied = precision_at_1(pos, np.ones((50, 4)))
    assert tied["precision_at_1"] == 0.0
    # a negative that ties at float32 rounding (the same words summed in another order) is a tie too
    eps = np.float32(0.7) - np.nextafter(np.float32(0.7), np.float32(0))
    assert precision_at_1(np.full(3, 0.7), np.full((3, 1), 0.7 - float(eps)))["precision_at_1"] == 0.0
    sc = pairwise_accuracy(np.array([0.9, 0.1, 0.5, 0.5]), np.array([0.1, 0.9, 0.2, 0.5]))
    assert (sc["accuracy"], sc["chance"], sc["n"]) == (50.0, 50.0, 4)


def test_chance_is_the_mean_over_items_of_one_over_candidates():
    neg = np.array([[0.0, 0.0, 0.0, 0.0], [0.0, np.nan, np.nan, np.nan]])
    # items with 4 and 1 negatives: (1/5 + 1/2) / 2 = 35 %
    assert precision_at_1(np.ones(2), neg)["chance"] == pytest.approx(35.0)


# ---------------------------------------------------------------- perturbations


def _probe(seed: int, **kw) -> dp.OrderProbe:
    cap2img = np.arange(len(CAPTIONS))
    ids = [f"im{i}" for i in range(len(CAPTIONS))]
    return dp.build_order_probe(CAPTIONS, cap2img, ids, seed=seed, tagger=dp.Tagger(reason="no tagger"), **kw)


def test_perturbations_same_seed_same_items_other_seed_other_items():
    a, b, c = _probe(0), _probe(0), _probe(1)
    assert dp.order_probe_json(a) == dp.order_probe_json(b)
    for kind in ("shuffle_all", "shuffle_trigrams", "shuffle_within_trigrams"):
        assert [it.negatives for it in a.items[kind]] != [it.negatives for it in c.items[kind]], kind


def test_perturbations_reorder_the_same_words_and_never_repeat_the_positive():
    probe = _probe(3)
    for kind in ("shuffle_all", "shuffle_trigrams", "shuffle_within_trigrams"):
        for it in probe.items[kind]:
            assert len(it.negatives) == len(set(it.negatives)) and it.positive not in it.negatives
            for neg in it.negatives:
                assert Counter(neg.split()) == Counter(it.positive.split())
    # one word, or the same word three times: no distinct shuffle; left out and counted
    assert probe.left_out["shuffle_all"] == 2
    assert {it.image for it in probe.items["shuffle_all"]} == {0, 1, 2}
    # trigram shuffle keeps each trigram whole: "a cat sleeps" is one trigram, nothing to move
    words = "two men ride old bikes down a long street".split()
    groups = [" ".join(words[i : i + 3]) for i in (0, 3, 6)]
    for neg in next(it for it in probe.items["shuffle_trigrams"] if it.image == 1).negatives:
        w = neg.split()
        assert sorted(" ".join(w[i : i + 3]) for i in (0, 3, 6)) == sorted(groups)
    for neg in next(it for it in probe.items["shuffle_within_trigrams"] if it.image == 1).negatives:
        w = neg.split()
        assert [sorted(w[i : i + 3]) for i in (0, 3, 6)] == [sorted(g.split()) for g in groups]


def test_noun_adjective_shuffle_moves_only_tagged_words_and_says_when_no_tagger():
    tags = {"small": "JJ", "dog": "NN", "green": "JJ", "grass": "NN", "red": "JJ", "house": "NN"}
    fake = dp.Tagger(tag=lambda ws: [(w, tags.get(w, "DT")) for w in ws])
    words = CAPTIONS[0].split()
    rng = np.random.default_rng(0)
    for _ in range(20):
        out = dp.permute(words, "shuffle_nouns_adjectives", rng, fake)
        assert [w for w, o in zip(words, out) if w not in tags] == [
            o for w, o in zip(words, out) if w not in tags
        ]
        assert sorted(o for w, o in zip(words, out) if w in tags) == sorted(tags)
    probe = _probe(0)
    assert probe.skipped == {"shuffle_nouns_adjectives": "no tagger"}
    assert "shuffle_nouns_adjectives" not in probe.items


def test_bag_of_words_similarity_is_at_or_below_chance_on_every_order_probe():
    """A hand-built bag of words: sim = cosine(image vector, normalised mean of word vectors), float32."""
    probe = _probe(0, negatives=4)
    vocab = sorted({w for c in CAPTIONS for w in c.split()})
    rng = np.random.default_rng(5)
    vec = {w: rng.normal(size=16).astype(np.float32) for w in vocab}
    image = rng.normal(size=(len(CAPTIONS), 16)).astype(np.float32)

    def sim(img: int, caption: str) -> float:
        m = np.mean([vec[w] for w in caption.split()], axis=0, dtype=np.float32)
        return float(image[img] @ (m / np.linalg.norm(m)))

    for kind, items in probe.items.items():
        pos = np.array([sim(it.image, it.positive) for it in items])
        neg = np.full((len(items), 4), np.nan)
        for i, it in enumerate(items):
            neg[i, : len(it.negatives)] = [sim(it.image, n) for n in it.negatives]
        r = precision_at_1(pos, neg)
        assert r["precision_at_1"] <= r["chance"], kind


# ---------------------------------------------------------------- text-only baseline


def test_kneser_ney_probabilities_by_hand():
    """Corpus "a b", "a c" (D = 0.75). Continuation counts: N1+(. a) = N1+(. b) = N1+(. c) = 1,
    N1+(. </s>) = 2, N1+(. .) = 5; V = {a, b, c, </s>, <unk>} = 5.
    P1(b) = 0.25/5 + 0.75*4/5/5 = 0.17; P1(<unk>) = 0.12.
    P2(b | a) = (1 - 0.75)/2 + 0.75*2/2 * 0.17 = 0.2525.
    P3(b | <s> a) = (1 - 0.75)/2 + 0.75*2/2 * 0.2525 = 0.314375."""
    lm = KneserNeyTrigram(["a b", "a c"])
    assert lm.p_unigram("b") == pytest.approx(0.17)
    assert lm.p_unigram("<unk>") == pytest.approx(0.12)
    assert lm.p_bigram("a", "b") == pytest.approx(0.2525)
    assert lm.p_trigram("<s>", "a", "b") == pytest.approx(0.314375)
    for ctx in (("<s>", "a"), ("a", "b"), ("zz", "qq")):  # seen and unseen contexts: distributions
        assert sum(lm.p_trigram(*ctx, w) for w in lm.vocab) == pytest.approx(1.0)


def test_text_only_baseline_prefers_the_word_order_it_was_trained_on():
    train = ["a dog runs on the grass", "a cat runs on the road", "a dog sleeps on the grass"] * 5
    lm = KneserNeyTrigram(train)
    assert lm.log_prob("a cat sleeps on the grass") > lm.log_prob("grass the on sleeps cat a")
    assert math.isfinite(lm.log_prob("a zebra flies"))


# ---------------------------------------------------------------- SugarCrepe files


def write_sugarcrepe(folder: Path, examples: dict[str, list[tuple[int, str, str]]]) -> Path:
    """The released layout: one `{category}.json` object per category, keyed "0", "1", ..."""
    folder.mkdir(parents=True, exist_ok=True)
    for cat, rows in examples.items():
        obj = {
            str(i): {"filename": f"{cid:012d}.jpg", "caption": pos, "negative_caption": neg}
            for i, (cid, pos, neg) in enumerate(rows)
        }
        (folder / f"{cat}.json").write_text(json.dumps(obj), encoding="utf-8")
    return folder


def test_sugarcrepe_reader_maps_coco_ids_and_splits_clean_from_contaminated(tmp_path):
    """Split ids 11..16; training ids 11, 12, 13 (val2017 pictures inside train2014, as in COCO).
    swap_att: 11, 12, 14, 99 -> rows of 11, 12, 14 found, 99 missing; contaminated 11, 12; clean 14.
    add_obj: 13, 15, 16, 16 -> all found; contaminated 13; clean 15, 16, 16."""
    folder = write_sugarcrepe(
        tmp_path / "sc",
        {
            "swap_att": [(11, "p", "n"), (12, "p", "n"), (14, "p", "n"), (99, "p", "n")],
            "add_obj": [(13, "p", "n"), (15, "p", "n"), (16, "p", "n"), (16, "p", "n")],
        },
    )
    examples = dp.read_sugarcrepe(folder)
    assert set(examples) == {"swap_att", "add_obj"}
    rows = dp.id_rows([str(i) for i in range(11, 17)], "test_ids.txt")
    counts = {}
    for cat, items in examples.items():
        found = [it.coco_id for it in items if it.coco_id in rows]
        masks = dp.subset_masks(np.array(found), {11, 12, 13})
        counts[cat] = (len(items) - len(found), *(int(masks[s].sum()) for s in dp.SUBSETS))
    assert counts == {"swap_att": (1, 3, 1, 2), "add_obj": (0, 4, 3, 1)}
    assert dp.coco_id_of("COCO_val2014_000000000139.jpg") == 139


def test_sugarcrepe_layout_and_bad_examples_are_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(dp.ProbeInputError, match="not SugarCrepe's layout"):
        dp.read_sugarcrepe(tmp_path / "empty")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "swap_obj.json").write_text(
        '{"0": {"filename": "x.jpg", "caption": "a", "negative_caption": "b"}}'
    )
    with pytest.raises(dp.ProbeInputError, match="holds no COCO id"):
        dp.read_sugarcrepe(bad)
    (bad / "swap_obj.json").write_text("[" * 100 + "]" * 100)
    with pytest.raises(dp.ProbeInputError, match="swap_obj.json"):
        dp.read_sugarcrepe(bad)


# ---------------------------------------------------------------- the command


@pytest.fixture(scope="module")
def coco_like(tmp_path_factory) -> Path:
    """The tiny synthetic set with COCO-style integer ids: test pictures 11..22, training 100..147 plus
    11 and 12 (two test pictures also among the training ones)."""
    from vsekit_lab.datasets.synthetic import make_synthetic_precomp

    data = make_synthetic_precomp(
        tmp_path_factory.mktemp("coco"), n_train=48, n_dev=12, n_test=12, regions=4, dim=8
    )
    (data / "test_ids.txt").write_text("".join(f"{i}\n" for i in range(11, 23)))
    (data / "dev_ids.txt").write_text("".join(f"{i}\n" for i in range(200, 212)))
    (data / "train_ids.txt").write_text("".join(f"{i}\n" for i in [11, 12, *range(100, 146)]))
    return data


@pytest.fixture(scope="module")
def bow_run(coco_like, tmp_path_factory) -> Path:
    from vsekit.config import load_recipe
    from vsekit.training.trainer import Trainer

    run = tmp_path_factory.mktemp("runs") / "bow"
    recipe = load_recipe(
        "bow", ["train.epochs=2", "train.batch_size=16", "train.log_every=0", "model.embed_dim=16"]
    )
    Trainer(recipe, coco_like, run, progress=False, log=lambda *_: None).fit()
    return run


def test_cli_order_probe_bow_floor_at_or_below_chance_and_items_reused(bow_run, tmp_path, monkeypatch):
    monkeypatch.setattr(dp, "find_tagger", lambda: dp.Tagger(reason="no part-of-speech tagger (test)"))
    out = tmp_path / "order.json"
    assert main(["eval", str(bow_run), "--probe", "order", "--probe-seed", "3", "--json-out", str(out)]) == 0
    rep = json.loads(out.read_text())
    res = rep["results"]
    assert res["shuffle_nouns_adjectives"] == {"skipped": "no part-of-speech tagger (test)"}
    for kind in ("shuffle_all", "shuffle_trigrams", "shuffle_within_trigrams"):
        r = res[kind]
        assert r["n"] + r["left_out"] == 12
        assert {"precision_at_1", "chance", "n", "text_only"} <= set(r)
        assert r["precision_at_1"] <= r["chance"], kind  # a bag of words ties every shuffle
    items = tmp_path / "order.items.json"
    assert items.is_file() and (tmp_path / "order.png").is_file()
    again = tmp_path / "again.json"
    assert (
        main(
            ["eval", str(bow_run), "--probe", "order", "--probe-items", str(items), "--json-out", str(again)]
        )
        == 0
    )
    assert json.loads(again.read_text())["results"]["shuffle_all"] == res["shuffle_all"]


def test_cli_sugarcrepe_counts_clean_contaminated_and_missing(bow_run, coco_like, tmp_path):
    """Test pictures 11..22, of which 11 and 12 are training pictures too. replace_rel: 11, 12, 13, 20, 500,
    501 -> 2 missing, contaminated 2, clean 2."""
    caps = (data_caps := (coco_like / "test_caps.txt").read_text().splitlines())[0], data_caps[5]
    write_sugarcrepe(
        tmp_path / "sc" / "data", {"replace_rel": [(i, caps[0], caps[1]) for i in (11, 12, 13, 20, 500, 501)]}
    )
    out = tmp_path / "sc.json"
    assert (
        main(["eval", str(bow_run), "--probe", "sugarcrepe", str(tmp_path / "sc"), "--json-out", str(out)])
        == 0
    )
    r = json.loads(out.read_text())["results"]["replace_rel"]
    assert (r["examples"], r["missing_rows"]) == (6, 2)
    assert (r["all"]["n"], r["clean"]["n"], r["contaminated"]["n"]) == (4, 2, 2)
    assert r["all"]["chance"] == 50.0 and "text_only" in r["clean"]


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--probe", "colour"], "--probe 'colour': unknown probe"),
        (["--probe", "sugarcrepe", "NOFOLDER"], "not SugarCrepe's layout"),
        (["--probe", "order", "--split", "nosuch"], "nosuch_caps.txt: missing"),
        (["--probe", "sugarcrepe"], "name one folder"),
    ],
)
def test_cli_probe_bad_input_is_one_line_exit_2(bow_run, tmp_path, capsys, argv, match):
    if "NOFOLDER" in argv:
        (tmp_path / "plain").mkdir()
        (tmp_path / "plain" / "notes.json").write_text("{}")
        argv = [str(tmp_path / "plain") if a == "NOFOLDER" else a for a in argv]
    assert main(["eval", str(bow_run), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and match in err[0], err


def test_cli_sugarcrepe_needs_coco_ids_in_the_split(bow_run, coco_like, tmp_path, capsys):
    data = tmp_path / "data"
    shutil.copytree(coco_like, data)
    (data / "test_ids.txt").write_text("".join(f"img{i}\n" for i in range(12)))
    folder = write_sugarcrepe(tmp_path / "sc", {"swap_obj": [(11, "a b", "b a")]})
    assert main(["eval", str(bow_run), "--data", str(data), "--probe", "sugarcrepe", str(folder)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a COCO id" in err[0]
