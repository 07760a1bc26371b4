"""`vse` verbs of other installed packages, found through entry points: the group `vsekit.commands` adds top-level
verbs, `vsekit.data_commands` adds `vse data` sub-verbs; each entry point names a `register(subparsers)` function.

This is how vsekit_lab (the demo, the benchmarks, the experiments and the builders of particular sets, shipped in
the same wheel) gives `vse` its verbs while the library never imports it; a user's package can add verbs the same
way. The installed metadata is read once per process (about 10 ms), and nothing is imported until a group is
registered; the registering modules import nothing heavy (each verb imports what it needs when it runs).
"""

from __future__ import annotations

import logging
from functools import cache

log = logging.getLogger(__name__)

COMMANDS_GROUP = "vsekit.commands"
DATA_COMMANDS_GROUP = "vsekit.data_commands"
GROUPS = (COMMANDS_GROUP, DATA_COMMANDS_GROUP)


@cache
def _entry_points(group: str) -> tuple:
    from importlib.metadata import entry_points

    return tuple(sorted(entry_points(group=group), key=lambda ep: ep.name))


def register_verbs(group: str, sub) -> list[str]:
    """Call the `register` function of every entry point of `group` with `sub` (an argparse subparsers object), in
    the order of their names; returns the names registered. An entry point that cannot be loaded (a broken or
    half-installed package) is logged and skipped, so the library's own verbs keep working."""
    done = []
    for ep in _entry_points(group):
        try:
            register = ep.load()
        except Exception as e:  # noqa: BLE001 - ImportError, AttributeError, a bug at import: one line, skipped
            log.warning(
                "the %s entry point %s = %s cannot be loaded (%s: %s); its verb is left out",
                group,
                ep.name,
                ep.value,
                type(e).__name__,
                e,
            )
            continue
        register(sub)
        done.append(ep.name)
    return done


def verb_packages() -> list[str]:
    """The top-level packages that register verbs (their loggers are the CLI's too), without importing them."""
    return sorted(
        {ep.value.split(":", 1)[0].split(".", 1)[0] for group in GROUPS for ep in _entry_points(group)}
    )
