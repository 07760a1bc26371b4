"""Fuzzed parsers: every input either works or fails with a clear error of a known type (exit code 2 and
one line at the CLI), never a traceback from deep inside."""

import io
import shutil
import tempfile
from contextlib import redirect_stderr
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vsekit.cli import main
from vsekit.config import ConfigError, load_recipe, parse_override, recipe_from_dict, to_dict
from vsekit.data.precomp import DataFormatError, load_precomp_split
from vsekit.data.validate import check_dataset
from vsekit.metrics import evaluate_sims
from vsekit_lab.datasets.synthetic import make_synthetic_precomp

FUZZ = settings(
    max_examples=40,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
TEXTISH = st.lists(
    st.sampled_from(
        [
            b"a dog",
            b"",
            b" ",
            b"\r",
            b"\xff\xfe",
            b"\x00",
            b"-1",
            b"7",
            b"x",
            b"3 4",
            "caf\u00e9".encode(),
            b"\t",
            b"999999999999999999999",
        ]
    ),
    max_size=40,
).map(lambda parts: b"\n".join(parts))


@pytest.fixture(autouse=True)
def _one_thread(_threads):
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    return make_synthetic_precomp(
        tmp_path_factory.mktemp("fz"), n_train=8, n_dev=4, n_test=4, regions=3, dim=4
    )


def _copy(clean: Path) -> Path:
    out = Path(tempfile.mkdtemp(prefix="fuzz_"))
    shutil.copytree(clean, out, dirs_exist_ok=True)
    return out


def _cli(argv: list[str]) -> tuple[int, str]:
    err = io.StringIO()
    with redirect_stderr(err):
        try:
            rc = main(argv)
        except SystemExit as e:  # argparse: usage error, exit 2
            rc = e.code
    return rc, err.getvalue()


def _load_or_clear_error(root: Path, split: str) -> None:
    try:
        load_precomp_split(root, split)
    except DataFormatError as e:
        assert str(root) in str(e)  # the message names the file


@FUZZ
@given(
    name=st.sampled_from(["train_caps.txt", "train_cap2img.txt", "train_ids.txt", "dev_images.txt"]),
    raw=TEXTISH,
)
def test_malformed_text_files(clean, name, raw):
    root = _copy(clean)
    try:
        (root / name).write_bytes(raw)
        split = name.split("_")[0]
        _load_or_clear_error(root, split)
        report = check_dataset(root)  # never raises: every problem is a line of the report
        assert all(p.path.startswith(str(root)) for p in report.problems)
        if name == "train_caps.txt" and raw.strip(b"\n") == b"":
            assert not report.ok
    finally:
        shutil.rmtree(root)


@FUZZ
@given(
    shape=st.lists(st.integers(0, 5), min_size=0, max_size=4),
    dtype=st.sampled_from(["float16", "float32", "float64", "int8", "bool", "complex64"]),
    truncate=st.booleans(),
)
def test_wrong_feature_shapes_and_dtypes(clean, shape, dtype, truncate):
    root = _copy(clean)
    try:
        path = root / "train_ims.npy"
        np.save(path, np.ones(shape, dtype=dtype))
        if truncate:
            path.write_bytes(path.read_bytes()[:-1] if path.stat().st_size > 128 else path.read_bytes()[:40])
        _load_or_clear_error(root, "train")
        report = check_dataset(root)
        good = shape == [8, 3, 4] and dtype in ("float16", "float32") and not truncate
        assert report.ok == good, report.format()
    finally:
        shutil.rmtree(root)


@FUZZ
@given(
    rows=st.lists(st.integers(0, 7), min_size=1, max_size=4, unique=True),
    value=st.sampled_from([np.nan, np.inf, -np.inf]),
)
def test_nan_features_reported_at_first_bad_row(clean, rows, value):
    root = _copy(clean)
    try:
        feats = np.load(root / "train_ims.npy")
        for r in rows:
            feats[r, r % 3, r % 4] = value
        np.save(root / "train_ims.npy", feats)
        report = check_dataset(root, chunk_rows=3)  # several chunks: the first bad row is found across them
        bad = [p for p in report.errors if "NaN or inf" in p.message]
        assert (
            len(bad) == 1
            and bad[0].where == f" row {min(rows)}"
            and f"({len(rows)} bad row(s)" in bad[0].message
        )
    finally:
        shutil.rmtree(root)


JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 3) | st.floats(allow_nan=True) | st.text(max_size=5),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=8), children, max_size=3)
    ),
    max_leaves=8,
)
KEYS = [
    "model",
    "loss",
    "train",
    "optim",
    "data",
    "name",
    "model.embed_dim",
    "model.image",
    "model.image.pooling",
    "model.image.pooling.name",
    "train.batch_size",
    "train.epochs",
    "optim.lr_decay_epochs",
    "loss.margin",
    "loss.name",
    "model.text.kind",
    "bogus",
    "model.bogus",
    "train.amp",
]


@FUZZ
@given(key=st.sampled_from(KEYS), value=JSONISH)
def test_ill_typed_and_unknown_config_keys(key, value):
    data = to_dict(load_recipe("vsepp"))
    node = data
    parts = key.split(".")
    for p in parts[:-1]:
        node = node[p]
    node[parts[-1]] = value
    try:
        recipe_from_dict(data)
    except ConfigError as e:
        assert str(e)


OVERRIDE = st.one_of(
    st.text(max_size=30),
    st.builds(
        lambda k, v: f"{k}={v}",
        st.sampled_from(KEYS + ["", ".", "a..b", "train..epochs"]),
        st.sampled_from(
            [
                "",
                "1",
                "-1",
                "0",
                "x",
                "[",
                "]",
                "{a: 1}",
                "[1, 2]",
                "true",
                "1e9",
                "nan",
                ": :",
                "'",
                "!!python/object:os.system",
                "&a [*a]",
                "null",
                "0x10",
                "[[1]]",
            ]
        ),
    ),
)


@FUZZ
@given(item=OVERRIDE)
def test_malformed_overrides_parse_or_fail_clearly(item):
    try:
        parse_override(item)
        load_recipe("vsepp", [item])
    except ConfigError as e:
        assert str(e)


@FUZZ
@given(item=OVERRIDE)
def test_cli_set_values_give_one_line_errors(tmp_path, item):
    # --data does not exist, so a valid override still stops before training, with a DataFormatError
    rc, err = _cli(["train", "--data", str(tmp_path / "none"), "--out", str(tmp_path / "run"), "--set", item])
    assert rc == 2
    lines = err.strip().splitlines()
    if lines and lines[0].startswith("usage:"):  # argparse refused it (e.g. a value starting with '-')
        return
    assert len(lines) >= 1 and lines[0].startswith("vse train: error: ") and "Traceback" not in err


@FUZZ
@given(
    shape=st.lists(st.integers(0, 12), min_size=0, max_size=3),
    fill=st.sampled_from(["normal", "ties", "nan", "inf", "int", "bool", "text"]),
    k=st.integers(-1, 6),
)
def test_eval_sims_inputs(tmp_path, shape, fill, k):
    rng = np.random.default_rng(len(shape))
    if fill == "text":
        arr = np.full(shape, "x")
    elif fill == "bool":
        arr = np.ones(shape, dtype=bool)
    elif fill == "int":
        arr = rng.integers(-3, 3, size=shape)
    else:
        arr = rng.normal(size=shape).astype(np.float32)
        if fill == "ties":
            arr = np.round(arr)
        elif fill in ("nan", "inf") and arr.size:
            arr.flat[rng.integers(arr.size)] = np.nan if fill == "nan" else np.inf
    path = tmp_path / "s.npy"
    np.save(path, arr)
    rc, err = _cli(["eval-sims", str(path), "--captions-per-image", str(k)])
    assert rc in (0, 2), err
    assert "Traceback" not in err and "internal error" not in err
    if rc == 2:
        assert err.startswith("vse eval-sims: error: ")


@FUZZ
@given(n_img=st.integers(2, 6), per=st.integers(1, 3), seed=st.integers(0, 99))
def test_rank_does_not_depend_on_the_order_of_tied_scores(n_img, per, seed):
    rng = np.random.default_rng(seed)
    sims = rng.integers(0, 3, size=(n_img, n_img * per)).astype(np.float32)  # many ties
    cap2img = np.arange(n_img * per) // per
    perm = rng.permutation(n_img * per)
    assert evaluate_sims(sims[:, perm], cap2img[perm]) == evaluate_sims(sims, cap2img)


def test_constant_similarities_do_not_score_perfect_recall():
    """Ties rank pessimistically: a collapsed model gets the worst ranks, not a perfect score."""
    m = evaluate_sims(np.zeros((10, 50), dtype=np.float32), np.arange(50) // 5)
    assert m["i2t_r10"] == 0.0 and m["t2i_r5"] == 0.0  # recalls are 100 x counts / n: exact here
    assert m["rsum"] == 100.0  # only t2i R@10: with 10 images the worst rank (9) is still inside the top 10
    assert m["t2i_medr"] == 10 and m["i2t_medr"] == 46  # 9 other images; 45 other captions above the tie


def test_ties_with_own_captions_do_not_count_as_negatives():
    sims = np.array([[1.0, 1.0, 0.5, 0.2], [0.1, 0.1, 0.9, 0.9]], dtype=np.float32)
    m = evaluate_sims(sims, np.array([0, 0, 1, 1]))
    assert m["i2t_r1"] == 100.0 and m["t2i_r1"] == 100.0


def test_vse_debug_switch_shows_full_tracebacks(tmp_path, monkeypatch):
    missing = str(tmp_path / "missing.npy")
    monkeypatch.delenv("VSE_DEBUG", raising=False)
    rc, err = _cli(["eval-sims", missing])
    assert (
        rc == 2
        and err.startswith("vse eval-sims: error: ")
        and "missing.npy" in err
        and "Traceback" not in err
    )
    import vsekit.commands.evaluate as ev

    def buggy(_args):
        raise TypeError("an internal bug")

    monkeypatch.setattr(ev, "load_sims", buggy)
    rc, err = _cli(["eval-sims", missing])
    assert rc == 1 and "internal error (TypeError: an internal bug)" in err and "VSE_DEBUG=1" in err
    monkeypatch.setenv("VSE_DEBUG", "1")
    with pytest.raises(TypeError, match="an internal bug"):
        main(["eval-sims", missing])
    monkeypatch.undo()
    monkeypatch.setenv("VSE_DEBUG", "1")
    with pytest.raises(FileNotFoundError, match="missing.npy"):
        main(["eval-sims", missing])
