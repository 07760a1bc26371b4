"""`vse bench amp`: how far a bf16-autocast training step's loss and gradients are from float32's.

bfloat16 keeps float32's 8 exponent bits (its range) and 8 significant bits (7 stored + the implicit one), so a
value rounded to it is off by at most 2^-9 ~ 0.2 % of itself. `train.amp=bf16` runs the step under
`torch.autocast(dtype=bfloat16)`: autocast runs matmul-like ops (linear layers, matmul/bmm, convolutions; the
recurrent layers on the CPU) in bf16 with float32 accumulation and leaves the rest in float32; vsekit keeps
more of the step in float32 itself (the similarity matrix is cast to float32 before the loss, so the loss and
its softmax / hardest-negative selection run in float32; the masked BatchNorm's statistics are float32; ADOPT's
gammas float64). The weights, their gradients and the optimizer stay float32: there is no loss scaling (bf16
has float32's range, so gradients do not underflow as float16's would).

For each recipe and seed, one model in float32 takes one forward + backward on a synthetic batch (random
features and captions of the bench's shapes), once plain and once under autocast, from the same weights; the
result is the relative error of the loss, of the two embeddings and of the gradients (all of them as one
vector, and the worst single tensor), and which module outputs autocast left in bf16 (forward hooks).
Gradients that are zero in exact arithmetic — the bias of a linear layer before a BatchNorm, which the
BatchNorm subtracts again, and ADPOOL's balance bias, added to both logits of a softmax — are rounding noise in
either precision, so their relative error means nothing: they are listed apart and left out of the worst tensor.

    from vsekit_lab.bench.amp import bf16_numerics
    rows = bf16_numerics(["vsepp", "vse_infty"], batch=64)
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import torch
from torch import nn

from vsekit.config import load_recipe
from vsekit.data.batch import Batch
from vsekit.errors import VseInputError
from vsekit.losses import create_loss
from vsekit.losses.base import StepContext
from vsekit.models.vse import DataSpec, VSEModel
from vsekit.training.step_parts import StepParts

# parameters whose gradient is zero in exact arithmetic (see the module docstring)
NOISE_DRIVEN = ("mlp.fc1.bias", "pool.balance.bias")


def _synthetic_batch(
    batch: int, regions: int, img_dim: int, vocab: int, min_tokens: int, max_tokens: int, seed: int
) -> Batch:
    g = torch.Generator().manual_seed(seed)
    img_len = torch.randint(max(1, regions // 2), regions + 1, (batch,), generator=g)
    slots = torch.arange(regions)[None, :]
    images = torch.randn(batch, regions, img_dim, generator=g).masked_fill(
        (slots >= img_len[:, None]).unsqueeze(-1), 0.0
    )
    tok_len = torch.randint(min_tokens, max_tokens + 1, (batch,), generator=g)
    tokens = torch.randint(4, vocab, (batch, max_tokens), generator=g)
    tokens = tokens.masked_fill(torch.arange(max_tokens)[None, :] >= tok_len[:, None], 0)
    return Batch(
        images=images,
        image_lengths=img_len,
        tokens=tokens,
        token_lengths=tok_len,
        image_index=torch.arange(batch),
        caption_index=torch.arange(batch),
    )


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def _one_pass(
    model: VSEModel,
    loss_fn: nn.Module,
    batch: Batch,
    amp: bool,
    device: torch.device,
    warmup: bool,
    dtypes: dict[str, torch.dtype] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    hooks = []
    if dtypes is not None:
        for name, mod in model.named_modules():
            if name and not list(mod.children()):

                def hook(_m, _i, out, name=name):
                    out = out[0] if isinstance(out, tuple) else out
                    out = getattr(out, "data", out)  # a PackedSequence (the packed BiGRU): its values
                    if torch.is_tensor(out) and out.is_floating_point():
                        dtypes[name] = out.dtype

                hooks.append(mod.register_forward_hook(hook))
    model.zero_grad(set_to_none=True)
    # the training step's own encode and score parts (what `train.amp=bf16` runs), without its update
    parts = StepParts(model, loss_fn, None, device, amp=amp)  # type: ignore[arg-type]  (no update here)
    b = parts.to_device(batch)
    try:
        img, txt = parts.encode(b, None)
        loss, _ = parts.score(img, txt, b.image_index, b.caption_index, context=StepContext(warmup=warmup))
        loss.backward()
    finally:
        for h in hooks:
            h.remove()
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach().float(), img.detach().float(), txt.detach().float(), grads


def bf16_numerics(
    recipes: Sequence[str] = ("vsepp", "vse_infty"),
    batch: int = 64,
    regions: int = 36,
    img_dim: int = 512,
    embed_dim: int = 256,
    vocab: int = 2000,
    min_tokens: int = 8,
    max_tokens: int = 25,
    seeds: Sequence[int] = (0, 1, 2),
    device: str = "cpu",
    overrides: Sequence[str] = (),
    warmup: bool = False,
) -> list[dict]:
    """One row per recipe: the relative errors of a bf16-autocast step against float32 (the worst over
    `seeds`; the median too for the gradients) on a model of the given shapes (module docstring): the
    recipe's loss after its warm-up (`warmup=False`: hardest negatives for vsepp / vse_infty, whose choice
    bf16 rounding can flip), or the warm-up's sum over all negatives (`warmup=True`: smooth in the
    similarities, so the error is the rounding's alone)."""
    if batch < 2 or not seeds:
        raise VseInputError(f"need batch >= 2 and at least one seed, got batch={batch}, seeds={list(seeds)}")
    if not 1 <= min_tokens <= max_tokens:
        raise VseInputError(f"need 1 <= min_tokens <= max_tokens, got {min_tokens}, {max_tokens}")
    dev = torch.device(device)
    rows = []
    for recipe in recipes:
        r = load_recipe(recipe, [f"model.embed_dim={embed_dim}", *overrides])
        spec = DataSpec(
            img_dim=img_dim,
            vocab_words=["<pad>", "<start>", "<end>", "<unk>"] + [f"w{i}" for i in range(vocab - 4)],
        )
        per_seed = []
        bf16_modules: set[str] = set()
        fp32_modules: set[str] = set()
        for seed in seeds:
            torch.manual_seed(seed)
            model = VSEModel(r, spec).to(dev).train()
            loss_fn = create_loss(r.loss, image_views=r.model.image.views, embed_dim=r.model.embed_dim).to(
                dev
            )
            loss_fn.host_diag = False  # a hook of every loss (vsekit.losses.base)
            data = _synthetic_batch(batch, regions, img_dim, vocab, min_tokens, max_tokens, seed)
            state = {k: v.clone() for k, v in model.state_dict().items()}
            ref = _one_pass(model, loss_fn, data, False, dev, warmup)
            model.load_state_dict(state)  # the BatchNorm statistics as they were: the same weights for both
            dtypes: dict[str, torch.dtype] = {}
            low = _one_pass(model, loss_fn, data, True, dev, warmup, dtypes)
            model.load_state_dict(state)
            bf16_modules |= {n for n, d in dtypes.items() if d == torch.bfloat16}
            fp32_modules |= {n for n, d in dtypes.items() if d == torch.float32}
            kept = [n for n in ref[3] if not n.endswith(NOISE_DRIVEN)]
            per_tensor = {n: _rel(low[3][n], ref[3][n]) for n in kept}
            worst = max(per_tensor, key=per_tensor.__getitem__)
            per_seed.append(
                {
                    "loss": abs(float(low[0]) - float(ref[0])) / abs(float(ref[0])),
                    "image_emb": _rel(low[1], ref[1]),
                    "text_emb": _rel(low[2], ref[2]),
                    "grads": _rel(
                        torch.cat([low[3][n].flatten() for n in kept]),
                        torch.cat([ref[3][n].flatten() for n in kept]),
                    ),
                    "grad_median": statistics.median(per_tensor.values()),
                    "grad_worst": per_tensor[worst],
                    "grad_worst_name": worst,
                    "loss_fp32": float(ref[0]),
                    "noise_driven": sorted(set(ref[3]) - set(kept)),
                }
            )
        worst_seed = max(per_seed, key=lambda s: s["grad_worst"])
        rows.append(
            {
                "recipe": recipe,
                "device": str(dev),
                "seeds": len(seeds),
                "batch": batch,
                "shapes": f"{regions}x{img_dim} features, embed {embed_dim}, vocab {vocab}, {min_tokens}-{max_tokens} tokens",
                **{
                    f"{k}_rel": max(s[k] for s in per_seed)
                    for k in ("loss", "image_emb", "text_emb", "grads", "grad_median")
                },
                "grad_worst_rel": worst_seed["grad_worst"],
                "grad_worst_tensor": worst_seed["grad_worst_name"],
                "loss_fp32": statistics.mean(s["loss_fp32"] for s in per_seed),
                "left_out": ", ".join(per_seed[0]["noise_driven"]) or "-",
                "loss_kind": "all negatives (the warm-up's sum)"
                if warmup
                else "after the warm-up (the recipe's loss)",
                "bf16_modules": sorted(bf16_modules),
                "fp32_modules": sorted(fp32_modules - bf16_modules),
            }
        )
    return rows
