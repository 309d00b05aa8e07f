"""The aggregator: the round clock, aggregation into version v+1, evaluation, metrics."""

from services.aggregator.aggregator import Aggregator, ensure_initial_version
from services.aggregator.evaluation import (
    EvalResult,
    Evaluator,
    VersionEval,
    build_evaluator,
    evaluate,
)
from services.common.jobmodel import job_model

__all__ = [
    "Aggregator",
    "EvalResult",
    "Evaluator",
    "VersionEval",
    "build_evaluator",
    "ensure_initial_version",
    "evaluate",
    "job_model",
]
