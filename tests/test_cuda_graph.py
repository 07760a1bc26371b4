"""`train.cuda_graph`: the training step as one CUDA graph per batch shape (vsekit.training.cuda_graph).

On the CPU (no GPU in the test environment) the machinery runs with the capture replaced by eager execution
(`TrainStep(..., graph="eager")`): one capture and one set of static input buffers per (batch shape, loss
warm-up flag), buffers reused, the fused capturable AdamW reading its learning rate from device tensors that
follow the trainer's schedule, AVSE's random views re-seeded before every run. Against the plain step with
the same (converted) optimizer it must be bit-identical: the same operations on the same values. The capture
itself is tested where CUDA exists (skipped here: NOT YET RUN ON A GPU).

Tolerances where the optimizer differs (a checkpoint of the graph run continued by torch's default AdamW, and
on CUDA the graph against the eager step): torch's fused AdamW kernel and its loop compute the same formula
with the terms in another order, and a float32 learning-rate tensor is not the Python float, so each update
differs by a few float32 ulps: rtol 1e-5 / atol 1e-7 on weights of ~0.2 and rtol 1e-6 on the O(1) loss after
one step (measured <= 3e-8 absolute). Two kinds of entries are left out there: biases whose gradient is zero in
exact arithmetic — the linear layer's before the region encoder's BatchNorm (`mlp.fc1.bias`, the BatchNorm
subtracts it again) and ADPOOL's balance bias (added to both logits of a softmax) — so their gradient is
rounding noise that AdamW normalises into lr-sized steps, and the BatchNorm running mean that carries the
first; the loss depends on none of them.

Why the CUDA tests may demand equality (the graph step against the eager step, a run resumed mid-way against
the uninterrupted one) without a tolerance for CUDA atomics: an atomic add sums in whatever order the threads
arrive, so it is only order-free when each address receives at most two nonzero terms (a + b = b + a; adding
an exact zero changes nothing). The step's atomic adds are the backwards of `gather` and `index_select`. GPO's
table of weights is gathered by indexing (its backward sorts the rows and sums each one's repeats in a fixed
order), not by `index_select`, whose backward added up to a batch of repeats atomically. The gathers left
(the unpacked BiGRU's and GPO's reversal, the region encoder's packing, AVSE's views) send each address one
nonzero gradient (a permutation, or padding whose gradient is an exact zero) or two (AVSE's two views of a
region). So the tolerances above need no atomics term. `torch.use_deterministic_algorithms` is not used:
it would swap these backwards for `index_put_` kernels (other kernels than a run uses), and in older PyTorch
releases those read the indices' range back to the host, a sync that a capture refuses.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from vsekit.cli import main
from vsekit.config import ConfigError, load_recipe
from vsekit.losses import create_loss
from vsekit.models.vse import DataSpec, VSEModel
from vsekit.pooling import length_mask
from vsekit.runs import optimizer_from_files, optimizer_to_files
from vsekit.training.cuda_graph import StepGraphs, cuda_graph_blockers, make_capturable, shape_key
from vsekit.training.trainer import Trainer, TrainStep

SMALL = [
    "model.embed_dim=32",
    "model.text.word_dim=16",
    "model.image.mlp_hidden=16",
    "loss.warmup_epochs=1",
    "optim.lr=0.002",
]
IMG_DIM, VOCAB = 12, 40
WEIGHTS = {"rtol": 1e-5, "atol": 1e-7}
NOISE_DRIVEN = ("mlp.fc1.bias", "mlp.bn.running_mean", "pool.balance.bias")  # see the module docstring


def _assert_same_weights(a: torch.nn.Module, b: torch.nn.Module, **tol) -> None:
    compared = 0
    for (name, x), y in zip(a.state_dict().items(), b.state_dict().values()):
        if not name.endswith(NOISE_DRIVEN):
            torch.testing.assert_close(x, y, **(tol or WEIGHTS), msg=name)
            compared += 1
    assert compared > 20


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _step(
    recipe: str,
    graph: str | None = None,
    device: str = "cpu",
    fused: bool | None = None,
    sets: tuple[str, ...] = (),
) -> TrainStep:
    extra = ["model.similarity.block_dim=16"] if recipe == "avse" else []
    r = load_recipe(recipe, SMALL + extra + list(sets))
    dev = torch.device(device)
    torch.manual_seed(0)
    model = VSEModel(r, DataSpec(img_dim=IMG_DIM, vocab_words=[f"w{i}" for i in range(VOCAB)])).to(dev)
    opt = torch.optim.AdamW(
        model.parameter_groups(r.optim.lr), lr=r.optim.lr, weight_decay=r.optim.weight_decay, fused=fused
    )
    return TrainStep(r, model, create_loss(r.loss, r.model.image.views).to(dev), opt, dev, graph=graph)


def _batch(b: int, width: int, seed: int, device: str = "cpu") -> dict:
    """A batch as the device data path gives it: sets padded to 6, captions to the bucket `width`."""
    g = torch.Generator().manual_seed(seed)
    img_len = torch.randint(2, 7, (b,), generator=g)
    images = torch.randn(b, 6, IMG_DIM, generator=g).masked_fill(~length_mask(img_len, 6).unsqueeze(-1), 0.0)
    tok_len = torch.randint(3, width + 1, (b,), generator=g)
    tokens = torch.randint(5, VOCAB, (b, width), generator=g).masked_fill(~length_mask(tok_len, width), 0)
    out = {
        "images": images,
        "image_lengths": img_len,
        "tokens": tokens,
        "token_lengths": tok_len,
        "image_index": torch.arange(b) // 2,
        "caption_index": torch.arange(b),
    }
    return {k: v.to(device) for k, v in out.items()}


# (epoch, batch size, caption width): two buckets, the loss warm-up epoch and the next, a short last batch
PLAN = [(0, 10, 5), (0, 10, 9), (0, 10, 5), (1, 10, 5), (1, 10, 9), (1, 6, 9), (1, 10, 9), (1, 10, 5)]


def _run(step: TrainStep, device: str = "cpu") -> list[float]:
    losses = []
    for i, (epoch, b, width) in enumerate(PLAN):
        if i == 4:  # the trainer's schedule sets the groups' float lr (an lr decay)
            for g in step.optimizer.param_groups:
                g["lr"] = g["lr"] * 0.25
        losses.append(float(step(_batch(b, width, seed=i, device=device), epoch=epoch, step=i)["loss"]))
    return losses


def _plain_with_the_graphs_optimizer(recipe: str) -> TrainStep:
    """The plain step with the optimizer the graph step runs: fused, capturable, lr read from its tensors."""
    step = _step(recipe)
    lrs = make_capturable(step.optimizer, torch.device("cpu"))
    inner = step.optimizer.step

    def optimizer_step(*args, **kwargs):
        with lrs.swapped():
            return inner(*args, **kwargs)

    step.optimizer.step = optimizer_step
    return step


@pytest.mark.parametrize("recipe", ["vse_infty", "vse_2ad", "avse"])
def test_graph_machinery_on_the_cpu_equals_the_plain_step(recipe):
    """vse_infty (GPO, triplet with warm-up), vse_2ad (ADPOOL, ADOPT's device K), avse (random views from the
    re-seeded generator, AEOM): the eager-captured graph step trains bit for bit like the plain step."""
    plain, graphed = _plain_with_the_graphs_optimizer(recipe), _step(recipe, graph="eager")
    want, got = _run(plain), _run(graphed)
    assert all(math.isfinite(v) for v in want)
    assert got == want
    for (name, a), b in zip(graphed.model.state_dict().items(), plain.model.state_dict().values()):
        assert torch.equal(a, b), name
    for a, b in zip(graphed.optimizer.state.values(), plain.optimizer.state.values()):
        assert all(torch.equal(a[k], b[k]) for k in ("step", "exp_avg", "exp_avg_sq"))
    # one capture per (shape, warm-up flag): widths 5 and 9 in epoch 0; 5, 9 and the short batch of 6 in epoch 1
    keys = {(epoch, b, width) for epoch, b, width in PLAN}
    assert len(graphed.graphs.entries) == len(keys) == 5 and graphed.graphs.capture.captured == 5


def test_the_learning_rate_tensors_follow_the_schedule():
    """Without the tensors' update (`LrTensors.sync`) the decayed lr would never reach the graph: the same run
    with the decay differs from one without it only after the decay (steps 5-8)."""
    decayed = _run(_step("vse_infty", graph="eager"))
    step = _step("vse_infty", graph="eager")
    kept = [float(step(_batch(b, w, seed=i), epoch=e, step=i)["loss"]) for i, (e, b, w) in enumerate(PLAN)]
    assert decayed[:5] == kept[:5] and decayed[5:] != kept[5:]
    assert float(step.graphs.capture.lrs.tensors[0]) == pytest.approx(0.002, rel=1e-7)


def test_static_buffers_are_reused_per_shape_and_hold_the_last_batch():
    step = _step("vse_infty", graph="eager")
    first = _batch(10, 5, seed=1)
    step(first, epoch=1, step=0)
    (entry,) = step.graphs.entries.values()
    ptrs = {k: v.data_ptr() for k, v in entry.inputs.items()}
    second = _batch(10, 5, seed=2)
    step(second, epoch=1, step=1)
    assert len(step.graphs.entries) == 1  # same shape, same flags: the same graph
    assert {k: v.data_ptr() for k, v in entry.inputs.items()} == ptrs  # the same memory, copied into
    assert all(torch.equal(entry.inputs[k], second[k]) for k in ptrs)
    step(_batch(10, 9, seed=3), epoch=1, step=2)
    assert len(step.graphs.entries) == 2 and step.graphs.capture.captured == 2


def test_step_graphs_key_by_shape_and_flags_and_return_copies():
    """`StepGraphs` with a counting body: a capture per new (shape, flags), replays otherwise, the seed hook
    before every run, and outputs that a later replay does not overwrite."""
    calls, seeds = [], []
    out = torch.zeros(())

    def body(inputs: dict, flags: tuple) -> dict:
        calls.append((tuple(inputs["tokens"].shape), flags))
        out.fill_(float(inputs["tokens"].sum()))
        return {"loss": out}

    graphs = StepGraphs(body, lambda fn: fn, torch.device("cpu"), before_run=seeds.append)
    a, b = _batch(4, 5, 0), _batch(4, 5, 1)
    ra = graphs(a, (False,), seed=11)
    rb = graphs(b, (False,), seed=12)
    graphs(a, (True,), seed=13)
    graphs(_batch(4, 7, 2), (False,), seed=14)
    assert len(graphs.entries) == 3 and seeds == [11, 12, 13, 14]
    assert float(ra["loss"]) == float(a["tokens"].sum()) and float(rb["loss"]) == float(b["tokens"].sum())
    assert shape_key(a) == shape_key(b) != shape_key(_batch(4, 7, 0))


def test_the_optimizer_is_checkpointed_as_built_and_resumes_without_graphs():
    """The fused, capturable AdamW's state dict reports the flags the trainer built it with and float learning
    rates (JSON); loaded into a plain AdamW it continues as the graph step does."""
    graphed = _step("vse_infty", graph="eager")
    _run(graphed)
    built = torch.optim.AdamW([torch.zeros(1, requires_grad=True)])
    tensors, meta = optimizer_to_files(graphed.optimizer)
    json.dumps(meta)  # float lrs, no tensors
    for g in meta["param_groups"]:
        assert (g["fused"], g["capturable"], g["foreach"]) == (
            built.defaults["fused"],
            False,
            built.defaults["foreach"],
        )
    assert all(g["fused"] and g["capturable"] for g in graphed.optimizer.param_groups)  # as it runs
    plain = _step("vse_infty")
    plain.model.load_state_dict(graphed.model.state_dict())
    optimizer_from_files(
        plain.optimizer, {k: v.clone() for k, v in tensors.items()}, json.loads(json.dumps(meta))
    )
    assert not any(g["fused"] for g in plain.optimizer.param_groups)
    batch = _batch(10, 9, seed=20)
    a, b = plain(batch, epoch=1, step=20), graphed(batch, epoch=1, step=20)
    assert float(a["loss"]) == pytest.approx(float(b["loss"]), rel=1e-6)
    _assert_same_weights(plain.model, graphed.model)


# -------------------------------------------------------------------------------------------- refusals
def _blockers(recipe: str, *sets: str, device: str = "cuda") -> str:
    return "; ".join(cuda_graph_blockers(load_recipe(recipe, list(sets)), torch.device(device)))


def test_what_cannot_be_captured_is_named():
    assert _blockers("vse_infty") == _blockers("vsepp") == _blockers("vse_2ad") == _blockers("bow") == ""
    assert "the run is on cpu" in _blockers("vse_infty", device="cpu")
    assert "model.text.kind=transformer" in _blockers("vse_infty", "model.text.kind=transformer")
    assert "loss.name=ladder" in _blockers("cvsepp")
    assert "model.image.kind=backbone" in _blockers("vse_infty_grid_e2e")
    assert "adopt_zero_fill_negatives" in _blockers(
        "vse_2ad", "loss.adopt_variant=reference", "loss.adopt_zero_fill_negatives=true"
    )
    assert "train.compile=true" in _blockers("vse_infty", "train.compile=true")
    both = _blockers("vse_infty", "model.text.kind=transformer", "train.compile=true")
    assert "transformer" in both and "compile" in both  # every part is named at once
    with pytest.raises(ConfigError, match=r"train.cuda_graph=true cannot capture .* the run is on cpu"):
        _step("vse_infty", sets=("train.cuda_graph=true",))


def test_dataloader_workers_are_refused_with_graphs(tiny_data, tmp_path, capsys):
    """DataLoader workers pin their batches in a thread of the training process that calls CUDA while a step
    is being captured: refused whenever the DataLoader may make the batches (data_on_device auto or false),
    not with data_on_device=true (the set lives on the GPU, no DataLoader is built)."""
    auto = _blockers("vse_infty", "data.num_workers=2")
    assert "data.num_workers=2 with train.data_on_device=auto" in auto and "pin-memory thread" in auto
    loader = _blockers("vse_infty", "data.num_workers=1", "train.data_on_device=false")
    assert "data.num_workers=1 with train.data_on_device=false" in loader
    assert _blockers("vse_infty", "data.num_workers=2", "train.data_on_device=true") == ""
    assert _blockers("vse_infty", "data.num_workers=0", "train.data_on_device=false") == ""
    out = tmp_path / "run"
    assert (
        main(
            [
                "train",
                "--data",
                str(tiny_data),
                "--out",
                str(out),
                "--device",
                "cpu",
                "--set",
                "train.cuda_graph=true",
                "--set",
                "data.num_workers=2",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "data.num_workers=2 with train.data_on_device=auto" in err and "the run is on cpu" in err
    assert not out.exists()


def test_vse_train_refuses_a_graph_on_the_cpu_before_writing_anything(tiny_data, tmp_path, capsys):
    out = tmp_path / "run"
    with pytest.raises(ConfigError, match="the run is on cpu"):
        Trainer(
            load_recipe("vse_infty", ["train.cuda_graph=true", "train.device=cpu"]),
            tiny_data,
            out,
            progress=False,
            log=lambda *_: None,
        )
    assert not out.exists()
    assert (
        main(
            [
                "train",
                "--data",
                str(tiny_data),
                "--out",
                str(out),
                "--device",
                "cpu",
                "--set",
                "train.cuda_graph=true",
            ]
        )
        == 2
    )
    assert "train.cuda_graph=true cannot capture" in capsys.readouterr().err and not out.exists()


def test_a_failed_capture_names_the_shape_and_the_way_on():
    """A capture that raises (as torch does when a kernel library calls what stream capture forbids) becomes one
    SetupError (exit 2 in the CLI) naming the batch shape, the error and the eager resume; nothing is kept."""
    from vsekit.errors import SetupError
    from vsekit.training.cuda_graph import CudaGraphCaptureError

    def capture(fn):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nmore detail")

    graphs = StepGraphs(lambda inputs, flags: {}, capture, torch.device("cpu"))
    with pytest.raises(CudaGraphCaptureError) as err:
        graphs(_batch(4, 5, 0))
    msg = str(err.value)
    assert isinstance(err.value, SetupError) and "\n" not in msg
    assert "'tokens': (4, 5)" in msg and "operation not permitted when stream is capturing" in msg
    assert "--resume RUN --set train.cuda_graph=false" in msg and graphs.entries == {}


def test_resume_may_switch_the_graph_off(tiny_data, tmp_path, capsys):
    """The CUDA graph switch is a resume key (the same step, replayed or eager): a run resumes with it set,
    config.json records it; on a CPU switching it on is refused by the step's own check."""
    run = tmp_path / "run"
    tiny = ["--set", "model.embed_dim=16", "--set", "model.text.word_dim=8", "--no-progress"]
    assert (
        main(
            ["train", "--data", str(tiny_data), "--out", str(run), "--epochs", "1", "--device", "cpu", *tiny]
        )
        == 0
    )
    resume = ["train", "--resume", str(run), "--epochs", "2", "--device", "cpu", "--no-progress"]
    assert main([*resume, "--set", "train.cuda_graph=false"]) == 0
    assert json.loads((run / "config.json").read_text())["recipe"]["train"]["epochs"] == 2
    capsys.readouterr()
    assert main([*resume, "--epochs", "3", "--set", "train.cuda_graph=true"]) == 2
    err = capsys.readouterr().err.strip()
    assert "train.cuda_graph=true cannot capture" in err and "the run is on cpu" in err and "\n" not in err
    assert main([*resume, "--epochs", "3", "--set", "train.seed=3"]) == 2
    assert "start a new run to change train.seed" in capsys.readouterr().err


# ------------------------------------------------------------------------------------ on a GPU (skipped)
@CUDA
@pytest.mark.parametrize("recipe", ["vse_infty", "vse_2ad", "avse"])
def test_cuda_graph_step_equals_the_eager_step(recipe):
    """The captured step replays what the eager step computes (both with the fused AdamW), over two caption
    buckets, the loss warm-up flag, a short batch and an lr change; replays run under sync debug mode "error"
    (a host sync raises), captures before them."""
    plain = _step(recipe, device="cuda", fused=True)
    graphed = _step(recipe, graph="cuda", device="cuda", sets=("train.cuda_graph=true",))
    want = _run(plain, "cuda")
    got = []
    for i, (epoch, b, width) in enumerate(PLAN):
        if i == 4:
            for g in graphed.optimizer.param_groups:
                g["lr"] = g["lr"] * 0.25
        batch = _batch(b, width, seed=i, device="cuda")
        replay = len(graphed.graphs.entries) == len({k for k in PLAN[:i]}) and (epoch, b, width) in PLAN[:i]
        if replay:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            out = graphed(batch, epoch=epoch, step=i)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        got.append(float(out["loss"]))
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-5, atol=0.0)
    _assert_same_weights(graphed.model, plain.model, rtol=1e-5, atol=1e-6)
    assert len(graphed.graphs.entries) == 5 and graphed.graphs.capture.captured == 5


@CUDA
def test_vse_train_with_cuda_graphs_trains_and_resumes(tiny_data, tmp_path):
    """Two epochs with graphs (several caption widths, the warm-up flag), then the same run stopped after 4
    steps and resumed (its graphs captured anew): the same weights, within the optimizer tolerance of the
    module docstring (the step is deterministic on CUDA, see there). The regex tokenizer: no nltk needed."""
    sets = [
        "model.embed_dim=32",
        "model.text.word_dim=16",
        "model.text.tokenizer=regex",
        "train.batch_size=16",
        "train.epochs=2",
        "train.device=cuda",
        "train.cuda_graph=true",
        "train.length_bucketing=true",
        "train.log_every=2",
    ]
    ref = Trainer(
        load_recipe("vse_infty", sets), tiny_data, tmp_path / "ref", progress=False, log=lambda *_: None
    )
    assert math.isfinite(ref.fit()["best_rsum"])
    stopped = Trainer(
        load_recipe("vse_infty", sets), tiny_data, tmp_path / "run", progress=False, log=lambda *_: None
    )
    stopped.fit(max_steps=4)
    resumed = Trainer(
        load_recipe("vse_infty", sets),
        tiny_data,
        tmp_path / "run",
        resume=True,
        progress=False,
        log=lambda *_: None,
    )
    resumed.fit()
    _assert_same_weights(ref.model, resumed.model, rtol=1e-5, atol=1e-6)
