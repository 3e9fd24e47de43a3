"""dask_otel.config: the ``otel:`` section of Dask's config and its validation."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys

import dask
import pytest
from distributed import Scheduler, Worker

from dask_otel.config import ConfigError, Settings, load_settings


def test_defaults():
    assert load_settings() == Settings(
        enabled=True,
        max_attribute_length=256,
        task_spans=True,
        transfer_spans=True,
        spill_spans=True,
        rpc_spans=True,
        metrics_enabled=True,
        rpc_always_record=frozenset(),
        rpc_never_record=frozenset(
            ["heartbeat_worker", "identity", "get_metadata", "set_metadata", "keep-alive"]
        ),
        redact_exception_messages=False,
        redact_log_bodies=False,
        max_task_links=8,
        max_spans_per_graph=10000,
        task_sample_ratio=1.0,
        keep_slower_than=1.0,
        include_prefixes=frozenset(),
        exclude_prefixes=frozenset(),
        flush_timeout=5.0,
        max_queue_memory=16 * 2**20,
        logs_enabled=True,
        logs_level=logging.INFO,
        logs_loggers=("", "distributed"),
        logs_exclude_event_topics=("stealing",),
        flight_recorder_size=4 * 2**20,
        memory_history=10.0,
        death_log_lines=20,
    )
    # The defaults are part of dask.config, where every Dask way of setting config works.
    assert dask.config.get("otel.task.max-links") == 8
    assert dask.config.get("otel.flush-timeout") == "5s"


def test_values_set_through_dask_config():
    with dask.config.set(
        {
            "otel.enabled": "False",
            "otel.max-attribute-length": 16,
            "otel.spans.transfers": False,
            "otel.metrics.enabled": "false",
            "otel.rpc.always-record": ["gather"],
            "otel.rpc.never-record": [],
            "otel.redact.exception-messages": True,
            "otel.task.max-links": 3,
            "otel.flush-timeout": "250ms",
            "otel.max-queue-memory": "1 MB",
            "otel.logs.enabled": False,
            "otel.logs.level": "warning",
            "otel.logs.loggers": ["distributed"],
        }
    ):
        settings = load_settings()
    assert settings == Settings(
        enabled=False,
        max_attribute_length=16,
        task_spans=True,
        transfer_spans=False,
        spill_spans=True,
        rpc_spans=True,
        metrics_enabled=False,
        rpc_always_record=frozenset(["gather"]),
        rpc_never_record=frozenset(),
        redact_exception_messages=True,
        redact_log_bodies=False,
        max_task_links=3,
        max_spans_per_graph=10000,
        task_sample_ratio=1.0,
        keep_slower_than=1.0,
        include_prefixes=frozenset(),
        exclude_prefixes=frozenset(),
        flush_timeout=0.25,
        max_queue_memory=1_000_000,
        logs_enabled=False,
        logs_level=logging.WARNING,
        logs_loggers=("distributed",),
        logs_exclude_event_topics=("stealing",),
        flight_recorder_size=4 * 2**20,
        memory_history=10.0,
        death_log_lines=20,
    )
    with dask.config.set({"otel.enabled": "true", "otel.flush-timeout": 2.5}):
        settings = load_settings()
    assert settings.enabled is True
    assert settings.flush_timeout == 2.5


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("otel.enabled", "maybe"),
        ("otel.enabled", 1),
        ("otel.enabled", None),
        ("otel.max-attribute-length", 3),
        ("otel.max-attribute-length", "256"),
        ("otel.task.max-links", -1),
        ("otel.task.max-links", 1.5),
        ("otel.task.max-links", True),
        ("otel.task.max-links", "x"),
        ("otel.task.max-links", -3),
        ("otel.logs.enabled", "yes"),
        ("otel.logs.level", "LOUD"),
        ("otel.logs.level", 2.5),
        ("otel.logs.loggers", "distributed"),
        ("otel.logs.loggers", ["distributed", 3]),
        ("otel.logs.exclude-event-topics", "stealing"),
        ("otel.task.sample-ratio", 1.5),
        ("otel.task.sample-ratio", "half"),
        ("otel.task.max-spans-per-graph", -1),
        ("otel.task.keep-slower-than", "slow"),
        ("otel.task.include-prefixes", "inc"),
        ("otel.flush-timeout", "soon"),
        ("otel.flush-timeout", -1),
        ("otel.flush-timeout", None),
        ("otel.flush-timeout", "inf"),
        ("otel.max-queue-memory", "lots"),
        ("otel.max-queue-memory", "1kB"),
        ("otel.max-queue-memory", -1),
        ("otel.max-queue-memory", True),
    ],
)
def test_invalid_value_names_the_full_key(key, value):
    with dask.config.set({key: value}), pytest.raises(ConfigError) as info:
        load_settings()
    message = str(info.value)
    assert key in message
    assert repr(value) in message
    # A ConfigError is a ValueError, for callers that catch those.
    assert isinstance(info.value, ValueError)


def test_settings_follow_every_change_of_the_config():
    """A client loads its settings on every submission, from what it validated last while
    the config is unchanged: any change shows at the next load, an invalid one raises."""
    assert load_settings() == load_settings()
    with dask.config.set({"otel.task.max-links": 3}):
        assert load_settings().max_task_links == 3
        dask.config.get("otel.task")["max-links"] = 4  # in place, as code can
        assert load_settings().max_task_links == 4
        dask.config.get("otel.logs.loggers").append("mine")
        assert load_settings().logs_loggers[-1] == "mine"
        dask.config.get("otel.logs.loggers").pop()
        with dask.config.set({"otel.task.max-links": -1}), pytest.raises(ConfigError):
            load_settings()
        assert load_settings().max_task_links == 4
    assert load_settings().max_task_links == 8


@pytest.mark.parametrize("value", [[5], {"seconds": 5}, "1e400"])
def test_unparseable_duration_raises_config_error(value):
    with dask.config.set({"otel.flush-timeout": value}), pytest.raises(ConfigError) as info:
        load_settings()
    assert "otel.flush-timeout" in str(info.value)


def test_environment_variable_is_honoured():
    """Dask reads DASK_* variables when it is imported, hence a fresh interpreter."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DASK_", "OTEL_"))}
    env["DASK_OTEL__TASK__MAX_LINKS"] = "32"
    env["DASK_OTEL__FLUSH_TIMEOUT"] = "1500ms"
    code = (
        "from dask_otel.config import load_settings\n"
        "s = load_settings()\n"
        "print(s.max_task_links, s.flush_timeout, s.max_spans_per_graph)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["32", "1.5", "10000"]


def test_invalid_environment_variable_fails_with_the_key():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DASK_", "OTEL_"))}
    env["DASK_OTEL__TASK__MAX_LINKS"] = "-2"
    code = "from dask_otel.config import load_settings\nload_settings()\n"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode != 0
    assert "ConfigError: otel.task.max-links" in out.stderr


@pytest.mark.parametrize(
    ("key", "value"),
    [("otel.task.max-links", -1), ("otel.flush-timeout", "soon")],
)
def test_invalid_value_stops_an_instrumented_scheduler(telemetry, key, value):
    async def start() -> None:
        with dask.config.set({key: value}):
            async with Scheduler(host="127.0.0.1", port=0, dashboard_address="127.0.0.1:0"):
                pass

    with pytest.raises(Exception) as info:
        asyncio.run(asyncio.wait_for(start(), 30))
    error = info.value
    chain = [error, error.__cause__, error.__context__]
    text = " ".join(str(e) for e in chain if e is not None)
    assert key in text, text
    assert "ConfigError" in text or any(isinstance(e, ConfigError) for e in chain)
    assert telemetry.spans() == []


def test_valid_value_lets_an_instrumented_scheduler_start(telemetry):
    """The counterpart of the test above: the same scheduler starts with valid config."""

    async def start() -> list[str]:
        with dask.config.set({"otel.task.max-links": 3}):
            async with Scheduler(
                host="127.0.0.1", port=0, dashboard_address="127.0.0.1:0"
            ) as scheduler:
                plugin = scheduler.plugins["dask-otel"]
                assert plugin.settings.max_task_links == 3
                return list(scheduler.plugins)

    assert "dask-otel" in asyncio.run(asyncio.wait_for(start(), 30))


def test_invalid_value_stops_an_instrumented_worker(telemetry):
    async def start() -> None:
        async with Scheduler(host="127.0.0.1", port=0, dashboard_address="127.0.0.1:0") as s:
            with dask.config.set({"otel.task.max-links": "x"}):
                async with Worker(s.address, host="127.0.0.1", dashboard_address="127.0.0.1:0"):
                    pass

    with pytest.raises(RuntimeError, match="Worker failed to start") as info:
        asyncio.run(asyncio.wait_for(start(), 30))
    chain = [info.value, info.value.__cause__, info.value.__context__]
    text = " ".join(str(e) for e in chain if e is not None)
    assert "otel.task.max-links" in text, text


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            {"otel.spans.task": False},
            "otel.spans.task = False is not a dask-otel setting (did you mean otel.spans.tasks?)",
        ),
        (
            {"otel.task.max_span_per_graph": 5},
            "otel.task.max_span_per_graph = 5 is not a dask-otel setting"
            " (did you mean otel.task.max-spans-per-graph?)",
        ),
        (
            {"otel.task.colour": "blue"},
            "otel.task.colour = 'blue' is not a dask-otel setting (the names there are "
            "max-links, max-spans-per-graph, sample-ratio, keep-slower-than, "
            "include-prefixes, exclude-prefixes)",
        ),
        (
            {"otel.logs": "off"},
            "otel.logs must be a section of settings (enabled, level, loggers, "
            "exclude-event-topics), got 'off'",
        ),
        (  # every problem at once
            {"otel.enable": True, "otel.task.max-links": -1},
            "otel.enable = True is not a dask-otel setting (did you mean otel.enabled?); "
            "otel.task.max-links must be an integer >= 0, got -1",
        ),
    ],
)
def test_unknown_keys_name_the_closest_valid_key(config, message):
    with dask.config.set(config), pytest.raises(ConfigError) as info:
        load_settings()
    assert str(info.value) == message


def test_keys_with_underscores_are_the_same_keys():
    """Dask treats ``max_links`` and ``max-links`` alike; so does the key check."""
    with dask.config.set({"otel.task.max_links": 3, "otel.flush_timeout": "2s"}):
        settings = load_settings()
    assert (settings.max_task_links, settings.flush_timeout) == (3, 2.0)


@pytest.mark.parametrize("where", ["variable", "YAML file"])
def test_bad_values_say_where_they_were_set(tmp_path, where):
    """The variable, or the YAML file (the last of Dask's that sets the key); an unknown
    key likewise."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DASK_", "OTEL_"))}
    env["DASK_CONFIG"] = str(tmp_path)
    (tmp_path / "a.yaml").write_text("otel:\n  task:\n    max-links: 3\n")
    if where == "variable":
        env["DASK_OTEL__TASK__MAX_LINKS"] = "-1"
        env["DASK_OTEL__TASK__COLOUR"] = "'blue'"
        origin = ["(from DASK_OTEL__TASK__MAX_LINKS=-1)", "(from DASK_OTEL__TASK__COLOUR='blue')"]
    else:
        (tmp_path / "b.yaml").write_text("otel:\n  task:\n    max_links: -1\n    colour: blue\n")
        origin = [f"(from {tmp_path / 'b.yaml'})"] * 2
    code = "from dask_otel.config import load_settings\nload_settings()\n"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    error = out.stderr.strip().splitlines()[-1]
    assert f"otel.task.max-links must be an integer >= 0, got -1 {origin[0]}" in error, error
    assert f"otel.task.colour = 'blue' {origin[1]} is not a dask-otel setting" in error, error


def test_dask_otel_exports_config_error():
    from dask_otel import ConfigError as Exported

    assert Exported is ConfigError
