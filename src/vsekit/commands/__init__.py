"""Subcommands of `vse`; each module has `register(subparsers)`. Verbs of other packages (vsekit_lab's demo,
benchmarks and experiments) come through entry points: `vsekit.commands.plugins`."""

from vsekit.commands import data, evaluate, importer, inspect, search, train

COMMAND_MODULES = [train, evaluate, inspect, data, search, importer]
