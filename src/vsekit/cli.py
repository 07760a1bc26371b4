"""`vse`: one command for training, evaluation, data and search. Each subcommand lives in vsekit.commands."""

from __future__ import annotations

import argparse
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


def main(argv: list[str] | None = None) -> int:
    from vsekit.checks import EXPECTED_ERRORS

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        result = args.func(args)
    except EXPECTED_ERRORS as e:
        print(f"vse {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"vse {args.command}: interrupted", file=sys.stderr)
        return 130
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
