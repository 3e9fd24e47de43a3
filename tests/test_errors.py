"""dask_otel.spans.errors: describing a failure never raises, never loads a pickle, keeps no
exception."""

from __future__ import annotations

import gc
import pickle
import traceback
import weakref

from distributed.protocol.serialize import Serialized, serialize
from distributed.scheduler import KilledWorker

from dask_otel.spans import errors
from dask_otel.spans.errors import describe
from dask_otel.strings import safe_str, type_name


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
    """The type from the repr, and the message it holds: not ``ZeroDivisionError:
    ZeroDivisionError('division by zero')`` on the span's status."""
    assert describe(b"not a pickle", "ZeroDivisionError('division by zero')") == (
        "ZeroDivisionError",
        "division by zero",
    )
    assert describe(b"not a pickle", "Odd(<object>)") == ("Odd", "Odd(<object>)")


def test_an_exception_as_the_scheduler_holds_it():
    """A worker's exception reaches the scheduler as Dask's ``Serialized``, unread."""
    header, frames = serialize(MyError("boom on 7"), serializers=("pickle",))
    assert describe(Serialized(header, frames), "MyError('boom on 7')") == (
        f"{__name__}.MyError",
        "boom on 7",
    )


class MyError(RuntimeError):
    pass


def test_nothing_known():
    assert describe(None, None) == ("Exception", "unknown error")
    assert describe(None, "") == ("Exception", "unknown error")


#: What unpickling ``Sneaky`` would have run.
ran: list[str] = []


def _ran(what: str) -> str:
    ran.append(what)
    return what


class Sneaky(Exception):
    """Unpickling it runs code (as a user's ``__reduce__`` or ``__setstate__`` may)."""

    def __setstate__(self, state: dict) -> None:
        _ran("unpickled")


def test_a_pickled_exception_is_never_loaded():
    """Only the class a pickle names is read: loading it would run the user's code and
    make copies of what the exception holds (distributed's test_worker_descopes_data)."""
    e = Sneaky("x")
    e.note = "state"  # pickled as state: loading calls __setstate__
    data = pickle.dumps(e)
    pickle.loads(data)
    assert ran == ["unpickled"]
    ran.clear()
    assert describe(data, "Sneaky('x')") == (f"{__name__}.Sneaky", "x")
    assert not ran
    # A pickle that names something else than the repr's type first: the repr's type.
    assert describe(pickle.dumps(_ran), "Sneaky('x')") == ("Sneaky", "x")
    assert not ran


def test_the_message_is_str_of_the_exception_when_its_repr_says_it():
    def pickled(e: BaseException) -> bytes:
        return error_message_of(e)["exception"].data

    assert describe(pickled(ValueError("boom 1")), "ValueError('boom 1')") == (
        "ValueError",
        "boom 1",
    )
    assert describe(pickled(KeyError("k")), "KeyError('k')") == ("KeyError", "'k'")
    assert describe(pickled(Exception("x", 1)), "Exception('x', 1)") == ("Exception", "('x', 1)")
    assert describe(pickled(ValueError()), "ValueError()") == ("ValueError", "")
    # Not literals: the repr is the message.
    text = "ValueError(<object object at 0x7f>)"
    assert describe(pickled(ValueError(object())), text) == ("ValueError", text)


def error_message_of(e: BaseException) -> dict:
    """Dask's own account of ``e`` raised (pickled with its traceback, by tblib)."""
    from distributed.core import error_message

    try:
        raise e
    except BaseException as raised:
        return error_message(raised)


def test_a_failure_is_text_only():
    """A :class:`Failure` keeps no exception, traceback or frame: the frames' locals (a
    task's data) would live as long as it waits for the emitter."""

    class Data:
        pass

    def fail(data: Data) -> None:
        raise ValueError("bad data")

    data = Data()
    alive = weakref.ref(data)
    try:
        fail(data)
    except ValueError as e:
        failure = errors.failure(e)
    del data
    gc.collect()
    assert alive() is None
    assert failure.type == "ValueError" and failure.message == "bad data"
    assert all(isinstance(part, (str, traceback.StackSummary)) for part in failure)
    assert "in fail" in "".join(failure.stack.format())
