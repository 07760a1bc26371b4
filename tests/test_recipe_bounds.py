"""Recipes and the files a run reads its recipe back from are bounded before they cost anything: YAML aliases,
nesting, a number's digits, bytes and encoding of a recipe file (R-D15, C-D14); every key that sizes an
allocation has an upper bound and the widths' parameter count is estimated before a model is built, for a
recipe, `--set` and a run's config.json alike (R-D16); config.json and vocab.json are read with JSON's bounds
(`vsekit.utils.safe_json`, C-D14). Each refusal is one line naming the file or key, exit 2."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap
import typing
from pathlib import Path

import pytest

from vsekit import registry
from vsekit.cli import main
from vsekit.config import ConfigError, Recipe, builtin_recipes, load_recipe
from vsekit.models.vse import DataSpec
from vsekit.runs import CheckpointError, read_run_config, write_run_config

MEMORY = (
    3 << 30
)  # the child's address space: torch's import needs ~1.5 GB of it; the probe's bomb took 3.16 GB
TIMEOUT_S = 60  # the probe's bomb ran 42 s; a refusal takes the child's start (~3 s)

WORDS = ["<pad>", "<start>", "<end>", "<unk>", "<mask>", "a", "dog"]


def run_bounded(code: str, cwd: Path) -> subprocess.CompletedProcess:
    """Python `code` in a child limited to MEMORY bytes of address space and TIMEOUT_S seconds."""
    head = f"import resource, sys\nresource.setrlimit(resource.RLIMIT_AS, ({MEMORY}, {MEMORY}))\n"
    return subprocess.run(
        [sys.executable, "-c", head + textwrap.dedent(code)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


def cli_bounded(argv: list[str], cwd: Path) -> subprocess.CompletedProcess:
    return run_bounded(f"from vsekit.cli import main\nsys.exit(main({argv!r}))", cwd)


def one_line_error(capsys, argv: list[str]) -> str:
    """`vse ARGV` exits 2 with exactly one line on stderr, which is returned."""
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "internal error" not in err.lower() and "Traceback" not in err
    return err


def alias_bomb() -> str:
    """The probe's ~600-byte recipe: ten levels of nine aliases each, 9**10 nodes once expanded."""
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 10)]
    lines.append("name: [" + ", ".join(["*a9"] * 9) + "]")
    return "\n".join(lines) + "\n"


def make_run(tmp_path: Path, recipe: Recipe | None = None, spec: DataSpec | None = None) -> Path:
    """A run folder as vsekit writes it (config.json, vocab.json), without weights: every check here comes first."""
    run = tmp_path / "run"
    run.mkdir()
    write_run_config(
        run, recipe or load_recipe("vse_infty"), spec or DataSpec(img_dim=32, vocab_words=WORDS), {}
    )
    return run


def edit_config(run: Path, edit: typing.Callable[[dict], None]) -> None:
    path = run / "config.json"
    cfg = json.loads(path.read_text())
    edit(cfg)
    path.write_text(json.dumps(cfg))


# --- R-D15: YAML aliases, depth, bytes ---------------------------------------------------------------------------


def test_r_d15_alias_bomb_refused_before_expanding(tmp_path):
    """R-D15: the 9**10 alias recipe is one line naming the file and the alias, in a child under 3 GB;
    without the alias refusal it expands until the limit stops it."""
    recipe = tmp_path / "bomb.yaml"
    recipe.write_text(alias_bomb())
    assert recipe.stat().st_size < 700
    proc = cli_bounded(["recipes", str(recipe)], tmp_path)
    err = proc.stderr.strip()
    assert proc.returncode == 2, err[-2000:]
    assert len(err.splitlines()) == 1 and str(recipe) in err and "alias (*a0)" in err


def test_r_d15_one_alias_refused_and_no_builtin_recipe_uses_anchors(tmp_path):
    """R-D15: even one alias is refused (recipes never need them), and the shipped recipes load without any."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("base: vsepp\nd: &w 512\nmodel: {embed_dim: *w}\n")
    with pytest.raises(ConfigError, match=r"r\.yaml: an alias \(\*w\)"):
        load_recipe(str(recipe))
    for name in builtin_recipes():
        load_recipe(name)  # through the same loader


def test_r_d15_recipe_file_byte_cap(tmp_path):
    """R-D15: a recipe file over 1 MiB (here 2 MiB of comment) is refused by its size, naming it."""
    recipe = tmp_path / "big.yaml"
    recipe.write_text("base: vsepp\n#" + "x" * (2 << 20) + "\n")
    with pytest.raises(ConfigError, match=r"big\.yaml: 1,048,577 bytes, more than a recipe may hold"):
        load_recipe(str(recipe))


def test_r_d15_depth_limit_counts_levels(tmp_path):
    """R-D15: 32 levels of lists are read (the error is then the key's type), 33 are refused as too deep."""
    for depth, needle in ((32, "expected a string"), (33, "nested more than 32 levels deep")):
        recipe = tmp_path / f"d{depth}.yaml"
        # the top-level mapping is one level, so a value of depth-1 lists reaches `depth`
        recipe.write_text("name: " + "[" * (depth - 1) + "]" * (depth - 1) + "\n")
        with pytest.raises(ConfigError, match=needle):
            load_recipe(str(recipe))


# --- C-D14: internal errors on recipes, config.json, vocab.json --------------------------------------------------


@pytest.mark.parametrize(
    "name,content,needle",
    [
        ("deep", b"name: " + b"[" * 5000 + b"]" * 5000 + b"\n", "nested more than 32 levels deep"),
        (
            "digits",
            b"model:\n  embed_dim: " + b"9" * 5000 + b"\n",
            "a number of 5,000 characters (at most 40)",
        ),
        ("latin1", b"base: vsepp\nname: caf\xe9\n", "not UTF-8 text (byte 21)"),
        ("float_digits", b"optim:\n  lr: 0." + b"1" * 5000 + b"\n", "a number of 5,002 characters"),
        ("int_key", b"base: vsepp\n1: x\n", "key '1' is not a name"),
    ],
)
def test_c_d14_bad_recipe_file_is_one_line(tmp_path, capsys, name, content, needle):
    """C-D14: a recipe 5,000 lists deep, a 5,000-digit embed_dim, a recipe that is not UTF-8 (and a 5,000-digit
    float, a key that is a number): RecursionError, ValueError, UnicodeDecodeError or TypeError without the bounds;
    one line naming the file (or the key) and the problem now."""
    recipe = tmp_path / f"{name}.yaml"
    recipe.write_bytes(content)
    err = one_line_error(capsys, ["recipes", str(recipe)])
    assert needle in err
    assert str(recipe) in err or "key" in err


def test_c_d14_set_value_with_5000_digits(capsys, tmp_path):
    """C-D14: `--set model.embed_dim=<5,000 digits>` is one line naming the override (a ValueError before)."""
    err = one_line_error(
        capsys,
        [
            "train",
            "--data",
            str(tmp_path),
            "--set",
            "model.embed_dim=" + "9" * 5000,
            "--out",
            str(tmp_path / "o"),
        ],
    )
    assert "override 'model.embed_dim=999" in err and "a number of 5,000 characters" in err
    assert len(err) < 400  # the value is not echoed whole


def test_c_d14_nan_and_infinity_refused_in_a_recipe():
    """C-D14: no recipe key takes NaN or infinity, so config.json never holds what JSON's bounds refuse on the way
    back (`ladder_percentile` has no range of its own; YAML reads `.nan` and `.inf` as floats)."""
    for value in (".nan", ".inf", "-.inf", "1e999"):
        with pytest.raises(ConfigError, match=r"loss\.ladder_percentile=\S+: must be a finite number"):
            load_recipe("vse_infty", ["loss.name=ladder", f"loss.ladder_percentile={value}"])


@pytest.mark.parametrize("name", builtin_recipes())
def test_c_d14_every_builtin_recipe_round_trips_through_bounded_config_json(tmp_path, name):
    """C-D14: what vsekit writes into config.json is read back by the bounded reader unchanged."""
    recipe = load_recipe(name)
    run = make_run(tmp_path, recipe)
    assert read_run_config(run)[0] == recipe


def test_c_d14_config_json_100000_deep(tmp_path, capsys):
    """C-D14: a run's config.json nested 100,000 deep: RecursionError without the bounds, one line naming it now, from
    `vse eval` and `vsekit.load`."""
    import vsekit

    run = make_run(tmp_path)
    (run / "config.json").write_text('{"format": 1, "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    err = one_line_error(capsys, ["eval", str(run), "--device", "cpu"])
    assert f"{run / 'config.json'}: nested more than 64 levels deep" in err
    with pytest.raises(CheckpointError, match="nested more than 64 levels deep"):
        vsekit.load(run)


@pytest.mark.parametrize(
    "content,needle",
    [
        ('["<pad>", "<start>", "<end>", "<unk>", "<mask>"]', "expected {'words': [...]}"),
        ('{"words": 7}', "'words' must be a list of words"),
        ('{"words": [1, 2, 3]}', "'words' must be a list of words"),
        ("[" * 1000 + "]" * 1000, "nested more than 64 levels deep"),
        ('{"words": ["<pad>", "\\ud800"]}', "lone surrogate"),
    ],
)
def test_c_d14_run_vocab_json_shapes(tmp_path, capsys, content, needle):
    """C-D14: a run's vocab.json that is a list (TypeError without the bounds), or not a list of strings, or too deep:
    one line naming vocab.json."""
    run = make_run(tmp_path)
    (run / "vocab.json").write_text(content)
    err = one_line_error(capsys, ["eval", str(run), "--device", "cpu"])
    assert str(run / "vocab.json") in err and needle in err


def test_c_d14_vocab_path_of_a_recipe_is_bounded(tmp_path):
    """C-D14: a recipe's vocab_path (Vocabulary.load) is read with the same bounds: a list, a 41-digit number."""
    from vsekit.data.text import Vocabulary
    from vsekit.errors import VseInputError

    bad = tmp_path / "v.json"
    for content, needle in (
        ("[1, 2]", "expected"),
        ('{"words": [' + "1" * 41 + "]}", "a number of 41 characters"),
    ):
        bad.write_text(content)
        with pytest.raises(VseInputError, match=needle):
            Vocabulary.load(bad)
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"words": WORDS}))
    assert Vocabulary.load(good).idx2word == WORDS


# --- R-D16: magnitudes -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "override,needle",
    [
        ("model.embed_dim=1000000000", "model.embed_dim=1000000000: at most 65,536"),
        ("train.batch_size=100000000", "train.batch_size=100000000: at most 1,048,576"),
        ("model.text.word_dim=1000000000", "model.text.word_dim=1000000000: at most 65,536"),
        ("model.text.num_layers=1000", "model.text.num_layers=1000: at most 256"),
        ("model.image.mlp_hidden=65537", "model.image.mlp_hidden=65537: at most 65,536"),
        ("data.num_workers=100000", "data.num_workers=100000: at most 256"),
    ],
)
def test_r_d16_set_sizes_have_upper_bounds(override, needle):
    """R-D16: sizes were checked for sign only (the allocator was the check); each is bounded by its key now."""
    with pytest.raises(ConfigError, match=needle):
        load_recipe("vse_infty", [override])


def test_r_d16_set_bound_from_the_cli(capsys, tmp_path):
    """R-D16: `vse train --set model.embed_dim=1000000000` is one line naming the key and the bound, exit 2."""
    err = one_line_error(
        capsys,
        [
            "train",
            "--data",
            str(tmp_path),
            "--set",
            "model.embed_dim=1000000000",
            "--out",
            str(tmp_path / "o"),
        ],
    )
    assert "model.embed_dim=1000000000: at most 65,536" in err


def test_r_d16_widths_within_bounds_but_too_many_parameters():
    """R-D16: embed_dim 65,536 is within its bound, but its BiGRU alone holds 2 directions x 3 gates x
    65,536 x (300 + 65,536) = 25,887,571,968 weights (hand count): refused with the key before allocating."""
    with pytest.raises(ConfigError) as e:
        load_recipe("vse_infty", ["model.embed_dim=65536", "loss.hrem_embed_dim=65536"])
    message = str(e.value)
    assert message.startswith("model.embed_dim=65536: the model would hold about 25.9 G parameters")
    assert "bound of 1.07 G" in message


def test_r_d16_estimate_against_torch_parameter_count():
    """R-D16: the estimate is within the model's real size, counted by torch (it leaves out biases, norms and the
    GPO pooling's small vectors, so it is a little lower), for a BiGRU + region model."""
    from vsekit.config import parameter_estimate
    from vsekit.models.vse import VSEModel

    recipe = load_recipe(
        "vse_infty",
        [
            "model.embed_dim=96",
            "model.text.word_dim=40",
            "model.image.mlp_hidden=48",
            "model.text.num_layers=2",
        ],
    )
    spec = DataSpec(img_dim=64, vocab_words=WORDS + [f"w{i}" for i in range(200)])
    estimate = sum(n for _, n in parameter_estimate(recipe, spec.img_dim, len(spec.vocab_words)))
    actual = sum(p.numel() for p in VSEModel(recipe, spec).parameters())
    assert 0.9 * actual <= estimate <= actual


@pytest.mark.parametrize(
    "edit,needle",
    [
        (
            lambda c: c["recipe"]["model"].update(embed_dim=10**9),
            "model.embed_dim=1000000000: at most 65,536",
        ),
        (
            lambda c: c["recipe"]["model"]["text"].update(word_dim=10**9),
            "model.text.word_dim=1000000000: at most",
        ),
        (
            lambda c: c["data_spec"].update(img_dim=10**9),
            "data_spec.img_dim=1000000000: must be an integer 0 .. 65,536",
        ),
        (lambda c: c["data_spec"].update(img_dim="wide"), "data_spec.img_dim=wide"),
    ],
)
def test_r_d16_run_config_json_magnitudes(tmp_path, capsys, edit, needle):
    """R-D16: a run's config.json with embed_dim or word_dim 10**9 (or a feature width 10**9): `vse eval` and
    `vsekit.load` refuse it with the key and the bound (an allocator error after up to 20 s without the bounds)."""
    import vsekit

    run = make_run(tmp_path)
    edit_config(run, edit)
    err = one_line_error(capsys, ["eval", str(run), "--device", "cpu"])
    assert needle in err and str(run / "config.json") in err
    with pytest.raises(CheckpointError, match=needle.replace("(", r"\(").replace(".", r"\.")):
        vsekit.load(run)


def test_r_d16_run_config_parameter_estimate_uses_the_runs_vocabulary(tmp_path):
    """R-D16: in-bound widths with the run's own vocabulary: 20,000 words x word_dim 65,536 = 1.31 G weights in
    the word embedding, plus the BiGRU's 6 x 1,024 x (65,536 + 1,024) = 0.41 G (hand count): 1.7 G, over the
    bound, refused naming word_dim before any allocation."""
    recipe = load_recipe("vse_infty", ["model.text.word_dim=65536"])  # no vocabulary yet: accepted
    run = make_run(
        tmp_path, recipe, DataSpec(img_dim=32, vocab_words=WORDS + [f"w{i}" for i in range(19_993)])
    )
    with pytest.raises(
        CheckpointError, match=r"word_dim=65536: the model would hold about 1\.7 G .*1\.3 G from this key"
    ):
        read_run_config(run)


def test_r_d16_load_refuses_in_a_bounded_child(tmp_path):
    """R-D16: `vsekit.load` of a run whose config.json says embed_dim 10**9 refuses under 3 GB of address space,
    fast: the check comes before the allocation."""
    run = make_run(tmp_path)
    edit_config(run, lambda c: c["recipe"]["model"].update(embed_dim=10**9))
    proc = run_bounded(
        f"""
        import vsekit
        from vsekit.runs import CheckpointError
        try:
            vsekit.load({str(run)!r})
        except CheckpointError as e:
            print(e)
            sys.exit(2)
        """,
        tmp_path,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "model.embed_dim=1000000000: at most 65,536" in proc.stdout


def _width_like(name: str) -> bool:
    """A key whose name says it sizes a tensor or a loop run every step (a warm-up's step count does not)."""
    sizes = ("_dim", "hidden", "heads", "batch_size", "layers", "views", "_chunk", "_iters", "_cache_mb")
    named = ("k", "d_pe", "image_size", "max_tokens", "num_workers", "hrem_topk", "caption_buckets")
    return (name.endswith(sizes) or name in named) and "warmup" not in name


def test_r_d16_every_size_key_declares_a_bound():
    """R-D16: each integer key whose name says it sizes something (a width, heads, layers, a batch, views, a
    chunk, iterations) declares `max=`, read by the one validator; a new one without fails here."""
    sections = [Recipe, *[type(s) for s in (Recipe().model, Recipe().data, Recipe().optim, Recipe().train)]]
    fields = [
        (f.name, f, typing.get_type_hints(cls)[f.name]) for cls in sections for f in dataclasses.fields(cls)
    ]
    for kind in registry.KINDS:
        fields += [(k, key.field, key.type) for k, key in registry.keys(kind).items()]
    sized = [(name, f) for name, f, tp in fields if tp is int and _width_like(name)]
    assert len(sized) >= 20
    missing = [name for name, f in sized if f.metadata.get("max") is None]
    assert not missing, missing
    from vsekit.config import MAX_MODEL_PARAMETERS

    assert MAX_MODEL_PARAMETERS == 2**30


# --- safe_json unit tests ---------------------------------------------------------------------------------------


@pytest.fixture
def loads_bounded():
    from vsekit.utils.safe_json import loads_bounded

    return loads_bounded


@pytest.fixture
def JsonBoundsError():  # noqa: N802  (the class, named as it is imported)
    from vsekit.utils.safe_json import JsonBoundsError

    return JsonBoundsError


def test_safe_json_matches_json_within_bounds(loads_bounded):
    """An ordinary document parses as the standard library parses it (brackets inside strings are not levels)."""
    text = json.dumps({"a": [1, 2.5, {"b": '[[[[{{{{ \\" ]]'}], "c": "😀", "d": None, "e": -(10**20)})
    assert loads_bounded(text, "x") == json.loads(text)
    assert loads_bounded(text.encode(), "x") == json.loads(text)


def test_safe_json_depth_boundary(loads_bounded, JsonBoundsError):
    """64 nested levels are read, 65 refused, counted the way json counts them (each [ or { one level)."""
    assert loads_bounded("[" * 64 + "]" * 64, "x") == json.loads("[" * 64 + "]" * 64)
    with pytest.raises(JsonBoundsError, match="x: nested more than 64 levels deep"):
        loads_bounded('{"a":' * 65 + "1" + "}" * 65, "x")
    with pytest.raises(JsonBoundsError, match="nested more than 64"):
        loads_bounded("[" * 100_000, "x")  # never closed: json would recurse as deep
    assert loads_bounded('["' + "[" * 1000 + '"]', "x") == ["[" * 1000]


def test_safe_json_numbers_constants_surrogates_encoding(loads_bounded, JsonBoundsError):
    with pytest.raises(JsonBoundsError, match="a number of 41 characters"):
        loads_bounded("1" * 41, "x")
    assert loads_bounded("1" * 40, "x") == int("1" * 40)
    for constant in ("NaN", "Infinity", "-Infinity"):
        with pytest.raises(JsonBoundsError, match=f"{constant} is not a JSON number"):
            loads_bounded(f"[{constant}]", "x")
    with pytest.raises(JsonBoundsError, match=r"lone surrogate \\ud800"):
        loads_bounded('["\\ud800"]', "x")
    assert loads_bounded('"\\ud83d\\ude00"', "x") == "\U0001f600"  # a pair is one character
    with pytest.raises(JsonBoundsError, match="x: not UTF-8 text"):
        loads_bounded(b'"caf\xe9"', "x")
    with pytest.raises(JsonBoundsError, match="x: not valid JSON"):
        loads_bounded("{", "x")
