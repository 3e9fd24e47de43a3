"""The real-backend tests share one recording (recording.py), made once per session."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator

import pytest
from recording import Recording, record


@pytest.fixture(scope="session")
def recording(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Recording]:
    if os.geteuid() != 0:
        pytest.fail("the backends tests make network namespaces: run them as root")
    for tool in ("go", "ip", "unshare"):
        if shutil.which(tool) is None:
            pytest.fail(f"the backends tests need {tool!r} on PATH")
    with record(tmp_path_factory.mktemp("backends")) as made:
        yield made
