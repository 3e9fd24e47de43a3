"""Which cluster, worker and Nanny this process hosts: the ``dask.*`` attributes that
name it on its log records and ``rpc`` spans (filled by the plugins as they start and
stop; a process that hosts several of one kind names none)."""

from __future__ import annotations

from collections import Counter

from dask_otel import runtime

#: The attributes that name this process (read, never changed, by the others).
attributes: dict[str, str] = {}
_workers: set[str] = set()
#: Nannies running in this process, with the worker each supervises.
_nannies: dict[str, str | None] = {}
#: Schedulers and workers running in this process, by cluster id.
_clusters: Counter[str] = Counter()


def add_cluster(cluster_id: str) -> None:
    """A scheduler or worker of cluster ``cluster_id`` runs in this process."""
    _clusters[cluster_id] += 1
    _name_cluster()


def remove_cluster(cluster_id: str) -> None:
    """It closed: a process outliving its cluster (a client that closed its
    ``LocalCluster``) no longer names it."""
    _clusters[cluster_id] -= 1
    if _clusters[cluster_id] <= 0:
        del _clusters[cluster_id]
    _name_cluster()


def clusters() -> dict[str, int]:
    """The clusters whose schedulers and workers run in this process, with how many."""
    return dict(_clusters)


def _after_fork_in_child() -> None:
    """A forked child hosts none of its parent's schedulers and workers."""
    _clusters.clear()
    _workers.clear()
    _nannies.clear()
    _name_cluster()
    _name_worker()


runtime.forget_in_child(_after_fork_in_child)


def _name_cluster() -> None:
    if len(_clusters) == 1:
        attributes["dask.cluster.id"] = next(iter(_clusters))
    else:  # none, or several in one process: records cannot say which
        attributes.pop("dask.cluster.id", None)


def add_worker(address: str) -> None:
    """Name the worker on this process's records (unless several share the process)."""
    _workers.add(address)
    _name_worker()


def remove_worker(address: str) -> None:
    _workers.discard(address)
    _name_worker()


def add_nanny(address: str, worker: str | None) -> None:
    """Name the Nanny and the worker it supervises on this process's records (a Nanny's
    records are about its worker), unless several share the process."""
    _nannies[address] = worker
    _name_worker()


def remove_nanny(address: str) -> None:
    _nannies.pop(address, None)
    _name_worker()


def _name_worker() -> None:
    _name("dask.worker.address", _workers or {w for w in _nannies.values() if w})
    _name("dask.nanny.address", set(_nannies))


def _name(attribute: str, values: set[str]) -> None:
    if len(values) == 1:
        attributes[attribute] = next(iter(values))
    else:
        attributes.pop(attribute, None)
