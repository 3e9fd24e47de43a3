"""The names of the collections a user computes, taken before Dask optimizes them.

``compute`` and ``persist`` (Dask's and the client's) lower a collection's expression
before they submit it: what reaches ``Client._graph_to_futures`` is named after Dask's
internals (``call_with_list_arg`` for a grouped sum over many partitions, ``p2pshuffle``),
not after the user's last operation (``sum``). While one of them runs, the names of the
collections it was given are current here, for the ``compute`` span of its submission; a
computation Dask makes on the way (a ``set_index``'s divisions, through ``dask.compute``)
has its own names for its own submission.
"""

from __future__ import annotations

import contextvars
from collections.abc import Hashable, Iterator
from typing import Any

import dask
import dask.base
import distributed
from dask.core import flatten
from dask.utils import key_split
from wrapt import wrap_function_wrapper

from dask_otel.spans import naming

#: The collections' names while a ``compute`` or ``persist`` call runs in this context.
_current: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar(
    "dask_otel_collection_names", default=None
)

#: (owner, attribute) of every entry point: ``dask.compute`` is ``dask.base.compute``
#: bound in another module (collections' ``.compute()`` call the latter).
ENTRY_POINTS = (
    (dask, "compute"),
    (dask, "persist"),
    (dask.base, "compute"),
    (dask.base, "persist"),
    (distributed.Client, "compute"),
    (distributed.Client, "persist"),
)


def current() -> list[str] | None:
    """The operations of the collections being computed here, or None."""
    return _current.get()


def install() -> None:
    for owner, attribute in ENTRY_POINTS:
        wrap_function_wrapper(owner, attribute, _named)


def uninstall() -> None:
    for owner, attribute in ENTRY_POINTS:
        patched = vars(owner).get(attribute)
        if hasattr(patched, "__wrapped__"):
            setattr(owner, attribute, patched.__wrapped__)


def _named(wrapped: Any, instance: Any, args: Any, kwargs: Any) -> Any:
    """wrapt wrapper: the call, with the names of the collections it was given current."""
    try:
        names = [naming.operation(key_split(_name_of(c))) for c in _collections(args)]
    except Exception:  # a name is a nicety: the computation goes ahead without it
        names = []
    token = _current.set(names or None)
    try:
        return wrapped(*args, **kwargs)
    finally:
        _current.reset(token)


def _collections(args: Any) -> Iterator[Any]:
    """The Dask collections among the positional arguments, and in a list or tuple of
    them (``client.compute([a, b])``)."""
    for arg in args:
        for item in arg if isinstance(arg, (list, tuple)) else [arg]:
            if dask.is_dask_collection(item):
                yield item


def _name_of(collection: Any) -> Hashable:
    """A collection's output name, read without building its keys (a DataFrame's may need
    its divisions computed): ``_name`` of DataFrame expressions, ``name`` of arrays and
    bags, ``key`` of delayed objects."""
    for attribute in ("_name", "name", "key"):
        try:
            value = getattr(collection, attribute, None)
        except Exception:
            continue
        if isinstance(value, (str, tuple)):
            return value
    return next(iter(flatten(collection.__dask_keys__())))
