"""The post-mortem: what a worker that died was doing, and what it had not yet exported.

A worker supervised by a dask-otel Nanny keeps a flight recorder (:mod:`.flight_recorder`,
its records in :mod:`.rings`) in a directory its Nanny made (:mod:`.folders`, labelled by
:mod:`.labels`); when the worker process dies, its Nanny (:mod:`.examiner`) exports what
the worker had queued but not sent and says how it died and what it lost (:mod:`.deaths`).
The export queues copy their records to the recorder through
:mod:`dask_otel.export.recorder_copy`, which also sends a dead worker's records on.
"""
