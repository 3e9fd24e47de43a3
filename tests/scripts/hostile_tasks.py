"""Tasks of tests/test_e2e_hostile.py (importable by its worker processes)."""

from __future__ import annotations

import logging

from opentelemetry import trace

#: What ``os.fsdecode(b"/data/caf\xe9.csv")`` gives.
FILE = "/data/caf\udce9.csv"
MEGABYTE = "m" * (1 << 20)


def inc(x: int) -> int:
    return x + 1


def parse(path: str) -> None:
    raise ValueError(f"cannot parse {path}")


def log(i: int, path: str | None = None) -> int:
    if path is None:
        logging.getLogger("user.task").warning("neighbour %d", i)
    else:
        logging.getLogger("user.task").warning("reading %s", path)
    return i


def mark(path: str) -> int:
    """The task's own span and a span of the user's, hostile in every field."""
    trace.get_current_span().set_attribute("user.file", path)
    tracer = trace.get_tracer("user.task")
    with tracer.start_as_current_span(f"open {path}", attributes={"file": path}) as span:
        span.add_event(f"read {path}", {"file": path})
        span.set_attribute("big", MEGABYTE)
    return 1
