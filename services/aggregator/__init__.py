"""The aggregator: the round clock, aggregation into version v+1, evaluation, metrics."""

from services.aggregator.aggregator import Aggregator
from services.aggregator.bootstrap import build_evaluator, ensure_initial_version, job_model
from services.aggregator.evaluation import EvalResult, Evaluator, VersionEval, evaluate

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
