"""Attribute values as OTLP carries them: a subclass of ``str``, ``int``, ``float`` or
``bytes`` (an IntEnum member, a NumPy float, a ``str`` subclass) goes out as its base
class's value, from every encoder and from the flight recorder alike."""

from __future__ import annotations

from typing import Any

#: What a subclass of is sent as its base class's value.
SUBCLASSED = (str, int, float, bytes)


def base_value(value: Any) -> Any:
    """A subclass's value as its base class's, which is what the encoders send; any
    other value (a bool included) as it is."""
    if value.__class__ is bool:
        return value
    for base in SUBCLASSED:
        if isinstance(value, base):
            return base.__str__(value) if base is str else base(value)
    return value
