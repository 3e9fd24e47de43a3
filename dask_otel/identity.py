"""Which cluster, worker and Nanny this process hosts: the ``dask.*`` attributes that
name it on its log records and ``rpc`` spans (filled by the plugins as they start and
stop; a process that hosts several of one kind names none)."""

from __future__ import annotations

from collections import Counter

from dask_otel import runtime
from dask_otel.runtime_state import ProcessState


class Hosted(ProcessState):
    """The schedulers, workers and Nannies running in this process, and the attributes
    that name them."""

    def __init__(self) -> None:
        #: The attributes that name this process (read, never changed, by the others).
        self.attributes: dict[str, str] = {}
        #: Workers running in this process.
        self._workers: set[str] = set()
        #: Nannies running in this process, with the worker each supervises.
        self._nannies: dict[str, str | None] = {}
        #: Schedulers and workers running in this process, by cluster id.
        self._clusters: Counter[str] = Counter()

    def add_cluster(self, cluster_id: str) -> None:
        """A scheduler or worker of cluster ``cluster_id`` runs in this process."""
        self._clusters[cluster_id] += 1
        self._name_cluster()

    def remove_cluster(self, cluster_id: str) -> None:
        """It closed: a process outliving its cluster (a client that closed its
        ``LocalCluster``) no longer names it."""
        self._clusters[cluster_id] -= 1
        if self._clusters[cluster_id] <= 0:
            del self._clusters[cluster_id]
        self._name_cluster()

    def clusters(self) -> dict[str, int]:
        """The clusters whose schedulers and workers run in this process, with how many."""
        return dict(self._clusters)

    def add_worker(self, address: str) -> None:
        """Name the worker on this process's records (unless several share the process)."""
        self._workers.add(address)
        self._name_worker()

    def remove_worker(self, address: str) -> None:
        self._workers.discard(address)
        self._name_worker()

    def add_nanny(self, address: str, worker: str | None) -> None:
        """Name the Nanny and the worker it supervises on this process's records (a
        Nanny's records are about its worker), unless several share the process."""
        self._nannies[address] = worker
        self._name_worker()

    def remove_nanny(self, address: str) -> None:
        self._nannies.pop(address, None)
        self._name_worker()

    def forget_parent(self) -> None:
        """A forked child hosts none of its parent's schedulers, workers and Nannies."""
        self._clusters.clear()
        self._workers.clear()
        self._nannies.clear()
        self._name_cluster()
        self._name_worker()

    def _name_cluster(self) -> None:
        if len(self._clusters) == 1:
            self.attributes["dask.cluster.id"] = next(iter(self._clusters))
        else:  # none, or several in one process: records cannot say which
            self.attributes.pop("dask.cluster.id", None)

    def _name_worker(self) -> None:
        self._name("dask.worker.address", self._workers or {w for w in self._nannies.values() if w})
        self._name("dask.nanny.address", set(self._nannies))

    def _name(self, attribute: str, values: set[str]) -> None:
        if len(values) == 1:
            self.attributes[attribute] = next(iter(values))
        else:
            self.attributes.pop(attribute, None)


#: The one per process.
hosted = runtime.own(Hosted())
