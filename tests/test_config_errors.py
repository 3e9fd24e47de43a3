"""Settings dask-otel cannot use, through real entry points (subprocesses): one line on
stderr naming the key, the value and what is allowed; a Dask command refuses to start
(status 1, no tracebacks), a client carries on untraced."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from conftest import bin_path, start_scheduler, start_worker
from otlp_receiver import closed_port

from dask_otel.config import KEYS

MAX_LINKS = "otel.task.max-links must be an integer >= 0, got -1"
MISSPELT = (
    "otel.task.max_span_per_graph = 5 (from DASK_OTEL__TASK__MAX_SPAN_PER_GRAPH=5) is not a"
    " dask-otel setting (did you mean otel.task.max-spans-per-graph?)"
)


def clean_env(**variables: str) -> dict[str, str]:
    """This environment without OTEL_/DASK_ settings, exporting nothing, plus ``variables``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "DASK_"))}
    env.pop("PYTHONPATH", None)
    none = {f"OTEL_{s}_EXPORTER": "none" for s in ("TRACES", "METRICS", "LOGS")}
    return {**env, **none, **variables}


def run(args: list[str], env: dict[str, str], cwd) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True, timeout=120)


def problem_lines(stderr: str) -> list[str]:
    """stderr without Dask's own INFO log lines."""
    return [line for line in stderr.splitlines() if " - INFO - " not in line]


def scheduler(*extra: str) -> list[str]:
    return [bin_path("dask"), "scheduler", "--host", "127.0.0.1", "--port", "0",
            "--dashboard-address", "127.0.0.1:0", *extra]  # fmt: skip


def worker(*extra: str) -> list[str]:
    address = f"tcp://127.0.0.1:{closed_port()}"  # they stop before connecting
    return [bin_path("dask"), "worker", address, "--host", "127.0.0.1", "--no-dashboard",
            *extra]  # fmt: skip


INSTRUMENT = [bin_path("opentelemetry-instrument")]


@pytest.mark.parametrize(
    ("command", "who"),
    [
        (scheduler("--preload", "dask_otel"), "scheduler"),
        ([*INSTRUMENT, *scheduler()], "scheduler"),
        ([*INSTRUMENT, *worker()], "nanny"),  # the Nanny stops before it starts a worker
        ([*INSTRUMENT, *worker("--no-nanny")], "worker"),
        (worker("--no-nanny", "--preload", "dask_otel"), "worker"),
        (worker("--preload", "dask_otel"), "nanny"),  # refused before the Nanny starts
        (worker("--preload-nanny", "dask_otel"), "nanny"),
    ],
    ids=["scheduler-preload", "scheduler-instrument", "nanny-instrument", "worker-instrument",
         "worker-preload",
         "worker-preload-nanny", "nanny-preload"],
)  # fmt: skip
@pytest.mark.parametrize(
    ("variable", "message"),
    [("DASK_OTEL__TASK__MAX_LINKS=-1", f"{MAX_LINKS} (from DASK_OTEL__TASK__MAX_LINKS=-1)"),
     ("DASK_OTEL__TASK__MAX_SPAN_PER_GRAPH=5", MISSPELT)],
    ids=["bad-value", "misspelt-key"],
)  # fmt: skip
def test_a_dask_command_refuses_to_start_with_one_line(tmp_path, command, who, variable, message):
    name, value = variable.split("=")
    out = run(command, clean_env(**{name: value}), tmp_path)
    assert out.returncode == 1, out.stderr
    assert problem_lines(out.stderr) == [f"dask-otel: {message}. This {who} does not start."]


CLIENT = """
    import dask, sys
    from distributed import Client, LocalCluster
    import dask_otel

    with LocalCluster(n_workers=1, processes=False, dashboard_address="127.0.0.1:0") as cluster:
        with Client(cluster) as client:
            with dask.config.set({"otel.task.max-links": -1}):  # the client's settings only
                dask_otel.instrument(client)
                print([client.submit(lambda x: x + 1, i).result() for i in range(3)])
    """


def test_a_client_carries_on_untraced_and_says_so_once(tmp_path):
    out = run([sys.executable, "-c", textwrap.dedent(CLIENT)], clean_env(), tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[0] == "[1, 2, 3]"
    assert problem_lines(out.stderr) == [f"dask-otel: {MAX_LINKS}. This client runs untraced."]


def test_under_opentelemetry_instrument_the_client_says_so_on_stderr(tmp_path):
    """The logging instrumentation's root handler would have taken the message away from
    the terminal, to the exporter alone."""
    script = tmp_path / "client.py"
    script.write_text(textwrap.dedent(CLIENT).replace("dask_otel.instrument(client)", "pass"))
    out = run([*INSTRUMENT, sys.executable, str(script)], clean_env(), tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[0] == "[1, 2, 3]"
    assert problem_lines(out.stderr) == [f"dask-otel: {MAX_LINKS}. This client runs untraced."]


LOCAL_CLUSTER = """
    import dask_otel
    from distributed import LocalCluster

    try:
        LocalCluster(n_workers=1, processes=False, dashboard_address="127.0.0.1:0")
    except RuntimeError as e:
        chain = [e]
        while chain[-1].__cause__ is not None:
            chain.append(chain[-1].__cause__)
        print(str(e))
        print(" ".join(str(c) for c in chain if isinstance(c, dask_otel.ConfigError)))
"""


def test_a_local_cluster_fails_with_a_config_error(tmp_path):
    """What README says a script starting a ``LocalCluster`` (dask-otel preloaded through
    Dask's config) gets: Dask's RuntimeError, caused by dask-otel's ConfigError."""
    preload = "DASK_DISTRIBUTED__SCHEDULER__PRELOAD"
    env = clean_env(**{preload: '["dask_otel"]', "DASK_OTEL__TASK__MAX_LINKS": "-1"})
    out = run([sys.executable, "-c", textwrap.dedent(LOCAL_CLUSTER)], env, tmp_path)
    assert out.returncode == 0, out.stderr
    failed, cause = out.stdout.splitlines()
    assert failed.startswith("Cluster failed to start"), out.stdout
    assert cause == f"{MAX_LINKS} (from DASK_OTEL__TASK__MAX_LINKS=-1)", out.stdout
    said = f"dask-otel: {MAX_LINKS} (from DASK_OTEL__TASK__MAX_LINKS=-1). This scheduler does"
    assert said in out.stderr


def test_a_running_cluster_with_bad_settings_runs_on_untraced(tmp_path, processes):
    """dask_otel.instrument(client) on a cluster whose processes cannot use their settings:
    they stay up, untraced, each saying why on its stderr, and the client says it too."""
    bad = clean_env(DASK_OTEL__SPANS__TASK="false")  # `tasks`, misspelt
    address = start_scheduler(processes, bad, instrumented=False)
    start_worker(processes, bad, address, "w0", instrumented=False, nanny=False)
    client = textwrap.dedent(
        f"""
        from distributed import Client
        import dask_otel

        with Client("{address}", timeout=60) as client:
            client.wait_for_workers(1, timeout=60)
            dask_otel.instrument(client)
            print(client.submit(lambda x: x + 1, 1).result())
        """
    )
    out = run([sys.executable, "-c", client], clean_env(), tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "2"
    problem = (
        "otel.spans.task = False (from DASK_OTEL__SPANS__TASK=false) is not a dask-otel setting"
        " (did you mean otel.spans.tasks?)"
    )
    said = problem_lines(out.stderr)
    assert (
        said[0]
        == f"dask-otel: {problem}. dask-otel is off in the scheduler, which runs on, untraced."
    )
    assert said[1].startswith(f"dask-otel: {problem}. dask-otel is off in the worker tcp://")
    assert len(said) == 2
    for _, log in processes.procs:
        lines = [line for line in problem_lines(log.read_text()) if "dask-otel" in line]
        role = log.stem.replace("w0", "worker")
        assert lines == [f"dask-otel: {problem}. This {role} runs on, untraced."], lines


def test_an_unknown_exporter_is_one_line(tmp_path):
    env = clean_env(OTEL_TRACES_EXPORTER="bogus")
    out = run([*INSTRUMENT, sys.executable, "-c", "print('ran')"], env, tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "ran\n"
    (line,) = out.stderr.splitlines()
    assert line.startswith(
        "dask-otel: cannot configure OpenTelemetry: OTEL_TRACES_EXPORTER=bogus names nothing "
        "installed (installed: console, otlp, "
    )
    assert line.endswith("; or none). Telemetry is off in this process.")


def test_an_unknown_sampler_is_one_line_and_untraced(tmp_path):
    """The SDK would trace everything with its default sampler, warning at each tracer
    provider: as for an unknown exporter, one line, and the process runs untraced."""
    env = clean_env(OTEL_TRACES_SAMPLER="nonsense", OTEL_TRACES_EXPORTER="console")
    job = textwrap.dedent(
        """
        from distributed import Client, LocalCluster
        with LocalCluster(n_workers=1, processes=False, dashboard_address=":0") as cluster:
            with Client(cluster) as client:
                print(client.submit(lambda x: x + 1, 1).result())
        """
    )
    out = run([*INSTRUMENT, sys.executable, "-c", job], env, tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "2\n"  # no span printed by the console exporter
    (line,) = [line for line in problem_lines(out.stderr) if "sampler" in line.lower()]
    assert line == (
        "dask-otel: cannot configure OpenTelemetry: OTEL_TRACES_SAMPLER=nonsense names nothing "
        "installed (installed: always_off, always_on, parentbased_always_off, "
        "parentbased_always_on, parentbased_traceidratio, traceidratio). Telemetry is off in "
        "this process."
    )


def test_every_key_of_the_defaults_is_known():
    """The keys the closest-match search offers are the ones README documents."""
    assert "otel.task.max-spans-per-graph" in KEYS and "otel.spans.tasks" in KEYS
