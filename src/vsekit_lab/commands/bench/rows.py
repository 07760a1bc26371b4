"""What every `vse bench` sub-verb prints: Markdown table rows that carry the machine, the date and the
exact command (reconstructed from the options), appended with `--append FILE` to that file's section for the
benchmark (docs/benchmarks.md), and `--json` / `--json-out`; so every figure in the docs can be re-measured
with the command written next to it."""

from __future__ import annotations

import argparse
import datetime
import math
import os
import shlex
from collections.abc import Callable
from pathlib import Path

from vsekit.utils.machine import cpu_model

SECTIONS = {
    "train-step": "Training step (`vse bench train-step`)",
    "grad-cache": "Gradient caching: peak memory of one step (`vse bench grad-cache`)",
    "data": "Data path (`vse bench data`)",
    "epoch": "One epoch of `vse train`, end to end (`vse bench epoch`)",
    "co-teaching": "Two networks (NCR) against one: epoch time and the split pass (`vse bench co-teaching`)",
    "amp": "bf16 autocast against float32: one step's loss and gradients (`vse bench amp`)",
    "eval": "Evaluation: `vse eval-sims` (`vse bench eval`)",
    "eval-sims": "Evaluation as whole processes: `vse eval-sims` vs a minimal numpy script (`vse bench eval-sims`)",
    "pool": "Pooling cost (`vse bench pool`)",
    "ladder": "Ladder loss step cost (`vse bench ladder`)",
    "search": "FAISS search (`vse bench search`)",
    "aeom": "AEOM similarity (`vse bench aeom`)",
    "serve": "Server load test (`vse bench serve`)",
    "late-interaction": "Two-stage CHAN search against exhaustive scoring (`vse bench late-interaction`)",
    "startup": "Start-up of the verbs that need no model (`vse bench startup`)",
    "eccv": "ECCV Caption, CxC and COCO 1K/5K keys: `vse eval-sims --eccv` (`vse bench eccv`)",
}

# a sub-verb's work: the parsed options in, the exit status out
RunBench = Callable[[argparse.Namespace], int]
# `add(name, help, run)`: a sub-verb's parser, with `--append`, whose run records its command line first
AddVerb = Callable[[str, str, RunBench], argparse.ArgumentParser]


def machine_description(device: str = "cpu") -> str:
    """CPU model, cores, torch threads and the 1-minute load (the machine may be shared), or the GPU."""
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(torch.device(device))}, torch {torch.__version__}"
    model = cpu_model()
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
        tables = [
            i for i in range(start, end) if doc[i] == header[0] and i + 1 < end and doc[i + 1] == header[1]
        ]
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
        if action.dest in (
            "help",
            "append",
            "json",
            "json_out",
        ):  # where the output goes is not part of the measurement
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


def sub_verb_adder(bs) -> AddVerb:
    """The `add` of `vse bench`'s sub-verbs (`bs`: its subparsers): each gets `--append`, and its run first
    records the command as typed (`args._command`), which every row it prints carries."""

    def add(name: str, help_: str, func: RunBench) -> argparse.ArgumentParser:
        q = bs.add_parser(name, help=help_)
        q.add_argument("--append", metavar="FILE", help="also add the rows to FILE (e.g. docs/benchmarks.md)")

        def run(args: argparse.Namespace) -> int:
            args._command = command_line(q, args, name)
            return func(args)

        q.set_defaults(func=run)
        return q

    return add


def emit(
    args: argparse.Namespace, columns: list[tuple[str, str]], rows: list[dict], device: str = "cpu"
) -> None:
    """Print the rows with the machine (`device`'s), the date and the command; `--append FILE` adds them
    there too."""
    context = {
        "machine": machine_description(device),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": args._command,
    }
    lines = markdown_rows(columns, rows, context)
    print("\n".join(lines))
    if args.append:
        append_markdown(args.append, SECTIONS[args.bench], lines)
        print(f"appended to {args.append}")


def write_json(args: argparse.Namespace, result: dict) -> None:
    """--json (stdout; the Markdown rows then go to stderr) / --json-out FILE (vsekit.commands.jsonout)."""
    from vsekit.commands.jsonout import emit_json

    emit_json(args, result, ensure_ascii=True)
