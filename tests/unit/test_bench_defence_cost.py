"""benchmarks/defence_cost.py --quick: every variant's client round runs, through the real
`SFL.client_round`, and the figures are written (no timing is asserted)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.defence_cost import VARIANTS, main
from services.algorithms.registry import build_strategy


def test_quick_mode_times_every_variant_and_writes_them(tmp_path: Path) -> None:
    out = tmp_path / "cost.json"
    costs = main(["--quick", "--json", str(out)])
    assert [c.variant for c in costs] == list(VARIANTS)
    assert all(c.median_ms > 0 and c.min_ms <= c.median_ms for c in costs)
    assert next(c for c in costs if c.variant == "none").ratio == 1.0
    doc = json.loads(out.read_text())
    assert doc["steps"] == 3 and doc["repeats"] == 2 and len(doc["costs"]) == len(VARIANTS)


def test_every_defended_variant_turns_its_defences_on() -> None:
    for name, params in VARIANTS.items():
        assert build_strategy("sfl_v2", dict(params)).defences.active == (name != "none")
