"""The aggregator: one core (inbox, gate, publication of version v+1) and two clocks (sync rounds,
async buffering), evaluation, metrics."""

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
