"""Flight recorders on a machine shared with other clusters and other users: a Nanny sends
only what its own cluster's dead workers left (or a cluster's that exports where it
does), writes only into its own private directory, and skips whatever is not a recorder
of its user's without giving up on the rest."""

from __future__ import annotations

import os
import signal
import struct
import tempfile
import time
from pathlib import Path

import pytest
from conftest import in_process_cluster, otel_env, start_scheduler, start_worker
from distributed import Client
from otlp_receiver import OTLPReceiver
from test_flight import run_child

from dask_otel.export import drops
from dask_otel.postmortem import flight_recorder, folders, labels
from dask_otel.spans import emitter

OTHER_USER = 4242


@pytest.fixture
def machine(tmp_path, monkeypatch) -> Path:
    """This test's temporary directory as the machine's; its processes export nowhere."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)
    for name in ("TRACES", "METRICS", "LOGS"):
        monkeypatch.setenv(f"OTEL_{name}_EXPORTER", "none")
    return tmp_path


def dead_nannys_folder(name: str, spans: int, label: labels.Label | None, **child) -> Path:
    """The directory a SIGKILLed Nanny left, with its SIGKILLed worker's recorder holding
    ``spans`` unexported spans (``child``: more of what the worker did, see ``run_child``)."""
    folder = folders.root() / name
    folder.mkdir(parents=True, mode=0o700)
    folders.root().chmod(0o700)
    run_child(folder, spans=spans, **child)
    if label is not None:
        labels.write(folder, label)
    return folder


def sent_by_a_new_nanny(telemetry) -> list[str]:
    with in_process_cluster(n_workers=1, processes=True, host="127.0.0.1") as client:
        assert client.submit(len, "abc").result() == 3
        assert emitter.shared().flush(10)
        return sorted(s.name for s in telemetry.spans("span "))


def here() -> labels.Label:
    return labels.Label(labels.destination())


def test_a_label_adopts_its_cluster_and_its_destination_only():
    mine = labels.Label("collector-a", "Scheduler-a")
    assert mine.adopts(labels.Label("collector-a"))
    assert mine.adopts(labels.Label("collector-b", "Scheduler-a"))
    assert not mine.adopts(labels.Label("collector-b", "Scheduler-b"))
    assert not mine.adopts(labels.Label("collector-b"))
    assert not mine.adopts(None)


def test_the_destination_is_the_exporter_settings(monkeypatch):
    before = labels.destination()
    monkeypatch.setenv("OTEL_SERVICE_NAME", "not a destination")
    assert labels.destination() == before
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://collector-b:4317")
    assert labels.destination() != before


def test_only_remains_that_go_where_this_nanny_exports_are_sent(machine, telemetry):
    """Another cluster's dead Nanny exported elsewhere: its worker's spans stay where they
    are, for a Nanny of that cluster; an unlabelled directory is nobody's."""
    other = dead_nannys_folder("aaaaaaaaaaaaaaaa", 4, labels.Label("elsewhere", "A"))
    unlabelled = dead_nannys_folder("bbbbbbbbbbbbbbbb", 2, None)
    same = dead_nannys_folder("cccccccccccccccc", 3, here())
    assert sent_by_a_new_nanny(telemetry) == ["span 0", "span 1", "span 2"]
    assert not same.exists()
    for folder in (other, unlabelled):
        assert len(list(folder.glob("*.flight"))) == 1


def test_a_planted_link_is_never_written_through(machine):
    """Links where a Nanny writes its mark and label and where a worker creates its
    recorder: the file they point to stays untouched."""
    folder = dead_nannys_folder("0123456789abcdef", 0, None)
    target = machine / "someone-elses-file"
    target.write_text("untouched")
    for name in (folders.OWNER, folders.LABEL, "12345.flight"):
        (folder / name).unlink(missing_ok=True)
        (folder / name).symlink_to(target)
    mark = folders.own(folder)
    labels.write(folder, here())
    with pytest.raises(OSError):
        flight_recorder.FlightRecorder(folder / "12345.flight", 1 << 20, 16)
    assert target.read_text() == "untouched"
    assert folders.mark_of(folder) == mark
    assert labels.read(folder) == here()


def test_a_directory_open_to_others_is_not_used(machine, telemetry):
    root = folders.root()
    root.mkdir(mode=0o700)
    root.chmod(0o777)  # as another user would make it, for everyone to plant files in
    with in_process_cluster(n_workers=1, processes=True, host="127.0.0.1") as client:
        assert client.submit(len, "abc").result() == 3
        assert list(root.iterdir()) == []  # no Nanny's directory, no worker's recorder
    with pytest.raises(folders.Foreign):
        folders.own(root / "0123456789abcdef")


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user takes root")
def test_another_users_directory_is_not_used(machine):
    root = folders.root()
    root.mkdir(mode=0o700)
    os.chown(root, OTHER_USER, OTHER_USER)
    with pytest.raises(folders.Foreign):
        folders.own(root / "0123456789abcdef")


def test_what_is_not_a_recorder_is_skipped_and_the_rest_sent(machine, telemetry):
    """Garbage, a file that only starts like a recorder, a link to a recorder, another
    user's recorder, a name no pid has: none is sent, none stops the cleanup."""
    folder = dead_nannys_folder("dddddddddddddddd", 3, here())
    (genuine,) = folder.glob("*.flight")
    (folder / "3999991.flight").write_bytes(os.urandom(1 << 17))
    forged = bytearray(genuine.read_bytes())
    forged[flight_recorder.HEADER_SIZE + 4 : flight_recorder.HEADER_SIZE + 64] = os.urandom(60)
    struct.pack_into("<I", forged, flight_recorder.HEADER_SIZE, 60)
    (folder / "3999992.flight").write_bytes(forged)
    elsewhere = machine / "elsewhere.flight"
    elsewhere.write_bytes(genuine.read_bytes())
    (folder / "3999993.flight").symlink_to(elsewhere)
    (folder / "99999999999999999999.flight").write_bytes(genuine.read_bytes())
    if os.geteuid() == 0:
        stranger = folder / "3999994.flight"
        stranger.write_bytes(genuine.read_bytes())
        os.chown(stranger, OTHER_USER, OTHER_USER)
    assert sent_by_a_new_nanny(telemetry) == ["span 0", "span 1", "span 2"]
    assert elsewhere.exists()


def test_what_a_dead_workers_recorder_could_not_hold_is_counted_lost(
    machine, telemetry, fresh_process
):
    """A span too large for the worker's recorder: the Nanny that sends the rest counts
    it with this process's losses (``dask_otel.exporter.dropped``, said once)."""
    dead_nannys_folder("eeeeeeeeeeeeeeee", 2, here(), big=2_000_000)
    assert sent_by_a_new_nanny(telemetry) == ["span 0", "span 1"]
    assert drops.dropped() == {("traces", "worker_died"): 1}


def test_two_clusters_on_one_machine(processes):
    """Cluster A's Nanny and worker are SIGKILLed with spans queued; cluster B's new
    Nanny leaves them (B exports to another collector), a new Nanny of A sends them to
    A's collector."""
    with OTLPReceiver() as a, OTLPReceiver() as b:
        env_a, env_b = otel_env(a), otel_env(b)
        held = {**env_a, "OTEL_BSP_SCHEDULE_DELAY": "60000", "OTEL_BLRP_SCHEDULE_DELAY": "60000"}
        address_a = start_scheduler(processes, env_a, name="scheduler-a")
        nanny = start_worker(processes, held, address_a, "a1")
        with Client(address_a, timeout=60) as client:
            client.wait_for_workers(1, timeout=60)
            keys = [f"cluster_a-{i}" for i in range(20)]
            futures = client.map(lambda x: x + 1, range(20), key=keys)
            assert client.gather(futures) == list(range(1, 21))
            os.killpg(nanny.pid, signal.SIGKILL)  # the Nanny and its worker
            nanny.wait()
            (left,) = (processes.tmp_path / f"dask-otel-{os.getuid()}").glob("*/*.flight")
            address_b = start_scheduler(processes, env_b, name="scheduler-b")
            start_worker(processes, env_b, address_b, "b1")
            with Client(address_b, timeout=60) as other:
                other.wait_for_workers(1, timeout=60)
                assert other.submit(len, "abc").result() == 3
            time.sleep(3)  # its Nanny has looked, twice (before and after its cluster id)
            assert left.exists()
            assert not b.spans("task cluster_a")
            start_worker(processes, env_a, address_a, "a2")
            client.wait_for_workers(1, timeout=60)
            spans = a.wait_for(lambda rx: len(rx.spans("task cluster_a")) == 20 and rx)
        assert not left.exists()
        assert not b.spans("task cluster_a")
        assert spans
