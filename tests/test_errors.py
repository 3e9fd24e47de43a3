"""dask_otel.errors: describing a failure never raises, whatever the exception does."""

from __future__ import annotations

import pickle

from distributed.scheduler import KilledWorker

from dask_otel.errors import describe, safe_str, type_name


class StrRaises(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no str for you")


class Holder:
    """Like distributed's Serialize: the payload sits in ``.data``."""

    def __init__(self, data: object) -> None:
        self.data = data


def test_type_names():
    assert type_name(ValueError("x")) == "ValueError"
    assert type_name(StrRaises()) == f"{__name__}.StrRaises"


def test_str_that_raises_is_described_not_raised():
    assert safe_str(StrRaises()) == "<StrRaises: str() failed>"
    assert describe(StrRaises(), None) == (f"{__name__}.StrRaises", "<StrRaises: str() failed>")


def test_pickled_exception_in_a_wrapper():
    assert describe(Holder(pickle.dumps(KeyError("k"))), "KeyError('k')") == ("KeyError", "'k'")
    data = pickle.dumps(KilledWorker(task="x", last_worker=None, allowed_failures=1))
    assert describe(data, None)[0] == "distributed.scheduler.KilledWorker"


def test_unreadable_pickle_falls_back_to_the_text():
    assert describe(b"not a pickle", "ZeroDivisionError('division by zero')") == (
        "ZeroDivisionError",
        "ZeroDivisionError('division by zero')",
    )


def test_nothing_known():
    assert describe(None, None) == ("Exception", "unknown error")
    assert describe(None, "") == ("Exception", "unknown error")
