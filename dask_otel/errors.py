"""What an ``exception`` span event says about a task's failure, computed safely.

Dask hands exceptions around pickled, with their repr and traceback as text. Turning
them into ``exception.*`` attributes must never raise: ``str()`` of a user exception can.
"""

from __future__ import annotations

import pickle
from typing import Any


def type_name(exc: BaseException) -> str:
    """``ValueError`` for builtins, ``package.module.MyError`` for everything else."""
    cls = type(exc)
    return (
        cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
    )


def safe_str(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:
        return f"<{type(exc).__name__}: str() failed>"


def describe(exception: Any, text: str | None) -> tuple[str, str]:
    """(``exception.type``, ``exception.message``) from what Dask recorded.

    ``exception`` may be the exception, its pickle (bytes), or a wrapper holding either
    in ``.data``; ``text`` is its repr. Only bytes the local process can unpickle are
    read (the worker's own failures, the scheduler's own ``KilledWorker``).
    """
    exception = getattr(exception, "data", exception)
    if isinstance(exception, bytes):
        try:
            exception = pickle.loads(exception)
        except Exception:
            exception = None
    if isinstance(exception, BaseException):
        return type_name(exception), safe_str(exception)
    if text:
        return text.split("(", 1)[0] or "Exception", text
    return "Exception", "unknown error"
