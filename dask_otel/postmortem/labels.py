"""Whose flight recorders a Nanny may send: one cluster's telemetry never reaches another's
collector.

Two clusters on one machine (one user's) keep their Nannies' directories side by side. A
Nanny sends what a dead worker left unexported only if that worker's Nanny would have
sent it to the same place: the directory's label names the cluster (once its Nanny knows
the scheduler's id) and where the Nanny exports (its exporter settings, hashed). A
directory without a label, or with another cluster's and other settings, is left alone.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from dask_otel.environment import FILE_EXPORT_DIR
from dask_otel.postmortem import folders

#: The settings that say where a process's telemetry goes (and as whom): OTLP endpoints,
#: protocols, headers and certificates per signal, and the OTLP JSON file directory.
_DESTINATION_PREFIXES = ("OTEL_EXPORTER_OTLP_", FILE_EXPORT_DIR)


def destination() -> str:
    """This process's exporter settings, hashed (headers may hold credentials)."""
    settings = sorted(
        (name, value)
        for name, value in os.environ.items()
        if name.startswith(_DESTINATION_PREFIXES)
    )
    return hashlib.sha256(json.dumps(settings).encode()).hexdigest()


@dataclass(frozen=True)
class Label:
    """Whose a Nanny's directory is: its cluster (the scheduler's id, once known) and
    where it exports (:func:`destination`)."""

    destination: str
    cluster: str | None = None

    def adopts(self, other: Label | None) -> bool:
        """Whether the Nanny labelled so may send what a directory labelled ``other``
        holds: it exports to the same place, or is of the same cluster."""
        if other is None:
            return False
        same_cluster = self.cluster is not None and other.cluster == self.cluster
        return same_cluster or other.destination == self.destination


def write(folder: Path, label: Label) -> None:
    folders.write_new(folder / folders.LABEL, json.dumps(asdict(label)))


def read(folder: Path) -> Label | None:
    """The label of ``folder`` (None: none, foreign, or not one)."""
    text = folders.read_small(folder / folders.LABEL)
    try:
        fields = json.loads(text) if text is not None else None
        label = Label(**fields) if isinstance(fields, dict) else None
    except (ValueError, TypeError):
        return None
    if label is None or not isinstance(label.destination, str):
        return None
    return label if label.cluster is None or isinstance(label.cluster, str) else None
