"""The dashboard in a real browser (headless Chromium) during and after a real short run.

It asserts that the charts carry that run's own numbers (the accuracy of each published
version, its members and workers) and that the finished page shows the run's report. The
screenshot goes to the test's temporary directory; with SPLITMQ_UPDATE_DOCS=1 it also
replaces docs/dashboard.png, the README's picture.
"""

from __future__ import annotations

import html
import os
import re
import shutil
import subprocess
import threading
from pathlib import Path

import pytest

from services.common.backends import Backends, Embedded
from services.common.supervise import Outcome
from services.config.loading import load_settings
from services.report.filesink import FileSink
from services.report.records import ListSink
from services.report.sinks import TeeSink
from services.runtime.embedded import run_embedded
from services.runtime.observe import observed
from tests.integration.scrape import state, wait_for

pytestmark = pytest.mark.slow

DOCS_PNG = Path(__file__).resolve().parents[2] / "docs" / "dashboard.png"
BROWSERS = ("chromium", "chromium-browser", "google-chrome")

CONFIG = """
[job]
name = "dashboard-demo"
rounds = 5

[data]
eval_samples = 500

[algorithm]
name = "sfl"
shards = 2
batch_size = 32
lr = 0.05
momentum = 0.9
max_steps_per_round = 30

[clients]
count = 4
min_to_start = 4

[workers]
count = 2

[metrics]
port = 0
probe_s = 0.5

[report]
dir = "{runs}"
plots = false
"""


@pytest.fixture(scope="session")
def chromium() -> str:
    """The headless browser; like RabbitMQ and Redis, missing under CI=true is a failure."""
    for name in BROWSERS:
        found = shutil.which(name)
        if found:
            return found
    message = "Chromium is not installed (Debian: apt-get install chromium)"
    if os.environ.get("CI", "").lower() in {"1", "true", "yes"}:
        pytest.fail(f"{message} (CI=true: a missing browser is a failure, not a skip)")
    pytest.skip(f"{message}; install it or set CI=true to make this a failure")
    raise AssertionError("unreachable")


def browse(chromium: str, url: str, profile: Path, *args: str) -> str:
    """Load `url` headless, give its script 4 s of (virtual) time, return stdout."""
    argv = [
        chromium,
        "--headless",
        "--no-sandbox",  # running as root in a container
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--hide-scrollbars",
        "--no-first-run",
        f"--user-data-dir={profile}",
        "--window-size=1400,1100",
        "--virtual-time-budget=4000",
        *args,
        url,
    ]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def series(dom: str, key: str) -> list[float | None]:
    """The values a chart's series was drawn from (its `data-values`)."""
    match = re.search(rf'data-series="{re.escape(key)}" data-values="([^"]*)"', dom)
    assert match, f"no series {key!r} in the page"
    return [float(v) if v else None for v in html.unescape(match.group(1)).split(",") if v != ""]


def chart_range(dom: str, chart: str) -> tuple[float, float]:
    """The y range a chart was drawn on (its `data-ymin`, `data-ymax`)."""
    tag = re.search(rf'<svg[^>]*id="{chart}"[^>]*>', dom)
    assert tag, f"no chart {chart!r} in the page"
    low = re.search(r'data-ymin="([^"]+)"', tag.group(0))
    high = re.search(r'data-ymax="([^"]+)"', tag.group(0))
    assert low and high, tag.group(0)
    return float(low.group(1)), float(high.group(1))


@pytest.mark.timeout(420)
def test_dashboard_shows_the_run_live_and_its_report(chromium: str, tmp_path: Path) -> None:
    path = tmp_path / "job.toml"
    path.write_text(CONFIG.format(runs=tmp_path / "runs"))
    settings = load_settings(path, {})
    files = FileSink.create(settings, command="pytest dashboard", base_dir=tmp_path / "runs")
    records = ListSink()
    backends = Backends(settings.broker, settings.store, Embedded())
    outcome: list[Outcome] = []
    printed: list[str] = []
    watch = observed(
        settings,
        "run",
        backends,
        echo=printed.append,
        dashboard=True,
        watch=True,
        run_dir=files.run_dir,
    )
    with watch as seen:
        page = seen.url + "/"
        assert f"dashboard: {page}" in printed
        stop = threading.Event()

        def run() -> None:
            sink = TeeSink([files, records])
            outcome.append(run_embedded(settings, sink=sink, stop=stop, backends=seen.backends))

        runner = threading.Thread(target=run)
        runner.start()
        try:
            wait_for("two versions", lambda: len(records.records) >= 2, 240)
            shot = tmp_path / "dashboard.png"
            live = browse(chromium, page, tmp_path / "profile", "--dump-dom")
            browse(chromium, page, tmp_path / "profile", f"--screenshot={shot}")
        finally:
            runner.join(300)
        assert outcome and outcome[0].ok, outcome

        # Live: the accuracy chart holds the versions published so far, with their values.
        seen_so_far = series(live, "global_accuracy")
        assert 2 <= len(seen_so_far) <= settings.job.rounds
        for drawn, record in zip(seen_so_far, records.records, strict=False):
            assert drawn == pytest.approx(record.global_accuracy)
        assert max(v or 0 for v in series(live, "clients")) == 4
        assert max(v or 0 for v in series(live, "version")) >= 3
        assert "member joined client-0" in live
        assert shot.stat().st_size > 20_000
        if os.environ.get("SPLITMQ_UPDATE_DOCS") == "1":
            shutil.copyfile(shot, DOCS_PNG)

        # Finished: every version, and the report the run wrote.
        wait_for(
            "the final report",
            lambda: bool((state(page).get("report") or {}).get("summary")),
            30,
        )
        final = browse(chromium, page, tmp_path / "profile", "--dump-dom")
    assert 'data-status="finished"' in final
    drawn = series(final, "global_accuracy")
    assert drawn == pytest.approx([r.global_accuracy for r in records.records])
    assert len(drawn) == settings.job.rounds
    losses = series(final, "train_loss")
    assert losses == pytest.approx([r.train_loss for r in records.records])
    # The accuracy axis fits the values (not a fixed 0-100%), on whole tens of percent.
    low, high = chart_range(final, "chart-accuracy")
    accuracies = [r.global_accuracy for r in records.records]
    assert low <= min(accuracies) and high >= max(accuracies)
    assert high - low <= max(accuracies) - min(accuracies) + 0.25
    per_version = series(final, "samples_per_s")
    assert per_version == pytest.approx([r.samples_per_s for r in records.records])
    assert 'id="report-table"' in final
    assert "final global accuracy" in final
    assert html.escape(str(files.run_dir)) in final
