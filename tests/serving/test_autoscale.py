"""The autoscaling rule (`--min-replicas`/`--max-replicas`): the count the load asks for, and the delays before
it changes anything. (The loop that applies it to replicas: tests/server/test_admin_replicas.py.)"""

from __future__ import annotations

import pytest

from tfserve.serving.autoscale import AutoscalePolicy, Autoscaler

POLICY = AutoscalePolicy(min_replicas=1, max_replicas=4, target_requests=8, upscale_delay_s=5, downscale_delay_s=60)


@pytest.mark.parametrize("num_in_flight,wanted", [(0, 1), (8, 1), (9, 2), (24, 3), (25, 4), (500, 4)])
def test_the_load_asks_for_one_replica_per_target_within_min_and_max(num_in_flight, wanted):
    assert POLICY.wanted(num_in_flight) == wanted
    assert AutoscalePolicy(2, 4).wanted(0) == 2


def test_a_burst_shorter_than_the_delay_scales_nothing():
    rule = Autoscaler(POLICY)
    assert rule.decide(0, 30, 1) is None
    assert rule.decide(4, 30, 1) is None
    assert rule.decide(4.5, 3, 1) is None  # over: the clock starts again
    assert rule.decide(5.5, 30, 1) is None
    assert rule.decide(10.4, 30, 1) is None
    assert rule.decide(10.5, 30, 1) == 4  # 5 s of asking for more
    assert rule.decide(11, 30, 4) is None


def test_fewer_replicas_only_after_a_minute_of_asking_for_fewer():
    rule = Autoscaler(POLICY)
    assert rule.decide(0, 10, 3) is None
    assert rule.decide(30, 2, 3) is None
    assert rule.decide(40, 40, 3) is None  # asks for more now: the wait for fewer starts over
    assert rule.decide(41, 2, 3) is None
    assert rule.decide(100, 2, 3) is None
    assert rule.decide(101, 2, 3) == 1
    assert rule.decide(101, 2, 1) is None


@pytest.mark.parametrize("kwargs", [dict(min_replicas=0, max_replicas=2), dict(min_replicas=3, max_replicas=2),
                                    dict(min_replicas=1, max_replicas=2, target_requests=0)])
def test_a_bad_policy_is_refused(kwargs):
    with pytest.raises(ValueError):
        AutoscalePolicy(**kwargs)
