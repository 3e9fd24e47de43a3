"""A user's own ``otel`` task annotation, of any type, is ignored: the graph is traced
and computed as without it (issue 23, item 5; fixed with trace model v2)."""

from __future__ import annotations

import dask
import numpy as np
import pytest
from conftest import flush_emitters, in_process_cluster

import dask_otel


def inc(x: int) -> int:
    return x + 1


@pytest.mark.parametrize(
    "value",
    [np.array([1, 2]), {"a": 1}, 42, b"00-bytes", "not a traceparent", None],
    ids=["array", "dict", "int", "bytes", "str", "None"],
)
def test_a_foreign_otel_annotation_is_ignored(telemetry, value):
    with in_process_cluster(n_workers=1) as client:
        dask_otel.DaskInstrumentor().uninstrument()  # a plain client: the scheduler roots
        with dask.annotate(otel=value):
            future = client.submit(inc, 1)
        assert future.result() == 2
        flush_emitters(client)
    (graph,) = telemetry.spans("graph")  # ended: it was exported
    assert graph.attributes["dask.graph.tasks"] == 1
    assert telemetry.spans("task inc")
