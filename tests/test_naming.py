"""Traces are named after what the user ran: ``compute mean``, not
``compute finalize-hlgfinalizecompute``; the same name when the scheduler roots the trace
(``graph mean``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import dask
import dask.bag as db
import pytest
from conftest import flush_emitters, in_process_cluster
from dask import delayed
from distributed import LocalCluster

from dask_otel.spans.naming import computation_name, operation

EXAMPLES = Path(__file__).parent.parent / "examples"

# -- the pure function ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prefix", "expected"),
    [
        ("mean_agg-aggregate", "mean"),
        ("mean_aggregate-aggregate", "mean"),
        ("mean_aggregate", "mean"),
        ("sum-aggregate", "sum"),
        ("sum-tree", "sum"),
        ("max-tree", "max"),
        ("inc", "inc"),
        ("log_and_square", "log_and_square"),
        ("aggregate", "aggregate"),  # nothing but a suffix: left as it is
        ("_chunk", "_chunk"),
    ],
)
def test_operation(prefix, expected):
    assert operation(prefix) == expected


TOKEN = "bef03e6f3c6e4bca93bd9bbf40a3f68f"


def test_wrapper_keys_are_named_after_what_they_wrap():
    finalize = f"finalize-hlgfinalizecompute-{TOKEN}"
    wrapped = {
        finalize: [(f"mean_agg-aggregate-{TOKEN}", 0)],
        (f"repartitiontofewer-{TOKEN}", 0): [(f"add-{TOKEN}", 0), (f"add-{TOKEN}", 1)],
    }
    name = lambda keys: computation_name(keys, lambda k: wrapped.get(k, []), 256)  # noqa: E731
    assert name([finalize]) == "mean"
    assert name([(f"repartitiontofewer-{TOKEN}", 0)]) == "add"
    assert name(["inc-5b6f0d4e-6f0d-4e2a-9c3b-2b5d7a9c1e3f"]) == "inc"
    # Several collections: sorted, so that any order of keys gives the same name.
    assert name([finalize, "inc-1"]) == "inc, mean"
    assert name(["inc-1", finalize]) == "inc, mean"
    assert name(["a-1", "b-1", "c-1", "d-1", "e-1"]) == "a, b, c +2"
    assert name([]) is None
    # A wrapper whose inputs are unknown keeps its own prefix.
    assert name([f"finalize-hlgfinalizecompute-{TOKEN[::-1]}"]) == "finalize-hlgfinalizecompute"
    assert computation_name(["a_very_long_function_name-1"], lambda k: [], 8) == "a_very_\u2026"


# -- what the client and the scheduler call real computations -----------------------------------


def inc(x):
    return x + 1


def computations(client):
    """Each computation a user might run, with the name its trace should have."""
    bag = db.from_sequence(range(8), npartitions=4)
    yield "mean", lambda: bag.mean().compute()
    yield "sum", lambda: bag.map(inc).sum().compute()
    yield "inc", lambda: bag.map(inc).compute()
    yield "inc", lambda: delayed(inc)(1).compute()
    yield "inc, sum", lambda: dask.compute(delayed(inc)(1), bag.sum())
    yield "inc", lambda: client.submit(inc, 1).result()
    yield "inc", lambda: client.gather(client.map(inc, range(3)))
    yield "mean", lambda: client.compute(bag.mean()).result()
    yield "x", lambda: client.get({"x-1": (inc, 1)}, "x-1")  # the key the user chose
    np = pytest.importorskip("numpy")  # the test extra has it; dask-otel does not need it
    da = pytest.importorskip("dask.array")
    x = da.from_array(np.arange(16.0).reshape(4, 4), chunks=2)
    yield "mean", lambda: x.mean().compute()
    yield "mean", lambda: (x @ x.T).mean().compute()
    yield "sum", lambda: x.sum(axis=0).compute()
    yield "mean", lambda: client.persist(x.mean()).compute()
    if importlib.util.find_spec("pandas") is None:  # not in the test extra
        return
    import dask.dataframe as dd
    import pandas as pd

    df = dd.from_pandas(pd.DataFrame({"a": range(8), "b": range(8)}), npartitions=2)
    yield "mean", lambda: df.a.mean().compute()
    yield "max", lambda: client.compute(df.b.max()).result()
    yield "add", lambda: (df.a + 1).compute()  # its partitions concatenated by Dask


def test_compute_spans_are_named_after_what_ran(telemetry):
    with in_process_cluster() as client:
        for expected, run in computations(client):
            before = len(telemetry.spans("compute"))
            run()
            new = [s.name for s in telemetry.spans("compute")[before:]]
            assert new[0] == f"compute {expected}", (expected, new)


def test_collections_are_named_after_the_users_last_operation(telemetry):
    """Whatever Dask lowers them to: a grouped sum over 20 partitions is a tree of
    ``call_with_list_arg`` tasks, a shuffle ``p2pshuffle``. (The scheduler, which sees
    only tasks, names a graph it roots after them.)"""
    dd = pytest.importorskip("dask.dataframe")  # pandas and pyarrow: not in the test extra
    import pandas as pd

    frame = pd.DataFrame({"key": [i % 7 for i in range(200)], "amount": range(200)})
    df = dd.from_pandas(frame, npartitions=20)
    with in_process_cluster() as client, dask.config.set({"dataframe.shuffle.method": "tasks"}):
        for run in (
            lambda: client.compute(df.groupby("key").amount.sum()).result(),
            lambda: df.groupby("key").amount.sum(split_out=4).compute(),
            lambda: client.persist(df.groupby("key").amount.sum()).compute(),
            lambda: dask.compute(df.groupby("key").amount.sum(), df.amount.max()),
        ):
            before = len(telemetry.spans("compute"))
            run()
            new = {s.name for s in telemetry.spans("compute")[before:]}
            assert new <= {"compute sum", "compute max, sum"}, new


def test_graph_spans_rooted_by_the_scheduler_are_named_alike(telemetry):
    with in_process_cluster() as client:
        for expected, run in computations(client):
            before = len(telemetry.spans("graph"))
            with dask.config.set({"otel.enabled": False}):  # an untraced client
                run()
            flush_emitters(client)
            new = [s for s in telemetry.spans("graph")[before:]]
            assert new[0].name == f"graph {expected}", (expected, [s.name for s in new])
            assert new[0].parent is None
    assert not telemetry.spans("compute")


def test_the_example_client_computes_mean(telemetry, capsys):
    """examples/demo_client.py promises a `compute mean` trace in Jaeger."""
    pytest.importorskip("numpy")
    spec = importlib.util.spec_from_file_location("demo_client", EXAMPLES / "demo_client.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    with LocalCluster(
        n_workers=2, threads_per_worker=1, processes=False, dashboard_address="127.0.0.1:0"
    ) as cluster:
        assert example.main(["demo_client.py", cluster.scheduler_address]) == 0
    assert "array reduction" in capsys.readouterr().out
    names = [s.name for s in telemetry.spans("compute")]
    assert names == ["compute mean", "compute greet", "compute fail"]
