"""`vse import` refuses what it cannot import in one line naming the file and the cause (exit 2, nothing
written): non-finite weights, wrong-typed options, vocabularies and configs, an --out that cannot be, and
pickles that name code (named as Python would import it, whatever the pickle protocol)."""

from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import warnings
from pathlib import Path

import pytest
import torch

from conftest import reference_fixture_dir
from vsekit.cli import main


def released(item: str, name: str) -> dict:
    with torch.serialization.safe_globals([argparse.Namespace]):
        return torch.load(reference_fixture_dir(item) / name, map_location="cpu", weights_only=True)


def vocab_file() -> Path:
    return sorted((reference_fixture_dir("vse_infty_bigru") / "vocab").glob("*.json"))[0]


def bigru_args(ckpt: Path, vocab: Path | None = None) -> list[str]:
    return ["import", "vse_infty", str(ckpt), "--vocab", str(vocab or vocab_file())]


def one_line_refusal(capsys, args: list[str], out: Path) -> str:
    """The import exits 2 with one `vse import: error:` line and creates nothing at --out or beside it."""
    beside = sorted(p.name for p in out.parent.iterdir()) if out.parent.is_dir() else None
    assert main(args + ["--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("vse import: error: "), err
    assert "internal error" not in err and "Errno" not in err
    assert not out.exists()
    if beside is not None:
        assert sorted(p.name for p in out.parent.iterdir()) == beside  # no temporary folder left either
    return err


# ------------------------------------------------------------------------------ non-finite weights


@pytest.mark.parametrize(
    ("value", "word"), [(float("nan"), "NaN"), (float("inf"), "inf"), (-float("inf"), "inf")]
)
def test_non_finite_weights_are_refused_naming_the_tensor(tmp_path, capsys, value, word):
    ckpt = released("vse_infty_bigru", "model_best.pth")
    ckpt["model"][1]["rnn.weight_hh_l0"][2, 3] = value
    path = tmp_path / "diverged.pth"
    torch.save(ckpt, path)
    err = one_line_refusal(capsys, bigru_args(path), tmp_path / "run")
    assert str(path) in err and "model[1].rnn.weight_hh_l0" in err and f"holds {word} (1 of " in err


def test_non_finite_weights_of_a_single_state_dict_are_named(tmp_path, capsys):
    ckpt = released("vse_2ad", "checkpoint.pth")
    key = next(k for k in ckpt["model"] if k.endswith("fc.weight"))
    ckpt["model"][key][0, 0] = float("nan")
    path = tmp_path / "diverged.pth"
    torch.save(ckpt, path)
    vocab = sorted((reference_fixture_dir("vse_2ad") / "vocab").glob("*.json"))[0]
    err = one_line_refusal(capsys, ["import", "vse_2ad", str(path), "--vocab", str(vocab)], tmp_path / "run")
    assert f"model.{key} holds NaN" in err


# ------------------------------------------------------------------------------ wrong-typed options


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("embed_size", "big", "an integer"),
        ("embed_size", [1024], "an integer"),
        ("embed_size", 32.5, "an integer"),
        ("img_dim", {"w": 64}, "an integer"),
        ("num_layers", "two", "an integer"),
        ("margin", "wide", "a finite number"),
        ("margin", float("nan"), "a finite number"),
        ("vse_mean_warmup_epochs", [1], "an integer"),
        ("no_imgnorm", torch.ones(3), "true or false"),
        ("no_txtnorm", "yes", "true or false"),
    ],
)
def test_wrong_typed_options_name_the_file_and_key(tmp_path, capsys, key, value, expected):
    ckpt = released("vse_infty_bigru", "model_best.pth")
    setattr(ckpt["opt"], key, value)
    path = tmp_path / "odd.pth"
    torch.save(ckpt, path)
    err = one_line_refusal(capsys, bigru_args(path), tmp_path / "run")
    assert str(path) in err and f"option {key!r}" in err and expected in err


def test_a_2ad_temperature_of_the_wrong_type_is_named(tmp_path, capsys):
    ckpt = released("vse_2ad", "checkpoint.pth")
    ckpt["args"].tau = "hot"
    path = tmp_path / "odd.pth"
    torch.save(ckpt, path)
    vocab = sorted((reference_fixture_dir("vse_2ad") / "vocab").glob("*.json"))[0]
    err = one_line_refusal(capsys, ["import", "vse_2ad", str(path), "--vocab", str(vocab)], tmp_path / "run")
    assert "option 'tau' is 'hot'" in err


def test_options_that_are_only_recorded_may_hold_anything(tmp_path):
    """Options the import does not use are recorded in config.json as JSON, whatever they hold."""
    ckpt = released("vse_infty_bigru", "model_best.pth")
    ckpt["opt"].extra = [torch.ones(2), float("nan"), {(1, 2): b"x"}]
    ckpt["opt"].embed_size = "32"  # an option argparse left untyped: a numeric string is read as its number
    path = tmp_path / "odd.pth"
    torch.save(ckpt, path)
    assert main(bigru_args(path) + ["--out", str(tmp_path / "run")]) == 0
    options = json.loads((tmp_path / "run" / "config.json").read_text())["imported_from"]["options"]
    assert (
        options["extra"] == ["tensor([1., 1.])", "nan", {"(1, 2)": "b'x'"}] and options["embed_size"] == "32"
    )


# ------------------------------------------------------------------------------ vocabularies and configs


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"\x7fELF\x02\x01\x01\x00\xd0\xff binary", "a binary file (not UTF-8 text)"),
        (b"{not json", "not a vocabulary JSON (Expecting property name"),
        (b"[1, 2, 3]", "found a JSON list"),
        (b'{"idx2word": 5}', "'idx2word' must be an object of id -> word"),
        (b'{"idx2word": {"0": "<pad>", "1": 1}}', "'idx2word' entry '1' is 1 (a JSON int), not a word"),
        (b'{"idx2word": ["<pad>", null]}', "'idx2word' entry 1 is None"),
        (b'{"words": "a b c"}', "'words' must be a list of words, got a JSON str"),
        (b'{"idx2word": {"0": "<pad>"}}', "vocabulary must start with"),
    ],
)
def test_bad_vocabularies_name_the_file_and_the_key(tmp_path, capsys, content, message):
    vocab = tmp_path / "vocab.json"
    vocab.write_bytes(content)
    good = reference_fixture_dir("vse_infty_bigru") / "model_best.pth"
    err = one_line_refusal(capsys, bigru_args(good, vocab), tmp_path / "run")
    assert err.startswith(f"vse import: error: {vocab}: ") and message in err


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"num_attention_heads": "four"}, "'num_attention_heads' is 'four', expected an integer"),
        ({"hidden_size": [64]}, "'hidden_size' is [64], expected an integer"),
        ({"layer_norm_eps": "small"}, "'layer_norm_eps' is 'small', expected a number"),
        ({"hidden_act": 5}, "'hidden_act' is 5, expected a string"),
        ({"hidden_act": "nope"}, "'hidden_act' is 'nope', not an activation transformers knows"),
    ],
)
def test_wrong_typed_text_config_names_the_file_and_the_field(tmp_path, capsys, config, message):
    meta = json.loads((reference_fixture_dir("vse_infty_bert") / "meta.json").read_text())
    path = tmp_path / "bert.json"
    path.write_text(json.dumps({**meta["bert_config"], **config}))
    ckpt = reference_fixture_dir("vse_infty_bert") / "model_best.pth"
    err = one_line_refusal(
        capsys, ["import", "vse_infty", str(ckpt), "--text-config", str(path)], tmp_path / "run"
    )
    assert err.startswith(f"vse import: error: {path}: BERT config field ") and message in err


@pytest.mark.parametrize(
    "block_dim, message",
    [
        ("0", "--block-dim must be at least 1, got 0"),  # refused while the command line is parsed
        ("-8", "--block-dim must be at least 1, got -8"),
        ("7", "embed size 32 is not a multiple of --block-dim 7"),  # the importer's own rule
    ],
)
def test_block_dim_must_be_positive(tmp_path, capsys, block_dim, message):
    folder = reference_fixture_dir("avse")
    meta = json.loads((folder / "meta.json").read_text())
    args = ["import", "avse", str(folder / "model_best.pth"), "--block-dim", block_dim]
    for key, flag in (("bert_config", "--text-config"), ("vit_config", "--vision-config")):
        (tmp_path / f"{key}.json").write_text(json.dumps(meta[key]))
        args += [flag, str(tmp_path / f"{key}.json")]
    assert message in one_line_refusal(capsys, args, tmp_path / "run")


# ------------------------------------------------------------------------------ --out


def test_out_under_a_file_says_so(tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    out = tmp_path / "afile" / "sub"
    good = reference_fixture_dir("vse_infty_bigru") / "model_best.pth"
    err = one_line_refusal(capsys, bigru_args(good), out)
    assert f"--out {out}: {tmp_path / 'afile'} is a file, not a folder" in err


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_out_where_no_folder_can_be_made_says_so(capsys):
    good = reference_fixture_dir("vse_infty_bigru") / "model_best.pth"
    assert main(bigru_args(good) + ["--out", "/proc/vsekit-test-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(
        "vse import: error: --out /proc/vsekit-test-run: cannot create the run folder in /proc"
    )
    assert len(err.splitlines()) == 1 and "Errno" not in err


# ------------------------------------------------------------------------------ unsafe pickles


class Reduces:
    """Pickles as a call of `func(*args)`: what a malicious checkpoint does."""

    def __init__(self, func, args) -> None:
        self.func, self.args = func, args

    def __reduce__(self):
        return self.func, self.args


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
@pytest.mark.parametrize("target", ["os.system", "subprocess.Popen"])
def test_unsafe_globals_are_refused_by_their_python_name(tmp_path, capsys, protocol, target):
    """Named as Python imports them (protocol 2 writes subprocess.Popen as `commands Popen` and os.system as
    `posix system`), refused for every protocol (4 and 5 were called corrupt), never run, and without torch's
    warning about the protocol."""
    marker = tmp_path / "ran"
    call = (
        (os.system, (f"touch {marker}",))
        if target == "os.system"
        else (subprocess.Popen, (["touch", str(marker)],))
    )
    path = tmp_path / "evil.pth"
    path.write_bytes(pickle.dumps({"model": Reduces(*call)}, protocol=protocol))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's "Detected pickle protocol" UserWarning would fail here
        err = one_line_refusal(capsys, bigru_args(path), tmp_path / "run")
    assert f"refused, an unsafe pickle: it names {target}, which a checkpoint never needs" in err
    assert "corrupt" not in err and not marker.exists()


@pytest.mark.parametrize("zipped", [True, False])
def test_unsafe_global_inside_a_protocol_4_torch_file_is_named(tmp_path, capsys, zipped):
    ckpt = released("vse_infty_bigru", "model_best.pth")
    ckpt["extra"] = Reduces(os.system, (f"touch {tmp_path / 'ran'}",))
    path = tmp_path / "evil.pth"
    torch.save(ckpt, path, pickle_protocol=4, _use_new_zipfile_serialization=zipped)
    err = one_line_refusal(capsys, bigru_args(path), tmp_path / "run")
    assert "it names os.system" in err and not (tmp_path / "ran").exists()


def test_a_clean_protocol_4_file_is_not_called_corrupt(tmp_path, capsys):
    """torch's safe loader reads protocol 2 only: a clean protocol-4 file is told so, not called corrupt."""
    path = tmp_path / "p4.pth"
    torch.save(released("vse_infty_bigru", "model_best.pth"), path, pickle_protocol=4)
    err = one_line_refusal(capsys, bigru_args(path), tmp_path / "run")
    assert "written with pickle protocol 4" in err and "corrupt" not in err
