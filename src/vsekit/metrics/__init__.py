"""One metrics module: everything that ranks (models, ensembles, search) is scored here."""

from vsekit.metrics.coherence import (
    CS_PROTOCOLS,
    average_precision_i2t,
    coherence_metrics,
    coherence_metrics_by_fold,
    coherent_scores,
    image_caption_relevance,
    kendall_tau_b,
)
from vsekit.metrics.retrieval import (
    METRIC_KEYS,
    MetricsInputError,
    cap2img_for_k,
    chance_rsum,
    evaluate_sims,
    format_table,
    retrieval_metrics,
    retrieval_metrics_fold5,
)

__all__ = [
    "CS_PROTOCOLS",
    "METRIC_KEYS",
    "MetricsInputError",
    "average_precision_i2t",
    "cap2img_for_k",
    "chance_rsum",
    "coherence_metrics",
    "coherence_metrics_by_fold",
    "coherent_scores",
    "evaluate_sims",
    "format_table",
    "image_caption_relevance",
    "kendall_tau_b",
    "retrieval_metrics",
    "retrieval_metrics_fold5",
]
