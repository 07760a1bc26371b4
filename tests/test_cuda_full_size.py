"""The training step at the sizes users train at, on CUDA (skipped without a GPU), and the two properties of
the step those tests rely on, checked on the CPU where they can be.

Full size is the vse_infty recipe as it trains on COCO: batch 128, region features 36 x 2048, the recipe's
1024-wide BiGRU over 300-d words, a vocabulary of 10,000 words and captions padded to 32 tokens, so the word
embedding's backward sees 128 x 32 = 4,096 indices (above 3,072, where CUDA's embedding backward leaves its
direct kernel for the sorted one).

Tolerances of the graph against the eager step (float32 with TF32 off: unit roundoff u = 2^-24 = 6.0e-8).
Both run the same operations on the same numbers; what may differ is the order of the additions inside a
reduction (cuBLAS or cuDNN may pick another kernel under capture; atomic adds arrive in any order). Two orders
of a sum of K terms differ by about 2 sqrt(K) u sum|terms| when rounding errors have random signs (Higham
and Mary 2019), at most 2 K u sum|terms|.
- The loss, in the loss's warm-up epoch (the step tested): at initialisation every hinge m + s_neg - s_pos is
  active (|s_neg - s_pos| << m = 0.2), so the loss is a sum of positive terms of about 0.2 with no kink near
  the weights. A similarity passes through about five reductions of at most 2,048 terms (region linear layer,
  MLP, GRU input, GPO, the 1,024-d dot product), 2 sqrt(2048) u = 5.4e-6 each: at most 3e-5 on a value of at
  most 1, i.e. 1.5e-4 of a 0.2 hinge, which a sum of positive terms keeps. LOSS_RTOL = 2e-4.
- Gradients, per tensor and normwise: a weight's gradient sums over the batch's rows, up to K = 128 x 36 =
  4,608; with terms of both signs sum|terms| / |sum| is about sqrt(K), so the two orders differ by about
  2 K u = 5.5e-4 of the gradient, plus the forward's 3e-5. GRAD_RTOL = 1e-3. (GPO's per-dimension sort and
  the ReLUs can route a few entries differently when two values tie within rounding: a handful of the
  4.7 million region values, far below this normwise bound.)
- The optimizer, checked on the graph's own numbers: AdamW's first step from a zero state moves each weight
  to w (1 - lr wd) - lr g / (|g| + eps) (the bias corrections cancel); float32 rounds that to a few ulps of w
  and of lr: rtol 1e-6, atol 1e-7. A step applied twice, the warm-up steps not undone, a wrong learning rate
  or gradients accumulated across the warm-up would all be off by about lr = 5e-4.
The bias before the region encoder's BatchNorm (`mlp.fc1.bias`) is left out of the gradient comparison: its
gradient is zero in exact arithmetic (the BatchNorm subtracts it again), so both are rounding noise.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from vsekit.config import load_recipe
from vsekit.losses import create_loss
from vsekit.models.vse import DataSpec, VSEModel
from vsekit.pooling import length_mask, rnn
from vsekit.pooling.gpo import GPO
from vsekit.pooling.rnn import bigru_unpacked
from vsekit.training.trainer import TrainStep

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
BATCH, REGIONS, IMG_DIM, VOCAB, WIDTH = 128, 36, 2048, 10_000, 32
LOSS_RTOL, GRAD_RTOL = 2e-4, 1e-3  # derived in the module docstring
NOISE_DRIVEN = ("mlp.fc1.bias",)


@pytest.fixture
def no_tf32():
    """float32 as float32: TF32 off for matmuls and for cuDNN (on by default: the GRUs), put back after."""
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


def _full_model(device: str = "cuda") -> VSEModel:
    torch.manual_seed(0)
    spec = DataSpec(img_dim=IMG_DIM, vocab_words=[f"w{i}" for i in range(VOCAB)])
    return VSEModel(load_recipe("vse_infty"), spec).to(device)


def _full_step(graph: str | None) -> TrainStep:
    r = load_recipe("vse_infty")
    model = _full_model()
    # the graph step makes its AdamW fused and capturable itself; the eager step is given the fused one
    groups, o = model.parameter_groups(r.optim.lr), r.optim
    opt = torch.optim.AdamW(groups, lr=o.lr, weight_decay=o.weight_decay, fused=graph is None)
    return TrainStep(
        r, model, create_loss(r.loss, r.model.image.views).to("cuda"), opt, torch.device("cuda"), graph=graph
    )


def _full_batch(seed: int = 0, device: str = "cuda") -> dict:
    """A batch as the device data path gives it at full size: sets of 20-36 regions padded to 36, captions of
    8-32 tokens padded to 32 (one of 32), pairs of captions sharing an image."""
    g = torch.Generator().manual_seed(seed)
    img_len = torch.randint(20, REGIONS + 1, (BATCH,), generator=g)
    images = torch.randn(BATCH, REGIONS, IMG_DIM, generator=g)
    images = images.masked_fill(~length_mask(img_len, REGIONS).unsqueeze(-1), 0.0)
    tok_len = torch.randint(8, WIDTH + 1, (BATCH,), generator=g)
    tok_len[0] = WIDTH
    tokens = torch.randint(5, VOCAB, (BATCH, WIDTH), generator=g).masked_fill(~length_mask(tok_len, WIDTH), 0)
    out = {
        "images": images,
        "image_lengths": img_len,
        "tokens": tokens,
        "token_lengths": tok_len,
        "image_index": torch.arange(BATCH) // 2,
        "caption_index": torch.arange(BATCH),
    }
    return {k: v.to(device) for k, v in out.items()}


def _normwise_close(got: torch.Tensor, want: torch.Tensor, rtol: float, name: str) -> None:
    err, scale = float((got.double() - want.double()).norm()), float(want.double().norm())
    assert err <= rtol * scale, f"{name}: |got - want| = {err:.3g} > {rtol} x |want| = {rtol * scale:.3g}"


# ------------------------------------------------------------------------------------ on a GPU (skipped)
@CUDA
def test_full_size_graph_step_equals_the_eager_step(no_tf32):
    """One capture and one replay of the full-size vse_infty step against the eager step from the same
    weights on the same batch: the loss, every gradient, the BatchNorm statistics, and the replay's AdamW
    update against AdamW's formula (tolerances: module docstring)."""
    plain, graphed = _full_step(graph=None), _full_step(graph="cuda")
    for (name, a), b in zip(graphed.model.state_dict().items(), plain.model.state_dict().values()):
        assert torch.equal(a, b), name  # the same start
    names = {id(p): n for n, p in graphed.model.named_parameters()}
    before = {n: p.detach().clone() for n, p in graphed.model.named_parameters()}
    batch = _full_batch()
    assert batch["tokens"].numel() > 3072  # the word embedding's sorted backward
    want = plain(batch, epoch=0, step=0)  # epoch 0: the loss's warm-up form (all negatives)
    got = graphed(batch, epoch=0, step=0)  # three warm-up steps, undone; the capture; one replay
    torch.cuda.synchronize()
    assert graphed.graphs.capture.captured == 1 and len(graphed.graphs.entries) == 1

    torch.testing.assert_close(got["loss"], want["loss"], rtol=LOSS_RTOL, atol=0.0)
    compared = 0
    for (name, p), q in zip(graphed.model.named_parameters(), plain.model.parameters()):
        if name.endswith(NOISE_DRIVEN):
            continue
        g_plain = q.grad if q.grad is not None else torch.zeros_like(q)
        _normwise_close(p.grad, g_plain, GRAD_RTOL, f"gradient of {name}")
        compared += 1
    assert compared > 20
    for (name, a), b in zip(graphed.model.named_buffers(), plain.model.buffers()):
        if a.is_floating_point():
            _normwise_close(a, b, GRAD_RTOL, name)
        else:
            assert torch.equal(a, b), name  # num_batches_tracked: 1, not 1 + the warm-up steps

    for group in graphed.optimizer.param_groups:
        lr, wd, eps = float(group["lr"]), float(group["weight_decay"]), float(group["eps"])
        beta1, beta2 = (float(b) for b in group["betas"])
        for p in group["params"]:
            name, g = names[id(p)], p.grad.double()
            state = graphed.optimizer.state[p]
            assert float(state["step"]) == 1.0, name
            torch.testing.assert_close(
                state["exp_avg"].double(), (1 - beta1) * g, rtol=1e-6, atol=0.0, msg=name
            )
            torch.testing.assert_close(
                state["exp_avg_sq"].double(), (1 - beta2) * g * g, rtol=1e-5, atol=1e-30, msg=name
            )
            expected = before[name].double() * (1 - lr * wd) - lr * g / (g.abs() + eps)
            torch.testing.assert_close(p.detach().double(), expected, rtol=1e-6, atol=1e-7, msg=name)


@CUDA
def test_bf16_autocast_keeps_the_grus_in_float32():
    """Under bf16 autocast on CUDA the caption BiGRU runs in float32 (autocast's cuDNN RNN wrapper would
    run it in float16): its token states are float32 and those of the step without autocast."""
    model = _full_model().train()
    batch = _full_batch()
    tokens, lengths = batch["tokens"], batch["token_lengths"]
    want = model.text_encoder.token_features(tokens, lengths)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got = model.text_encoder.token_features(tokens, lengths)
        emb = model.encode_texts(tokens, lengths)
    assert model.text_encoder.gru.weight_hh_l0.dtype == torch.float32
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want)
    assert torch.isfinite(emb).all()


@CUDA
def test_gpo_backward_repeats_bit_for_bit_at_full_size():
    """GPO at full size (128 sets of up to 36 regions, many sharing a size): forward and backward ten times
    give the same gradients to the bit (its weight table is gathered by indexing, whose backward sums each
    row's repeats in a fixed order; `index_select`'s summed them atomically)."""
    torch.manual_seed(0)
    pool = GPO().cuda()
    feats = torch.randn(BATCH, REGIONS, 1024, device="cuda")
    lengths = torch.randint(20, REGIONS + 1, (BATCH,), device="cuda")
    grads = []
    for _ in range(10):
        pool.zero_grad(set_to_none=True)
        x = feats.clone().requires_grad_()
        (pool(x, lengths) * torch.linspace(-1, 1, 1024, device="cuda")).sum().backward()
        grads.append([x.grad] + [p.grad.clone() for p in pool.parameters()])
    for other in grads[1:]:
        assert all(torch.equal(a, b) for a, b in zip(grads[0], other))


# ------------------------------------------------------------------------------- the same, on the CPU
class _OpLog(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_gpo_gathers_its_weights_without_an_atomic_index_add():
    """The CPU side of the test above: GPO's backward (batch larger than the set width: the weight table is
    gathered) runs no `index_add`, the op CUDA sums with atomics, and gives index_select's values."""
    torch.manual_seed(0)
    pool = GPO()
    x = torch.randn(40, 12, 16, requires_grad=True)
    lengths = torch.randint(1, 13, (40,))
    out = pool(x, lengths)
    with _OpLog() as log:
        out.sum().backward()
    assert log.ops and not [op for op in log.ops if "index_add" in op]
    table = pool.weights_for_lengths(torch.arange(1, 13), 12).detach()
    torch.testing.assert_close(
        pool(x, lengths, return_weights=True)[1], table.index_select(0, lengths - 1), rtol=0, atol=0
    )


def test_the_gru_runs_in_its_weights_precision_with_autocast_off(monkeypatch):
    """The CPU side of the bf16 test above: the branch CUDA takes (`FLOAT16_RNN_AUTOCAST`), given the CPU.
    Under autocast every GRU call of the unpacked BiGRU (the path CUDA takes) reaches `torch.gru` with
    autocast off and float32 input, even from a bf16 input, and gives the float32 result."""
    monkeypatch.setattr(rnn, "FLOAT16_RNN_AUTOCAST", ("cpu",))
    seen = []
    real = torch.gru

    def spy(x, *args):
        seen.append((torch.is_autocast_enabled(x.device.type), x.dtype))
        return real(x, *args)

    torch.manual_seed(0)
    gru = torch.nn.GRU(8, 16, batch_first=True, bidirectional=True)
    x, lengths = torch.randn(3, 5, 8), torch.tensor([5, 2, 3])
    want = bigru_unpacked(gru, x, lengths)
    monkeypatch.setattr(torch, "gru", spy)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = bigru_unpacked(gru, x, lengths)
        from_bf16 = bigru_unpacked(gru, x.bfloat16(), lengths)
    assert seen == [(False, torch.float32)] * 4  # two directions, two calls
    assert got.dtype == from_bf16.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(from_bf16, bigru_unpacked(gru, x.bfloat16().float(), lengths), rtol=0, atol=0)
