"""`vse`: one command for training, evaluation, data and search. Each subcommand lives in vsekit.commands."""

from __future__ import annotations

import argparse
import os
import sys

from vsekit.commands import COMMAND_MODULES


class CliError(Exception):
    """An error to print as one clear line, without a traceback."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vse", description="Visual-semantic embedding toolkit.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMAND_MODULES:
        module.register(sub)
    return parser


def debug_enabled() -> bool:
    """`VSE_DEBUG=1` (or true/yes): show full tracebacks instead of one-line errors."""
    return os.environ.get("VSE_DEBUG", "").strip().lower() in ("1", "true", "yes", "on")


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand. Bad input -> one line naming the problem and exit 2; a bug -> one line that says
    so and exit 1; `VSE_DEBUG=1` re-raises both with their full traceback."""
    from vsekit.checks import EXPECTED_ERRORS

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        result = args.func(args)
    except (*EXPECTED_ERRORS, FloatingPointError, CliError) as e:
        if debug_enabled():
            raise
        print(f"vse {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if debug_enabled():
            raise
        print(f"vse {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if debug_enabled():
            raise
        print(f"vse {args.command}: internal error ({type(e).__name__}: {e}); this is a bug in vsekit: "
              "rerun with VSE_DEBUG=1 for the full traceback and report it", file=sys.stderr)  # fmt: skip
        return 1
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
