# dask-otel with Dask, for the local observability stack (docker-compose.yml): the
# scheduler, the workers and the demo client all run from this image.
FROM python:3.11.15-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    DASK_TEMPORARY_DIRECTORY=/tmp

WORKDIR /app

# The package with its runtime dependencies only (no test extra), the OpenTelemetry set CI
# tests (.ci/constraints.txt), NumPy for the demo's dask.array workload and Bokeh for Dask's
# dashboard on :8787.
COPY pyproject.toml README.md ./
COPY .ci/constraints.txt .ci/constraints.txt
COPY dask_otel ./dask_otel
RUN pip install -c .ci/constraints.txt . "numpy>=1.26" "bokeh>=3.1"

COPY examples ./examples

# Never run the cluster as root.
RUN useradd --create-home --uid 10001 dask
USER dask

# Scheduler, dashboard; workers pick their own ports.
EXPOSE 8786 8787

CMD ["opentelemetry-instrument", "dask-scheduler"]
