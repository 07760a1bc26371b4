"""`vse bench …`: registers the timing benchmarks' sub-verbs, each from the module of its group, in the
order `vse bench --help` lists them."""

from __future__ import annotations

from vsekit_lab.commands.bench.blocks import add_aeom, add_pool, add_view_reg
from vsekit_lab.commands.bench.evaluation import add_eccv, add_eval, add_eval_sims, add_startup
from vsekit_lab.commands.bench.rows import sub_verb_adder
from vsekit_lab.commands.bench.search import add_search_verbs
from vsekit_lab.commands.bench.training import (
    add_amp,
    add_co_teaching,
    add_data,
    add_epoch,
    add_grad_cache,
    add_ladder,
    add_train_step,
)


def register(sub) -> None:
    """Add `vse bench` and its sub-verbs to `sub` (the `vse` subparsers): the `vsekit.commands` entry
    point."""
    p = sub.add_parser("bench", help="timing benchmarks that print Markdown rows (machine, date, command)")
    add = sub_verb_adder(p.add_subparsers(dest="bench", required=True, metavar="BENCH"))
    for add_verb in (
        add_train_step,
        add_amp,
        add_grad_cache,
        add_data,
        add_epoch,
        add_co_teaching,
        add_eval,
        add_eval_sims,
        add_eccv,
        add_startup,
        add_pool,
        add_ladder,
        add_search_verbs,  # search, serve
        add_aeom,
        add_view_reg,
    ):
        add_verb(add)
