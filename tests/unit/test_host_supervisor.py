"""How `zerodp run --hostfile` stops its hosts (zerodp.launch.host_supervisor), with pdsh,
srun and stop commands stood in for by small shell scripts on PATH."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from zerodp.launch import host_supervisor, runner

# pdsh, standing in: the launch reports node-b's failure and waits until a stop arrives;
# a stop (`node_agent.py --stop`) notes pdsh's variables and lets the launch end, or with
# STOP_HANGS set never ends (a dead host).
_PDSH = """#!/bin/sh
case "$*" in
  *--stop*)
    env | grep '^PDSH_' | sort > "$WORK/stop.env"
    [ -n "$STOP_HANGS" ] && exec sleep 300
    touch "$WORK/stopped"; exit 0;;
esac
echo "pdsh@here: node-b: ssh exited with exit code 3" >&2
while [ ! -e "$WORK/stopped" ]; do sleep 0.05; done
exit 1
"""


@pytest.fixture
def launch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> runner.HostsPlan:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "train.py").write_text("")
    (tmp_path / "hosts").write_text("node-a slots=1\nnode-b slots=1\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("pdsh", _PDSH), ("ssh", "#!/bin/sh\n")):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.defpath}")
    planned = runner.plan_run(
        ["--hostfile", "hosts", "--master_addr", "10.0.0.1", "--ssh_port", "2200", "train.py"]
    )
    assert isinstance(planned, runner.HostsPlan)
    return planned


def _environ(tmp_path: Path, **extra: str) -> dict[str, str]:
    return {
        "PATH": os.environ["PATH"],
        "WORK": str(tmp_path),
        "PDSH_SSH_ARGS_APPEND": "-o ConnectTimeout=3",
        **extra,
    }


def test_pdsh_stops_run_in_the_launchs_pdsh_environment(
    launch: runner.HostsPlan, tmp_path: Path
) -> None:
    status = host_supervisor.launch_on_hosts(launch.hosts, _environ(tmp_path))
    assert status == 3
    assert (tmp_path / "stop.env").read_text().splitlines() == [
        "PDSH_RCMD_TYPE=ssh",
        "PDSH_SSH_ARGS_APPEND=-o ConnectTimeout=3 -p 2200 -o BatchMode=yes",
    ]


def test_a_stop_that_hangs_still_ends_the_local_processes(
    launch: runner.HostsPlan, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(host_supervisor, "STOP_TIMEOUT_S", 1.0)
    monkeypatch.setattr(host_supervisor, "KILL_AFTER_S", 1.0)
    began = time.monotonic()
    status = host_supervisor.launch_on_hosts(launch.hosts, _environ(tmp_path, STOP_HANGS="1"))
    assert status == 3 and time.monotonic() - began < 60
    assert (tmp_path / "stop.env").exists() and not (tmp_path / "stopped").exists()


def test_stops_run_side_by_side_and_a_missing_program_is_no_crash(tmp_path: Path) -> None:
    # Each stop waits for the other to have started: one after the other, the first would
    # time out (and be killed) before the second began.
    def waits_for(other: str, mine: str) -> list[str]:
        script = f"touch {mine}; while [ ! -e {other} ]; do sleep 0.05; done; touch {mine}.done"
        return ["sh", "-c", script]

    a, b = tmp_path / "a", tmp_path / "b"
    commands = [waits_for(str(b), str(a)), ["no-such-program-here"], waits_for(str(a), str(b))]
    host_supervisor.run_stops(commands, {"PATH": os.defpath}, timeout=60)
    assert (tmp_path / "a.done").exists() and (tmp_path / "b.done").exists()


def test_sigterm_to_the_launcher_reaches_srun(tmp_path: Path) -> None:
    srun = tmp_path / "srun"
    srun.write_text(
        "#!/bin/sh\n"
        f"trap 'touch {tmp_path}/terminated; exit 143' TERM\n"
        f"touch {tmp_path}/ready\n"
        "i=0; while [ $i -lt 600 ]; do sleep 0.05; i=$((i+1)); done\n"
    )
    srun.chmod(0o755)

    def ignore(*_: object) -> None:  # a SIGTERM never ends this test process
        pass

    previous = signal.signal(signal.SIGTERM, ignore)

    def terminate_when_ready() -> None:
        deadline = time.monotonic() + 30
        while not (tmp_path / "ready").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    sender = threading.Thread(target=terminate_when_ready)
    sender.start()
    try:
        status = host_supervisor._run_one([str(srun)], {"PATH": os.defpath})
        restored = signal.getsignal(signal.SIGTERM) is ignore
    finally:
        sender.join()
        signal.signal(signal.SIGTERM, previous)
    assert status == 143 and (tmp_path / "terminated").exists() and restored
