"""Subcommands of `vse`; each module has `register(subparsers)`."""

from vsekit.commands import bench, data, demo, evaluate, experiment, importer, inspect, search, train

COMMAND_MODULES = [train, evaluate, inspect, data, demo, search, bench, experiment, importer]
