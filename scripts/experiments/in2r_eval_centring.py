"""How much IN2R's evaluation protocol matters: a trained `in2r` run's test rsum with the centring vsekit's
eval mode applies (the running mean of the training batches: an embedding independent of its batch-mates),
with the release's (IN2R/evaluation.py `encode_data`: consecutive batches of captions, each caption's image
beside it, every batch centred by its own mean; an image's embedding is the row of its first caption), and
with the mean of the training split's own embeddings in eval mode (batch-independent too).

    .venv/bin/python scripts/experiments/in2r_eval_centring.py runs/noisy/c40/in2r_bigru/seed0 \\
        --data data/noisy/openclipart_c40 [--batch-size 128] [--json-out F]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from vsekit.data.precomp import load_precomp_split
from vsekit.evaluation import encode_captions, encode_images, image_source_for
from vsekit.losses.noisy_split import centred_l2norm
from vsekit.metrics import evaluate_sims
from vsekit.models.norm import l2_normalize
from vsekit.models.tokenizers import text_processor_for
from vsekit.runs import load_run


def release_embeddings(img_raw: torch.Tensor, cap_raw: torch.Tensor, cap2img: np.ndarray, batch: int):
    """(images, captions) as the release's `encode_data` makes them, for any number of captions per image."""
    cap2img = np.asarray(cap2img)
    img_out = torch.zeros_like(img_raw)
    seen = np.zeros(len(img_raw), dtype=bool)
    cap_out = torch.empty_like(cap_raw)
    for start in range(0, len(cap2img), batch):
        rows = np.arange(start, min(start + batch, len(cap2img)))
        cap_out[rows] = centred_l2norm(cap_raw[rows])
        imgs = centred_l2norm(img_raw[torch.as_tensor(cap2img[rows])])
        for j, i in enumerate(cap2img[rows]):
            if not seen[i]:  # the image's row is its first caption's
                img_out[i], seen[i] = imgs[j], True
    return img_out, cap_out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run")
    p.add_argument("--data", required=True)
    p.add_argument("--split", default="test")
    p.add_argument("--batch-size", type=int, default=128, help="the release's evaluation batch (captions)")
    p.add_argument("--json-out")
    args = p.parse_args()
    pair, _ = load_run(Path(args.run), "best", "cpu")
    split = load_precomp_split(args.data, args.split, pair.recipe.data.captions_per_image)
    text = text_processor_for(pair)
    source = image_source_for(pair, split)
    out: dict = {}
    train = load_precomp_split(args.data, pair.recipe.data.train_split, pair.recipe.data.captions_per_image)
    train_source = image_source_for(pair, train)
    sims = {"running": [], "release": [], "train_mean": []}
    with torch.no_grad():
        for member in pair.members:
            member.eval()
            img = encode_images(member, source, 256, "cpu")
            cap = encode_captions(member, split.captions, text, 256, "cpu")
            sims["running"].append((img @ cap.T).numpy())
            with member.uncentred():
                img_raw = encode_images(member, source, 256, "cpu")
                cap_raw = encode_captions(member, split.captions, text, 256, "cpu")
            i, c = release_embeddings(img_raw, cap_raw, split.cap2img, args.batch_size)
            sims["release"].append((i @ c.T).numpy())
            with member.uncentred():
                img_mean = encode_images(member, train_source, 256, "cpu").mean(0)
                cap_mean = encode_captions(member, train.captions, text, 256, "cpu").mean(0)
            i, c = l2_normalize(img_raw - img_mean, "add_eps"), l2_normalize(cap_raw - cap_mean, "add_eps")
            sims["train_mean"].append((i @ c.T).numpy())
    for way, (a, b) in sims.items():
        out[way] = {
            "pair_rsum": evaluate_sims((a + b) / 2, split.cap2img)["rsum"],
            "A_rsum": evaluate_sims(a, split.cap2img)["rsum"],
        }
    print(json.dumps(out, indent=1))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
