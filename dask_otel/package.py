"""The `distributed` versions this instrumentation supports (read by `opentelemetry-instrument`)."""

_instruments = ("distributed >= 2025.9.0",)
