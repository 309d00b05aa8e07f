"""The notice a client sends when it drops a round (docs/reliability.md, "Liveness"): said at
once, so the round need not wait for its deadline to learn it.
"""

from __future__ import annotations

from broker.messages import ABORTED, NON_FINITE, RoundDropped, WeightsAssignment, new_message_id

# The codec's wording for a tensor holding NaN or infinities (broker/codec.py), which is how a
# diverged model shows: in its weights (the update) or its activations (a smashed batch).
_NON_FINITE_WORDS = "NaN or infinite"
# Enough of the exception's text for an operator's log; the reason kind is what counts.
_DETAIL_CHARS = 300


def drop_reason(exc: Exception) -> str:
    """`non_finite` when the local model diverged, else `aborted`."""
    return NON_FINITE if _NON_FINITE_WORDS in str(exc) else ABORTED


def drop_notice(
    job: str, client: str, assignment: WeightsAssignment, exc: Exception
) -> RoundDropped:
    return RoundDropped(
        job=job,
        client=client,
        message_id=new_message_id(),
        version=assignment.version,
        round=assignment.round,
        reason=drop_reason(exc),
        ref_message_id=assignment.message_id,
        detail=str(exc)[:_DETAIL_CHARS],
    )
