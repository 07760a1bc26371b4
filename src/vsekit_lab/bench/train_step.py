"""Time one training step (forward + backward + AdamW) on synthetic data of the released step's shapes.

The reference point: VSE∞'s BUTD-region + BiGRU step — batch 128, 36 x 2048 regions, embed 1024,
a 10k-word vocabulary, captions of 8-25 tokens, hardest negatives — takes 52.3 ms (2,447 samples/s) on one
H100 in the reference code. `bench_train_step` times exactly the step the trainer runs (`TrainStep`, with
the recipe's AMP / TF32 / compile settings) on consecutive, different batches of those shapes, drawn through
the data path `vse train` uses (`vsekit.training.data_path`: on the device, augmented, or the DataLoader, as
train.data_on_device picks) from a synthetic precomp split written to a temporary directory (float16
features, captions of min..max tokens): `warmup` untimed steps, then the median of `steps` timed ones, each
from fetching its batch to a device synchronisation after the optimizer step. The data path's share of a
step is measured apart (the next `steps` batches alone, as `vse bench data` times them), so that timing the
parts does not stall the device between them. `bench_train_step_variants` times several variants of the recipe
(e.g. `train.caption_buckets=1` and `=4`, `train.cuda_graph=false` and `=true`) in one run, alternating rounds
of steps, and gives each row's speed-up over the first.

    from vsekit_lab.bench.train_step import bench_train_step
    row = bench_train_step("vse_infty", batch=128, device="cuda", overrides=["train.amp=bf16"])

The transformer-text variant (`text="transformer"`) uses `text_model`: a local Hugging Face directory, or
`"bert-base"` / `"tiny"` for a randomly initialised BERT of that shape written to a temporary directory
(the timing does not depend on the weights, and no download is needed).
"""

from __future__ import annotations

import copy
import math
import shutil
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from vsekit.config import load_recipe
from vsekit.data.batch import Batch
from vsekit.data.text import SPECIALS, HFTextProcessor, Vocabulary
from vsekit.errors import VseInputError
from vsekit.losses import create_loss
from vsekit.models.vse import DataSpec, VSEModel
from vsekit.training.step import TrainStep
from vsekit.utils.memory import peak_memory_bytes
from vsekit_lab.bench.data_path import (
    DEFAULT_SETS,
    build_data,
    endless_batches,
    synthetic_words,
    time_batches,
    write_coco_like,
)

CAPTIONS_PER_IMAGE = 5

BERT_SHAPES = {
    "bert-base": {
        "hidden_size": 768,
        "num_hidden_layers": 12,
        "num_attention_heads": 12,
        "intermediate_size": 3072,
    },
    "tiny": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64},
}


def synthetic_batch(
    batch: int,
    regions: int,
    img_dim: int,
    vocab: int,
    min_tokens: int,
    max_tokens: int,
    seed: int = 0,
    first_token: int = 1,
) -> Batch:
    """A collated training batch of random features and captions (full region sets, 8-25 token captions)."""
    if batch < 2:
        raise VseInputError(f"a training step needs at least 2 samples (negatives), got batch={batch}")
    if not 1 <= min_tokens <= max_tokens:
        raise VseInputError(f"need 1 <= min_tokens <= max_tokens, got {min_tokens}, {max_tokens}")
    g = torch.Generator().manual_seed(seed)
    tok_len = torch.randint(min_tokens, max_tokens + 1, (batch,), generator=g)
    tok_len[0] = max_tokens  # the collate function pads to the longest caption
    tokens = torch.randint(first_token, vocab, (batch, max_tokens), generator=g)
    tokens[torch.arange(max_tokens)[None, :] >= tok_len[:, None]] = 0
    return Batch(
        images=torch.randn(batch, regions, img_dim, generator=g),
        image_lengths=torch.full((batch,), regions, dtype=torch.long),
        tokens=tokens,
        token_lengths=tok_len,
        image_index=torch.arange(batch),
        caption_index=torch.arange(batch),
    )


def random_bert_dir(shape: str, vocab: int = 30522) -> str:
    """Write a randomly initialised BERT of a named shape (`BERT_SHAPES`) to a temporary directory, with a
    WordPiece tokenizer whose words are `synthetic_words(vocab)` (each one token), as the bench's captions."""
    from transformers import BertConfig, BertModel, BertTokenizer

    if shape not in BERT_SHAPES:
        raise VseInputError(
            f"unknown BERT shape {shape!r}; choose from {', '.join(BERT_SHAPES)} or give a directory"
        )
    out = Path(tempfile.mkdtemp(prefix=f"vsekit-bench-{shape}-"))
    torch.manual_seed(0)
    BertModel(BertConfig(vocab_size=vocab, **BERT_SHAPES[shape])).save_pretrained(out)
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + synthetic_words(vocab)
    BertTokenizer(vocab={w: i for i, w in enumerate(words)}, do_lower_case=True).save_pretrained(out)
    return str(out)


def build_train_step(
    recipe: str = "vse_infty",
    batch: int = 128,
    device: str = "cpu",
    overrides: list[str] | tuple[str, ...] = (),
    text: str = "bigru",
    text_model: str = "bert-base",
    regions: int = 36,
    img_dim: int = 2048,
    embed_dim: int = 1024,
    vocab: int = 10_000,
    min_tokens: int = 8,
    max_tokens: int = 25,
    seed: int = 0,
) -> tuple[TrainStep, Batch, int]:
    """The trainer's `TrainStep` for `recipe` on a model of the given shapes, a synthetic batch (pinned on
    CUDA) and the epoch to call it with (past the loss warm-up: hardest negatives). For profiling."""
    if text not in ("bigru", "transformer"):
        raise VseInputError(f"text must be 'bigru' or 'transformer', got {text!r}")
    dev = torch.device(device)
    sets = [f"model.embed_dim={embed_dim}", f"model.text.kind={text}", *overrides]
    spec = DataSpec(img_dim=img_dim)
    first_token = 1
    if text == "transformer":
        path = text_model if Path(text_model).is_dir() else random_bert_dir(text_model)
        spec.text_model_path = path
        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(path, local_files_only=True).vocab_size
        first_token = min(1000, vocab - 1)  # skip the special tokens
    else:
        spec.vocab_words = ["<pad>", "<start>", "<end>", "<unk>"] + [f"w{i}" for i in range(vocab - 4)]
    r = load_recipe(recipe, sets)
    torch.manual_seed(seed)
    model = VSEModel(r, spec).to(dev)
    loss_fn = create_loss(r.loss, image_views=r.model.image.views, embed_dim=r.model.embed_dim).to(dev)
    if loss_fn.needs_caption_embeddings:  # ladder losses look relevance up by caption id
        g = torch.Generator().manual_seed(seed)
        loss_fn.set_caption_embeddings(torch.randn(batch, 384, generator=g))
    opt = torch.optim.AdamW(
        model.parameter_groups(r.optim.lr), lr=r.optim.lr, weight_decay=r.optim.weight_decay
    )
    step_fn = TrainStep(r, model, loss_fn, opt, dev)
    data = synthetic_batch(batch, regions, img_dim, vocab, min_tokens, max_tokens, seed, first_token)
    if dev.type == "cuda":
        data = data.pin_memory()
    return step_fn, data, r.loss.warmup_epochs


def bench_train_step(
    recipe: str = "vse_infty",
    batch: int = 128,
    device: str = "cpu",
    steps: int = 10,
    warmup: int = 3,
    overrides: list[str] | tuple[str, ...] = (),
    text: str = "bigru",
    text_model: str = "bert-base",
    regions: int = 36,
    img_dim: int = 2048,
    embed_dim: int = 1024,
    vocab: int = 10_000,
    min_tokens: int = 8,
    max_tokens: int = 25,
    seed: int = 0,
    n_images: int | None = None,
) -> dict:
    """ms per training step (median), samples/s, the data path's share and peak memory for `recipe`.

    The batches come from a synthetic precomp split of `n_images` images (default: enough for every step's
    batch to be new), through the trainer's data path. Hardest negatives: the loss runs as after its warm-up
    epochs. `overrides` are recipe `--set` strings (e.g. `train.amp=bf16`, `train.tf32=true`,
    `train.compile=true`, `train.data_on_device=false`, `train.caption_buckets=1`, `train.cuda_graph=true`).
    """
    return bench_train_step_variants(
        recipe,
        batch,
        device,
        steps,
        warmup,
        overrides,
        text=text,
        text_model=text_model,
        regions=regions,
        img_dim=img_dim,
        embed_dim=embed_dim,
        vocab=vocab,
        min_tokens=min_tokens,
        max_tokens=max_tokens,
        seed=seed,
        n_images=n_images,
    )[0]


def bench_train_step_variants(
    recipe: str = "vse_infty",
    batch: int = 128,
    device: str = "cpu",
    steps: int = 10,
    warmup: int = 3,
    overrides: list[str] | tuple[str, ...] = (),
    variants: Sequence[Sequence[str]] = ((),),
    rounds: int = 1,
    text: str = "bigru",
    text_model: str = "bert-base",
    regions: int = 36,
    img_dim: int = 2048,
    embed_dim: int = 1024,
    vocab: int = 10_000,
    min_tokens: int = 8,
    max_tokens: int = 25,
    seed: int = 0,
    n_images: int | None = None,
) -> list[dict]:
    """`bench_train_step` for several variants of the recipe in one run (e.g. `[["train.caption_buckets=1"],
    ["train.caption_buckets=4"]]`: before / after), one row each. The synthetic set is written once; every
    variant gets the same initial weights and draws the same batches (each its own data path); after their
    warm-up steps the variants are timed in turn, `steps` steps each, for `rounds` rounds (a shared machine's
    load falls on all of them alike). `speedup` is the first variant's median step time over the row's."""
    if steps < 1 or warmup < 0 or rounds < 1:
        raise VseInputError(f"steps and rounds must be >= 1 and warmup >= 0, got {steps}, {rounds}, {warmup}")
    if not variants:
        raise VseInputError("give at least one variant (an empty one: the recipe as it is)")
    if text not in ("bigru", "transformer"):
        raise VseInputError(f"text must be 'bigru' or 'transformer', got {text!r}")
    if batch < 2:
        raise VseInputError(f"a training step needs at least 2 samples (negatives), got batch={batch}")
    if not 3 <= min_tokens <= max_tokens:
        raise VseInputError(
            f"need 3 <= min_tokens <= max_tokens (a word between the two ends), got {min_tokens}, {max_tokens}"
        )
    dev = torch.device(device)
    n_img = n_images or max(2, math.ceil(batch * (warmup + (rounds + 1) * steps) / CAPTIONS_PER_IMAGE) + 1)
    tmp = Path(tempfile.mkdtemp(prefix="vsekit-bench-step-"))
    try:
        base = [
            *DEFAULT_SETS,
            f"model.embed_dim={embed_dim}",
            f"model.text.kind={text}",
            f"train.batch_size={batch}",
            *overrides,
        ]
        spec = DataSpec(img_dim=img_dim)
        r0 = load_recipe(recipe, base)
        if text == "transformer":
            path = text_model if Path(text_model).is_dir() else random_bert_dir(text_model)
            spec.text_model_path = path
            from vsekit.models.text import load_tokenizer

            processor = HFTextProcessor(load_tokenizer(path), r0.model.text.max_tokens)
        else:
            processor = Vocabulary(list(SPECIALS) + synthetic_words(vocab), "regex")
            spec.vocab_words = processor.idx2word
        write_coco_like(
            tmp, n_img, regions, img_dim, CAPTIONS_PER_IMAGE, min_tokens - 2, max_tokens - 2, vocab, seed
        )
        runs = [
            _Variant(list(v), recipe, base, spec, processor, tmp, batch, device, n_img, seed)
            for v in variants
        ]

        def sync() -> None:
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)

        def one(v: _Variant) -> float:
            sync()
            t0 = time.perf_counter()
            batch_ = next(v.batches)
            out = v.step_fn(batch_, epoch=v.epoch, step=v.steps)
            sync()
            dt = time.perf_counter() - t0
            v.steps += 1
            v.widths.append(int(batch_.tokens.shape[1]))
            if not torch.isfinite(out["loss"]):
                raise FloatingPointError(f"the benchmark's loss is not finite at step {v.steps}")
            return dt * 1e3

        for v in runs:
            for _ in range(warmup):
                one(v)
            v.widths.clear()
        for _ in range(rounds):
            for v in runs:
                if dev.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(dev)
                v.times += [one(v) for _ in range(steps)]
                v.peak = max(v.peak, peak_memory_bytes(dev)[0])
        for v in runs:  # the data path alone, on the next batches
            v.data_ms = time_batches(v.batches, steps, dev) * 1e3 / steps
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    peak_kind = peak_memory_bytes(dev)[1]
    rows = []
    for v in runs:
        r, times = v.recipe, v.times
        ms = statistics.median(times)
        rows.append(
            {
                "recipe": recipe,
                "text": text if text == "bigru" else f"transformer ({Path(text_model).name})",
                "variant": ", ".join(v.sets) or "as the recipe is",
                "batch": batch,
                "device": str(dev),
                "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                "threads": torch.get_num_threads(),
                "amp": r.train.amp,
                "tf32": r.train.tf32,
                "compile": r.train.compile,
                "cuda_graph": r.train.cuda_graph,
                "caption_buckets": r.train.caption_buckets,
                "length_bucketing": r.train.length_bucketing,
                "caption_widths": list(v.data.caption_widths),
                "mean_caption_width": statistics.mean(v.widths),
                "shapes": f"{regions}x{img_dim} {r.model.image.feature_type}, embed {embed_dim}, "
                f"vocab {len(v.model.spec.vocab_words) if v.model.spec.vocab_words else 'of the transformer'}, "
                f"{min_tokens}-{max_tokens} tokens",
                "steps": steps,
                "rounds": rounds,
                "warmup": warmup,
                "ms_median": ms,
                "ms_min": min(times),
                "ms_std": statistics.stdev(times) if len(times) > 1 else 0.0,
                "samples_per_s": batch / (ms / 1e3),
                "peak_gib": v.peak / 2**30,
                "peak_kind": peak_kind,
                "params": sum(p.numel() for p in v.model.parameters()),
                "data_path": v.data.path,
                "data_reason": v.data.reason,
                "data_ms": v.data_ms,
                "data_share": v.data_ms / ms,
                "n_images": n_img,
                "speedup": statistics.median(runs[0].times) / ms,
            }
        )
    return rows


class _Variant:
    """One variant's model, step and data path over the shared synthetic set, and its timings."""

    def __init__(
        self,
        sets: list[str],
        recipe: str,
        base: list[str],
        spec: DataSpec,
        processor,
        data_dir: Path,
        batch: int,
        device: str,
        n_img: int,
        seed: int,
    ) -> None:
        dev = torch.device(device)
        self.sets = sets
        self.recipe = r = load_recipe(recipe, [*base, *sets])
        torch.manual_seed(seed)
        self.model = VSEModel(r, copy.deepcopy(spec)).to(dev)
        loss_fn = create_loss(r.loss, image_views=r.model.image.views, embed_dim=r.model.embed_dim).to(dev)
        if loss_fn.needs_caption_embeddings:  # ladder losses look relevance up by caption id
            g = torch.Generator().manual_seed(seed)
            loss_fn.set_caption_embeddings(torch.randn(n_img * CAPTIONS_PER_IMAGE, 384, generator=g))
        opt = torch.optim.AdamW(
            self.model.parameter_groups(r.optim.lr), lr=r.optim.lr, weight_decay=r.optim.weight_decay
        )
        self.step_fn = TrainStep(r, self.model, loss_fn, opt, dev)
        self.data = build_data(
            data_dir, r, batch, device, text=processor, captions_per_image=CAPTIONS_PER_IMAGE
        )
        self.batches = endless_batches(self.data)
        self.epoch = r.loss.warmup_epochs  # past the loss warm-up: hardest negatives
        self.steps = 0
        self.times: list[float] = []
        self.widths: list[int] = []
        self.peak = 0
        self.data_ms = 0.0
