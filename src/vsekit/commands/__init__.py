"""Subcommands of `vse`; each module has `register(subparsers)`."""

from vsekit.commands import data, demo, evaluate, train

COMMAND_MODULES = [train, evaluate, data, demo]
