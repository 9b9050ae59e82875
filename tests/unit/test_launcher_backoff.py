"""The launcher's restart policy (Backoff) and run file (runfile), as plain code."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from hetmesh.launcher import runfile
from hetmesh.launcher.supervise import Backoff, how_it_ended


def test_restarts_back_off_doubling_to_a_cap_and_start_over_after_a_stable_run() -> None:
    b = Backoff(first_s=0.5, cap_s=4.0, max_restarts=100, window_s=60.0, stable_s=30.0)
    assert [b.after_exit(float(t), 1.0) for t in range(5)] == [0.5, 1.0, 2.0, 4.0, 4.0]
    assert b.after_exit(100.0, 31.0) == 0.5  # it ran 31 s: a fresh start


def test_more_exits_than_allowed_within_the_window_is_a_crash_loop() -> None:
    b = Backoff(max_restarts=2, window_s=10.0)
    assert b.after_exit(0.0, 1.0) is not None and b.after_exit(5.0, 1.0) is not None
    assert b.after_exit(20.0, 1.0) is not None  # the first two left the window
    assert b.after_exit(21.0, 1.0) is not None
    assert b.after_exit(22.0, 1.0) is None


def test_how_a_process_ended_reads_as_words() -> None:
    assert how_it_ended(-9) == "was killed by SIGKILL"
    assert how_it_ended(0).startswith("exited 0") and how_it_ended(3) == "exited with 3"


def test_the_run_file_names_live_launchers_and_drops_dead_ones(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HETMESH_RUN_DIR", str(tmp_path))
    assert runfile.find() is None
    path = runfile.write({"nats_url": "nats://127.0.0.1:4999", "started_at": 1.0})
    assert path == tmp_path / f"mesh-{os.getpid()}.json"
    assert runfile.find()["nats_url"] == "nats://127.0.0.1:4999"  # type: ignore[index]
    assert runfile.find("nats://elsewhere:1") is None
    # a launcher long gone whose pid another process has now: its start time tells them apart
    stale = tmp_path / "mesh-1.json"
    stale.write_text(f'{{"pid": {os.getpid()}, "pid_start": "1", "nats_url": "nats://stale:1", "started_at": 2.0}}')
    assert runfile.find()["nats_url"] == "nats://127.0.0.1:4999"  # type: ignore[index]
    assert not stale.exists()
    runfile.remove()
    assert runfile.find() is None
