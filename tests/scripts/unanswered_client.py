"""A traced client that submits a task and waits for dask-otel to say, on stderr, that
its submissions get no graph span back; then submits another.

Usage: opentelemetry-instrument python unanswered_client.py SCHEDULER_ADDRESS SECONDS

Prints a JSON line: the lines dask-otel wrote on stderr.
"""

from __future__ import annotations

import io
import json
import sys
import time

from distributed import Client


def inc(x: int) -> int:
    return x + 1


class Tee(io.TextIOBase):
    """stderr, and a copy of what was written to it."""

    def __init__(self, stream: io.TextIOBase) -> None:
        self.stream = stream
        self.written: list[str] = []

    def write(self, text: str) -> int:
        self.written.append(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()


def main() -> None:
    tee = sys.stderr = Tee(sys.stderr)
    with Client(sys.argv[1], timeout=30) as client:
        client.wait_for_workers(1, timeout=60)
        assert client.submit(inc, 1).result() == 2
        deadline = time.monotonic() + float(sys.argv[2])
        while "graph span" not in "".join(tee.written) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert client.submit(inc, 2).result() == 3  # said once, not again
        time.sleep(1)
    said = [line for line in "".join(tee.written).splitlines() if line.startswith("dask-otel:")]
    print(json.dumps(said))


if __name__ == "__main__":
    main()
