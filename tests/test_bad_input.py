"""Bad input never changes what Dask computes; what telemetry can be sent is sent.

Keys of every type and length, foreign or malformed trace context in annotations,
exceptions that cannot be printed or pickled, tasks that touch the global tracer provider,
invalid ``otel:`` config in a client and garbage ``OTEL_*`` variables in a real worker.
"""

from __future__ import annotations

import logging
import operator
import os
import pickle
import subprocess
import sys
from contextlib import contextmanager

import dask
import pytest
from conftest import flush_emitters, in_process_cluster, otel_env, start_scheduler, start_worker
from distributed import Client
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import SpanContext, StatusCode, TraceFlags

import dask_otel
from dask_otel import strings
from dask_otel.spans import errors, ids

LIMIT = 256  # otel.max-attribute-length default

# -- properties of key and value sanitizing (hypothesis) ------------------------------------

scalar_keys = st.one_of(st.text(), st.integers(), st.floats(allow_nan=False))
keys = st.recursive(
    scalar_keys, lambda inner: st.tuples(inner, inner) | st.tuples(inner), max_leaves=6
)
trace_ids = st.integers(1, 2**128 - 1)
span_ids = st.integers(1, 2**64 - 1)
contexts = st.builds(
    lambda t, s, f: SpanContext(t, s, is_remote=True, trace_flags=TraceFlags(f)),
    trace_ids,
    span_ids,
    st.integers(0, 255),
)


@given(keys)
def test_key_to_str_is_a_stable_string(key):
    text = strings.key_to_str(key)
    assert isinstance(text, str)
    assert strings.key_to_str(pickle.loads(pickle.dumps(key))) == text  # the same on every host


@given(st.text(), st.integers(-5, 300))
def test_cap_bounds_the_length_and_keeps_a_prefix(text, limit):
    capped = strings.cap(text, limit)
    assert len(capped) <= max(limit, 0)
    if len(text) <= limit:
        assert capped == text
    else:
        assert text.startswith(capped[:-1]) and (capped == "" or capped.endswith("\u2026"))


@given(contexts, st.text())
def test_task_span_id_is_a_valid_span_id_for_any_key(carrier, key):
    span_id = ids.task_span_id(carrier, key)
    assert 1 <= span_id < 2**64
    assert span_id == ids.task_span_id(carrier, key)


@given(contexts)
def test_encode_decode_round_trip(context):
    for value in (ids.encode(context), ids.encode(context) + ids.THINNED):
        decoded = ids.decode(value)
        assert decoded is not None
        assert (decoded.trace_id, decoded.span_id) == (context.trace_id, context.span_id)
        assert decoded.trace_flags == context.trace_flags


anything = st.one_of(
    st.none(),
    st.text(),
    st.binary(),
    st.integers(),
    st.floats(),
    st.lists(st.text(), max_size=3),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=3),
)


@given(anything)
def test_decode_never_raises(value):
    decoded = ids.decode(value)
    assert decoded is None or decoded.is_valid


class StrRaises(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no str for you")


class StrReturnsNonStr(Exception):
    def __str__(self):  # type: ignore[override]
        return 42


class HasData(Exception):
    """An exception with a ``data`` attribute of its own (not a Dask wrapper)."""

    data = ("rows", 3)


class BadData:
    """A wrapper whose ``data`` cannot even be read."""

    @property
    def data(self):
        raise ValueError("unreadable")


exceptions = st.one_of(
    st.builds(ValueError, st.text()),
    st.builds(KeyError, anything),
    st.builds(HasData, st.text()),
    st.builds(StrRaises),
    st.builds(StrReturnsNonStr),
    st.builds(lambda a, b: Exception(a, b), anything, anything),
)


@given(exceptions)
def test_safe_str_never_raises(exc):
    assert isinstance(strings.safe_str(exc), str)


@given(
    st.one_of(exceptions, anything, st.builds(BadData), exceptions.map(pickle.dumps)),
    st.one_of(st.none(), st.text(), st.binary(), st.integers()),
)
def test_describe_never_raises_and_returns_text(exception, text):
    exc_type, message = errors.describe(exception, text)
    assert isinstance(exc_type, str) and exc_type
    assert isinstance(message, str)


@given(exceptions)
@settings(max_examples=50)
def test_describe_names_the_exceptions_own_type(exc):
    exc_type, _ = errors.describe(exc, None)
    assert exc_type == strings.type_name(exc)
    assert errors.describe(pickle.dumps(exc), None)[0] == exc_type


def test_describe_an_exception_dask_could_not_pickle():
    """Dask sends ``Exception(repr(e))``: the repr still names the type, as on the scheduler;
    the message is what the repr holds, without the type again."""
    text = "Unpicklable('y')"
    assert errors.describe(pickle.dumps(Exception(text)), text) == ("Unpicklable", "y")
    assert errors.describe(None, text) == ("Unpicklable", "y")
    # A plain Exception whose message is something else keeps its type.
    assert errors.describe(Exception("x"), "Exception('x')") == ("Exception", "x")


# -- keys of every kind in a cluster --------------------------------------------------------


def inc(x: int) -> int:
    return x + 1


def test_tuple_int_float_and_very_long_keys(telemetry):
    long_key = "k" * 20_000
    submitted = {("t", 0): 1, 5: 2, 2.5: 3, long_key: 4, ("x" * 5000, 1): 5}
    with in_process_cluster() as client:
        futures = {key: client.submit(inc, v, key=key) for key, v in submitted.items()}
        assert {k: f.result() for k, f in futures.items()} == {
            k: v + 1 for k, v in submitted.items()
        }
        # Dask rejects bytes keys; instrumented or not, with the same exception.
        with pytest.raises(TypeError, match="Unexpected key type"):
            client.submit(inc, 1, key=b"bytes-key").result()
        flush_emitters(client)
    spans = telemetry.spans()
    keys_seen = {s.attributes.get("dask.task.key") for s in telemetry.spans("task ")}
    assert len(keys_seen) == len(submitted)
    assert strings.key_to_str(("t", 0)) in keys_seen and "5" in keys_seen and "2.5" in keys_seen
    for span in spans:
        for name, value in span.attributes.items():
            if isinstance(value, str):
                assert len(value) <= LIMIT, name
    # The client's span is named after the key's prefix, capped too.
    assert all(len(s.name) <= len("compute ") + LIMIT for s in telemetry.spans("compute"))
    (failed,) = [s for s in telemetry.spans("compute") if s.status.status_code == StatusCode.ERROR]
    assert failed.attributes["error.type"] == "TypeError"


def test_span_names_of_very_long_keys_are_capped(telemetry):
    with in_process_cluster(n_workers=1) as client:
        assert client.submit(inc, 1, key="k" * 20_000).result() == 2
        flush_emitters(client)
    spans = telemetry.spans()
    assert {s.name.split()[0] for s in spans} >= {"task", "graph"}
    assert all(len(s.name) <= len("compute ") + LIMIT for s in spans)
    assert all(len(s.attributes.get("dask.task.prefix", "")) <= LIMIT for s in spans)


# -- foreign or malformed trace context in annotations --------------------------------------

FOREIGN_ANNOTATIONS = [
    "garbage",
    "00-00000000000000000000000000000000-0000000000000000-01",  # all-zero ids
    "00-0af7651916cd43dd8448eb211c80319c-00f067aa0ba902b7-zz",  # bad flags
    42,
    {"trace": "mine"},
    ["x"],
    b"00-0af7651916cd43dd8448eb211c80319c-00f067aa0ba902b7-01",
]


def test_a_users_otel_annotation_is_replaced_with_one_warning(telemetry, caplog, fresh_process):
    caplog.set_level(logging.WARNING, logger="dask_otel")
    with in_process_cluster() as client:
        for i, value in enumerate(FOREIGN_ANNOTATIONS):
            with dask.annotate(otel=value):
                assert client.submit(inc, i, key=f"inc-{i}").result() == i + 1
        flush_emitters(client)
    # Every submission is traced as if the annotation were not there.
    for i in range(len(FOREIGN_ANNOTATIONS)):
        (task,) = [
            s for s in telemetry.spans("task") if s.attributes["dask.task.key"] == f"inc-{i}"
        ]
        (graph,) = [s for s in telemetry.spans("graph") if s.context.span_id == task.parent.span_id]
        (_compute,) = [
            s for s in telemetry.spans("compute") if s.context.span_id == graph.parent.span_id
        ]
    warnings = [r for r in caplog.records if "reserved for dask-otel" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "'otel'" in warnings[0].getMessage()


@contextmanager
def uninstrumented_client(telemetry):
    """An in-process cluster traced by dask-otel, with a client that is not."""
    with in_process_cluster(n_workers=1) as instrumented:
        dask_otel.DaskInstrumentor().uninstrument()
        with Client(instrumented.cluster) as client:
            yield client
        dask_otel.DaskInstrumentor().instrument(
            tracer_provider=telemetry.tracer_provider,
            meter_provider=telemetry.meter_provider,
            logger_provider=telemetry.logger_provider,
        )


def test_foreign_annotations_never_change_results(telemetry):
    """Values of every type in the ``otel`` annotation, also where nothing replaces them
    (an uninstrumented client; a collection built while the annotation was set)."""
    with uninstrumented_client(telemetry) as client:
        for i, value in enumerate(FOREIGN_ANNOTATIONS):
            with dask.annotate(otel=value):
                assert client.submit(inc, i).result() == i + 1
                assert dask.delayed(inc)(i).compute() == i + 1
        flush_emitters(client)
    # The scheduler still opened (and closed) one graph span per submission.
    assert len(telemetry.spans("graph")) == 2 * len(FOREIGN_ANNOTATIONS)


def test_tasks_with_a_foreign_annotation_are_still_traced(telemetry):
    with uninstrumented_client(telemetry) as client:
        with dask.annotate(otel="garbage"):
            assert client.submit(inc, 1, key="inc-foreign").result() == 2
        flush_emitters(client)
    assert [s.attributes["dask.task.key"] for s in telemetry.spans("task")] == ["inc-foreign"]


# -- exceptions that cannot be printed or pickled -------------------------------------------


class Unpicklable(Exception):
    def __reduce__(self):
        raise TypeError("cannot pickle me")


def raise_str_raises() -> None:
    raise StrRaises("hidden")


def raise_unpicklable() -> None:
    raise Unpicklable("y")


def raise_has_data() -> None:
    raise HasData("with data")


def outcome(client, func) -> tuple[str, str]:
    """The exception ``func`` raises through Dask: (type, repr)."""
    try:
        client.submit(func, pure=False).result()
    except Exception as e:
        return type(e).__qualname__, repr(e)
    raise AssertionError(f"{func.__name__} did not fail")


FAILING = [raise_str_raises, raise_unpicklable, raise_has_data]


def test_unprintable_and_unpicklable_exceptions(telemetry):
    with dask.config.set({"otel.enabled": False}), in_process_cluster(n_workers=1) as client:
        plain = [outcome(client, f) for f in FAILING]
    with in_process_cluster(n_workers=1) as client:
        traced = [outcome(client, f) for f in FAILING]
        flush_emitters(client)
    assert traced == plain  # what Dask raises is unchanged
    for func, expected in [
        (raise_unpicklable, "Unpicklable"),
        (raise_has_data, f"{__name__}.HasData"),
    ]:
        prefix = func.__name__.replace("_", "-").split("-")[0]
        spans = [
            s
            for s in telemetry.spans()
            if s.name in (f"task {func.__name__}", f"attempt {func.__name__}")
        ]
        assert len(spans) == 2, (prefix, [s.name for s in telemetry.spans()])
        for span in spans:
            assert span.status.status_code == StatusCode.ERROR
            assert span.attributes["error.type"] == expected, span.name
            (event,) = [e for e in span.events if e.name == "exception"]
            assert event.attributes["exception.type"] == expected


# -- a task that changes the global tracer provider -----------------------------------------


def replace_global_provider(x: int) -> int:
    trace.set_tracer_provider(TracerProvider())
    return x


def test_a_task_that_replaces_the_global_tracer_provider(telemetry):
    with in_process_cluster(n_workers=1) as client:
        assert client.submit(replace_global_provider, 1).result() == 1
        assert client.submit(inc, 1, key="inc-after").result() == 2
        flush_emitters(client)
    # dask-otel's components keep the providers they started with.
    names = {s.attributes.get("dask.task.key") for s in telemetry.spans("task ")}
    assert "inc-after" in names
    assert len(telemetry.spans("task replace_global_provider")) == 1


# -- invalid otel: config in a client -------------------------------------------------------


def test_invalid_client_config_submits_untraced_and_says_so_once(telemetry, capfd):
    with in_process_cluster(n_workers=1) as client:
        with dask.config.set({"otel.task.max-links": -4242}):
            assert [client.submit(inc, i).result() for i in range(3)] == [1, 2, 3]
        flush_emitters(client)
    assert not telemetry.spans("compute")
    assert len(telemetry.spans("graph")) == 3  # the scheduler still roots every graph
    # Said once, on stderr, whatever logging is configured.
    said = [line for line in capfd.readouterr().err.splitlines() if "otel.task.max-links" in line]
    assert said == [
        "dask-otel: otel.task.max-links must be an integer >= 0, got -4242. "
        "This client runs untraced."
    ]


# -- garbage OTEL_* variables in real worker processes --------------------------------------


def test_garbage_otel_variables_in_a_real_worker(receiver, processes):
    """Two ``dask worker`` processes under opentelemetry-instrument: one with a setting the
    SDK replaces by its default (still traced), one with a setting no SDK can be built
    from (runs untraced). Both compute; each names its variable."""
    env = otel_env(receiver)
    address = start_scheduler(processes, env)
    garbage = {
        "recoverable": {"OTEL_BSP_MAX_QUEUE_SIZE": "lots"},
        "fatal": {"OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT": "huge"},
    }
    for name, variables in garbage.items():
        start_worker(processes, {**env, **variables}, address, name, nanny=False)
    with Client(address, timeout=60) as client:
        client.wait_for_workers(2, timeout=90)
        workers = {info["name"]: addr for addr, info in client.scheduler_info()["workers"].items()}
        for name in garbage:
            future = client.submit(operator.add, 41, 1, key=f"add-{name}", workers=[workers[name]])
            assert future.result(timeout=60) == 42
    # The recoverable worker's telemetry is sent; the other one's cannot be.
    spans = receiver.wait_for(lambda r: [s for s in r.spans() if s["name"].startswith("task ")])
    assert [s["attributes"]["dask.task.key"] for s in spans] == ["add-recoverable"]
    assert spans[0]["attributes"]["dask.worker.name"] == "recoverable"
    logs = {log.stem: log.read_text() for _, log in processes.procs}
    # One message (the SDK's; traceback lines aside) names the variable it ignored.
    recoverable = [
        line
        for line in logs["recoverable"].splitlines()
        if "OTEL_BSP_MAX_QUEUE_SIZE" in line and not line.startswith(" ")
    ]
    assert len(recoverable) == 1, logs["recoverable"]
    assert "OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT must be" in logs["fatal"]
    said = [line for line in logs["fatal"].splitlines() if line.startswith("dask-otel: cannot")]
    assert len(said) == 1, logs["fatal"]
    assert "OTEL_ATTRIBUTE_VALUE_LENGTH_LIMIT" in said[0]


def test_an_sdk_that_cannot_be_configured_leaves_the_process_untraced_and_is_not_retried():
    """Every client submission activates dask-otel: after one failed attempt it must say
    so once and stay off, not build the SDK again (and again say nothing); until the user
    sets providers of their own, which it then uses."""
    script = (
        "import logging; logging.basicConfig()\n"
        "from opentelemetry import trace\n"
        "from opentelemetry.sdk.trace import TracerProvider\n"
        "from dask_otel.plugins.activation import activate\n"
        "print([activate('client') for _ in range(3)])\n"
        "trace.set_tracer_provider(TracerProvider())\n"
        "print(activate('client') is not None)\n"
    )
    env = {**os.environ, "OTEL_TRACES_EXPORTER": "no-such-exporter"}
    env.pop("OTEL_SDK_DISABLED", None)
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[None,", "None,", "None]", "True"]
    said = [line for line in out.stderr.splitlines() if "dask-otel: cannot configure" in line]
    assert len(said) == 1, out.stderr
