"""Subcommands of `vse`; each module has `register(subparsers)`."""

from vsekit.commands import data, demo, evaluate, search, train

COMMAND_MODULES = [train, evaluate, data, demo, search]
