"""The ``otel:`` section of Dask's config: defaults, and validation that names the bad key.

Defaults ship in ``otel.yaml`` and merge into ``dask.config`` on import, so the usual Dask
ways of setting config apply: YAML files, ``DASK_OTEL__TASK__MAX_LINKS=32`` environment
variables and ``dask.config.set({"otel.task.max-links": 32})``.
"""

from __future__ import annotations

import difflib
import logging
import os
import pathlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import dask.config
import yaml
from dask.utils import format_bytes, parse_bytes, parse_timedelta

#: Smallest flight recorder (``otel.nanny.flight-recorder``): room for its slots and
#: 64 kiB of rings.
FLIGHT_RECORDER_MIN_SIZE = 512 * 1024
#: Least ``otel.max-queue-memory`` but 0 (no bound in bytes): a few dozen spans.
QUEUE_MEMORY_MIN_SIZE = 64 * 1024
_DEFAULTS_PATH = pathlib.Path(__file__).with_name("otel.yaml")
with _DEFAULTS_PATH.open() as _f:
    #: dask-otel's defaults: also the list of the keys there are.
    DEFAULTS: dict[str, Any] = yaml.safe_load(_f)
dask.config.update_defaults(DEFAULTS)


class ConfigError(ValueError):
    """An ``otel.*`` config value that dask-otel cannot use."""


@dataclass(frozen=True)
class Settings:
    """Validated snapshot of the ``otel:`` config, taken once when a component starts."""

    enabled: bool
    max_attribute_length: int
    task_spans: bool
    transfer_spans: bool
    spill_spans: bool
    rpc_spans: bool
    metrics_enabled: bool
    rpc_always_record: frozenset[str]
    rpc_never_record: frozenset[str]
    redact_exception_messages: bool
    redact_log_bodies: bool
    max_task_links: int
    max_spans_per_graph: int
    task_sample_ratio: float
    keep_slower_than: float
    include_prefixes: frozenset[str]
    exclude_prefixes: frozenset[str]
    flush_timeout: float
    max_queue_memory: int
    logs_enabled: bool
    logs_level: int
    logs_loggers: tuple[str, ...]
    logs_exclude_event_topics: tuple[str, ...]
    flight_recorder_size: int
    memory_history: float
    death_log_lines: int


def _get(key: str) -> object:
    return dask.config.get(f"otel.{key}")


def _bad(key: str, requirement: str, value: object, hint: str = "") -> ConfigError:
    """The error for a value of ``otel.<key>`` that dask-otel cannot use, and where it
    was set."""
    return ConfigError(f"otel.{key} {requirement}, got {value!r}{_origin(f'otel.{key}')}{hint}")


def _bool(key: str) -> bool:
    value = _get(key)
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise _bad(key, "must be true or false", value)


def _count(key: str, minimum: int) -> int:
    value = _get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise _bad(key, f"must be an integer >= {minimum}", value)
    return value


def _ratio(key: str) -> float:
    value = _get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise _bad(key, "must be a number from 0 to 1", value)
    return float(value)


def _seconds(key: str) -> float:
    value = _get(key)
    try:
        seconds = parse_timedelta(value, default="seconds")
    except Exception as e:  # parse_timedelta raises many types for bad input
        raise _bad(key, "must be a duration such as '5s' or 2.5", value) from e
    if seconds is None or seconds < 0:
        raise _bad(key, "must be a non-negative duration", value)
    return seconds


def _bytes(key: str, minimum: int) -> int:
    """A size such as ``4MiB`` (bytes), at least ``minimum``; 0 (or false) for none."""
    value = _get(key)
    if value is False or value == 0:
        return 0
    try:
        size = parse_bytes(value) if isinstance(value, str) else value
    except ValueError as e:
        raise _bad(key, "must be a size such as '4MiB', or 0", value) from e
    if size == 0:
        return 0
    if isinstance(size, bool) or not isinstance(size, int) or size < minimum:
        raise _bad(key, f"must be 0 or a size of at least {format_bytes(minimum)}", value)
    return size


def _level(key: str) -> int:
    value = _get(key)
    level = logging.getLevelName(str(value).upper()) if isinstance(value, str) else value
    if isinstance(level, bool) or not isinstance(level, int):
        raise _bad(key, "must be a logging level such as INFO or WARNING", value)
    return level


def _names(key: str) -> tuple[str, ...]:
    value = _get(key)
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise _bad(key, "must be a list of names", value)
    return tuple(value)


def _canonical(key: object) -> str:
    """Dask treats ``_`` and ``-`` in keys alike (``max_links`` is ``max-links``)."""
    return str(key).replace("_", "-")


def _leaves(tree: dict[str, Any], prefix: str) -> Iterator[str]:
    for key, value in tree.items():
        name = f"{prefix}.{key}"
        yield from _leaves(value, name) if isinstance(value, dict) else [name]


#: Every dask-otel setting, dotted (``otel.task.max-links``).
KEYS = tuple(_leaves(DEFAULTS["otel"], "otel"))


def _origin(key: str) -> str:
    """Where a key was set: its environment variable, else the last of Dask's YAML files
    that sets it (Dask's order: later ones win); nothing when code set it."""
    variable = "DASK_" + key.upper().replace(".", "__").replace("-", "_")
    value = os.environ.get(variable)
    if value is not None:
        return f" (from {variable}={value})"
    files = [path for path, tree in _config_files() if _sets(tree, key.split("."))]
    return f" (from {files[-1]})" if files else ""


def _config_files() -> Iterator[tuple[pathlib.Path, dict[str, Any]]]:
    """Dask's YAML config files and what each holds; none if they cannot be read again."""
    try:
        yield from dask.config.collect_yaml(dask.config.paths, return_paths=True)
    except Exception:  # a file that changed since Dask read it names no origin
        return


def _sets(tree: object, parts: list[str]) -> bool:
    """Whether the nested mapping ``tree`` has the key ``parts`` (``_`` and ``-`` alike)."""
    for part in parts:
        if not isinstance(tree, dict):
            return False
        found = {_canonical(k): v for k, v in tree.items()}
        if _canonical(part) not in found:
            return False
        tree = found[_canonical(part)]
    return True


def _unknown(key: str, value: object, section: dict[str, Any]) -> str:
    """The message for a key dask-otel does not have, with the closest one it does, or
    else the names its ``section`` has."""
    # Compared without the common "otel." that would make every key look alike.
    close = difflib.get_close_matches(_canonical(key)[5:], [k[5:] for k in KEYS], n=1)
    hint = (
        f"did you mean otel.{close[0]}?" if close else "the names there are " + ", ".join(section)
    )
    return f"{key} = {value!r}{_origin(key)} is not a dask-otel setting ({hint})"


def _unknown_keys(config: object, defaults: dict[str, Any], path: str) -> Iterator[str]:
    """A message per key under ``path`` that has no default, and per section that is
    not a mapping."""
    if not isinstance(config, dict):
        names = ", ".join(defaults)
        yield f"{path} must be a section of settings ({names}), got {config!r}{_origin(path)}"
        return
    sections = {_canonical(key): value for key, value in defaults.items()}
    for key, value in config.items():
        name = f"{path}.{key}"
        default = sections.get(_canonical(key), _MISSING)
        if default is _MISSING:
            yield _unknown(name, value, defaults)
        elif isinstance(default, dict):
            yield from _unknown_keys(value, default, f"{path}.{_canonical(key)}")


_MISSING = object()

#: How each field of :class:`Settings` is read from its key.
_READERS: dict[str, Callable[[], object]] = {
    "enabled": lambda: _bool("enabled"),
    "max_attribute_length": lambda: _count("max-attribute-length", 16),
    "task_spans": lambda: _bool("spans.tasks"),
    "transfer_spans": lambda: _bool("spans.transfers"),
    "spill_spans": lambda: _bool("spans.spill"),
    "rpc_spans": lambda: _bool("spans.rpc"),
    "metrics_enabled": lambda: _bool("metrics.enabled"),
    "rpc_always_record": lambda: frozenset(_names("rpc.always-record")),
    "rpc_never_record": lambda: frozenset(_names("rpc.never-record")),
    "redact_exception_messages": lambda: _bool("redact.exception-messages"),
    "redact_log_bodies": lambda: _bool("redact.log-bodies"),
    "max_task_links": lambda: _count("task.max-links", 0),
    "max_spans_per_graph": lambda: _count("task.max-spans-per-graph", 0),
    "task_sample_ratio": lambda: _ratio("task.sample-ratio"),
    "keep_slower_than": lambda: _seconds("task.keep-slower-than"),
    "include_prefixes": lambda: frozenset(_names("task.include-prefixes")),
    "exclude_prefixes": lambda: frozenset(_names("task.exclude-prefixes")),
    "flush_timeout": lambda: _seconds("flush-timeout"),
    "max_queue_memory": lambda: _bytes("max-queue-memory", QUEUE_MEMORY_MIN_SIZE),
    "logs_enabled": lambda: _bool("logs.enabled"),
    "logs_level": lambda: _level("logs.level"),
    "logs_loggers": lambda: _names("logs.loggers"),
    "logs_exclude_event_topics": lambda: _names("logs.exclude-event-topics"),
    "flight_recorder_size": lambda: _bytes("nanny.flight-recorder", FLIGHT_RECORDER_MIN_SIZE),
    "memory_history": lambda: _seconds("nanny.memory-history"),
    "death_log_lines": lambda: _count("nanny.log-lines", 0),
}


def load_settings() -> Settings:
    """Read and validate the current ``otel:`` config; raises :class:`ConfigError` naming
    every problem: keys dask-otel does not have (with the closest one it does) and values
    it cannot use (with what is allowed)."""
    problems = list(_unknown_keys(dask.config.get("otel", {}), DEFAULTS["otel"], "otel"))
    values = {}
    for name, read in _READERS.items():
        try:
            values[name] = read()
        except ConfigError as e:
            problems.append(str(e))
        except (KeyError, TypeError, AttributeError):  # below a section that is not one
            continue
    if problems:
        raise ConfigError("; ".join(problems))
    return Settings(**values)  # type: ignore[arg-type]
