"""``runtime.metric_demand``'s class: who holds it, and what the export queues learn from
it (see tests/test_threads_left.py for the processes it serves)."""

from __future__ import annotations

import gc
import time

from dask_otel.runtime_state import MetricDemand


class Holder:
    """A server or client stand-in (weakly referenced, as they are)."""

    def __init__(self) -> None:
        self.running = True


def running(holder: Holder) -> bool:
    return holder.running


def test_held_until_released_then_all_closed_for_a_while() -> None:
    demand, holder = MetricDemand(), Holder()
    demand.LINGER = 0.2
    before = demand.holds
    assert not demand.all_closed_since(before)  # nothing held since
    demand.hold(holder, running)
    assert demand.wanted() and demand.holding(holder)
    assert not demand.all_closed_since(before)  # still held
    demand.release(holder)
    assert not demand.wanted() and not demand.holding(holder)
    assert demand.all_closed_since(before)
    assert not demand.all_closed_since(demand.holds)  # a queue made after: not its business
    time.sleep(0.3)
    assert not demand.all_closed_since(before)  # the linger is over: on schedule again


def test_holders_stopped_or_gone_are_forgotten() -> None:
    demand = MetricDemand()
    stopped, gone, alive = Holder(), Holder(), Holder()
    for holder in (stopped, gone, alive):
        demand.hold(holder, running)
    stopped.running = False
    del gone
    gc.collect()
    demand.forget_stopped()
    assert not demand.holding(stopped) and demand.holding(alive) and demand.wanted()
    alive.running = False
    demand.forget_stopped()
    assert not demand.wanted()


def test_a_check_that_fails_counts_as_stopped() -> None:
    demand, holder = MetricDemand(), Holder()
    told: list[bool] = []
    demand.listen(told.append)
    demand.hold(holder, lambda h: h.status == "running")  # a stand-in without .status
    demand.forget_stopped()
    assert not demand.wanted() and told == [True, False]
