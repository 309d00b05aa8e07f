"""A CI-sized fuzz run: ~1,000 bad and replayed messages at every queue the services consume,
while a real (short) training run goes on over RabbitMQ and Redis.

The full run (10,000 messages) is `python -m benchmarks.fuzz_services --messages 10000`; its
results are in docs/reliability.md. What this checks is the acceptance of the full one:
0 crashes, 100% of bad messages dead-lettered with a reason, replays never applied twice, and
training still ends well above chance.
"""

from __future__ import annotations

import pytest

from benchmarks.fuzz_services import FuzzConfig, markdown, run

pytestmark = [pytest.mark.rabbitmq, pytest.mark.redis, pytest.mark.slow]

# Training must outlast the fuzz even on a loaded host (it failed once with 20 steps a round
# when the fuzzer fell behind its rate): 5 rounds of 40 steps.
CONFIG = FuzzConfig(messages=1000, rate=250.0, seed=11, clients=2, rounds=5, steps=40)


@pytest.mark.timeout(240)
def test_fuzzing_every_queue_crashes_nothing_and_dead_letters_every_bad_message(
    amqp_url: str, redis_url: str
) -> None:
    cfg = FuzzConfig(**{**CONFIG.__dict__, "amqp_url": amqp_url, "redis_url": redis_url})
    report = run(cfg)
    print(markdown(report, cfg))

    assert report.messages == cfg.messages and report.unroutable == 0
    assert set(report.sent_by_target) == {"shard", "infer", "control", "updates", "reply", "events"}
    assert report.reject > 0.8 * cfg.messages and report.tolerate > 0
    # 0 crashes: every role ended cleanly, the split-inference thread lived to the end.
    assert report.role_errors == {} and report.crashes == []
    assert report.inference_alive
    # 100% of the bad messages dead-lettered, each with its reason.
    assert report.rejected_missing == [] and report.rejected_without_reason == []
    assert report.rejected_dead_lettered == report.reject
    assert report.other_dead_letters == {}  # and nothing valid was dead-lettered
    # The fuzz overlapped training, which lost nothing and applied no replay twice.
    assert not report.finished_before_fuzz_ended
    assert report.batches_sent == report.batches_applied > 0
    assert report.versions == cfg.rounds
    assert report.final_accuracy > 0.4  # chance is 0.1
    assert report.ok
