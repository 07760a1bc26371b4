"""One metrics module: everything that ranks (models, ensembles, search) is scored here."""

from vsekit.metrics.retrieval import (
    METRIC_KEYS,
    MetricsInputError,
    cap2img_for_k,
    evaluate_sims,
    format_table,
    retrieval_metrics,
    retrieval_metrics_fold5,
)

__all__ = [
    "METRIC_KEYS",
    "MetricsInputError",
    "cap2img_for_k",
    "evaluate_sims",
    "format_table",
    "retrieval_metrics",
    "retrieval_metrics_fold5",
]
