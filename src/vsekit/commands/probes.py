"""`vse eval RUN --probe order | sugarcrepe DIR`: compositional probes beside recall, each score printed
beside the text-only baseline's on the same items (docs/probes.md).

The items come from `vsekit.data.probes`, the scores from `vsekit.metrics.probes`, the baseline from
`vsekit.data.text_only`; this module encodes what the items need with the run's model and reports.
"""

from __future__ import annotations

import argparse
import logging
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np

from vsekit.errors import VseInputError

log = logging.getLogger(__name__)

PROBES = ("order", "sugarcrepe")


def parse_probe(values: list[str]) -> tuple[str, str | None]:
    """(probe name, its folder) from `--probe NAME [DIR]`; one-line errors for an unknown name or a
    missing / extra folder."""
    name, rest = values[0], values[1:]
    if name not in PROBES:
        raise VseInputError(f"--probe {name!r}: unknown probe; choose one of {', '.join(PROBES)}")
    if name == "order" and rest:
        raise VseInputError(f"--probe order takes no folder (got {' '.join(rest)!r})")
    if name == "sugarcrepe" and len(rest) != 1:
        raise VseInputError("--probe sugarcrepe DIR: name one folder holding SugarCrepe's JSON files")
    return name, (rest[0] if rest else None)


def side_files(args: argparse.Namespace, name: str) -> tuple[Path | None, Path | None]:
    """(items file, plot) written beside `--json-out F`: F's name with `.items.json` and `.png`."""
    if not args.json_out:
        return None, None
    out = Path(args.json_out)
    stem = out.name[: -len(out.suffix)] if out.suffix else out.name
    items = out.with_name(f"{stem}.items.json") if name == "order" else None
    return items, out.with_name(f"{stem}.png")


def subset_split(split, images: np.ndarray):
    """The split restricted to `images` (image indices, in that order), without captions: what the image
    encoder needs for the probe's pictures only."""
    from vsekit.data.precomp import PrecompSplit

    idx = np.asarray(images, dtype=np.int64)
    return PrecompSplit(
        split.root,
        split.split,
        split.features,
        [],
        np.zeros(0, dtype=np.int64),
        split.image_rows[idx],
        [split.image_ids[i] for i in idx],
        [split.image_paths[i] for i in idx] if split.image_paths is not None else None,
        split.set_sizes,
        split.image_root,
    )


def pair_similarities(model, split, pairs: list[tuple[int, str]], batch_size: int, device) -> np.ndarray:
    """The model's similarity of each (image index, caption) pair: each picture and each distinct caption
    encoded once, then scored in blocks of pictures against the captions those pictures need."""
    from vsekit.evaluation import encode_captions, encode_images, image_source_for, text_processor_for
    from vsekit.similarity import all_pairs

    if not pairs:
        return np.zeros(0, dtype=np.float64)
    images = np.array(sorted({p[0] for p in pairs}), dtype=np.int64)
    texts = list(dict.fromkeys(p[1] for p in pairs))
    text_index = {t: i for i, t in enumerate(texts)}
    image_index = {int(img): i for i, img in enumerate(images)}
    img_emb = encode_images(model, image_source_for(model, subset_split(split, images)), batch_size, device)
    txt_emb = encode_captions(model, texts, text_processor_for(model), batch_size, device)
    by_image: dict[int, list[int]] = {}
    for k, (img, _) in enumerate(pairs):
        by_image.setdefault(image_index[img], []).append(k)
    out = np.empty(len(pairs), dtype=np.float64)
    order = sorted(by_image)
    block = 64
    for start in range(0, len(order), block):
        rows = order[start : start + block]
        ks = [k for r in rows for k in by_image[r]]
        caps = sorted({text_index[pairs[k][1]] for k in ks})
        col = {c: j for j, c in enumerate(caps)}
        sims = all_pairs(model.sim, img_emb[rows], txt_emb[caps], device)
        row_of = {r: i for i, r in enumerate(rows)}
        for k in ks:
            out[k] = sims[row_of[image_index[pairs[k][0]]], col[text_index[pairs[k][1]]]]
    return out


def plain(value):
    """`value` with NaN as None (JSON has no NaN)."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, float) and math.isnan(value):
        return None
    return value


def with_text_only(model_score: dict, text_score: dict, key: str) -> dict:
    out = dict(model_score)
    out["text_only"] = text_score[key]
    out["text_only_ci_low"], out["text_only_ci_high"] = text_score["ci_low"], text_score["ci_high"]
    return out


def line(label: str, r: dict, key: str) -> str:
    return (
        f"  {label:<28} n={r['n']:<6} model {r[key]:5.1f} [{r['ci_low']:5.1f}, {r['ci_high']:5.1f}]  "
        f"chance {r['chance']:5.1f}  text-only {r['text_only']:5.1f} "
        f"[{r['text_only_ci_low']:5.1f}, {r['text_only_ci_high']:5.1f}]"
    )


def training_captions(data: str, train_split: str) -> list[str]:
    """The run's own training captions, which the text-only baseline learns from."""
    from vsekit.data.precomp import DataFormatError, read_lines

    path = Path(data) / f"{train_split}_caps.txt"
    if not path.is_file():
        raise DataFormatError(
            f"{path}: missing; the text-only baseline is trained on the run's training captions"
        )
    return read_lines(path)


def score_order(args, model, split, text_model, probe) -> dict:
    from vsekit.data.probes import ORDER_PERTURBATIONS
    from vsekit.metrics.probes import precision_at_1

    results: dict[str, dict] = {}
    for kind in ORDER_PERTURBATIONS:
        if kind in probe.skipped:
            results[kind] = {"skipped": probe.skipped[kind]}
        if kind not in probe.items:
            continue
        items = probe.items[kind]
        k = max((len(it.negatives) for it in items), default=1)
        pairs = [(it.image, it.positive) for it in items]
        for it in items:
            pairs += [(it.image, n) for n in it.negatives]
        sims = pair_similarities(model, split, pairs, args.batch_size, args.device)
        n = len(items)
        pos, neg = sims[:n], np.full((n, k), np.nan)
        texts_neg = np.full((n, k), np.nan)
        at = n
        for i, it in enumerate(items):
            m = len(it.negatives)
            neg[i, :m] = sims[at : at + m]
            texts_neg[i, :m] = text_model.scores(it.negatives)
            at += m
        text_pos = text_model.scores([it.positive for it in items])
        r = with_text_only(precision_at_1(pos, neg), precision_at_1(text_pos, texts_neg), "precision_at_1")
        r["left_out"] = probe.left_out.get(kind, 0)
        results[kind] = r
    return results


def score_sugarcrepe(args, model, split, text_model, examples, training_ids) -> tuple[dict, dict]:
    from vsekit.data.probes import id_rows, subset_masks
    from vsekit.metrics.probes import pairwise_accuracy

    rows = id_rows(split.image_ids, f"{split.root / f'{split.split}_ids.txt'}")
    results, missing = {}, {}
    for cat, items in examples.items():
        found = [(it, rows[it.coco_id]) for it in items if it.coco_id in rows]
        missing[cat] = len(items) - len(found)
        pairs = [(r, it.positive) for it, r in found] + [(r, it.negative) for it, r in found]
        sims = pair_similarities(model, split, pairs, args.batch_size, args.device)
        n = len(found)
        pos, neg = sims[:n], sims[n:]
        tpos = text_model.scores([it.positive for it, _ in found])
        tneg = text_model.scores([it.negative for it, _ in found])
        masks = subset_masks(np.array([it.coco_id for it, _ in found], dtype=np.int64), training_ids)
        results[cat] = {
            name: with_text_only(
                pairwise_accuracy(pos[m], neg[m]), pairwise_accuracy(tpos[m], tneg[m]), "accuracy"
            )
            for name, m in masks.items()
        }
        results[cat]["examples"] = len(items)
        results[cat]["missing_rows"] = missing[cat]
    return results, missing


def plot_probe(results: dict, name: str, out_png: Path) -> None:
    """One panel per perturbation / category: the model's score and the text-only baseline's with their
    intervals (per subset for SugarCrepe), chance dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cats = [c for c, r in results.items() if "skipped" not in r]
    if not cats:
        return
    fig, axes = plt.subplots(1, len(cats), figsize=(3.2 * len(cats), 3.4), dpi=120, squeeze=False)
    key = "precision_at_1" if name == "order" else "accuracy"
    for ax, cat in zip(axes[0], cats):
        groups = (
            {"": results[cat]}
            if name == "order"
            else {s: results[cat][s] for s in ("all", "clean", "contaminated") if s in results[cat]}
        )
        x = np.arange(len(groups))
        for off, (what, lo_k, hi_k, label) in enumerate(
            (
                (key, "ci_low", "ci_high", "model"),
                ("text_only", "text_only_ci_low", "text_only_ci_high", "text-only"),
            )
        ):
            vals = [g[what] for g in groups.values()]
            err = [
                [max(0.0, g[what] - g[lo_k]) for g in groups.values()],
                [max(0.0, g[hi_k] - g[what]) for g in groups.values()],
            ]
            ax.bar(x + (off - 0.5) * 0.38, vals, 0.38, yerr=err, capsize=3, label=label)
        ax.axhline(next(iter(groups.values()))["chance"], color="grey", ls="--", lw=1, label="chance")
        ax.set_xticks(x, [f"{s}\n(n={g['n']})" for s, g in groups.items()], fontsize=7)
        ax.set_ylim(0, 100)
        ax.set_title(cat, fontsize=9)
        ax.set_ylabel(f"{key} (%)")
        ax.grid(alpha=0.3, axis="y")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out_png)
    plt.close(fig)


def check_probe_args(args: argparse.Namespace) -> tuple[str, str | None]:
    name, folder = parse_probe(args.probe)
    if len(args.runs) != 1:
        raise VseInputError(f"--probe scores one run; got {len(args.runs)} ({' '.join(args.runs)})")
    for flag, on in (("--fold5", args.fold5), ("--eccv", args.eccv), ("--save-sims", args.save_sims)):
        if on:
            raise VseInputError(
                f"--probe {name} and {flag}: a probe scores its own items; run {flag} separately"
            )
    if args.probe_items and name != "order":
        raise VseInputError("--probe-items FILE: the saved items of --probe order; not for sugarcrepe")
    return name, folder


def run_probe(
    args: argparse.Namespace,
    eval_preflight: Callable[[argparse.Namespace], str],
    check_result_files: Callable[[argparse.Namespace, str], None],
) -> int:
    """`vse eval RUN --probe ...`: every check before the model is built (`vse eval`'s own preflight and
    result-file checks, passed in by `vsekit.commands.evaluate`, then the probe's), then encode, score and
    report."""
    from vsekit.commands.jsonout import command_inputs, emit_json
    from vsekit.data.precomp import load_precomp_split
    from vsekit.data.probes import build_order_probe, order_probe_json, read_sugarcrepe, read_training_ids
    from vsekit.data.text_only import KneserNeyTrigram
    from vsekit.runs import load_run, read_run_config
    from vsekit.utils.io import atomic_write_json, check_output_file
    from vsekit.utils.runtime import resolve_device

    name, folder = check_probe_args(args)
    examples = read_sugarcrepe(folder) if name == "sugarcrepe" else None  # a wrong folder: before any work
    data = eval_preflight(args)
    check_result_files(args, data)
    items_file, png = side_files(args, name)
    inputs = command_inputs(args, data, folder, args.probe_items)
    for path, what in ((items_file, "--json-out (its .items.json)"), (png, "--json-out (its .png)")):
        if path is not None:
            check_output_file(path, what, inputs)
    run = args.runs[0]
    recipe, _, _ = read_run_config(run)
    split = load_precomp_split(data, args.split, recipe.data.captions_per_image)
    training_ids = None
    if name == "sugarcrepe":
        from vsekit.data.probes import id_rows

        id_rows(split.image_ids, str(Path(data) / f"{args.split}_ids.txt"))  # COCO ids, before the model
        training_ids = read_training_ids(data, recipe.data.train_split)
    if name == "order":
        if args.probe_items:
            from vsekit.data.probes import read_order_probe

            probe = read_order_probe(args.probe_items, split.n_images, split.image_ids)
        else:
            probe = build_order_probe(
                split.captions,
                split.cap2img,
                split.image_ids,
                args.split,
                args.probe_seed,
                args.probe_negatives,
                args.probe_images,
            )
    text_model = KneserNeyTrigram(training_captions(data, recipe.data.train_split))
    args.device = resolve_device(args.device)
    model, _ = load_run(run, args.checkpoint, args.device)
    report = {"probe": name, "run": str(run), "data": str(data), "split": args.split}
    if name == "order":
        results = score_order(args, model, split, text_model, probe)
        report.update(seed=probe.seed, negatives=probe.negatives, results=results)
        print(
            f"order probe on {data} split {args.split!r} (seed {probe.seed}, up to {probe.negatives} "
            f"negatives): precision@1 % [95% Wilson interval]; ties count as failures"
        )
        for kind in results:
            r = results[kind]
            if "skipped" in r:
                print(f"  {kind:<28} skipped: {r['skipped']}")
            else:
                print(
                    line(kind, r, "precision_at_1")
                    + (f"  ({r['left_out']} left out)" if r["left_out"] else "")
                )
        if items_file is not None:
            atomic_write_json(items_file, order_probe_json(probe))
            report["items_file"] = str(items_file)
            print(f"wrote {items_file} (score another run on these items: --probe-items {items_file})")
    else:
        results, missing = score_sugarcrepe(args, model, split, text_model, examples, training_ids)
        report.update(folder=str(folder), training_split=recipe.data.train_split, results=results)
        if training_ids is None:
            report["contamination"] = (
                f"unknown: {Path(data) / f'{recipe.data.train_split}_ids.txt'} is missing, so no item can be "
                "called clean"
            )
        print(
            f"SugarCrepe on {data} split {args.split!r}: accuracy % [95% Wilson interval], clean = picture "
            f"outside the run's training split {recipe.data.train_split!r}"
        )
        for cat, r in results.items():
            for subset in ("all", "clean", "contaminated"):
                if subset in r:
                    print(line(f"{cat} {subset}", r[subset], "accuracy"))
            if r["missing_rows"]:
                print(f"  {cat}: {r['missing_rows']} of {r['examples']} pictures have no row in the split")
        if "contamination" in report:
            print(f"  contamination {report['contamination']}")
    if png is not None:
        plot_probe(results, name, png)
        print(f"plot: {png}")
    emit_json(args, plain(report), ensure_ascii=True)
    return 0


def add_probe_args(p: argparse.ArgumentParser) -> None:
    """The `--probe` options of `vse eval`."""
    from vsekit.commands.argtypes import at_least

    p.add_argument(
        "--probe",
        nargs="+",
        metavar="NAME",
        help="compositional probe instead of recall: `order` (seeded word-order shuffles of the split's "
        "captions) or `sugarcrepe DIR` (the released SugarCrepe JSON files); each score beside a text-only "
        "baseline; docs/probes.md",
    )
    p.add_argument(
        "--probe-seed",
        type=int,
        action=at_least(0),
        default=0,
        help="seed of the order probe's images and shuffles",
    )
    p.add_argument(
        "--probe-images",
        type=int,
        action=at_least(0),
        default=0,
        help="order probe: a seeded sample of N images (0 = all)",
    )
    p.add_argument(
        "--probe-negatives",
        type=int,
        action=at_least(1),
        default=4,
        help="order probe: shuffles per caption (ARO: 4)",
    )
    p.add_argument("--probe-items", metavar="FILE", help="order probe: score the items an earlier run saved")
