"""Subcommands of `vse`; each module has `register(subparsers)`."""

from vsekit.commands import bench, data, demo, evaluate, experiment, search, train

COMMAND_MODULES = [train, evaluate, data, demo, search, bench, experiment]
