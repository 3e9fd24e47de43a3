"""Environment variables of dask-otel's own, read before Dask is imported (or where it
never is): nothing here imports Dask or the SDK."""

#: The directory of the ``otlp_json_file`` exporters' files (``dask-otel demo`` sets it).
FILE_EXPORT_DIR = "DASK_OTEL_FILE_EXPORT_DIR"
