"""`vse bench …`: timing benchmarks. Each prints Markdown table rows that carry the machine, the date and
the exact command, and `--append FILE` adds them to that file's section for the benchmark
(docs/benchmarks.md), so every figure in the docs can be re-measured with the command written next to it.

One module per group of sub-verbs: `training` (train-step, amp, grad-cache, data, ladder), `evaluation`
(eval, eval-sims, eccv, startup), `blocks` (pool, aeom, view-reg), `search` (search, serve); `rows` prints
what they measure; `verb` registers them (`register`, the `vsekit.commands` entry point)."""

from vsekit_lab.commands.bench.blocks import run_aeom, run_pool, run_view_reg
from vsekit_lab.commands.bench.evaluation import run_eccv, run_eval, run_eval_sims_process, run_startup
from vsekit_lab.commands.bench.rows import (
    SECTIONS,
    append_markdown,
    command_line,
    emit,
    machine_description,
    markdown_rows,
)
from vsekit_lab.commands.bench.search import HNSW_M, run_search, run_serve_load
from vsekit_lab.commands.bench.training import run_amp, run_data, run_grad_cache, run_ladder, run_train_step
from vsekit_lab.commands.bench.verb import register

__all__ = [
    "HNSW_M",
    "SECTIONS",
    "append_markdown",
    "command_line",
    "emit",
    "machine_description",
    "markdown_rows",
    "register",
    "run_aeom",
    "run_amp",
    "run_data",
    "run_eccv",
    "run_eval",
    "run_eval_sims_process",
    "run_grad_cache",
    "run_ladder",
    "run_pool",
    "run_search",
    "run_serve_load",
    "run_startup",
    "run_train_step",
    "run_view_reg",
]
