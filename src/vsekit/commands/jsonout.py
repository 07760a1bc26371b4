"""`--json` and `--json-out FILE`, the same for every verb with a JSON result.

- `--json` prints the result as JSON on stdout, and nothing else: what the verb prints otherwise (tables,
  notes, "wrote …") goes to stderr for that run, so `vse eval RUN --json | jq .rsum` works;
- `--json-out FILE` writes the same JSON to FILE (atomically), next to the usual output;
- verbs whose `--json` used to take a FILE (eval, eval-sims, data relevance-share, pooling, experiment,
  bench search / serve) still accept `--json FILE`: it means `--json-out FILE` and prints a deprecation note.

`cli.main` calls `prepare` before the verb runs (so a bad combination or a bad `--json-out FILE` fails before
any work) and sends stdout to stderr while a `--json` verb runs; the verb calls `emit_json` with its result.
`--json-out FILE` follows the rule of every result file (`vsekit.utils.io.check_output_file`): its folder
exists, and it is neither inside a folder the command reads (a run, an index, a dataset) nor one of its input
files. `prepare` checks it against the inputs named on the command line (`INPUT_ARGS`); a verb that learns
more inputs as it goes (the dataset a run records, the run an index records) calls `check_json_out` again.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from vsekit.errors import VseInputError
from vsekit.utils.io import check_output_file

# the argument names under which verbs take the files and folders they read (positionals and options)
INPUT_ARGS = (
    "runs",
    "run",
    "index",
    "data",
    "sims",
    "image",
    "relevance",
    "cap2img",
    "source",
    "input",
    "resume",
)

DEPRECATED_NOTE = (
    "note: `--json FILE` is deprecated; use `--json-out FILE` (`--json` alone prints the JSON on stdout)"
)


def add_json_args(p: argparse.ArgumentParser, what: str, path_form: bool = False) -> None:
    """Add `--json` and `--json-out FILE`; `path_form`: `--json FILE` is also accepted (its old meaning)."""
    stdout_help = f"print {what} as JSON on stdout (everything else goes to stderr)"
    if path_form:
        p.add_argument(
            "--json",
            nargs="?",
            const=True,
            default=False,
            metavar="FILE",
            help=f"{stdout_help}. Deprecated form: `--json FILE` = `--json-out FILE`",
        )
    else:
        p.add_argument("--json", action="store_true", help=stdout_help)
    p.add_argument("--json-out", metavar="FILE", help=f"write {what} as JSON to FILE")


def prepare(args: argparse.Namespace) -> None:
    """Turn a deprecated `--json FILE` into `--json-out FILE` (args.json becomes a bool), refusing a FILE that is
    clearly an input (a .npy) and `--json FILE` with `--json-out`."""
    if not hasattr(args, "json_out"):
        return
    if isinstance(args.json, str):
        path = args.json
        if args.json_out:
            raise VseInputError(
                f"--json {path} and --json-out {args.json_out}: give the file once, as --json-out FILE"
            )
        if path.lower().endswith(".npy"):
            raise VseInputError(
                f"--json {path}: --json takes no file now (it prints the JSON on stdout) and {path} "
                "looks like an input matrix; put --json after the inputs, or use --json-out FILE"
            )
        print(DEPRECATED_NOTE, file=sys.stderr)
        args.json, args.json_out = False, path
    args.json = bool(args.json)
    check_json_out(args)


def command_inputs(args: argparse.Namespace, *more: str | os.PathLike | None) -> list[str]:
    """The files and folders the command reads: the values of its `INPUT_ARGS`, plus `more`."""
    found: list[str] = []
    for value in [*(getattr(args, name, None) for name in INPUT_ARGS), *more]:
        values = value if isinstance(value, (list, tuple)) else [value]
        found += [str(v) for v in values if isinstance(v, (str, os.PathLike)) and str(v)]
    return found


def check_json_out(args: argparse.Namespace, *more_inputs: str | os.PathLike | None) -> None:
    """`--json-out FILE` may be written: its folder exists and it overwrites none of the command's inputs
    (`command_inputs(args, *more_inputs)`); else a one-line error before any work."""
    if getattr(args, "json_out", None):
        check_output_file(args.json_out, "--json-out", command_inputs(args, *more_inputs))


def wants_stdout(args: argparse.Namespace) -> bool:
    return getattr(args, "json", None) is True and hasattr(args, "json_out")


def emit_json(args: argparse.Namespace, obj: Any, ensure_ascii: bool = False) -> None:
    """Write `obj` where the flags ask: FILE for --json-out, stdout for --json (the stream `cli.main` kept)."""
    if getattr(args, "json_out", None):
        from vsekit.utils.io import atomic_write_json

        atomic_write_json(args.json_out, obj, ensure_ascii=ensure_ascii)
        print(f"wrote {args.json_out}")
    if wants_stdout(args):
        stream = getattr(args, "_json_stream", None) or sys.stdout
        stream.write(json.dumps(obj, indent=2, ensure_ascii=ensure_ascii) + "\n")
        stream.flush()
