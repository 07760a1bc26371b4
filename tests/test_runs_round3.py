"""Round 3 of the probe on runs and writes: a run has one writer (D-D21), a full disk or file-size limit is one
line with the earlier state kept (P-D22), `--fold5` only where COCO 1K applies (W-D18), and the public encoders
work in bounded chunks without an autograd graph in eval mode (R-D17).

Every test that provokes exhaustion (a file-size limit, 20,000 captions at once) runs in a child process under
`resource.setrlimit` (RLIMIT_FSIZE with SIGXFSZ ignored; RLIMIT_AS), never on the machine's whole disk or memory.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from vsekit.cli import main
from vsekit.config import load_recipe
from vsekit.models.vse import DataSpec, VSEModel
from vsekit.training.trainer import Trainer
from vsekit_lab.datasets.synthetic import make_synthetic_precomp

TINY = [
    "model.embed_dim=32",
    "model.text.word_dim=16",
    "train.batch_size=16",
    "train.log_every=1",
    "optim.lr_decay_epochs=[1]",
    "train.epochs=1",
]
TIMEOUT_S = 120
VOCAB = ["<pad>", "<start>", "<end>", "<unk>", "<mask>"] + [f"w{i}" for i in range(45)]


@pytest.fixture(autouse=True)
def _one_thread(_threads):
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return make_synthetic_precomp(
        tmp_path_factory.mktemp("tiny"), n_train=48, n_dev=12, n_test=12, regions=4, dim=8
    )


@pytest.fixture(scope="module")
def trained(data, tmp_path_factory) -> Path:
    """A finished 1-epoch run (copied by each test that changes it)."""
    run = tmp_path_factory.mktemp("trained") / "run"
    Trainer(load_recipe("vsepp", TINY), data, run, progress=False, log=lambda *_: None).fit()
    return run


def copy_run(trained: Path, tmp_path: Path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    return run


def digests(folder: Path) -> dict[str, str]:
    """sha256 of every file under `folder` (by relative path): the state a failed command must leave."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def vse_child(argv: list[str], cwd: Path, head: str) -> subprocess.CompletedProcess:
    """`vse ARGV` in a child process that runs `head` (its resource limits) first."""
    code = head + "\nfrom vsekit.cli import main\nsys.exit(main(sys.argv[1:]))\n"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run(
        [sys.executable, "-c", code, *argv],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env=env,
    )


def file_size_limit(limit: int) -> str:
    """A child's preamble: files may not grow past `limit` bytes, and SIGXFSZ is ignored so that a write past
    it fails with EFBIG (the signal's default action kills the process outright)."""
    return textwrap.dedent(f"""
        import resource, signal, sys
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))
    """)


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "error" in line]


# ------------------------------------------------------------------------- D-D21: a run has one writer


def test_d_d21_second_train_of_a_running_run_is_refused_and_writes_nothing(trained, data, tmp_path, capsys):
    """D-D21: while one `vse train` holds the run (its writer lock), a second `vse train --resume RUN` stops
    with one line naming the other writer's pid, exit 2, and metrics.jsonl and every other file unchanged."""
    from vsekit.utils.locks import folder_lock  # the lock `vse index` uses, which a run's writer holds too

    run = copy_run(trained, tmp_path)
    before = digests(run)
    with folder_lock(run, "vse train", "this run", log=lambda *_: None, name=".lock") as lock:
        assert lock.read_text().split()[0] == str(os.getpid())  # the holder's pid, as the message names it
        rc = main(["train", "--resume", str(run), "--epochs", "3", "--no-progress", "--device", "cpu"])
        err = capsys.readouterr().err
        assert rc == 2
        lines = error_lines(err)
        assert len(lines) == 1 and "another vse train" in lines[0] and f"pid {os.getpid()}" in lines[0]
        assert str(run) in lines[0]
        # a fresh run over it (--overwrite) is refused the same way, before anything is cleared
        argv = ["train", "--recipe", "vsepp", "--data", str(data), "--out", str(run), "--overwrite"]
        assert main([*argv, "--no-progress", "--device", "cpu", *sum((["--set", s] for s in TINY), [])]) == 2
        assert "another vse train" in capsys.readouterr().err
        assert {k: v for k, v in digests(run).items() if k != ".lock"} == before
    assert not (run / ".lock").exists()


def test_d_d21_the_lock_is_held_for_the_whole_run_and_released_after(trained, tmp_path, monkeypatch, capsys):
    """D-D21: `vse train --resume` holds RUN/.lock while it trains (seen from inside the trainer's fit) and
    removes it when it ends, so the next resume is not blocked."""
    from vsekit.utils.locks import lock_owner

    run = copy_run(trained, tmp_path)
    seen = []
    real_fit = Trainer.fit

    def spying_fit(self, *args, **kwargs):
        seen.append(lock_owner(run / ".lock"))
        return real_fit(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "fit", spying_fit)
    assert main(["train", "--resume", str(run), "--epochs", "2", "--no-progress", "--device", "cpu"]) == 0
    assert seen == [os.getpid()]
    assert not (run / ".lock").exists()
    epochs = [json.loads(x)["epoch"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert epochs.count(2) > 0 and sorted(set(epochs)) == [1, 2]  # epoch 2 trained once, after epoch 1


# ----------------------------------------------------------------- P-D22: a full disk, a file-size limit


def test_p_d22_checkpoint_at_a_file_size_limit_is_one_line_and_keeps_the_last_checkpoint(trained, tmp_path):
    """P-D22: a resumed run whose checkpoint cannot be written (RLIMIT_FSIZE of 100 kB, below the 136 kB
    weights; SIGXFSZ ignored so the write raises EFBIG) stops with one line naming the file and the free
    space, exit 2; the committed checkpoint set is intact and loads."""
    from vsekit.runs import load_run, read_checkpoint_set

    run = copy_run(trained, tmp_path)
    assert (run / "last.safetensors").stat().st_size > 100_000  # else the limit would not be reached
    old = {
        p: hashlib.sha256((run / p).read_bytes()).hexdigest()
        for p in ("last.manifest.json", "best.manifest.json")
    }
    old_set = {s: p.read_bytes() for s, p in read_checkpoint_set(run, "last", (".safetensors",)).items()}
    res = vse_child(
        ["train", "--resume", str(run), "--epochs", "2", "--no-progress", "--device", "cpu"],
        tmp_path,
        file_size_limit(100_000),
    )
    assert res.returncode == 2, res.stderr[-2000:]
    lines = error_lines(res.stderr)
    assert len(lines) == 1, res.stderr[-2000:]
    assert "internal error" not in res.stderr and "Traceback" not in res.stderr
    assert "cannot be written" in lines[0] and "free in" in lines[0] and str(run) in lines[0]
    assert "file-size limit" in lines[0]
    for p, digest in old.items():
        assert hashlib.sha256((run / p).read_bytes()).hexdigest() == digest
    now = read_checkpoint_set(run, "last", (".safetensors",))
    assert {s: p.read_bytes() for s, p in now.items()} == old_set
    assert not list((run / "ckpt").glob("last-000001*"))  # the failed set's files are gone
    load_run(run, "last")  # sha256-checked against the manifest


@pytest.mark.parametrize("number", [errno.ENOSPC, errno.EDQUOT])
def test_p_d22_full_disk_or_quota_during_a_checkpoint_is_one_line(
    trained, tmp_path, monkeypatch, capsys, number
):
    """P-D22: ENOSPC / EDQUOT while the checkpoint's weights are written: one line naming the file and the
    free space (as `shutil.disk_usage` of its folder says), exit 2, the last committed set kept."""
    import vsekit.runs as runs

    run = copy_run(trained, tmp_path)
    manifest = (run / "last.manifest.json").read_bytes()
    real = runs.atomic_write_bytes

    def full(path, data, *args, **kwargs):
        if Path(path).name.startswith("last-") and Path(path).suffix == ".safetensors":
            raise OSError(number, os.strerror(number))  # what write(2) raises, without a file name
        return real(path, data, *args, **kwargs)

    monkeypatch.setattr(runs, "atomic_write_bytes", full)
    rc = main(["train", "--resume", str(run), "--epochs", "2", "--no-progress", "--device", "cpu"])
    err = capsys.readouterr().err
    assert rc == 2
    lines = error_lines(err)
    assert len(lines) == 1 and "internal error" not in err
    free_gib = shutil.disk_usage(run).free / (1 << 30)
    assert "last.manifest.json" in lines[0] and "free in" in lines[0]
    assert os.strerror(number) in lines[0]  # "No space left on device", "Disk quota exceeded"
    if free_gib >= 1:
        shown = float(lines[0].split(" GiB free in")[0].rsplit("(", 1)[1])
        assert shown == pytest.approx(free_gib, abs=0.2)  # disk use may change a little meanwhile
    assert (run / "last.manifest.json").read_bytes() == manifest
    assert "the run keeps its previous last checkpoint" in lines[0]


def test_p_d22_index_append_at_a_file_size_limit_is_one_line_and_keeps_the_index(trained, data, tmp_path):
    """P-D22: `vse index` adding a split to an index under RLIMIT_FSIZE (5 kB, below a segment's 7.8 kB
    caption embeddings): one line naming the file and the free space, exit 2; every file of the index as it
    was, and the index still searches."""
    out = tmp_path / "idx"
    assert main(["index", str(trained), f"{data}:test", "--out", str(out), "--quiet", "--device", "cpu"]) == 0
    before = digests(out)
    res = vse_child(
        ["index", str(trained), f"{data}:dev", "--out", str(out), "--quiet", "--device", "cpu"],
        tmp_path,
        file_size_limit(5_000),
    )
    assert res.returncode == 2, res.stderr[-2000:]
    lines = error_lines(res.stderr)
    assert len(lines) == 1 and "internal error" not in res.stderr, res.stderr[-2000:]
    assert "cannot be written" in lines[0] and "free in" in lines[0] and str(out) in lines[0]
    assert digests(out) == before
    from vsekit.search.index import SearchIndex

    assert len(SearchIndex(out).meta["segments"]) == 1  # loads as before, its one segment


def test_p_d22_atomic_write_past_the_limit_keeps_the_old_file(tmp_path):
    """P-D22: `atomic_write_bytes` past RLIMIT_FSIZE raises `StorageFullError` (one line naming the file), the
    old file keeps its bytes and no temporary file is left."""
    target = tmp_path / "f.bin"
    target.write_bytes(b"old")
    code = file_size_limit(1000) + textwrap.dedent(f"""
        from vsekit.utils.io import StorageFullError, atomic_write_bytes
        try:
            atomic_write_bytes({str(target)!r}, b"x" * 5000)
        except StorageFullError as e:
            print("refused:", e)
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT_S)
    assert res.stdout.startswith(f"refused: {target}: cannot be written"), res.stdout + res.stderr
    assert "previous copy is kept" in res.stdout and len(res.stdout.strip().splitlines()) == 1
    assert target.read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["f.bin"]


# --------------------------------------------------------------------- W-D18: --fold5 is COCO 1K only


def test_w_d18_eval_sims_fold5_refuses_a_5x25_matrix(tmp_path, capsys):
    """W-D18: on a random 5x25 matrix every "fold" is one image (rsum 600): `vse eval-sims --fold5` refuses
    it in one line naming the sizes, exit 2."""
    sims = tmp_path / "sims.npy"
    np.save(sims, np.random.default_rng(0).standard_normal((5, 25)).astype(np.float32))
    assert main(["eval-sims", str(sims), "--fold5"]) == 2
    err = capsys.readouterr().err
    lines = error_lines(err)
    assert len(lines) == 1 and "5,000 images" in lines[0] and "has 5 images and 25 captions" in lines[0]
    assert main(["eval-sims", str(sims)]) == 0  # without --fold5 it is scored as it is


def test_w_d18_evaluate_sims_fold5_needs_5000_images_with_5_captions_each():
    """W-D18: the Python entry point raises ValueError off the protocol; the rule accepts exactly COCO's test
    layout (5,000 images x 5 captions, in any caption order) and nothing else of the same image count."""
    from vsekit.metrics import evaluate_sims
    from vsekit.metrics.retrieval import check_fold5_protocol

    rng = np.random.default_rng(1)
    with pytest.raises(ValueError, match="has 25 images and 125 captions"):
        evaluate_sims(rng.standard_normal((25, 125)), np.repeat(np.arange(25), 5), fold5=True)
    coco = np.repeat(np.arange(5000), 5)
    check_fold5_protocol(5000, coco)  # accepted
    check_fold5_protocol(5000, rng.permutation(coco))
    uneven = coco.copy()
    uneven[0] = 1  # image 0 has 4 captions, image 1 has 6
    with pytest.raises(ValueError, match="4/5/6 per image"):
        check_fold5_protocol(5000, uneven)
    with pytest.raises(ValueError, match="has 5,000 images and 5,000 captions"):
        check_fold5_protocol(5000, np.arange(5000))


def test_w_d18_eval_fold5_refuses_a_small_split_before_encoding(trained, data, tmp_path, capsys, monkeypatch):
    """W-D18: `vse eval RUN --fold5` on a 12-image split: one line naming the split and its sizes, exit 2,
    before any model is loaded."""
    import vsekit.runs as runs

    monkeypatch.setattr(runs, "load_run", lambda *a, **k: pytest.fail("the split was encoded"))
    assert main(["eval", str(trained), "--split", "test", "--device", "cpu", "--fold5"]) == 2
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) == 1 and "split 'test'" in lines[0] and "has 12 images and 60 captions" in lines[0]


# ------------------------------------------------------------- R-D17: chunked encoders, no graph in eval


@pytest.fixture(scope="module")
def small_model() -> VSEModel:
    torch.manual_seed(0)
    recipe = load_recipe("vsepp", ["model.embed_dim=16", "model.text.word_dim=8"])
    return VSEModel(recipe, DataSpec(img_dim=8, vocab_words=VOCAB)).eval()


def test_r_d17_chunked_encode_text_equals_one_forward_and_holds_no_graph(small_model):
    """R-D17: 700 captions (three chunks of at most 256) give the rows of one direct forward of the text
    encoder on all of them (float32 rounding), with requires_grad False in eval mode; token ids too."""
    from vsekit.models import inputs

    chunk = getattr(inputs, "ENCODE_CHUNK", 256)  # (857c500 had none)
    rng = np.random.default_rng(2)
    texts = [" ".join(rng.choice(VOCAB[5:], size=rng.integers(1, 9))) for _ in range(700)]
    assert len(texts) > 2 * chunk
    out = small_model.encode_text(texts)
    tokens, lengths = small_model.tokenize(texts)
    with torch.no_grad():
        direct = small_model.encode_texts(tokens, lengths)
    assert out.shape == direct.shape and not out.requires_grad and out.grad_fn is None
    torch.testing.assert_close(out, direct, rtol=1e-5, atol=1e-6)
    ids = small_model.encode_text(tokens, lengths)
    assert not ids.requires_grad
    torch.testing.assert_close(ids, direct, rtol=1e-5, atol=1e-6)


def test_r_d17_chunked_encode_image_equals_one_forward_and_train_mode_keeps_gradients(small_model):
    """R-D17: 600 feature sets chunked give one direct forward's rows without a graph in eval mode; in train
    mode `encode_text` keeps its graph (one batch, as before)."""
    x = torch.randn(600, 4, 8, generator=torch.Generator().manual_seed(3))
    out = small_model.encode_image(x)
    with torch.no_grad():
        direct = small_model.encode_images(x, torch.full((600,), 4))
    assert not out.requires_grad
    torch.testing.assert_close(out, direct, rtol=1e-5, atol=1e-6)
    small_model.train()
    try:
        assert small_model.encode_text(["w1 w2", "w3"]).requires_grad
    finally:
        small_model.eval()


def test_r_d17_encode_text_of_20000_captions_stays_bounded(tmp_path):
    """R-D17: 20,000 captions through `encode_text` at once (embed 256: unchunked with autograd this held
    +5.4 GB) in a child under a 2 GiB address-space limit: it finishes, with a peak under +512 MB."""
    limit = 2 << 30
    code = textwrap.dedent(f"""
        import resource, sys
        resource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit}))
        import torch
        torch.set_num_threads(1)
        from vsekit.config import load_recipe
        from vsekit.models.vse import DataSpec, VSEModel
        words = {VOCAB!r}
        recipe = load_recipe("vsepp", ["model.embed_dim=256", "model.text.word_dim=32"])
        model = VSEModel(recipe, DataSpec(img_dim=8, vocab_words=words)).eval()
        texts = [" ".join(words[5 + (i * 7 + j) % 45] for j in range(6)) for i in range(20000)]
        model.encode_text(texts[:4])
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        out = model.encode_text(texts)
        grew = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024
        print(tuple(out.shape), out.requires_grad, round(grew))
    """)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT_S, env=env
    )
    assert res.returncode == 0, res.stderr[-1500:]
    shape, grad, grew = res.stdout.split(") ")[0] + ")", *res.stdout.split(") ")[1].split()
    assert shape == "(20000, 256)" and grad == "False"
    assert int(grew) < 512, f"+{grew} MB"


def test_p_d22_faiss_index_filling_the_disk_at_its_last_flush_is_refused(tmp_path):
    """P-D22: FAISS's own file writer ignores the error of its final flush, so an index of 3,245 bytes (all
    inside libc's buffer until the file is closed) under a 3,000-byte file-size limit used to be committed
    truncated; written through a Python file, the close raises and the old index is kept."""
    import faiss

    from vsekit.search.faiss_index import write_faiss

    target = tmp_path / "pictures.faiss"
    small = faiss.IndexFlatIP(8)
    small.add(np.ones((1, 8), np.float32))
    write_faiss(small, target)
    old = target.read_bytes()
    big = faiss.IndexFlatIP(8)
    big.add(np.random.default_rng(0).random((100, 8), dtype=np.float32))
    assert len(faiss.serialize_index(big)) == 45 + 100 * 8 * 4 > 3000  # the header, then the vectors
    code = file_size_limit(3000) + textwrap.dedent(f"""
        import faiss, numpy as np
        from vsekit.search.faiss_index import write_faiss
        from vsekit.utils.io import StorageFullError
        big = faiss.IndexFlatIP(8)
        big.add(np.random.default_rng(0).random((100, 8), dtype=np.float32))
        try:
            write_faiss(big, {str(target)!r})
            print("written")
        except StorageFullError as e:
            print("refused:", e)
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT_S)
    assert res.stdout.startswith(f"refused: {target}: cannot be written"), res.stdout + res.stderr
    assert target.read_bytes() == old and sorted(p.name for p in tmp_path.iterdir()) == ["pictures.faiss"]
    assert faiss.read_index(str(target)).ntotal == 1


def test_d_d21_the_python_train_function_is_the_runs_one_writer_too(trained, data, tmp_path):
    """D-D21: `vsekit.training.trainer.train` takes the run's writer lock as `vse train` does: while another
    writer holds it, the call stops with the holder's pid and the run's files are unchanged."""
    from vsekit.runs import CheckpointError
    from vsekit.training.trainer import train
    from vsekit.utils.locks import folder_lock

    run = copy_run(trained, tmp_path)
    before = digests(run)
    recipe = load_recipe("vsepp", [*TINY, "train.epochs=2"])
    with folder_lock(run, "vse train", "this run", log=lambda *_: None, name=".lock"):
        with pytest.raises(CheckpointError, match=str(os.getpid())):
            train(recipe, data, run, resume=True, progress=False, log=lambda *_: None)
    assert digests(run) == before
