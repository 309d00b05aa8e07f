"""The nearest valid name to a mistyped one, for an error message (settings, recipe names)."""

from __future__ import annotations

from collections.abc import Iterable
from difflib import get_close_matches


def did_you_mean(word: str, names: Iterable[str]) -> str:
    """': did you mean NAME?' for the closest of `names` to `word`, '' when none is close."""
    near = get_close_matches(word, list(names), n=1)
    return f": did you mean {near[0]}?" if near else ""
