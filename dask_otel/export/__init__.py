"""dask-otel's export path: how a span or log record gets from the SDK to the wire.

Its face is small: :func:`processors.span_processor` (the batch span processor dask-otel
configures, for users who configure the SDK themselves too), the configurator's processors
(:func:`processors.counting_processors`) and :func:`span_writer.span_writer` (spans written
without ``start_span``). Behind it, private to this package: a queued span as one tuple
(:mod:`.queued_spans`), bounded export queues (:mod:`.queues`), OTLP/gRPC encoding straight
from those tuples (:mod:`.otlp_encoding`), checks before a batch leaves (:mod:`.sanitize`),
losses counted (:mod:`.drops`), a worker's queues copied for its Nanny
(:mod:`.recorder_copy`), exports given up at exit (:mod:`.abandon`) and metric readers that
tick only while wanted (:mod:`.metric_readers`). Where the SDK lacks a private name this
relies on (:mod:`.sdk_names`), the SDK's own processors and exporters do the work.
"""
