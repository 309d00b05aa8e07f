"""Reading a /metrics endpoint as a test would with curl: one GET, parsed by the client's
own text parser."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]

# Every family an endpoint exports (the _total / _count names are what a scrape shows).
FAMILIES = (
    "splitmq_samples_total",
    "splitmq_queue_depth",
    "splitmq_dead_lettered_total",
    "splitmq_staleness_versions_count",
    "splitmq_version",
    "splitmq_members",
    "splitmq_busy_fraction",
    "splitmq_bytes_in_total",
    "splitmq_bytes_out_total",
    "splitmq_step_latency_seconds_count",
)


def get(url: str, timeout: float = 10.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        body: bytes = response.read()
        return body


def scrape(url: str) -> tuple[str, Samples]:
    text = get(url).decode()
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return text, samples


def total(samples: Samples, name: str, **labels: str) -> float:
    """Sum of `name` over the series whose labels include `labels` (0 when none)."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def families_in(text: str) -> set[str]:
    """Family names declared by `# TYPE` lines (a family shows even before its first sample)."""
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            name, kind = line.split()[2:4]
            counter = kind == "counter" and not name.endswith("_total")
            names.add(name + ("_total" if counter else ""))
            if kind == "histogram":
                names.add(name + "_count")
    return names


def state(dashboard_url: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(get(dashboard_url.rstrip("/") + "/api/state"))
    return doc


def wait_for(what: str, check: Callable[[], bool], timeout: float, every: float = 0.5) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)


def missing(text: str, names: Iterable[str] = FAMILIES) -> list[str]:
    return sorted(set(names) - families_in(text))
