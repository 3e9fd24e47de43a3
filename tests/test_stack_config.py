"""Static checks of the collector pipeline and the local observability stack.

No Docker engine runs these: they parse collector-config.yaml, docker-compose.yml, the
Dockerfile and deploy/ (Grafana provisioning and dashboard, Prometheus, Tempo, Loki) and
check that the pieces fit together. The dashboard's metric names are derived from
``dask_otel.signals.instruments.INSTRUMENTS`` with Prometheus' OTLP translation, so they
cannot drift from the code.

Every check is a function ``check_*(root) -> list[str]`` of problems, run on the
repository; ``test_check_catches`` runs each one again on a broken copy of the stack, to
show it can fail.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from dask_otel.signals.instruments import INSTRUMENTS, Instrument

ROOT = Path(__file__).resolve().parents[1]

#: The collector release collector-config.yaml is written for; COMPONENT_TYPES below lists
#: component names valid in it. Bumping the image means re-checking those names.
COLLECTOR_IMAGE = "otel/opentelemetry-collector-contrib"
COLLECTOR_VERSION = "0.162.0"

#: Component types this config may use, as named in collector-contrib 0.162.0.
COMPONENT_TYPES = {
    "receivers": {"otlp"},
    "processors": {
        "memory_limiter",
        "resource",
        "attributes",
        "transform",
        "filter",
        "tail_sampling",
        "batch",
    },
    "exporters": {"otlp_grpc", "otlp_http", "debug", "load_balancing"},
    "connectors": {"span_metrics", "service_graph", "forward", "routing"},
    "extensions": {"health_check", "zpages", "pprof"},
}

#: Old names: removed components, or deprecated aliases of renamed ones.
RENAMED = {
    ("exporters", "otlp"): "otlp_grpc",
    ("exporters", "otlphttp"): "otlp_http",
    ("exporters", "logging"): "debug (logging was removed)",
    ("exporters", "jaeger"): "otlp_grpc to Jaeger (the jaeger exporter was removed)",
    ("exporters", "loki"): "otlp_http to Loki's /otlp (the loki exporter was removed)",
    ("exporters", "loadbalancing"): "load_balancing",
    ("connectors", "spanmetrics"): "span_metrics",
    ("connectors", "servicegraph"): "service_graph",
}

#: Services whose image has no shell or HTTP client to run a Docker healthcheck with.
NO_HEALTHCHECK = {"collector": COLLECTOR_IMAGE}

#: Dashboard rows, and instruments each must show (a rename in code fails here).
DASHBOARD_SECTIONS = {
    "Cluster overview": ["dask.scheduler.workers", "dask.scheduler.tasks"],
    "Task throughput and durations": ["dask.task.finished", "dask.task.duration"],
    "Memory and spilling": ["dask.worker.memory", "dask.worker.spill.size"],
    "Transfers": ["dask.worker.transfer.size", "dask.worker.transfer.count"],
    "Errors": ["dask.task.finished", "dask.task.duration"],
}

#: Attributes on points besides each instrument's own (see the INSTRUMENTS comment).
COMMON_ATTRIBUTES = ("dask.cluster.id", "dask.worker.address", "dask.worker.name")

CheckResult = list[str]


# -- helpers ------------------------------------------------------------------------------


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


#: Merged over collector-config.yaml by docker-compose.yml (a second ``--config``).
COLLECTOR_OVERLAY = "deploy/collector/service-graph.yaml"


def merged(base: Any, overlay: Any) -> Any:
    """Two collector configs as the collector merges them: maps key by key, anything else
    (lists included) replaced by the overlay's."""
    if isinstance(base, dict) and isinstance(overlay, dict):
        return {k: merged(base[k], v) if k in base else v for k, v in overlay.items()} | {
            k: v for k, v in base.items() if k not in overlay
        }
    return overlay


def collector(root: Path) -> dict[str, Any]:
    """The collector's configuration as compose runs it: the file and the overlay."""
    return merged(load_yaml(root / "collector-config.yaml"), load_yaml(root / COLLECTOR_OVERLAY))


def compose(root: Path) -> dict[str, Any]:
    return load_yaml(root / "docker-compose.yml")


def datasources(root: Path) -> list[dict[str, Any]]:
    path = root / "deploy/grafana/provisioning/datasources/datasources.yaml"
    return load_yaml(path)["datasources"]


def dashboard(root: Path) -> dict[str, Any]:
    return json.loads((root / "deploy/grafana/dashboards/dask.json").read_text())


def pipelines(cfg: dict[str, Any]) -> dict[str, dict[str, list[str]]]:
    return cfg["service"]["pipelines"]


def component_type(component_id: str) -> str:
    return component_id.split("/", 1)[0]


def command_words(service: dict[str, Any]) -> list[str]:
    command = service.get("command", [])
    return command.split() if isinstance(command, str) else [str(w) for w in command]


def hostname(endpoint: str) -> str:
    """``http://prometheus:9090/api`` or ``jaeger:4317`` -> the host name; an endpoint
    from ``${env:NAME:-default}`` is its default (compose sets none of those variables)."""
    default = re.fullmatch(r"\$\{env:\w+:-(.*)\}", endpoint)
    if default:
        endpoint = default[1]
    without_scheme = endpoint.split("://", 1)[-1]
    return re.split(r"[:/]", without_scheme, maxsplit=1)[0]


def walk(node: Any) -> Iterator[tuple[str, Any]]:
    """Every (key, value) pair in a nested structure of dicts and lists."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield key, value
            yield from walk(value)
    elif isinstance(node, list):
        for item in node:
            yield from walk(item)


def prometheus_label(attribute: str) -> str:
    """An attribute as Prometheus' OTLP receiver names the label: dots become ``_``."""
    return re.sub(r"[^a-zA-Z0-9_]", "_", attribute)


def prometheus_names(name: str, instrument: Instrument) -> set[str]:
    """The series names Prometheus (OTLP receiver, UnderscoreEscapingWithSuffixes) stores.

    As prometheus/otlptranslator does it: the name is split into tokens on characters
    other than ``[a-zA-Z0-9:]``; the unit's Prometheus word (``s`` -> ``seconds``, ``By``
    -> ``bytes``; units in braces add nothing) is appended unless it is a token already;
    monotonic counters end in ``_total``; histograms are stored as ``_bucket``, ``_sum``
    and ``_count`` series.
    """
    units = {"s": "seconds", "ms": "milliseconds", "By": "bytes", "1": "", "%": "percent"}
    tokens = [t for t in re.split(r"[^a-zA-Z0-9:]+", name) if t]
    unit = instrument.unit.split("/", 1)[0].strip()
    if unit and not re.search(r"[{}]", unit):
        word = units.get(unit, unit)
        if word and word not in tokens:
            tokens.append(word)
    if instrument.kind == "counter":
        tokens = [t for t in tokens if t != "total"] + ["total"]
    if instrument.unit == "1" and instrument.kind == "gauge":
        tokens = [t for t in tokens if t != "ratio"] + ["ratio"]
    base = "_".join(tokens)
    if instrument.kind == "histogram":
        return {f"{base}_bucket", f"{base}_sum", f"{base}_count"}
    return {base}


def series_catalog() -> dict[str, str]:
    """Prometheus series name -> the instrument it comes from."""
    return {
        series: name
        for name, instrument in INSTRUMENTS.items()
        for series in prometheus_names(name, instrument)
    }


PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool"}
PROMQL_WORDS |= {"and", "or", "unless", "offset", "inf", "nan", "Inf", "NaN"}


def promql_selectors(expr: str) -> list[tuple[str, list[str]]]:
    """(metric name, label names in its matchers) of every series selector in ``expr``."""
    expr = re.sub(r"\$__\w+", "5m", expr)
    strings_blanked = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    grouping = r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)"
    text = re.sub(grouping, " ", strings_blanked)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    found = []
    for match in re.finditer(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(\{[^}]*\})?\s*(\()?", text):
        name, matchers, call = match.groups()
        if call or name in PROMQL_WORDS or re.fullmatch(r"\d.*", name):
            continue
        labels = re.findall(r"([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)", matchers or "")
        found.append((name, labels))
    return found


def promql_labels(expr: str) -> set[str]:
    """Label names in matchers and in by/without/on/ignoring clauses."""
    labels = {label for _, names in promql_selectors(expr) for label in names}
    for clause in re.findall(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)", expr):
        labels |= {part.strip() for part in clause.split(",") if part.strip()}
    return labels


def dashboard_queries(board: dict[str, Any]) -> Iterator[tuple[str, str, str]]:
    """(where, datasource uid, PromQL or LogQL) of every panel target and variable."""
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            uid = (target.get("datasource") or panel.get("datasource") or {}).get("uid")
            yield f"panel {panel['title']!r}", uid, target["expr"]
    for variable in board.get("templating", {}).get("list", []):
        query = variable.get("query")
        text = query.get("query") if isinstance(query, dict) else query
        if text:
            yield f"variable {variable['name']!r}", variable["datasource"]["uid"], text


def label_values_parts(query: str) -> tuple[str, str] | None:
    """Grafana's ``label_values(selector, label)`` -> (selector, label)."""
    match = re.fullmatch(r"\s*label_values\((.*),\s*([a-zA-Z_]\w*)\s*\)\s*", query)
    return (match.group(1), match.group(2)) if match else None


# -- checks: collector --------------------------------------------------------------------


def check_components_defined(root: Path) -> CheckResult:
    cfg = collector(root)
    problems = []
    connectors = set(cfg.get("connectors") or {})
    for pipeline_id, pipeline in pipelines(cfg).items():
        for role in ("receivers", "processors", "exporters"):
            defined = set(cfg.get(role) or {})
            if role != "processors":
                defined |= connectors
            for component in pipeline.get(role, []):
                if component not in defined:
                    problems.append(f"pipeline {pipeline_id}: {role[:-1]} {component} undefined")
        if not pipeline.get("receivers") or not pipeline.get("exporters"):
            problems.append(f"pipeline {pipeline_id} lacks receivers or exporters")
    for extension in cfg["service"].get("extensions", []):
        if extension not in (cfg.get("extensions") or {}):
            problems.append(f"extension {extension} undefined")
    return problems


def check_components_used(root: Path) -> CheckResult:
    """Defined but unused components are silently ignored by the collector: flag them."""
    cfg = collector(root)
    used = {
        (role, component)
        for pipeline in pipelines(cfg).values()
        for role in ("receivers", "processors", "exporters")
        for component in pipeline.get(role, [])
    }
    problems = []
    for role in ("receivers", "processors", "exporters"):
        for component in cfg.get(role) or {}:
            if (role, component) not in used:
                problems.append(f"{role[:-1]} {component} is in no pipeline")
    for extension in cfg.get("extensions") or {}:
        if extension not in cfg["service"].get("extensions", []):
            problems.append(f"extension {extension} is not enabled in service.extensions")
    return problems


def check_connectors_both_sides(root: Path) -> CheckResult:
    cfg = collector(root)
    problems = []
    all_pipelines = pipelines(cfg).values()
    for connector in cfg.get("connectors") or {}:
        if not any(connector in p.get("exporters", []) for p in all_pipelines):
            problems.append(f"connector {connector} is no pipeline's exporter")
        if not any(connector in p.get("receivers", []) for p in all_pipelines):
            problems.append(f"connector {connector} is no pipeline's receiver")
    return problems


def check_component_names_current(root: Path) -> CheckResult:
    cfg = collector(root)
    problems = []
    for role, known in COMPONENT_TYPES.items():
        for component in cfg.get(role) or {}:
            kind = component_type(component)
            if (role, kind) in RENAMED:
                problems.append(f"{role[:-1]} {component}: use {RENAMED[role, kind]}")
            elif kind not in known:
                problems.append(f"{role[:-1]} {component}: {kind!r} not checked for the release")
    image = compose(root)["services"]["collector"]["image"]
    if image != f"{COLLECTOR_IMAGE}:{COLLECTOR_VERSION}":
        problems.append(f"collector image {image}: re-check COMPONENT_TYPES for it")
    return problems


def check_memory_limiter_first(root: Path) -> CheckResult:
    return [
        f"pipeline {pipeline_id}: processors start with {pipeline.get('processors')}"
        for pipeline_id, pipeline in pipelines(collector(root)).items()
        if [component_type(p) for p in pipeline.get("processors", [])][:1] != ["memory_limiter"]
    ]


def check_otlp_receiver_binds_all_interfaces(root: Path) -> CheckResult:
    cfg = collector(root)
    protocols = cfg["receivers"]["otlp"]["protocols"]
    problems = []
    for protocol, port in (("grpc", 4317), ("http", 4318)):
        endpoint = (protocols.get(protocol) or {}).get("endpoint")
        if endpoint != f"0.0.0.0:{port}":
            problems.append(f"otlp {protocol} endpoint is {endpoint}, not 0.0.0.0:{port}")
    health = cfg["extensions"]["health_check"].get("endpoint", "")
    if not health.startswith("0.0.0.0:"):
        problems.append(f"health_check endpoint {health} is not reachable from outside")
    return problems


def check_tail_sampling_policies(root: Path) -> CheckResult:
    cfg = collector(root)
    samplers = [p for p in cfg.get("processors") or {} if component_type(p) == "tail_sampling"]
    if not samplers:
        return ["no tail_sampling processor"]
    problems = []
    for sampler in samplers:
        policies = cfg["processors"][sampler].get("policies", [])
        types = {policy["type"]: policy for policy in policies}
        codes = (types.get("status_code") or {}).get("status_code", {}).get("status_codes", [])
        if "ERROR" not in codes:
            problems.append(f"{sampler}: no status_code policy keeping ERROR traces")
        if "threshold_ms" not in (types.get("latency") or {}).get("latency", {}):
            problems.append(f"{sampler}: no latency policy keeping slow traces")
        if "probabilistic" not in types:
            problems.append(f"{sampler}: no probabilistic policy for a share of the rest")
    traces_to = [
        set(p.get("exporters", []))
        for p in pipelines(cfg).values()
        if any(component_type(x) == "tail_sampling" for x in p.get("processors", []))
    ]
    if not any({"otlp_grpc/jaeger", "otlp_grpc/tempo"} <= exporters for exporters in traces_to):
        problems.append("the sampled traces do not go to both Jaeger and Tempo")
    return problems


def check_signals_reach_backends(root: Path) -> CheckResult:
    """Traces to Jaeger and Tempo, metrics to Prometheus, logs to Loki, debug available."""
    cfg = collector(root)
    exporters = cfg.get("exporters") or {}
    by_host: dict[str, set[str]] = {}
    for exporter, settings in exporters.items():
        endpoint = (settings or {}).get("endpoint")
        if endpoint:
            by_host.setdefault(hostname(endpoint), set()).add(exporter)

    def reached(signal: str) -> set[str]:
        """Hosts a signal's data reaches, following connectors between pipelines."""
        hosts: set[str] = set()
        todo = [pid for pid in pipelines(cfg) if component_type(pid) == signal]
        seen: set[str] = set()
        while todo:
            pid = todo.pop()
            seen.add(pid)
            for exporter in pipelines(cfg)[pid].get("exporters", []):
                hosts |= {host for host, ids in by_host.items() if exporter in ids}
                if exporter in (cfg.get("connectors") or {}):
                    todo += [
                        other
                        for other, p in pipelines(cfg).items()
                        if exporter in p.get("receivers", [])
                        and other not in seen
                        # A connector to another signal (span metrics) is not this signal.
                        and component_type(other) == signal
                    ]
        return hosts

    problems = []
    for signal, backends in (
        ("traces", {"jaeger", "tempo"}),
        ("metrics", {"prometheus"}),
        ("logs", {"loki"}),
    ):
        missing = backends - reached(signal)
        if missing:
            problems.append(f"{signal} do not reach {sorted(missing)}")
    if "debug" not in exporters:
        problems.append("no debug exporter")
    if "/otlp" not in (exporters.get("otlp_http/loki") or {}).get("endpoint", ""):
        problems.append("logs do not go to Loki's OTLP endpoint (/otlp)")
    if "/api/v1/otlp" not in (exporters.get("otlp_http/prometheus") or {}).get("endpoint", ""):
        problems.append("metrics do not go to Prometheus' OTLP receiver (/api/v1/otlp)")
    return problems


def check_exporter_hosts_are_services(root: Path) -> CheckResult:
    services = set(compose(root)["services"])
    problems = []
    for exporter, settings in (collector(root).get("exporters") or {}).items():
        endpoint = (settings or {}).get("endpoint")
        if endpoint and hostname(endpoint) not in services:
            problems.append(f"exporter {exporter} sends to {endpoint}: no such compose service")
    prometheus = load_yaml(root / "deploy/prometheus/prometheus.yml")
    for job in prometheus.get("scrape_configs", []):
        for static in job.get("static_configs", []):
            for target in static.get("targets", []):
                host = hostname(target)
                if host != "localhost" and host not in services:
                    problems.append(f"Prometheus scrapes {target}: no such compose service")
    for source in datasources(root):
        if hostname(source["url"]) not in services:
            problems.append(f"data source {source['name']} at {source['url']}: no such service")
    return problems


# -- checks: compose ----------------------------------------------------------------------


def check_bind_mounts_exist(root: Path) -> CheckResult:
    spec = compose(root)
    named = set(spec.get("volumes") or {})
    problems = []
    for name, service in spec["services"].items():
        for volume in service.get("volumes", []):
            if isinstance(volume, dict):
                source, kind = volume.get("source", ""), volume.get("type")
            else:
                source = volume.split(":", 1)[0]
                kind = "bind" if source.startswith((".", "/", "~")) else "volume"
            if kind == "bind" and not (root / source).exists():
                problems.append(f"{name}: bind-mounted {source} does not exist")
            if kind == "volume" and source not in named:
                problems.append(f"{name}: volume {source} is not declared")
    return problems


def check_dask_services_instrumented(root: Path) -> CheckResult:
    services = compose(root)["services"]
    roles: dict[str, list[str]] = {"scheduler": [], "worker": [], "client": []}
    problems = []
    for name, service in services.items():
        words = command_words(service)
        text = " ".join(words)
        if re.search(r"\bdask[- ]scheduler\b", text):
            role = "scheduler"
        elif re.search(r"\bdask[- ]worker\b", text):
            role = "worker"
        elif "demo_client.py" in text:
            role = "client"
        else:
            continue
        replicas = (service.get("deploy") or {}).get("replicas", 1)
        roles[role] += [name] * replicas
        if words[:1] != ["opentelemetry-instrument"]:
            problems.append(f"{name} runs {words[:2]}, not under opentelemetry-instrument")
        if "build" not in service:
            problems.append(f"{name} does not run the image built from this repository")
        endpoint = (service.get("environment") or {}).get("OTEL_EXPORTER_OTLP_ENDPOINT", "")
        if hostname(endpoint) not in services:
            problems.append(f"{name} exports to {endpoint!r}, not to a compose service")
    if len(roles["scheduler"]) != 1:
        problems.append(f"scheduler services: {roles['scheduler']}")
    if len(roles["worker"]) < 2:
        problems.append(f"fewer than two workers: {roles['worker']}")
    for name in roles["client"]:
        if services[name].get("restart", "no") != "no":
            problems.append(f"demo client {name} restarts; it is a one-shot job")
        script = next(w for w in command_words(services[name]) if w.endswith("demo_client.py"))
        if not (root / script).is_file():
            problems.append(f"{name} runs {script}, which does not exist")
    if not roles["client"]:
        problems.append("no one-shot demo client")
    return problems


def pinned(image: str) -> bool:
    """``name:1.2.3`` (or ``v1.2.3``, suffixes allowed) or a digest; never latest/major."""
    if "@sha256:" in image:
        return True
    tag = image.rsplit(":", 1)[1] if ":" in image.rsplit("/", 1)[-1] else ""
    return bool(re.match(r"v?\d+\.\d+\.\d+", tag))


def check_images_pinned(root: Path) -> CheckResult:
    problems = []
    for name, service in compose(root)["services"].items():
        image = service.get("image")
        if "build" in service:
            continue  # built here: its base image is checked in the Dockerfile below
        if not image or not pinned(image):
            problems.append(f"{name}: image {image!r} is not pinned to a version")
    dockerfile = (root / "Dockerfile").read_text()
    for base in re.findall(r"^FROM\s+(\S+)", dockerfile, flags=re.MULTILINE):
        if not pinned(base):
            problems.append(f"Dockerfile: FROM {base} is not pinned to a version")
    return problems


def check_dockerfile(root: Path) -> CheckResult:
    dockerfile = (root / "Dockerfile").read_text()
    problems = []
    bases = re.findall(r"^FROM\s+(\S+)", dockerfile, flags=re.MULTILINE)
    if not bases or not re.fullmatch(r"python:3\.11\.\d+-slim(-\w+)?", bases[-1]):
        problems.append(f"Dockerfile base {bases} is not python:3.11.x-slim")
    installs = re.findall(r"pip install[^\n]*", dockerfile)
    if not any(re.search(r"\s\.(\s|$)", line) for line in installs):
        problems.append("Dockerfile does not pip-install this repository")
    if re.search(r"\.\[[^\]]*test", dockerfile):
        problems.append("Dockerfile installs the test extra")
    if not re.search(r"^USER\s+(?!root)", dockerfile, flags=re.MULTILINE):
        problems.append("Dockerfile runs as root")
    return problems


def check_healthchecks(root: Path) -> CheckResult:
    spec = compose(root)
    problems = []
    for name, service in spec["services"].items():
        if service.get("restart", "no") == "no":
            continue  # one-shot jobs
        test = (service.get("healthcheck") or {}).get("test")
        if name in NO_HEALTHCHECK:
            if not service["image"].startswith(NO_HEALTHCHECK[name]):
                problems.append(f"{name}: exempt from a healthcheck, but runs {service['image']}")
            published = [str(p).split(":")[-1] for p in service.get("ports", [])]
            if "13133" not in published:
                problems.append(f"{name}: health_check port 13133 is not published")
            continue
        if not test or test in (["NONE"], "NONE") or service["healthcheck"].get("disable"):
            problems.append(f"{name}: no healthcheck")
    for name, service in spec["services"].items():
        for dependency, rule in (service.get("depends_on") or {}).items():
            condition = rule.get("condition") if isinstance(rule, dict) else None
            if condition == "service_healthy" and dependency in NO_HEALTHCHECK:
                problems.append(f"{name} waits for {dependency} to be healthy: it never is")
    return problems


def check_prometheus_otlp(root: Path) -> CheckResult:
    """What the dashboard test assumes about Prometheus: OTLP in, default names, exemplars."""
    service = compose(root)["services"]["prometheus"]
    flags = " ".join(command_words(service))
    problems = []
    if "--web.enable-otlp-receiver" not in flags:
        problems.append("Prometheus runs without --web.enable-otlp-receiver")
    if "exemplar-storage" not in flags:
        problems.append("Prometheus keeps no exemplars (--enable-feature=exemplar-storage)")
    otlp = load_yaml(root / "deploy/prometheus/prometheus.yml").get("otlp") or {}
    strategy = otlp.get("translation_strategy", "UnderscoreEscapingWithSuffixes")
    if strategy != "UnderscoreEscapingWithSuffixes":
        problems.append(f"translation_strategy {strategy}: prometheus_names() assumes another")
    return problems


def check_backends_listen(root: Path) -> CheckResult:
    tempo = load_yaml(root / "deploy/tempo/tempo.yaml")
    protocols = tempo["distributor"]["receivers"]["otlp"]["protocols"]
    problems = [
        f"Tempo otlp {protocol} listens on {(protocols.get(protocol) or {}).get('endpoint')}"
        for protocol in ("grpc", "http")
        if not str((protocols.get(protocol) or {}).get("endpoint", "")).startswith("0.0.0.0:")
    ]
    loki = load_yaml(root / "deploy/loki/loki.yaml")
    if not loki.get("limits_config", {}).get("allow_structured_metadata", True):
        problems.append("Loki refuses structured metadata: OTLP logs would be rejected")
    return problems


# -- checks: Grafana ----------------------------------------------------------------------


def check_datasource_links(root: Path) -> CheckResult:
    sources = datasources(root)
    uids = [source["uid"] for source in sources]
    by_type = {source["type"]: source for source in sources}
    problems = [f"duplicate data source uid {uid}" for uid in set(uids) if uids.count(uid) > 1]
    for source in sources:
        for key, value in walk(source.get("jsonData") or {}):
            if key == "datasourceUid" and value not in uids:
                problems.append(f"{source['name']}: {key} {value} is no data source")
    for panel in dashboard(root)["panels"]:
        uid = (panel.get("datasource") or {}).get("uid")
        if uid and not uid.startswith("$") and uid not in uids:
            problems.append(f"dashboard panel {panel['title']!r}: data source {uid} unknown")

    def linked(source: dict[str, Any] | None, path: list[str], target_type: str) -> bool:
        node: Any = (source or {}).get("jsonData") or {}
        for part in path:
            node = node.get(part) if isinstance(node, dict) else None
        targets = node if isinstance(node, list) else [node]
        wanted = {s["uid"] for s in sources if s["type"] == target_type}
        return any(
            (t.get("datasourceUid") if isinstance(t, dict) else None) in wanted for t in targets
        )

    for source_type, path, target, what in (
        ("tempo", ["tracesToLogsV2"], "loki", "traces to logs"),
        ("jaeger", ["tracesToLogsV2"], "loki", "traces to logs (Jaeger)"),
        ("loki", ["derivedFields"], "tempo", "logs to traces"),
        ("prometheus", ["exemplarTraceIdDestinations"], "tempo", "metrics to traces"),
    ):
        if not linked(by_type.get(source_type), path, target):
            problems.append(f"no {what} link ({source_type} -> {target})")
    tempo = by_type.get("tempo", {}).get("jsonData", {})
    if not tempo.get("tracesToLogsV2", {}).get("filterByTraceID"):
        problems.append("traces to logs does not filter by trace id")
    fields = by_type.get("loki", {}).get("jsonData", {}).get("derivedFields", [])
    if not any("trace_id" in field.get("matcherRegex", "") for field in fields):
        problems.append("no Loki derived field on trace_id")
    return problems


def check_dashboard_provisioned(root: Path) -> CheckResult:
    provider_file = root / "deploy/grafana/provisioning/dashboards/dashboards.yaml"
    paths = [p["options"]["path"] for p in load_yaml(provider_file)["providers"]]
    grafana = compose(root)["services"]["grafana"]
    mounts = dict(
        reversed(str(v).split(":")[:2]) for v in grafana.get("volumes", []) if ":" in str(v)
    )
    problems = []
    for path in paths:
        source = mounts.get(path)
        if source is None:
            problems.append(f"dashboard provider path {path} is not mounted into grafana")
        elif not (root / source / "dask.json").is_file():
            problems.append(f"{source} (mounted at {path}) has no dask.json")
    if "/etc/grafana/provisioning" not in mounts:
        problems.append("provisioning is not mounted at /etc/grafana/provisioning")
    return problems


def check_dashboard_metrics(root: Path) -> CheckResult:
    catalog = series_catalog()
    known_labels = {prometheus_label(a) for a in COMMON_ATTRIBUTES}
    known_labels |= {prometheus_label(a) for i in INSTRUMENTS.values() for a in i.attributes}
    known_labels |= {"le", "job", "instance", "deployment_environment_name"}
    problems = []
    for where, uid, query in dashboard_queries(dashboard(root)):
        if uid != "prometheus":
            continue
        parts = label_values_parts(query)
        expr, extra_labels = (parts[0], {parts[1]}) if parts else (query, set())
        selectors = promql_selectors(expr)
        if not selectors:
            problems.append(f"{where}: {query!r} queries no metric")
        for metric, labels in selectors:
            if metric not in catalog:
                problems.append(f"{where}: {metric} is no series of INSTRUMENTS")
                continue
            instrument = INSTRUMENTS[catalog[metric]]
            allowed = {prometheus_label(a) for a in (*instrument.attributes, *COMMON_ATTRIBUTES)}
            for label in labels:
                if label.startswith("dask_") and label not in allowed:
                    problems.append(f"{where}: {metric} has no label {label}")
        for label in promql_labels(expr) | extra_labels:
            if label not in known_labels:
                problems.append(f"{where}: label {label} comes from no attribute")
    return problems


def check_dashboard_sections(root: Path) -> CheckResult:
    board = dashboard(root)
    sections: dict[str, set[str]] = {}
    current = None
    for panel in sorted(board["panels"], key=lambda p: (p["gridPos"]["y"], p["gridPos"]["x"])):
        if panel["type"] == "row":
            current = panel["title"]
            sections[current] = set()
        elif current is not None:
            for target in panel.get("targets", []):
                sections[current] |= {m for m, _ in promql_selectors(target["expr"])}
    catalog = series_catalog()
    problems = []
    for title, instruments in DASHBOARD_SECTIONS.items():
        if title not in sections:
            problems.append(f"no dashboard row {title!r}")
            continue
        shown = {catalog.get(metric) for metric in sections[title]}
        for instrument in instruments:
            if instrument not in INSTRUMENTS:
                problems.append(f"row {title!r} expects {instrument}, gone from INSTRUMENTS")
            elif instrument not in shown:
                problems.append(f"row {title!r} shows no {instrument}")
    return problems


CHECKS: list[Callable[[Path], CheckResult]] = [
    check_components_defined,
    check_components_used,
    check_connectors_both_sides,
    check_component_names_current,
    check_memory_limiter_first,
    check_otlp_receiver_binds_all_interfaces,
    check_tail_sampling_policies,
    check_signals_reach_backends,
    check_exporter_hosts_are_services,
    check_bind_mounts_exist,
    check_dask_services_instrumented,
    check_images_pinned,
    check_dockerfile,
    check_healthchecks,
    check_prometheus_otlp,
    check_backends_listen,
    check_datasource_links,
    check_dashboard_provisioned,
    check_dashboard_metrics,
    check_dashboard_sections,
]


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__.removeprefix("check_"))
def test_stack(check: Callable[[Path], CheckResult]) -> None:
    assert check(ROOT) == []


# -- the translation helper itself ----------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "instrument", "expected"),
    [
        (
            "dask.task.duration",
            Instrument("histogram", "s", ""),
            {
                "dask_task_duration_seconds_bucket",
                "dask_task_duration_seconds_sum",
                "dask_task_duration_seconds_count",
            },
        ),
        ("dask.task.finished", Instrument("counter", "{task}", ""), {"dask_task_finished_total"}),
        ("dask.worker.memory", Instrument("gauge", "By", ""), {"dask_worker_memory_bytes"}),
        (
            "dask.worker.gc.time",
            Instrument("counter", "s", ""),
            {"dask_worker_gc_time_seconds_total"},
        ),
        ("a.seconds.b", Instrument("gauge", "s", ""), {"a_seconds_b"}),
        ("a.total.b", Instrument("counter", "1", ""), {"a_b_total"}),
        ("a.use", Instrument("gauge", "1", ""), {"a_use_ratio"}),
        (
            "dask.scheduler.event_loop.ticks",
            Instrument("counter", "{tick}", ""),
            {"dask_scheduler_event_loop_ticks_total"},
        ),
    ],
)
def test_prometheus_names(name: str, instrument: Instrument, expected: set[str]) -> None:
    assert prometheus_names(name, instrument) == expected


def test_promql_selectors() -> None:
    expr = (
        "histogram_quantile(0.95, sum by (le, dask_task_prefix) (rate(dask_task_duration_seconds_"
        'bucket{dask_cluster_id=~"$cluster", dask_task_outcome="error"}[$__rate_interval])))'
        " / on (job) group_left dask_worker_threads"
    )
    assert promql_selectors(expr) == [
        ("dask_task_duration_seconds_bucket", ["dask_cluster_id", "dask_task_outcome"]),
        ("dask_worker_threads", []),
    ]
    assert promql_labels(expr) >= {"le", "dask_task_prefix", "job", "dask_task_outcome"}


# -- every check can fail ---------------------------------------------------------------------


def edit_yaml(relative: str, change: Callable[[Any], None]) -> Callable[[Path], None]:
    def apply(root: Path) -> None:
        path = root / relative
        data = yaml.safe_load(path.read_text())
        change(data)
        path.write_text(yaml.safe_dump(data, sort_keys=False))

    return apply


def edit_json(relative: str, change: Callable[[Any], None]) -> Callable[[Path], None]:
    def apply(root: Path) -> None:
        path = root / relative
        data = json.loads(path.read_text())
        change(data)
        path.write_text(json.dumps(data))

    return apply


def replace_text(relative: str, old: str, new: str) -> Callable[[Path], None]:
    def apply(root: Path) -> None:
        path = root / relative
        text = path.read_text()
        assert old in text, f"{old!r} not in {relative}"
        path.write_text(text.replace(old, new, 1))

    return apply


COLLECTOR = "collector-config.yaml"
COMPOSE = "docker-compose.yml"
SOURCES = "deploy/grafana/provisioning/datasources/datasources.yaml"
BOARD = "deploy/grafana/dashboards/dask.json"


def first_expr_replace(old: str, new: str) -> Callable[[Any], None]:
    def change(board: dict[str, Any]) -> None:
        for panel in board["panels"]:
            for target in panel.get("targets", []):
                if old in target["expr"]:
                    target["expr"] = target["expr"].replace(old, new)
                    return
        raise AssertionError(f"{old} in no query")

    return change


def drop_rows_section(title: str) -> Callable[[Any], None]:
    def change(board: dict[str, Any]) -> None:
        for panel in board["panels"]:
            if panel["type"] == "row" and panel["title"] == title:
                panel["title"] = "Something else"

    return change


BREAKAGES: list[tuple[str, Callable[[Path], None], Callable[[Path], CheckResult]]] = [
    (
        "undefined exporter",
        edit_yaml(COLLECTOR, lambda c: c["exporters"].pop("otlp_grpc/tempo")),
        check_components_defined,
    ),
    (
        "unused processor",
        edit_yaml(COLLECTOR, lambda c: c["processors"].update({"attributes/x": {}})),
        check_components_used,
    ),
    (
        "one-sided connector",
        edit_yaml(
            COLLECTOR_OVERLAY,
            lambda c: c["service"]["pipelines"]["metrics"]["receivers"].remove("service_graph"),
        ),
        check_connectors_both_sides,
    ),
    (
        "deprecated exporter name",
        replace_text(COLLECTOR, "otlp_grpc/jaeger:", "otlp/jaeger:"),
        check_component_names_current,
    ),
    (
        "removed loki exporter",
        edit_yaml(COLLECTOR, lambda c: c["exporters"].update({"loki": {}})),
        check_component_names_current,
    ),
    (
        "other collector release",
        replace_text(
            COMPOSE, f"{COLLECTOR_IMAGE}:{COLLECTOR_VERSION}", f"{COLLECTOR_IMAGE}:0.99.0"
        ),
        check_component_names_current,
    ),
    (
        "memory_limiter not first",
        edit_yaml(
            COLLECTOR,
            lambda c: c["service"]["pipelines"]["logs"]["processors"].reverse(),
        ),
        check_memory_limiter_first,
    ),
    (
        "receiver on localhost",
        replace_text(COLLECTOR, "endpoint: 0.0.0.0:4317", "endpoint: localhost:4317"),
        check_otlp_receiver_binds_all_interfaces,
    ),
    (
        "no error policy",
        replace_text(COLLECTOR, "status_codes: [ERROR]", "status_codes: [UNSET]"),
        check_tail_sampling_policies,
    ),
    (
        "no latency policy",
        replace_text(COLLECTOR, "type: latency", "type: always_sample"),
        check_tail_sampling_policies,
    ),
    (
        "traces miss Tempo",
        edit_yaml(
            COLLECTOR,
            lambda c: c["service"]["pipelines"]["traces/sampled"]["exporters"].remove(
                "otlp_grpc/tempo"
            ),
        ),
        check_signals_reach_backends,
    ),
    (
        "exporter to unknown host",
        replace_text(
            COLLECTOR,
            "LOGS_OTLP_ENDPOINT:-http://loki:3100/otlp",
            "LOGS_OTLP_ENDPOINT:-http://logs:3100/otlp",
        ),
        check_exporter_hosts_are_services,
    ),
    (
        "missing bind-mounted file",
        lambda root: (root / "deploy/loki/loki.yaml").unlink(),
        check_bind_mounts_exist,
    ),
    (
        "worker without opentelemetry-instrument",
        edit_yaml(COMPOSE, lambda c: c["services"]["worker-2"]["command"].pop(0)),
        check_dask_services_instrumented,
    ),
    (
        "one worker",
        edit_yaml(COMPOSE, lambda c: c["services"].pop("worker-2")),
        check_dask_services_instrumented,
    ),
    (
        "unpinned image",
        replace_text(COMPOSE, "grafana/grafana:13.2.0", "grafana/grafana:latest"),
        check_images_pinned,
    ),
    (
        "floating base image",
        replace_text("Dockerfile", "FROM python:3.11.15-slim", "FROM python:3.11-slim"),
        check_images_pinned,
    ),
    (
        "dev extras in the image",
        replace_text("Dockerfile", "constraints.txt . ", "constraints.txt .[test] "),
        check_dockerfile,
    ),
    (
        "service without healthcheck",
        edit_yaml(COMPOSE, lambda c: c["services"]["loki"].pop("healthcheck")),
        check_healthchecks,
    ),
    (
        "Prometheus without OTLP receiver",
        replace_text(COMPOSE, "- --web.enable-otlp-receiver", "- --web.enable-lifecycle"),
        check_prometheus_otlp,
    ),
    (
        "Tempo on localhost",
        replace_text("deploy/tempo/tempo.yaml", "0.0.0.0:4317", "localhost:4317"),
        check_backends_listen,
    ),
    (
        "link to a missing data source",
        replace_text(SOURCES, "datasourceUid: loki", "datasourceUid: logs"),
        check_datasource_links,
    ),
    (
        "no logs-to-traces link",
        edit_yaml(SOURCES, lambda c: c["datasources"][-1]["jsonData"].pop("derivedFields")),
        check_datasource_links,
    ),
    (
        "dashboards not mounted",
        replace_text(COMPOSE, ":/var/lib/grafana/dashboards:ro", ":/srv/dashboards:ro"),
        check_dashboard_provisioned,
    ),
    (
        "metric the package does not emit",
        edit_json(BOARD, first_expr_replace("dask_worker_memory_bytes", "dask_worker_ram_bytes")),
        check_dashboard_metrics,
    ),
    (
        "histogram queried without suffix",
        edit_json(
            BOARD,
            first_expr_replace("dask_task_duration_seconds_bucket", "dask_task_duration_seconds"),
        ),
        check_dashboard_metrics,
    ),
    (
        "label the metric lacks",
        edit_json(
            BOARD,
            first_expr_replace(
                "dask_worker_memory_bytes{", 'dask_worker_memory_bytes{dask_task_prefix="x",'
            ),
        ),
        check_dashboard_metrics,
    ),
    (
        "missing section",
        edit_json(BOARD, drop_rows_section("Transfers")),
        check_dashboard_sections,
    ),
]


@pytest.mark.parametrize(
    ("breakage", "check"),
    [(b, c) for _, b, c in BREAKAGES],
    ids=[name for name, _, _ in BREAKAGES],
)
def test_check_catches(
    tmp_path: Path,
    breakage: Callable[[Path], None],
    check: Callable[[Path], CheckResult],
) -> None:
    for name in ("collector-config.yaml", "docker-compose.yml", "Dockerfile"):
        shutil.copy(ROOT / name, tmp_path / name)
    for name in ("deploy", "examples"):
        shutil.copytree(ROOT / name, tmp_path / name)
    assert check(tmp_path) == [], "the copy is not the repository's stack"
    breakage(tmp_path)
    assert check(tmp_path) != []


def test_every_check_is_shown_to_fail() -> None:
    assert {check for _, _, check in BREAKAGES} == set(CHECKS)
