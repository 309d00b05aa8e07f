"""VersionRecords as JSON and CSV text (and back from JSON, for `splitmq up`'s summary)."""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, fields
from typing import Any

from services.report.records import VersionRecord

_BASE_COLUMNS = tuple(f.name for f in fields(VersionRecord) if f.name != "extra")


def record_from_dict(data: Mapping[str, Any]) -> VersionRecord:
    known = {f.name for f in fields(VersionRecord)}
    values: dict[str, Any] = {
        k: (math.nan if v is None else v) for k, v in data.items() if k in known
    }
    values["extra"] = {str(k): float(v) for k, v in dict(data.get("extra") or {}).items()}
    return VersionRecord(**values)


def metrics_json(run: Mapping[str, Any], records: Sequence[VersionRecord]) -> str:
    """`{"run": {...}, "records": [...]}`; NaN becomes null so any JSON reader accepts it."""
    doc = {"run": dict(run), "records": [finite(asdict(r)) for r in records]}
    return json.dumps(doc, indent=2, allow_nan=False) + "\n"


def metrics_csv(records: Sequence[VersionRecord]) -> str:
    """One row per version; `extra` metrics become `extra.<name>` columns (union, sorted)."""
    extra_keys = sorted({k for r in records for k in r.extra})
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow([*_BASE_COLUMNS, *(f"extra.{k}" for k in extra_keys)])
    for r in records:
        writer.writerow(
            [getattr(r, c) for c in _BASE_COLUMNS] + [r.extra.get(k, "") for k in extra_keys]
        )
    return out.getvalue()


def finite(value: Any) -> Any:
    """`value` with NaN and infinities as None, at any depth: JSON has no spelling for them."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value
