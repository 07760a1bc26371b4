"""What caption buckets (`train.caption_buckets`) and length-bucketed batches (`train.length_bucketing`) save
on real caption lengths: for each setting, over several epochs of the trainer's own batch order
(`EpochBatches`, seeded as `vse train` seeds it), the share of batches padded to the top caption width, the
BiGRU's sequential time steps per epoch (the sum of the batches' widths: on a GPU each step is a launch of
its own, so this is what a launch-bound step pays) and the padded token positions per epoch (batch size x
width: the arithmetic), beside the real tokens (what a packed GRU would run) and the number of batch shapes
(CUDA graphs captured).

Captions come from the openclipart metadata the builder reads (`--svg-root`, the Debian openclipart-svg
tree by default; the train split of `vse data openclipart`'s seeded split, without rendering: the few
drawings that render blank are not dropped) or from a caption file (`--captions DIR/train_caps.txt`, one
caption a line: e.g. a built set or COCO's). Widths are the device path's: token lengths (`<start> words
<end>`) with the recipe's tokenizer, the batch padded to the smallest width holding its longest caption
before augmentation.

    .venv/bin/python scripts/experiments/length_bucketing.py                       # openclipart, batch 128
    .venv/bin/python scripts/experiments/length_bucketing.py --captions data/coco/train_caps.txt
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np

from vsekit.data.text import Vocabulary
from vsekit.training.data_path import EpochBatches, bucket_width, caption_widths, vocabulary_lengths


def openclipart_train_captions(svg_root: str, seed: int = 0) -> list[str]:
    """The train split's captions that `vse data openclipart --seed SEED` makes, from the SVG metadata."""
    from vsekit_lab.datasets.openclipart import (
        assign_labels,
        assign_splits,
        ensure_svg_root,
        find_svgs,
        merge_duplicates,
        parse_all,
    )

    root = ensure_svg_root(svg_root)
    rel_paths, _ = find_svgs(root)
    with tempfile.TemporaryDirectory() as tmp:
        parsed, _ = parse_all(root, rel_paths, Path(tmp) / "metadata.json", progress=False)
    kept, _ = assign_labels(merge_duplicates(parsed)[0])
    by_id = {d.id: d for d in kept}
    train = assign_splits(sorted(by_id), seed, 500, 300)["train"]  # the builder's default test/dev sizes
    return [c for i in train for c in by_id[i].captions]


def epoch_stats(
    tokens: np.ndarray, sort_key: np.ndarray | None, batch: int, buckets: int, epochs: int, seed: int
) -> dict:
    """Per-epoch means of one setting. `tokens`: the token lengths the widths are cut from; `sort_key`: what
    the sampler sorts by with length bucketing (None: random batches; the trainer sorts by word counts)."""
    widths = caption_widths(tokens, buckets)
    top_width = widths[-1] if widths else int(tokens.max())
    sampler = EpochBatches(len(tokens), batch, seed, sort_key)
    top = steps = padded = n_batches = 0
    shapes = set()
    for epoch in range(epochs):
        sampler.epoch = epoch
        for b in sampler.batches():
            w = bucket_width(widths, int(tokens[b].max()))
            top += w == top_width
            steps += w
            padded += w * len(b)
            n_batches += 1
            shapes.add((len(b), w))
    return {
        "caption_buckets": buckets,
        "widths": list(widths),
        "batches_per_epoch": n_batches / epochs,
        "top_width_share": top / n_batches,
        "gru_steps_per_epoch": steps / epochs,
        "padded_tokens_per_epoch": padded / epochs,
        "real_tokens_per_epoch": int(tokens.sum()),
        "batch_shapes": len(shapes),
    }


HEADER = (
    "| caption_buckets | length_bucketing | widths | batches at the top width | BiGRU steps / epoch | "
    "vs 1 bucket, random | padded tokens / epoch | real tokens | batch shapes |"
)


def table_row(r: dict, base_steps: float) -> str:
    widths = ", ".join(map(str, r["widths"])) or "own longest"
    steps = r["gru_steps_per_epoch"]
    cells = [
        str(r["caption_buckets"]),
        r["length_bucketing"],
        widths,
        f"{100 * r['top_width_share']:.1f} %",
        f"{steps:,.0f}",
        f"{steps / base_steps:.2f}",
        f"{r['padded_tokens_per_epoch']:,.0f}",
        f"{r['real_tokens_per_epoch']:,}",
        str(r["batch_shapes"]),
    ]
    return "| " + " | ".join(cells) + " |"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--captions", help="a caption file, one a line (default: openclipart's train captions)")
    ap.add_argument("--svg-root", default=None, help="openclipart's SVG tree (default: the builder's)")
    ap.add_argument("--tokenizer", default="nltk", choices=("nltk", "regex"), help="default: the recipes'")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0, help="train.seed")
    ap.add_argument("--json-out")
    args = ap.parse_args()
    if args.captions:
        captions = [c for c in Path(args.captions).read_text(encoding="utf-8").splitlines() if c.strip()]
        source = args.captions
    else:
        from vsekit_lab.datasets.openclipart import DEFAULT_SVG_ROOT

        captions = openclipart_train_captions(args.svg_root or DEFAULT_SVG_ROOT)
        source = "openclipart train split"
    tokens = vocabulary_lengths(captions, Vocabulary.build(captions, 1, args.tokenizer))
    words = np.array([len(c.split()) for c in captions])
    q = np.percentile(tokens, [50, 75, 90, 99, 100]).astype(int)
    stats = f"mean {tokens.mean():.2f}, median {q[0]}, p75 {q[1]}, p90 {q[2]}, p99 {q[3]}, max {q[4]}"
    print(f"{source}: {len(captions):,} captions; {args.tokenizer} token lengths (+ <start> <end>): {stats}")
    # length bucketing as the trainer does it (sorted by whitespace words) and, for comparison, sorted by the
    # token lengths the widths are cut from (not what the trainer does)
    keys = {"false": None, "true": words, "true, by tokens": tokens}
    rows = []
    for nb in (1, 4, 0):
        for name, key in keys.items():
            if nb == 4 or name != "true, by tokens":
                rows.append(
                    {
                        "length_bucketing": name,
                        **epoch_stats(tokens, key, args.batch, nb, args.epochs, args.seed),
                    }
                )
    widths4 = next(r["widths"] for r in rows if r["caption_buckets"] == 4)
    third = widths4[-2] if len(widths4) > 1 else 0
    p_top = float((tokens > third).mean())
    hit = 1 - (1 - p_top) ** args.batch
    print(
        f"captions longer than the third of 4 widths ({third} tokens): p = {p_top:.3f}; a random batch of "
        f"{args.batch} holds one with probability 1 - (1 - p)^B = {hit:.6f}"
    )
    print(f"\nbatch {args.batch}, means over {args.epochs} epochs of seed {args.seed}\n")
    print(HEADER)
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(table_row(r, rows[0]["gru_steps_per_epoch"]))
    if args.json_out:
        doc = {"source": source, "captions": len(captions), "p_top": p_top, "rows": rows}
        Path(args.json_out).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
