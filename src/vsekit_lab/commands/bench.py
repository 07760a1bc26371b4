"""`vse bench …`: timing benchmarks. Each prints Markdown table rows that carry the machine, the date and
the exact command, and `--append FILE` adds them to that file's section for the benchmark (docs/benchmarks.md),
so every figure in the docs can be re-measured with the command written next to it."""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import shlex
from pathlib import Path

from vsekit.commands.argtypes import POSITIVE, at_least, checked, finite, in_range, positive_number
from vsekit.commands.jsonout import add_json_args

SECTIONS = {
    "train-step": "Training step (`vse bench train-step`)",
    "grad-cache": "Gradient caching: peak memory of one step (`vse bench grad-cache`)",
    "data": "Data path (`vse bench data`)",
    "amp": "bf16 autocast against float32: one step's loss and gradients (`vse bench amp`)",
    "eval": "Evaluation: `vse eval-sims` (`vse bench eval`)",
    "eval-sims": "Evaluation as whole processes: `vse eval-sims` vs a minimal numpy script (`vse bench eval-sims`)",
    "pool": "Pooling cost (`vse bench pool`)",
    "ladder": "Ladder loss step cost (`vse bench ladder`)",
    "search": "FAISS search (`vse bench search`)",
    "aeom": "AEOM similarity (`vse bench aeom`)",
    "serve": "Server load test (`vse bench serve`)",
    "startup": "Start-up of the verbs that need no model (`vse bench startup`)",
    "eccv": "ECCV Caption, CxC and COCO 1K/5K keys: `vse eval-sims --eccv` (`vse bench eccv`)",
}


# ------------------------------------------------------------------------------------------- rows
def machine_description(device: str = "cpu") -> str:
    """CPU model, cores, torch threads and the 1-minute load (the machine may be shared), or the GPU."""
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(torch.device(device))}, torch {torch.__version__}"
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = f", load {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else ""
    return f"{model}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads{load}, torch {torch.__version__}"


def _fmt(v) -> str:
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if math.isnan(v):
            return "–"
        return f"{v:.3g}" if abs(v) < 10 else f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.1f}"
    return str(v).replace("|", "\\|")


def markdown_rows(columns: list[tuple[str, str]], rows: list[dict], context: dict) -> list[str]:
    """Header, separator and one line per row; `columns` = (key, title); context columns appended."""
    titles = [t for _, t in columns] + ["machine", "date", "command"]
    lines = ["| " + " | ".join(titles) + " |", "|" + "---|" * len(titles)]
    for r in rows:
        cells = [_fmt(r.get(k, "")) for k, _ in columns]
        cells += [_fmt(context["machine"]), context["date"], f"`{context['command']}`"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def append_markdown(path: str | Path, section: str, lines: list[str]) -> None:
    """Add the table rows under `## section` of `path` (after that section's table when the header matches,
    else as a new table at the section's end; a missing section goes at the end of the file)."""
    path = Path(path)
    text = path.read_text(encoding="utf-8") if path.is_file() else "# Benchmarks\n"
    doc = text.rstrip("\n").split("\n")
    heading = f"## {section}"
    header, rows = lines[:2], lines[2:]
    if heading not in doc:
        doc += ["", heading, "", *header, *rows]
    else:
        start = doc.index(heading)
        end = next((i for i in range(start + 1, len(doc)) if doc[i].startswith("## ")), len(doc))
        tables = [i for i in range(start, end) if doc[i] == header[0] and i + 1 < end and doc[i + 1] == header[1]]
        if tables:
            last = tables[-1] + 2
            while last < end and doc[last].startswith("|"):
                last += 1
            doc[last:last] = rows
        else:
            while end > start + 1 and not doc[end - 1].strip():
                end -= 1
            doc[end:end] = ["", *header, *rows]
    path.write_text("\n".join(doc) + "\n", encoding="utf-8")


def command_line(parser: argparse.ArgumentParser, args: argparse.Namespace, name: str) -> str:
    """The command as typed, reconstructed from the options that differ from their defaults."""
    parts = ["vse", "bench", name]
    for action in parser._actions:
        if action.dest in ("help", "append", "json", "json_out"):  # where the output goes is not part of the measurement
            continue
        if not action.option_strings:  # a positional (e.g. the index of `vse bench serve`)
            value = getattr(args, action.dest, None)
            if value is not None:
                parts.append(str(value))
            continue
        value = getattr(args, action.dest, None)
        if value == action.default or value is None:
            continue
        flag = action.option_strings[-1]
        if value is True:
            parts.append(flag)
        elif isinstance(value, list) and isinstance(action, argparse._AppendAction):
            for v in value:
                parts += [flag, str(v)]
        elif isinstance(value, list):
            parts += [flag, *map(str, value)]
        else:
            parts += [flag, str(value)]
    return shlex.join(parts)


def emit(args: argparse.Namespace, columns: list[tuple[str, str]], rows: list[dict], device: str = "cpu") -> None:
    context = {"machine": machine_description(device),
               "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
               "command": args._command}  # fmt: skip
    lines = markdown_rows(columns, rows, context)
    print("\n".join(lines))
    if args.append:
        append_markdown(args.append, SECTIONS[args.bench], lines)
        print(f"appended to {args.append}")


# ------------------------------------------------------------------------------------------- runs
def run_train_step(args: argparse.Namespace) -> int:
    from vsekit_lab.bench.train_step import bench_train_step_variants

    sets = list(args.set)
    if args.amp:
        sets.append(f"train.amp={args.amp}")
    if args.tf32:
        sets.append("train.tf32=true")
    if args.compile:
        sets.append("train.compile=true")
    if args.data_on_device is not None:
        sets.append(f"train.data_on_device={args.data_on_device}")
    if args.length_bucketing:
        sets.append("train.length_bucketing=true")
    if args.cuda_graph:
        sets.append("train.cuda_graph=true")
    # variants timed in one run (before / after): each --variant, then each --caption-buckets value
    variants = [[s for s in v.split(",") if s] for v in args.variant]
    variants += [[f"train.caption_buckets={n}"] for n in args.caption_buckets or []]
    if args.threads > 0:
        import torch

        torch.set_num_threads(args.threads)
    rows = bench_train_step_variants(args.recipe, batch=args.batch, device=args.device, steps=args.steps,
                                     warmup=args.warmup, overrides=sets, variants=variants or [[]], rounds=args.rounds,
                                     text=args.text, text_model=args.text_model, regions=args.regions,
                                     img_dim=args.img_dim, embed_dim=args.embed_dim, vocab=args.vocab,
                                     n_images=args.n)  # fmt: skip
    for row in rows:
        row["peak"] = f"{row['peak_gib']:.2f} GiB ({row['peak_kind']})"
        row["precision"] = (f"{row['amp']}{', tf32' if row['tf32'] else ''}{', compiled' if row['compile'] else ''}"
                            f"{', CUDA graph' if row['cuda_graph'] else ''}")  # fmt: skip
        row["data_share_pct"] = 100 * row["data_share"]
        row["captions"] = (f"{row['caption_buckets']} bucket(s) {row['caption_widths']}"
                           f"{', length-bucketed' if row['length_bucketing'] else ''}: mean {row['mean_caption_width']:.1f}")  # fmt: skip
    columns = [("recipe", "recipe"), ("text", "text"), ("shapes", "shapes"), ("device_name", "device"),
               ("precision", "precision"), ("batch", "batch"), ("data_path", "data path"),
               ("captions", "caption widths (mean)"), ("ms_median", "ms/step (median)"), ("samples_per_s", "samples/s"),
               ("data_share_pct", "data path % of step"), ("peak", "peak memory")]  # fmt: skip
    if len(rows) > 1:
        columns[1:1] = [("variant", "variant")]
        columns.append(("speedup", "speed-up vs first row"))
    emit(args, columns, rows, args.device)
    _write_json(args, rows[0] if len(rows) == 1 else {"rows": rows})
    return 0


def run_amp(args: argparse.Namespace) -> int:
    from vsekit_lab.bench.amp import bf16_numerics

    if args.threads > 0:
        import torch

        torch.set_num_threads(args.threads)
    rows = []
    for warmup in (False, True):
        rows += bf16_numerics(args.recipe, batch=args.batch, regions=args.regions, img_dim=args.img_dim,
                              embed_dim=args.embed_dim, vocab=args.vocab, seeds=range(args.seeds), device=args.device,
                              overrides=args.set, warmup=warmup)  # fmt: skip
    emit(args, [("recipe", "recipe"), ("loss_kind", "loss"), ("shapes", "shapes"), ("batch", "batch"),
                ("seeds", "seeds"), ("loss_rel", "loss rel. error"), ("image_emb_rel", "image emb."),
                ("text_emb_rel", "caption emb."), ("grads_rel", "gradients (all)"),
                ("grad_median_rel", "gradients (median tensor)"), ("grad_worst_rel", "worst tensor"),
                ("grad_worst_tensor", "which"), ("left_out", "left out (zero in exact arithmetic)")], rows,
         args.device)  # fmt: skip
    for row in rows[: len(args.recipe)]:
        print(f"{row['recipe']}: bf16 outputs: {', '.join(row['bf16_modules'])}; float32 outputs: "
              f"{', '.join(row['fp32_modules']) or '-'}")  # fmt: skip
    _write_json(args, {"rows": rows})
    return 0


def run_data(args: argparse.Namespace) -> int:
    import torch

    from vsekit_lab.bench.data_path import bench_data

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    res = bench_data(n=args.n, regions=args.regions, img_dim=args.img_dim, batch=args.batch, device=args.device,
                     steps=args.steps, warmup=args.warmup, rounds=args.rounds, recipe=args.recipe, overrides=args.set,
                     paths=args.paths, data_dir=args.data)  # fmt: skip
    rows = []
    for r in res["rows"]:
        rows.append({**r, "shapes": f"{res['n']:,} x {res['regions']}x{res['img_dim']} float16",
                     "batch": res["batch"], "threads": res["threads"], "what": f"{r['path']} (data_on_device={r['setting']})"})  # fmt: skip
    emit(args, [("what", "data path"), ("shapes", "images x set"), ("batch", "batch"), ("samples_per_s", "samples/s"),
                ("bare_gather_samples_per_s", "bare `features[idx].float()` samples/s"), ("ratio", "ratio"),
                ("bare_index_select_samples_per_s", "bare `index_select` samples/s"),
                ("ratio_index_select", "ratio to it")], rows, args.device)  # fmt: skip
    for r in res["rows"]:
        print(f"{r['path']}: {r['reason']}")
    _write_json(args, res)
    return 0


def run_eval(args: argparse.Namespace) -> int:
    from vsekit_lab.bench.eval import bench_eval

    row = bench_eval(args.images, args.captions_per_image, repeats=args.repeats, reference=not args.no_reference)
    row["shape"] = f"{row['images']:,} x {row['captions']:,}"
    emit(args, [("shape", "images x captions"), ("eval_sims_s", "`vse eval-sims` (s, median, load included)"),
                ("in_memory_s", "evaluate_sims in memory (s)"), ("reference_s", "reference argsort loop (s)"),
                ("speedup", "speed-up"), ("max_abs_diff", "max metric difference")], [row])  # fmt: skip
    return 0


def run_eval_sims_process(args: argparse.Namespace) -> int:
    from vsekit_lab.bench.eval import bench_eval_sims_process

    row = bench_eval_sims_process(args.images, args.captions_per_image, repeats=args.repeats)
    row["shape"] = f"{row['images']:,} x {row['captions']:,}"
    emit(args, [("shape", "images x captions"), ("eval_sims_s", "`vse eval-sims` process (s, median)"),
                ("minimal_s", "minimal numpy script process (s, median)"), ("ratio", "ratio"),
                ("max_abs_diff", "max metric difference")], [row])  # fmt: skip
    return 0


def run_eccv(args: argparse.Namespace) -> int:
    from vsekit_lab.bench.eccv import bench_eccv

    row = bench_eccv(repeats=args.repeats, reference=not args.no_reference, sims_path=args.sims)
    row["shape"] = f"{row['images']:,} x {row['captions']:,} ({row['matrix']})"
    row["k"] = f"{row['k_i2t']} / {row['k_t2i']}"
    emit(args, [("shape", "images x captions"), ("k", "top-k i2t / t2i"),
                ("eccv_s", "`--eccv` adds (s, median, load included)"), ("lists_s", "lists (s)"),
                ("package_s", "eccv_caption metrics (s)"), ("reference_s", "full-sort reference (s)"),
                ("speedup", "speed-up"), ("max_abs_diff", "max metric difference")], [row])  # fmt: skip
    return 0


def run_startup(args: argparse.Namespace) -> int:
    from vsekit_lab.bench.startup import bench_startup

    rows = bench_startup(repeats=args.repeats)
    for r in rows:
        r["torch"] = "yes" if r["imports_torch"] else "no"
    emit(args, [("verb", "process"), ("median_s", "wall s (median)"), ("min_s", "min"),
                ("over_python_s", "s over `python -c pass`"), ("torch", "imports torch")], rows)  # fmt: skip
    _write_json(args, {"rows": rows})
    return 0


def run_pool(args: argparse.Namespace) -> int:
    import torch

    from vsekit_lab.bench.pool import POOLINGS, bench_pool

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    rows = bench_pool(batch=args.batch, n=args.n, dim=args.dim, device=args.device, repeats=args.repeats,
                      warmup=args.warmup, poolings=tuple(args.poolings or POOLINGS),
                      variable_lengths=args.variable_lengths)  # fmt: skip
    for r in rows:
        r["shape"] = f"{r['batch']}x{r['n']}x{r['dim']}" + (" (variable sizes)" if r["variable_lengths"] else "")
    emit(args, [("pooling", "pooling"), ("shape", "B x N x D"), ("params", "params"),
                ("ms_median", "fwd+bwd ms (median)"), ("ms_std", "std"), ("vs_avg", "x avg")], rows, args.device)  # fmt: skip
    _write_json(args, {"rows": rows})
    return 0


def run_grad_cache(args: argparse.Namespace) -> int:
    from vsekit_lab.bench.grad_cache import bench_grad_cache

    rows = bench_grad_cache(args.recipe, batch=args.batch, chunks=args.chunks, device=args.device, overrides=args.set,
                            regions=args.regions, img_dim=args.img_dim, embed_dim=args.embed_dim, vocab=args.vocab,
                            threads=args.threads)  # fmt: skip
    for r in rows:
        r["step"] = f"{r['step_gib']:.2f} GiB" + ("" if r["step_peak_observed"] else " (below the setup's peak)")
    emit(args, [("recipe", "recipe"), ("shapes", "shapes"), ("batch", "batch"), ("setting", "setting"),
                ("step", "step peak above before"), ("step_ratio", "ratio"), ("peak_gib", "process/device peak GiB"),
                ("measure", "measured by"), ("seconds", "s/step"), ("encoder_calls", "encoder calls"),
                ("loss", "loss"), ("loss_diff", "loss diff to whole batch")], rows, args.device)  # fmt: skip
    _write_json(args, {"rows": rows})
    return 0


def run_ladder(args: argparse.Namespace) -> int:
    from vsekit_lab.bench.ladder import bench_ladder_step

    row = bench_ladder_step(batch=args.batch, device=args.device, repeats=args.repeats, embed_dim=args.embed_dim,
                            regions=args.regions, img_dim=args.img_dim, vocab=args.vocab)  # fmt: skip
    emit(args, [("batch", "batch"), ("vsepp_step_ms", "VSE++ step ms"), ("ladder_step_ms", "ladder step ms"),
                ("ladder_auto_step_ms", "adaptive ladder step ms"), ("ratio_fixed", "ladder / VSE++"),
                ("ratio_auto", "adaptive / VSE++")], [row], args.device)  # fmt: skip
    return 0


def run_search(args: argparse.Namespace) -> int:
    from vsekit_lab.bench.search import bench_search, format_search_table

    res = bench_search(n=args.n, dim=args.dim, queries=args.queries, exact_queries=args.exact_queries,
                       clusters=args.clusters, spread=args.spread, nlist=args.nlist, nprobes=tuple(args.nprobe),
                       sq8=not args.no_sq8, hnsw_m=args.hnsw_m, ef_searches=tuple(args.ef_search),
                       train_size=args.train_size, kmeans_iters=args.kmeans_iters, threads=args.threads,
                       vectors=args.vectors, query_vectors=args.query_vectors, ivfpq=args.ivfpq,
                       pq_ms=tuple(args.pq_m), rerank=args.rerank,
                       ivf_flat=not args.no_ivf_flat, embeddings=args.from_embeddings,
                       save_embeddings=args.save_embeddings, log=lambda *_: None)  # fmt: skip
    _write_json(args, res)
    print(format_search_table(res).split("\n\n", 1)[0] + "\n")
    s = res["setup"]
    source = Path(s["vectors"]).name if s["vectors"] else f"{s['clusters']:,} clusters"
    for r in res["rows"]:
        r["setup"] = f"{s['n']:,} x {s['dim']}, {source}, k={s['k']}"
    emit(args, [("setup", "vectors"), ("index", "index"), ("params", "params"), ("build_s", "build s"),
                ("p50_ms", "p50 ms"), ("p99_ms", "p99 ms"), ("recall_at_k", "recall@k")], res["rows"])  # fmt: skip
    return 0


def _write_json(args: argparse.Namespace, result: dict) -> None:
    """--json (stdout; the Markdown rows then go to stderr) / --json-out FILE (vsekit.commands.jsonout)."""
    from vsekit.commands.jsonout import emit_json

    emit_json(args, result, ensure_ascii=True)


def run_serve_load(args: argparse.Namespace) -> int:
    from vsekit_lab.bench.search import bench_serve

    row = bench_serve(args.index, requests=args.requests, concurrency=args.concurrency,
                      max_seconds=args.max_seconds, k=args.k)  # fmt: skip
    _write_json(args, row)
    row["index"] = args.index
    emit(args, [("index", "index"), ("n", "requests"), ("concurrency", "concurrency"), ("errors", "errors"),
                ("requests_per_s", "requests/s"), ("p50_ms", "p50 ms"), ("p99_ms", "p99 ms")], [row])  # fmt: skip
    return 0 if row["errors"] == 0 else 1


def run_aeom(args: argparse.Namespace) -> int:
    from vsekit_lab.bench.aeom import bench_aeom, bench_aeom_eval

    if args.model_eval:
        row = bench_aeom_eval(args.images, max(1, args.captions // args.images), args.device, args.repeats)
        emit(args, [("n_images", "images"), ("n_captions", "captions"), ("views", "views"),
                    ("block_dim", "d2"), ("iters", "c"), ("cosine_eval_s", "vse_infty eval (s)"),
                    ("aeom_eval_s", "avse eval (s)"), ("ratio_eval", "ratio")], [row], args.device)  # fmt: skip
        return 0
    row = bench_aeom(args.images, args.captions, args.dim, args.device, args.repeats, views=args.views,
                     block_dim=args.block_dim, iters=args.iters)  # fmt: skip
    emit(args, [("n_images", "images"), ("n_captions", "captions"), ("dim", "d1"), ("views", "views"),
                ("block_dim", "d2"), ("iters", "c"), ("cosine_s", "cosine (s)"), ("aeom_s", "AEOM (s)"),
                ("aeom_nosinkhorn_s", "AEOM no Sinkhorn (s)"), ("ratio", "ratio"),
                ("cosine_e2e_s", "cosine + metrics (s)"), ("aeom_e2e_s", "AEOM + metrics (s)"),
                ("ratio_end_to_end", "ratio + metrics")], [row], args.device)  # fmt: skip
    return 0


def run_view_reg(args: argparse.Namespace) -> int:
    from vsekit_lab.bench.view_reg import format_table, random_grad_ratios

    print(format_table(random_grad_ratios(args.dim, args.batch, args.views, args.block_dim, args.readout,
                                          args.weight)))  # fmt: skip
    return 0


# ---------------------------------------------------------------------------------------- parser
# FAISS crashes building an HNSW graph of degree 1; 0 builds none
HNSW_M = checked(lambda v: None if v == 0 or v >= 2 else "must be 0 (no HNSW rows) or at least 2", "HnswM")


def register(sub) -> None:
    p = sub.add_parser("bench", help="timing benchmarks that print Markdown rows (machine, date, command)")
    bs = p.add_subparsers(dest="bench", required=True, metavar="BENCH")

    def add(name: str, help_: str, func) -> argparse.ArgumentParser:
        q = bs.add_parser(name, help=help_)
        q.add_argument("--append", metavar="FILE", help="also add the rows to FILE (e.g. docs/benchmarks.md)")

        def run(args: argparse.Namespace) -> int:
            args._command = command_line(q, args, name)
            return func(args)

        q.set_defaults(func=run)
        return q

    t = add("train-step", "one training step (forward+backward+AdamW) on synthetic data", run_train_step)
    t.add_argument("--recipe", default="vse_infty")
    t.add_argument("--batch", type=int, action=POSITIVE, default=128)
    t.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1 …")
    t.add_argument("--steps", type=int, action=POSITIVE, default=10, help="timed steps (median reported)")
    t.add_argument("--warmup", type=int, action=at_least(0), default=3, help="untimed steps first")
    t.add_argument("--text", choices=("bigru", "transformer"), default="bigru")
    t.add_argument("--text-model", default="bert-base",
                   help="transformer text: a local HF directory, or bert-base / tiny (random weights)")
    t.add_argument("--regions", type=int, action=POSITIVE, default=36)
    t.add_argument("--img-dim", type=int, action=POSITIVE, default=2048)
    t.add_argument("--embed-dim", type=int, action=POSITIVE, default=1024)
    t.add_argument("--vocab", type=int, action=POSITIVE, default=10_000)
    t.add_argument("--amp", choices=("none", "bf16"), help="override train.amp")
    t.add_argument("--tf32", action="store_true", help="TF32 matmuls (CUDA)")
    t.add_argument("--compile", action="store_true", help="torch.compile the encoders")
    t.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="any recipe key")
    t.add_argument("--data-on-device", choices=("auto", "true", "false"),
                   help="override train.data_on_device: where the batches are made (vse bench data)")
    t.add_argument("--n", type=int, action=POSITIVE, default=None, metavar="N",
                   help="images of the synthetic set the batches are drawn from (default: enough for every step)")
    t.add_argument("--threads", type=int, action=in_range(0, note="0 = leave as is"), default=0, help="torch CPU threads (0 = leave as is)")
    t.add_argument("--length-bucketing", action="store_true", help="train.length_bucketing=true (similar lengths per batch)")
    t.add_argument("--cuda-graph", action="store_true", help="train.cuda_graph=true: the step as CUDA graphs (CUDA only)")
    t.add_argument("--caption-buckets", type=int, action=POSITIVE, nargs="+", metavar="N",
                   help="time one variant per value of train.caption_buckets, in one run (e.g. 1 4: before / after)")
    t.add_argument("--variant", action="append", default=[], metavar="KEY=VALUE[,KEY=VALUE]",
                   help="a variant timed in the same run (repeat it; rows keep the order, --caption-buckets last)")
    t.add_argument("--rounds", type=int, action=POSITIVE, default=1, help="rounds of --steps steps per variant, alternated")
    add_json_args(t, "the row (several variants: {'rows': [...]})")

    am = add("amp", "bf16 autocast vs float32: relative error of one step's loss and gradients", run_amp)
    am.add_argument("--recipe", nargs="+", default=["vsepp", "vse_infty"])
    am.add_argument("--batch", type=int, action=POSITIVE, default=64)
    am.add_argument("--regions", type=int, action=POSITIVE, default=36)
    am.add_argument("--img-dim", type=int, action=POSITIVE, default=512)
    am.add_argument("--embed-dim", type=int, action=POSITIVE, default=256)
    am.add_argument("--vocab", type=int, action=POSITIVE, default=2000)
    am.add_argument("--seeds", type=int, action=POSITIVE, default=3, help="seeds 0..N-1 (weights and batch); the worst is reported")
    am.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1 …")
    am.add_argument("--threads", type=int, action=in_range(0, note="0 = leave as is"), default=0, help="torch CPU threads (0 = leave as is)")
    am.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="any recipe key")
    add_json_args(am, "the rows")

    gc = add("grad-cache", "peak memory of one training step, whole batch vs gradient caching (train.grad_cache_chunk)",
             run_grad_cache)  # fmt: skip
    gc.add_argument("--recipe", default="vse_infty")
    gc.add_argument("--batch", type=int, action=POSITIVE, default=1024)
    gc.add_argument("--chunks", type=int, action=POSITIVE, nargs="+", default=[128], help="chunk sizes to compare with the whole batch")
    gc.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1 …")
    gc.add_argument("--regions", type=int, action=POSITIVE, default=36)
    gc.add_argument("--img-dim", type=int, action=POSITIVE, default=2048)
    gc.add_argument("--embed-dim", type=int, action=POSITIVE, default=1024)
    gc.add_argument("--vocab", type=int, action=POSITIVE, default=10_000)
    gc.add_argument("--threads", type=int, action=in_range(0, note="0 = default"), default=0, help="torch CPU threads in each measuring process (0 = default)")
    gc.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="any recipe key")
    add_json_args(gc, "the rows")

    da = add("data", "the training data path alone (batches ready on the device) vs a bare gather", run_data)
    da.add_argument("--n", type=int, action=POSITIVE, default=20_000, help="images of the synthetic COCO-shaped set (5 captions each)")
    da.add_argument("--regions", type=int, action=POSITIVE, default=36)
    da.add_argument("--img-dim", type=int, action=POSITIVE, default=2048)
    da.add_argument("--batch", type=int, action=POSITIVE, default=128)
    da.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1 …")
    da.add_argument("--steps", type=int, action=POSITIVE, default=20, help="timed batches per round")
    da.add_argument("--rounds", type=int, action=POSITIVE, default=5, help="rounds; each times every path, then the bare gathers")
    da.add_argument("--warmup", type=int, action=at_least(0), default=3, help="untimed batches first")
    da.add_argument("--recipe", default="vse_infty")
    da.add_argument("--paths", nargs="+", choices=("auto", "true", "false"), default=["auto"],
                    help="train.data_on_device values to time, one row each (false: the DataLoader)")
    da.add_argument("--data", metavar="DIR", help="time a precomp dataset's train split instead of a synthetic one")
    da.add_argument("--threads", type=int, action=in_range(0, note="0 = leave as is"), default=0, help="torch CPU threads (0 = leave as is)")
    da.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="any recipe key")
    add_json_args(da, "the result")

    e = add("eval", "`vse eval-sims` on an N x 5N random matrix vs the reference argsort loop", run_eval)
    e.add_argument("--images", type=int, action=POSITIVE, default=5000)
    e.add_argument("--captions-per-image", type=int, action=POSITIVE, default=5)
    e.add_argument("--repeats", type=int, action=POSITIVE, default=3)
    e.add_argument("--no-reference", action="store_true", help="skip the (slow) reference loop")

    es = add("eval-sims", "`vse eval-sims` vs a minimal vectorised numpy script, both timed as whole processes",
             run_eval_sims_process)  # fmt: skip
    es.add_argument("--images", type=int, action=POSITIVE, default=5000)
    es.add_argument("--captions-per-image", type=int, action=POSITIVE, default=5)
    es.add_argument("--repeats", type=int, action=POSITIVE, default=5, help="timed runs of each, alternated (median reported)")

    ec = add("eccv", "`vse eval-sims --eccv` on COCO 5K test (5,000 x 25,000) vs full sorts fed to eccv-caption",
             run_eccv)  # fmt: skip
    ec.add_argument("--repeats", type=int, action=POSITIVE, default=3)
    ec.add_argument("--no-reference", action="store_true", help="skip the (slow) full-sort reference")
    ec.add_argument("--sims", metavar="S.npy", help="time your own 5,000 x 25,000 matrix instead of a planted one")

    st = add("startup", "wall time of `vse --help`, `vse recipes`, `vse eval-sims --help` as processes", run_startup)
    st.add_argument("--repeats", type=int, action=POSITIVE, default=5, help="timed runs of each, alternated (median reported)")
    add_json_args(st, "the rows")

    po = add("pool", "forward+backward time of each pooling", run_pool)
    po.add_argument("--batch", type=int, action=POSITIVE, default=128)
    po.add_argument("--n", type=int, action=POSITIVE, default=36, help="set size (regions / tokens)")
    po.add_argument("--dim", type=int, action=POSITIVE, default=1024)
    po.add_argument("--device", default="cpu", help="cpu | cuda | cuda:1 ...")
    po.add_argument("--repeats", type=int, action=POSITIVE, default=20)
    po.add_argument("--warmup", type=int, action=at_least(0), default=3, help="untimed runs first")
    po.add_argument("--threads", type=int, action=in_range(0, note="0 = leave as is"), default=0, help="torch CPU threads (0 = leave as is)")
    po.add_argument("--poolings", nargs="+", help="a subset of avg max kmax gpo adpool adpool-ref (default: all)")
    po.add_argument("--variable-lengths", action="store_true", help="set sizes drawn in [1, n] (text-like)")
    add_json_args(po, "the rows", path_form=True)

    la = add("ladder", "training step with the (adaptive) ladder loss vs VSE++", run_ladder)
    la.add_argument("--batch", type=int, action=POSITIVE, default=128)
    la.add_argument("--device", default="cpu")
    la.add_argument("--repeats", type=int, action=POSITIVE, default=10)
    la.add_argument("--embed-dim", type=int, action=POSITIVE, default=1024)
    la.add_argument("--regions", type=int, action=POSITIVE, default=36)
    la.add_argument("--img-dim", type=int, action=POSITIVE, default=2048)
    la.add_argument("--vocab", type=int, action=POSITIVE, default=10_000)

    _add_search_args(add)

    ae = add("aeom", "AVSE's asymmetric embedding optimal matching (vsekit_lab.bench.aeom)", run_aeom)
    ae.add_argument("--images", type=int, action=POSITIVE, default=1000)
    ae.add_argument("--captions", type=int, action=POSITIVE, default=5000)
    ae.add_argument("--dim", type=int, action=POSITIVE, default=1024, help="caption embedding size d1 (images: views x d1)")
    ae.add_argument("--views", type=int, action=POSITIVE, default=2)
    ae.add_argument("--block-dim", type=int, action=POSITIVE, default=512)
    ae.add_argument("--iters", type=int, action=POSITIVE, default=20)
    ae.add_argument("--device", default="cpu")
    ae.add_argument("--repeats", type=int, action=POSITIVE, default=3)
    ae.add_argument("--model-eval", action="store_true",
                    help="time `vse eval` end to end (encoders + scoring + metrics), avse vs vse_infty recipe")

    vr = add("view-reg", "AVSE: gradient-norm ratio of the view regulariser vs the ranking loss (random "
             "embeddings)", run_view_reg)  # fmt: skip
    vr.add_argument("--dim", type=int, action=POSITIVE, default=1024)
    vr.add_argument("--batch", type=int, action=POSITIVE, default=128)
    vr.add_argument("--views", type=int, action=POSITIVE, default=2)
    vr.add_argument("--block-dim", type=int, action=POSITIVE, default=512)
    vr.add_argument("--readout", default="log_plan", choices=["log_plan", "plan", "maxsum"])
    vr.add_argument("--weight", type=float, action=finite(), default=1.0)



def _add_search_args(add) -> None:
    """`vse bench search` and `vse bench serve`.
    The search defaults are `bench_search`'s own: the documented 1M x 1024 run (docs/benchmarks.md)."""
    from vsekit_lab.bench.search import SEARCH_DEFAULTS as d
    se = add("search", "FAISS exact vs IVF (and HNSW) latency and recall on synthetic vectors or your own (--vectors)",
             run_search)  # fmt: skip
    se.add_argument("--n", type=int, action=POSITIVE, default=d["n"], help="database vectors (with --vectors: the most rows used)")
    se.add_argument("--dim", type=int, action=POSITIVE, default=d["dim"])
    se.add_argument("--queries", type=int, action=POSITIVE, default=d["queries"])
    se.add_argument("--exact-queries", type=int, action=POSITIVE, default=d["exact_queries"], help="single queries timed on the flat index")
    se.add_argument("--clusters", type=int, action=in_range(0, note="0 = none"), default=d["clusters"], help="Gaussian clusters of the synthetic set (0 = none)")
    se.add_argument("--spread", type=float, action=in_range(0, None, finite=True), default=d["spread"])
    se.add_argument("--nlist", type=int, action=in_range(0, note="0 = automatic"), default=d["nlist"], help="IVF lists (0 = about 4*sqrt(n), as `vse index` picks)")
    se.add_argument("--nprobe", type=int, action=POSITIVE, nargs="+", default=list(d["nprobes"]))
    se.add_argument("--train-size", type=int, action=in_range(0, note="0 = automatic"), default=d["train_size"], help="k-means training vectors (0 = max(65536, 40*nlist))")
    se.add_argument("--kmeans-iters", type=int, action=POSITIVE, default=d["kmeans_iters"])
    se.add_argument("--no-sq8", action="store_true", help="skip the IVF-SQ8 rows")
    se.add_argument("--no-ivf-flat", action="store_true", help="skip the IVF-Flat rows")
    se.add_argument("--ivfpq", action="store_true",
                    help="add IVF-PQ rows (the code `vse index --index ivfpq` picks: dim/8 bytes, 8-bit)")
    se.add_argument("--pq-m", type=int, action=POSITIVE, nargs="+", default=[], help="IVF-PQ code sizes to build (default: the automatic one)")
    se.add_argument("--rerank", type=int, action=in_range(0, note="0 = no such rows"), default=0, metavar="F",
                    help="also re-score the IVF-PQ top F*k exactly against the float32 vectors (0 = no such rows)")
    se.add_argument("--from-embeddings", metavar="DIR",
                    help="index a `vse embed` folder's img_emb files (queries: its text_emb, else its last rows)")
    se.add_argument("--save-embeddings", metavar="DIR",
                    help="write the synthetic set (n + queries rows) as an embeddings folder first, then index from it")
    se.add_argument("--hnsw-m", type=int, action=HNSW_M, default=d["hnsw_m"], help="also build HNSW with this M (slow to build at 1M)")
    se.add_argument("--ef-search", type=int, action=POSITIVE, nargs="+", default=list(d["ef_searches"]))
    se.add_argument("--threads", type=int, action=POSITIVE, default=d["threads"], help="FAISS threads")
    se.add_argument("--vectors", metavar="DB.npy", help="(N, D) embeddings to index instead of synthetic vectors "
                    "(--n caps the rows used)")  # fmt: skip
    se.add_argument("--query-vectors", metavar="Q.npy",
                    help="(M, D) query embeddings; default: hold out the last --queries rows of --vectors")
    add_json_args(se, "the full result (setup and rows)", path_form=True)

    sv = add("serve", "bounded loopback load test of `vse serve INDEX` (GET /search from N client threads)",
             run_serve_load)  # fmt: skip
    sv.add_argument("index", metavar="INDEX_DIR")
    sv.add_argument("--requests", type=int, action=POSITIVE, default=2000)
    sv.add_argument("--concurrency", type=int, action=POSITIVE, default=32)
    sv.add_argument("--max-seconds", type=float, action=positive_number(), default=120.0, help="stop sending after this long")
    sv.add_argument("-k", type=int, action=POSITIVE, default=10)
    add_json_args(sv, "the result", path_form=True)
