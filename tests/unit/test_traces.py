"""Availability traces: the CSV format, the replay API, the generator and `splitmq traces`."""

from __future__ import annotations

import math
import statistics
from pathlib import Path

import pytest
from click.testing import CliRunner

from services.cli.main import cli
from services.client.trace_model import DiurnalModel, generate
from services.client.traces import Trace, TraceError
from services.common.user_errors import user_message

HEADER = "client,online_from_s,online_to_s\n"


def parse(body: str, header: str = HEADER) -> Trace:
    return Trace.parse(header + body, source="t.csv")


# -- format -----------------------------------------------------------------------------------


def test_rows_by_index_and_by_id_sorted_and_half_open() -> None:
    trace = parse("0,50,60\n0,10,20.5\nH-7,0,inf\n\n3,5,6\n")
    assert trace.intervals(0) == ((10.0, 20.5), (50.0, 60.0))
    assert trace.intervals(7, "H-7") == ((0.0, math.inf),)
    assert trace.clients() == [0, 3, "H-7"]
    assert [trace.online(0, "H-0", t) for t in (9.9, 10, 20.4, 20.5, 55, 60)] == [
        False,
        True,
        True,
        False,
        True,
        False,
    ]


def test_an_id_row_wins_over_the_index_row_of_the_same_client() -> None:
    trace = parse("2,0,10\nH-2,100,200\n")
    assert trace.intervals(2, "H-2") == ((100.0, 200.0),)
    assert trace.intervals(2, "other") == ((0.0, 10.0),)


def test_missing_clients_are_online_unless_the_trace_says_offline() -> None:
    text = HEADER + "0,10,20\n"
    assert Trace.parse(text).online(5, "H-5", 1e9)
    assert Trace.parse(text).next_change(5, "H-5", 0) == math.inf
    offline = Trace.parse(text, missing="offline")
    assert not offline.online(5, "H-5", 0) and offline.intervals(5) == ()


def test_columns_in_any_order() -> None:
    trace = parse("30,40,1\n", header="online_from_s,online_to_s,client\n")
    assert trace.intervals(1) == ((30.0, 40.0),)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "t.csv:1: empty file"),
        ("client,online_from_s,online_to_s,extra\n", "t.csv:1: unknown column 'extra'"),
        ("client,online_from_s\n", "t.csv:1: missing column 'online_to_s'"),
        ("client,client,online_from_s,online_to_s\n", "t.csv:1: a column is named twice"),
        (HEADER + "0,1,2\n0,-1,2\n", "t.csv:3: online_from_s -1 is negative"),
        (HEADER + "0,1,-2\n", "t.csv:2: online_to_s -2 is negative"),
        (HEADER + "0,5,5\n", "t.csv:2: online_from_s 5 is not before online_to_s 5"),
        (HEADER + "0,6,5\n", "t.csv:2: online_from_s 6 is not before online_to_s 5"),
        (HEADER + "0,inf,inf\n", "t.csv:2: online_from_s is inf"),
        (HEADER + "0,soon,5\n", "t.csv:2: online_from_s 'soon' is not a number"),
        (HEADER + "0,nan,5\n", "t.csv:2: online_from_s is nan"),
        (HEADER + "0,1\n", "t.csv:2: 2 fields, the header has 3"),
        (
            HEADER + "0,0,10\n1,0,1\n0,5,20\n",
            "t.csv:4: client 0: this interval overlaps the one on line 2",
        ),
        (HEADER + "a b,0,1\n", "t.csv:2: bad client 'a b'"),
        (HEADER + ",0,1\n", "t.csv:2: bad client ''"),
        (HEADER + "-1,0,1\n", "t.csv:2: bad client '-1'"),
    ],
)
def test_bad_traces_say_file_line_and_what(text: str, message: str) -> None:
    with pytest.raises(TraceError) as caught:
        Trace.parse(text, source="t.csv")
    assert str(caught.value).startswith(message), str(caught.value)
    assert user_message(caught.value) is not None  # the CLI prints it as one line


def test_touching_intervals_are_no_overlap() -> None:
    assert parse("0,0,10\n0,10,20\n").next_change(0, None, 5) == 10


def test_save_and_load_round_trip(tmp_path: Path) -> None:
    trace = parse("0,0.1,2.25\n1,3,inf\nH-9,1e-3,7\n")
    trace.save(tmp_path / "t.csv")
    assert Trace.load(tmp_path / "t.csv") == trace


def test_a_missing_file_is_a_trace_error(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="cannot read the trace"):
        Trace.load(tmp_path / "nope.csv")


# -- replay API and stats ---------------------------------------------------------------------


def test_next_change_walks_the_intervals() -> None:
    trace = parse("0,10,20\n0,30,inf\n")
    assert [trace.next_change(0, None, t) for t in (0, 10, 15, 20, 29, 30, 1e9)] == [
        10,
        20,
        20,
        30,
        30,
        math.inf,
        math.inf,
    ]


def test_scaled_multiplies_every_time_and_keeps_inf() -> None:
    trace = parse("0,3600,7200\n1,0,inf\n").scaled(300 / 86_400)
    assert trace.intervals(0)[0] == pytest.approx((12.5, 25.0))
    assert trace.intervals(1) == ((0.0, math.inf),)
    with pytest.raises(ValueError, match="positive"):
        trace.scaled(0)


def test_stats_count_sessions_and_average_the_online_fraction_per_bucket() -> None:
    trace = parse("0,0,50\n0,75,100\n1,25,100\n")
    stats = trace.stats(buckets=4)
    assert (stats.clients, stats.sessions, stats.sessions_per_client) == (2, 3, 1.5)
    assert stats.mean_session_s == pytest.approx(50)
    assert stats.median_session_s == 50
    assert stats.bucket_s == 25
    assert stats.online_fraction == pytest.approx((0.5, 1.0, 0.5, 1.0))


# -- generator --------------------------------------------------------------------------------


def test_the_generator_is_reproducible_by_seed_and_per_device() -> None:
    model = DiurnalModel(tz_spread_h=6)
    first = generate(model, 50, 86_400, seed=3)
    assert generate(model, 50, 86_400, seed=3) == first
    assert generate(model, 50, 86_400, seed=4) != first
    # Device n does not depend on how many devices the trace has.
    assert generate(model, 10, 86_400, seed=3).intervals(7) == first.intervals(7)


@pytest.mark.parametrize("spread_h", [0.0, 8.0])
def test_online_fraction_by_hour_follows_the_diurnal_curve(spread_h: float) -> None:
    clients, hours = 1_500, 48
    model = DiurnalModel(tz_spread_h=spread_h)
    stats = generate(model, clients, hours * 3_600.0, seed=11).stats(hours, hours * 3_600.0)
    # Sampling: each device's hourly fraction has variance <= p(1-p), devices independent.
    # Lag: the fraction follows the curve one session late, so it may trail by the curve's
    # steepest slope times a mean session.
    slope = (model.peak_fraction - model.trough_fraction) / 2 * 2 * math.pi / 86_400
    lag = slope * model.mean_session_s()
    for hour, seen in enumerate(stats.online_fraction):
        target = statistics.fmean(
            model.expected_fraction(hour * 3_600.0 + s) for s in range(0, 3_600, 60)
        )
        tolerance = 4 * math.sqrt(target * (1 - target) / clients) + lag
        assert abs(seen - target) < tolerance, (hour, seen, target, tolerance)
    # The swing is really there (not a flat line inside the tolerance).
    assert max(stats.online_fraction) - min(stats.online_fraction) > 0.2


def test_session_lengths_median_near_the_configured_one() -> None:
    model = DiurnalModel(session_median_s=900, session_sigma=0.8)
    duration = 86_400.0
    trace = generate(model, 400, duration, seed=5)
    # Sessions cut by the trace's start or end are shorter than drawn: leave them out.
    lengths = [
        b - a for spans in trace.sessions.values() for a, b in spans if a > 0 and b < duration
    ]
    # The median of n lognormal draws: its log has a standard error of ~1.2533 sigma / sqrt(n).
    error = 4 * 1.2533 * model.session_sigma / math.sqrt(len(lengths))
    assert abs(math.log(statistics.median(lengths) / 900)) < error, statistics.median(lengths)


def test_day_s_compresses_the_whole_day() -> None:
    model = DiurnalModel()
    day = generate(model, 30, 86_400, seed=2)
    short = generate(model, 30, 300, day_s=300, seed=2)
    for index in range(30):
        expected = day.scaled(300 / 86_400).intervals(index)
        got = short.intervals(index)
        assert len(got) == len(expected) and all(
            abs(a - c) <= 1e-3 and abs(b - d) <= 1e-3
            for (a, b), (c, d) in zip(got, expected, strict=True)
        )


def test_bad_model_parameters_are_refused() -> None:
    with pytest.raises(ValueError, match="trough_fraction"):
        DiurnalModel(peak_fraction=0.1, trough_fraction=0.3)


# -- CLI --------------------------------------------------------------------------------------


def invoke(args: list[str]) -> tuple[int, str]:
    result = CliRunner().invoke(cli, args, prog_name="splitmq")
    return result.exit_code, result.output


def test_cli_generate_then_show(tmp_path: Path) -> None:
    out = tmp_path / "day.csv"
    options = ["--clients", "40", "--duration", "300", "--day-s", "300", "--seed", "1"]
    code, _ = invoke(["traces", "generate", *options, "--out", str(out)])
    assert code == 0
    assert Trace.load(out) == generate(DiurnalModel(), 40, 300, day_s=300, seed=1)
    code, text = invoke(["traces", "show", str(out), "--buckets", "6"])
    assert code == 0, text
    assert "clients:  40" in text
    assert text.count("%") == 6


def test_cli_generate_to_stdout_is_a_trace() -> None:
    code, text = invoke(["traces", "generate", "--clients", "3", "--duration", "86400"])
    assert code == 0
    assert len(Trace.parse(text).sessions) == 3


def test_cli_show_plot(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text(HEADER + "0,0,3600\n1,1800,7200\n")
    code, text = invoke(["traces", "show", str(path), "--plot", str(tmp_path / "t.png")])
    assert code == 0, text
    assert (tmp_path / "t.png").read_bytes()[:4] == b"\x89PNG"


def test_cli_show_a_bad_trace_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(HEADER + "0,5,1\n")
    code, text = invoke(["traces", "show", str(path)])
    assert code == 1
    assert text.strip() == f"Error: {path}:2: online_from_s 5 is not before online_to_s 1"


def test_cli_generate_refuses_a_bad_model() -> None:
    code, text = invoke(
        ["traces", "generate", "--clients", "3", "--duration", "10", "--peak", "0.05"]
    )
    assert code == 2 and "trough_fraction" in text
