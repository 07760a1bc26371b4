"""Limits of the dataset builders (`vse data folder | table | webdataset`) and of caption text: captions with
control characters and runaway captions (one rule, shared with `vse data check`), the token cap of the
tokenizers, a folder whose path is not UTF-8, what a failed build leaves behind, `--image-size` and the
out-of-memory advice, one build per `--out` at a time, and the trainer's dataset warnings."""

from __future__ import annotations

import csv
import io
import json
import os
import resource
import shutil
import subprocess
import sys
import tarfile
import threading
from pathlib import Path

import pytest
import torch
from PIL import Image

from vsekit.cli import main
from vsekit.data.precomp import DataFormatError, load_precomp_split
from vsekit.data.validate import check_dataset
from vsekit.datasets import own_checks, own_features, own_pairs

SPLITS = ("train", "dev", "test")
NUL, ESC, DEL = "\x00", "\x1b", "\x7f"
RUNAWAY = "dog " * 2_500_000  # a 10 MB caption
TINY = ["model.embed_dim=32", "model.text.word_dim=16", "train.batch_size=16", "optim.lr_decay_epochs=[1]"]


@pytest.fixture(autouse=True)
def _one_thread(_threads):
    torch.set_num_threads(1)


def png(i: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (40, 32), ((37 * i) % 256, (91 * i) % 256, (13 * i + 50) % 256)).save(buf, format="PNG")
    return buf.getvalue()


def write_input(kind: str, base: Path, captions: dict[str, list[str]]) -> list[str]:
    """The pictures p0, p1, … with their captions as a folder, a CSV table or a tar shard; the `vse data` args."""
    base.mkdir(parents=True, exist_ok=True)
    if kind == "folder":
        root = base / "in"
        root.mkdir()
        for i, (name, caps) in enumerate(captions.items()):
            (root / f"{name}.png").write_bytes(png(i))
            (root / f"{name}.txt").write_text("".join(c + "\n" for c in caps), encoding="utf-8")
        return ["folder", str(root)]
    if kind == "table":
        with open(base / "t.csv", "w", newline="", encoding="utf-8") as f:
            w = csv.writer(f)
            w.writerow(["image", "caption"])
            for i, (name, caps) in enumerate(captions.items()):
                (base / f"{name}.png").write_bytes(png(i))
                w.writerows((f"{name}.png", c) for c in caps)
        return ["table", str(base / "t.csv")]
    shard = base / "s-000.tar"
    with tarfile.open(shard, "w") as tf:
        for i, (name, caps) in enumerate(captions.items()):
            for member, data in ((f"{name}.png", png(i)), (f"{name}.txt", "\n".join(caps).encode())):
                info = tarfile.TarInfo(member)
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    return ["webdataset", str(shard)]


def written_captions(out: Path) -> dict[str, list[str]]:
    got: dict[str, list[str]] = {}
    for split in SPLITS:
        sp = load_precomp_split(out, split)
        for cap, row in zip(sp.captions, sp.cap2img):
            got.setdefault(sp.image_ids[row], []).append(cap)
    return got


def build(args: list[str], out: Path, *extra: str) -> int:
    return main(["data", *args, "--out", str(out), "--dev", "1", "--test", "1", "--no-progress", *extra])


# ------------------------------------------------------------------------------ W2: control characters


@pytest.mark.parametrize("kind", ["folder", "table", "webdataset"])
def test_builders_skip_and_report_captions_with_control_characters(kind, tmp_path, capsys):
    captions = {
        "p0": ["a red square"],
        "p1": ["a blue circle", f"in {ESC}[31mred"],
        "p2": ["a green bar", f"nul {NUL} x"],
        "p3": [f"del {DEL} only"],
        "p4": ["a grey dot"],
        "p5": ["a pink star"],
    }
    out = tmp_path / "out"
    assert build(write_input(kind, tmp_path, captions), out, "--pixels") == 0
    problems = (out / "problems.txt").read_text(encoding="utf-8").splitlines()
    assert any("p1.png: control character: caption 2: U+001B at character 4" in line for line in problems)
    assert any("p2.png: control character: caption 2: U+0000 at character 5" in line for line in problems)
    assert any("p3.png: control character: caption 1: U+007F" in line for line in problems)
    assert any("p3.png: no caption" in line for line in problems)  # its only caption went
    assert written_captions(out) == {
        "p0": ["a red square"],
        "p1": ["a blue circle"],
        "p2": ["a green bar"],
        "p4": ["a grey dot"],
        "p5": ["a pink star"],
    }
    assert json.loads((out / "manifest.json").read_text())["problems"]["control character"] == 3
    report = check_dataset(out)  # what the builders write, the check accepts
    assert report.ok, report.format()


@pytest.mark.parametrize("char", [NUL, ESC, DEL, "\x85"])
def test_check_refuses_the_captions_the_builders_skip(char, tiny_data, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(tiny_data, data)
    caps = (data / "train_caps.txt").read_text(encoding="utf-8").split("\n")
    caps[2] = f"a caption{char}with a control character"
    (data / "train_caps.txt").write_text("\n".join(caps), encoding="utf-8")
    report = check_dataset(data)
    assert [str(p) for p in report.errors] == [
        f"error: {data / 'train_caps.txt'}:3: control character: "
        f"U+{ord(char):04X} at character 10 (binary data or a terminal escape)"
    ]


# ------------------------------------------------------------------------------ C1: runaway captions


@pytest.mark.parametrize("tokenizer", ["regex", "nltk"])
def test_a_10_mb_caption_gives_at_most_the_token_cap(tokenizer):
    from vsekit.data.text import MAX_CAPTION_TOKENS, SPECIALS, Vocabulary

    if tokenizer == "nltk":
        pytest.importorskip("nltk")
    assert MAX_CAPTION_TOKENS == 256
    vocab = Vocabulary([*SPECIALS, "dog"], tokenizer)
    dog = vocab.word2idx["dog"]
    assert vocab.encode(RUNAWAY) == [1] + [dog] * 256 + [2]  # <start> 256 words <end>
    many = " ".join(f"w{i}" for i in range(300_000))  # 2 MB of distinct words
    assert Vocabulary.build([many], tokenizer=tokenizer).idx2word == [
        *SPECIALS,
        *sorted(f"w{i}" for i in range(256)),
    ]


def test_the_transformer_tokenizer_reads_the_start_of_a_runaway_caption():
    from vsekit.data.text import HFTextProcessor
    from vsekit.models.text import default_transformer_path, load_tokenizer

    tok = load_tokenizer(default_transformer_path())

    class Counting:  # the tokenizer, counting the words it is asked to encode
        calls = 0

        def __getattr__(self, name):
            return getattr(tok, name)

        def __len__(self):
            return len(tok)

        def encode(self, *a, **k):
            Counting.calls += 1
            return tok.encode(*a, **k)

    ids = HFTextProcessor(Counting(), max_tokens=64).encode("dog " * 250_000)  # 1 MB
    assert ids == [tok.cls_token_id] + [tok.convert_tokens_to_ids("dog")] * 62 + [tok.sep_token_id]
    assert Counting.calls <= 10_000 // 2  # the words of its first 10,000 characters, not 250,000


@pytest.mark.parametrize("kind", ["folder", "table", "webdataset"])
def test_builders_skip_and_report_over_long_captions(kind, tmp_path):
    long = "dog " * 5_000  # 20,000 characters: the readers refuse a caption file or table line above 1 MB
    captions = {
        "p0": ["a red square"],
        "p1": ["a blue circle", long],
        "p2": [long],
        "p3": ["a grey dot"],
        "p4": ["a pink star"],
    }
    out = tmp_path / "out"
    assert build(write_input(kind, tmp_path, captions), out, "--pixels") == 0
    problems = (out / "problems.txt").read_text(encoding="utf-8").splitlines()
    n = len(long.strip())
    assert any(
        line.endswith(
            f"p1.png: over-long caption: caption 2: {n:,} characters (the limit is 10,000); skipped"
        )
        for line in problems
    )
    assert any("p2.png: no caption" in line for line in problems)
    assert written_captions(out) == {
        "p0": ["a red square"],
        "p1": ["a blue circle"],
        "p3": ["a grey dot"],
        "p4": ["a pink star"],
    }
    assert (out / "train_caps.txt").stat().st_size < 1000


def _limit_memory() -> None:
    limit = 2 << 30  # 2 GiB of address space: the run with the cap needs well under 1.5
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def test_vse_train_with_a_10_mb_caption_runs_under_a_memory_limit(tiny_data, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(tiny_data, data)
    caps = (data / "train_caps.txt").read_text(encoding="utf-8").split("\n")
    caps[3] = RUNAWAY.strip()
    (data / "train_caps.txt").write_text("\n".join(caps), encoding="utf-8")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "MALLOC_ARENA_MAX": "2"}
    cmd = [
        sys.executable,
        "-m",
        "vsekit.cli",
        "train",
        "--data",
        str(data),
        "--out",
        str(tmp_path / "run"),
        "--epochs",
        "1",
        "--recipe",
        "vsepp",
        "--no-progress",
        *[x for s in TINY for x in ("--set", s)],
    ]
    proc = subprocess.run(cmd, preexec_fn=_limit_memory, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "run" / "config.json").is_file()
    report = check_dataset(data)  # a warning, not an error: the text encoders read its start only
    assert report.ok and [p.message.split(":")[0] for p in report.warnings] == ["over-long caption"]


# ------------------------------------------------------------------------------ C3: a folder path that is not UTF-8


def test_a_folder_whose_path_is_not_utf8_builds_and_records_it_escaped(tmp_path, capsys):
    base = tmp_path / os.fsdecode(b"pics\xff")
    try:
        base.mkdir()
    except (OSError, UnicodeEncodeError):
        pytest.skip("this file system refuses names that are not UTF-8")
    for i in range(5):
        (base / f"p{i}.png").write_bytes(png(i))
        (base / f"p{i}.txt").write_text(f"picture number {i}\n", encoding="utf-8")
    out = tmp_path / "out"
    assert build(["folder", str(base)], out, "--pixels") == 0
    assert "dataset ready" in capsys.readouterr().out
    m = json.loads((out / "manifest.json").read_text(encoding="utf-8"))
    assert m["source"]["input"] == str(tmp_path) + "/pics\\xff"  # the byte 0xff written as \xff
    assert (
        "images_root" not in m and m["build"]["copy_images"]
    )  # the pictures were copied: their folder is unrecordable
    assert sorted(p.name for p in (out / "images").iterdir()) == [f"p{i}.png" for i in range(5)]
    assert check_dataset(out).ok
    assert sorted(c for caps in written_captions(out).values() for c in caps) == [
        f"picture number {i}" for i in range(5)
    ]


# ------------------------------------------------------------------------------ P1: what a failed build leaves


TINYNET = (
    "import torch\n"
    "class Tiny(torch.nn.Module):\n"
    "    def __init__(self):\n"
    "        super().__init__()\n"
    "        self.features = torch.nn.Conv2d(3, 2, 1, stride=32)\n"
    "def make():\n"
    "    return Tiny()\n"
)


def tinynet(tmp_path: Path, monkeypatch, weight: float) -> list[str]:
    """A python: backbone (1x1 convolution) with all weights `weight` (NaN: every feature is NaN)."""
    (tmp_path / "tinynet_limits.py").write_text(TINYNET)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("tinynet_limits", None)
    path = tmp_path / f"tiny_{weight}.pth"
    torch.save({"features.weight": torch.full((2, 3, 1, 1), weight), "features.bias": torch.zeros(2)}, path)
    return [
        "--backbone",
        "python:tinynet_limits:make",
        "--backbone-weights",
        str(path),
        "--image-size",
        "64",
        "--device",
        "cpu",
        "--batch-size",
        "1",
    ]


def test_a_failed_build_removes_what_it_created_but_never_an_earlier_cache(tmp_path, monkeypatch, capsys):
    args = write_input("folder", tmp_path / "a", {f"p{i}": [f"picture {i}"] for i in range(5)})
    out = tmp_path / "out"
    assert build(args, out, *tinynet(tmp_path, monkeypatch, float("nan"))) == 2
    assert "non-finite features" in capsys.readouterr().err
    assert not out.exists()  # no OUT/.cache, no OUT
    out.mkdir()
    assert build(args, out, *tinynet(tmp_path, monkeypatch, float("nan"))) == 2
    assert out.is_dir() and not any(out.iterdir())  # a folder that was there stays, empty as it was
    assert build(args, out, "--pixels") == 0  # an earlier build: its cache and dataset
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    checked = (out / ".cache" / "checked.json").read_bytes()
    assert build(args, out, *tinynet(tmp_path, monkeypatch, float("nan"))) == 2
    assert (out / ".cache" / "checked.json").read_bytes() == checked and (out / "manifest.json").is_file()
    assert set(before) <= {p.relative_to(out) for p in out.rglob("*")}


def test_a_failed_build_keeps_finished_feature_parts_and_the_rerun_resumes(tmp_path, monkeypatch):
    args = write_input("folder", tmp_path / "a", {f"p{i}": [f"picture {i}"] for i in range(5)})
    out = tmp_path / "out"
    net = tinynet(tmp_path, monkeypatch, 0.5)
    monkeypatch.setattr(own_features, "PART_PICTURES", 1)  # a part a picture
    real, calls = own_features.extract_part, {"n": 0}

    def failing_second(*a, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            raise DataFormatError("p-something: a picture that cannot be read")
        return real(*a, **k)

    monkeypatch.setattr(own_features, "extract_part", failing_second)
    assert build(args, out, *net) == 2
    assert own_features.finished_parts(out / ".cache" / "features") == 1
    monkeypatch.setattr(own_features, "extract_part", real)
    assert build(args, out, *net) == 0
    m = json.loads((out / "manifest.json").read_text())
    assert m["cache"] == {"features_computed": 4, "features_reused": 1}


# ------------------------------------------------------------------------------ P2: --image-size, out-of-memory advice


def test_image_size_is_checked_while_parsing(tmp_path, capsys):
    assert build(["folder", str(tmp_path / "missing")], tmp_path / "out", "--image-size", "100000") == 2
    assert capsys.readouterr().err.strip() == "vse data: error: --image-size must lie in 32..1024, got 100000"
    assert not (tmp_path / "out").exists()


def test_out_of_memory_advice_names_only_the_commands_options(tiny_data, tmp_path, monkeypatch, capsys):
    import vsekit.data.validate as validate

    def exhausted(*a, **k):
        raise MemoryError("Unable to allocate 19.0 GiB")

    monkeypatch.setattr(validate, "check_dataset", exhausted)
    assert main(["data", "check", str(tiny_data)]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err
        == "vse data: error: out of memory (Unable to allocate 19.0 GiB); free some memory or use a machine with more"
    )
    monkeypatch.setattr(own_pairs, "build_own_dataset", exhausted)
    args = write_input("folder", tmp_path, {"p0": ["a picture"]})
    assert build(args, tmp_path / "out") == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith("; try a smaller --batch-size or a smaller --image-size or another --device")
    )


# ------------------------------------------------------------------------------ P7: one build per --out


def test_a_second_build_into_the_same_folder_fails_naming_it(tmp_path, monkeypatch, capsys):
    args = write_input("folder", tmp_path, {f"p{i}": [f"picture {i}"] for i in range(5)})
    out = tmp_path / "out"
    inside, release = threading.Event(), threading.Event()
    real, calls = own_checks.check_picture, []

    def held_first(ref, name):  # the first check of the first build waits until released
        calls.append(name)
        if len(calls) == 1:
            inside.set()
            release.wait(30)
        return real(ref, name)

    monkeypatch.setattr(own_checks, "check_picture", held_first)
    codes: list[int] = []
    thread = threading.Thread(target=lambda: codes.append(build(args, out, "--pixels", "--workers", "1")))
    thread.start()
    try:
        assert inside.wait(30)
        capsys.readouterr()
        assert build(args, out, "--pixels") == 2
        errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
        assert errors == [
            f"vse data: error: {out / '.lock'}: another `vse data` build is writing to this folder "
            f"right now (pid {os.getpid()}); wait for it to finish"
        ]
    finally:
        release.set()
        thread.join(120)
    assert codes == [0] and (out / "manifest.json").is_file() and not (out / ".lock").exists()
    other = tmp_path / "other"
    other.mkdir()
    (other / ".lock").write_text("999999999\n")  # left by a killed build: it does not block
    assert build(args, other, "--pixels") == 0 and not (other / ".lock").exists()


# ------------------------------------------------------------------------------ P9: the trainer's warnings


def test_trainer_logs_a_dataset_warning_with_one_prefix(tiny_data, tmp_path):
    from vsekit.config import load_recipe
    from vsekit.training.trainer import Trainer

    data = tmp_path / "data"
    shutil.copytree(tiny_data, data)
    caps = (data / "train_caps.txt").read_text(encoding="utf-8").split("\n")
    caps[0] = " ".join(["word"] * 201)
    (data / "train_caps.txt").write_text("\n".join(caps), encoding="utf-8")
    lines: list[str] = []
    Trainer(load_recipe("vsepp", TINY), data, tmp_path / "run", progress=False, log=lines.append)
    warned = [line for line in lines if "train_caps.txt:1" in line]
    assert warned == [
        f"warning: {data / 'train_caps.txt'}:1: 201 words (over 200; text encoders read the first ones only)"
    ]
