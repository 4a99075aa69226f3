"""The jobs' thread choice: it counts the work running now, not the last minute's average, so
``make demo`` trains on every core right after its own build (issue 18, item 6)."""
import os

import pytest
import torch

from fastformer.jobs import devices
from fastformer.jobs.cli import build_parser


@pytest.fixture
def four_cores(monkeypatch):
    """A 4-core machine where torch would start 4 threads."""
    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)


def _loadavg(tmp_path, text):
    path = tmp_path / "loadavg"
    path.write_text(text)
    return str(path)


def test_a_quiet_machine_right_after_a_build_gets_every_core(tmp_path, four_cores):
    # the build left a 1-minute average of 3.9, but only this process is running now
    path = _loadavg(tmp_path, "3.90 2.10 0.95 1/312 40123\n")
    now = devices.runnable_elsewhere(path, own_tasks=str(tmp_path / "no-such-dir"), samples=3, interval=0)
    assert now == 0
    assert devices.pick_threads(None, load=lambda: now) == 4


def test_a_busy_machine_gets_one_thread(tmp_path, four_cores):
    # 5 running tasks besides this one on 4 cores, though the 1-minute average is still low
    path = _loadavg(tmp_path, "0.40 0.20 0.10 6/312 40123\n")
    now = devices.runnable_elsewhere(path, own_tasks=str(tmp_path / "no-such-dir"), samples=1)
    assert now == 5
    assert devices.pick_threads(None, load=lambda: now) == 1


def test_some_other_work_below_the_core_count_keeps_every_core(four_cores):
    assert devices.pick_threads(None, load=lambda: 3) == 4


def test_the_jobs_own_other_processes_are_not_competition(four_cores):
    # 2 processes of one training job on 4 cores: 2 threads each; the sibling running is not load
    assert devices.pick_threads(None, processes_here=2, load=lambda: 1) == 2
    assert devices.pick_threads(None, processes_here=2, load=lambda: 5) == 1


def test_this_processes_running_threads_are_taken_off(tmp_path):
    tasks = tmp_path / "task"
    for tid, state in [(101, "R"), (102, "S"), (103, "R")]:
        (tasks / str(tid)).mkdir(parents=True)
        (tasks / str(tid) / "stat").write_text(f"{tid} (python (worker)) {state} 1 2 3\n")
    path = _loadavg(tmp_path, "1.00 1.00 1.00 5/312 40123\n")
    assert devices.runnable_elsewhere(path, own_tasks=str(tasks), samples=1) == 3  # 5 running, 2 of them ours


def test_the_median_of_the_samples_ignores_a_passing_spike(tmp_path, monkeypatch):
    path = _loadavg(tmp_path, "0.1 0.1 0.1 1/100 1")
    later = iter(["0.1 0.1 0.1 9/100 1", "0.1 0.1 0.1 1/100 1"])
    # between samples another task briefly runs 8 more threads
    monkeypatch.setattr(devices.time, "sleep", lambda seconds: open(path, "w").write(next(later)))
    assert devices.runnable_elsewhere(path, own_tasks=str(tmp_path / "none"), samples=3) == 0


def test_without_proc_the_load_average_decides(monkeypatch, tmp_path, four_cores):
    absent = str(tmp_path / "absent")
    assert devices.runnable_elsewhere(absent) is None
    monkeypatch.setattr(os, "getloadavg", lambda: (4.5, 1.0, 0.5))
    assert devices.machine_load(absent) == 4.5
    assert devices.pick_threads(None, load=lambda: devices.machine_load(absent)) == 1


def test_threads_given_are_taken_as_given_and_checked(four_cores):
    def never():
        raise AssertionError("the load is not read when --threads is given")

    assert devices.pick_threads(3, load=never) == 3
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="--threads must be at least 1"):
            devices.pick_threads(bad, load=never)


def test_the_threads_help_says_what_the_default_looks_at():
    helps = [a.help for a in build_parser()._subparsers._group_actions[0].choices["train"]._actions
             if "--threads" in a.option_strings]
    assert helps == [devices.THREADS_HELP]
    assert "load average" not in devices.THREADS_HELP and "busy" in devices.THREADS_HELP


def test_pick_device():
    assert devices.pick_device("cpu") == torch.device("cpu")
    assert devices.pick_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="--device"):
        devices.pick_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="--device cuda"):
            devices.pick_device("cuda")
