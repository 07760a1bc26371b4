"""One metrics module: everything that ranks (models, ensembles, search) is scored here."""

from vsekit.metrics.coherence import (
    average_precision_i2t,
    coherence_metrics,
    coherent_scores,
    kendall_tau_b,
)
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
    "average_precision_i2t",
    "cap2img_for_k",
    "coherence_metrics",
    "coherent_scores",
    "evaluate_sims",
    "format_table",
    "kendall_tau_b",
    "retrieval_metrics",
    "retrieval_metrics_fold5",
]
