"""`zerodp run --hostfile` starts every host itself (over ssh here: pdsh is not installed).

The hosts are reached through an `ssh` stand-in on PATH that records its arguments and runs
the command on this machine, as ssh would run it on the host. Two "hosts" of one slot
each make a world of 2; the `.deepspeed_env` variable and the forwarded PYTHON* variables
reach every rank; a failing rank makes the launcher exit with its status, and no process
of the run is left afterwards (the others' stuck rank included).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).with_name("hostfile_rank_script.py")

_SSH_STAND_IN = '''#!{python}
"""ssh, standing in: records the host and options, runs the command on this machine."""
import json, os, sys
args = sys.argv[1:]
options = []
while args and args[0].startswith("-"):
    takes_value = args[0] in ("-p", "-o", "-i", "-l", "-F", "-J")
    options += args[: 2 if takes_value else 1]
    args = args[2 if takes_value else 1 :]
host, command = args[0], " ".join(args[1:])
with open(os.environ["SSH_STAND_IN_LOG"], "a") as log:
    log.write(json.dumps({{"host": host, "options": options, "command": command}}) + "\\n")
os.execvp("bash", ["bash", "-c", command])
'''


def _processes_marked(mark: str) -> list[int]:
    """Live processes whose environment holds `mark` (the run's own, on any 'host')."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if mark.encode() in environ.read_bytes():
                found.append(int(environ.parent.name))
        except OSError:
            continue
    return [pid for pid in found if pid != os.getpid()]


@pytest.fixture
def hosts(tmp_path: Path) -> dict[str, object]:
    return make_hosts(tmp_path)


def make_hosts(tmp_path: Path) -> dict[str, object]:
    """A hostfile of two hosts, the ssh stand-in on PATH, a `.deepspeed_env`, and the
    environment of the launch (with a mark that every process of the run inherits)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    ssh = bin_dir / "ssh"
    ssh.write_text(_SSH_STAND_IN.format(python=sys.executable))
    ssh.chmod(0o755)
    (tmp_path / "hostfile").write_text("# two hosts, one slot each\nhostA slots=1\nhostB slots=1\n")
    (tmp_path / ".deepspeed_env").write_text("ZDP_FROM_ENV_FILE=from-the-file\n")
    mark = f"ZDP_RUN_MARK_{uuid.uuid4().hex}"
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in {"RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"}
    }
    env.update(
        {
            "PATH": f"{bin_dir}:{env['PATH']}",
            "PYTHONPATH": str(ROOT),
            "PYTHONHASHSEED": "7",  # a PYTHON* variable: forwarded to every host
            "OMP_NUM_THREADS": "1",
            "SSH_STAND_IN_LOG": str(tmp_path / "ssh.log"),
            "PDSH_SSH_ARGS_APPEND": "-o StrictHostKeyChecking=no",  # the user's own
            mark: "1",
        }
    )
    return {"dir": tmp_path, "env": env, "mark": mark}


def _launch(
    hosts: dict, *script_args: str, flags: tuple[str, ...] = (), timeout: int = 150
) -> subprocess.CompletedProcess:
    out = hosts["dir"] / "out"
    out.mkdir(exist_ok=True)
    for old in out.glob("rank*.json"):
        old.unlink()
    command = [
        *(sys.executable, "-m", "zerodp.launch.cli", "run", "--hostfile", "hostfile", *flags),
        *("--ssh_port", "2222", "--master_port", str(_free_port())),
        *(str(SCRIPT), "--out", str(out), *script_args),
    ]
    return subprocess.run(
        command,
        cwd=hosts["dir"],
        env=hosts["env"],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _free_port() -> int:
    from zerodp.testing import free_port

    return free_port()


def _ranks(hosts: dict) -> dict[int, dict]:
    return {
        int(file.stem[4:]): json.loads(file.read_text())
        for file in (hosts["dir"] / "out").glob("rank*.json")
    }


@pytest.mark.timeout(300)
def test_every_host_is_started_and_a_failure_stops_them_all(hosts: dict) -> None:
    done = _launch(hosts)
    assert done.returncode == 0, done.stderr[-4000:]
    log = [json.loads(line) for line in (hosts["dir"] / "ssh.log").read_text().splitlines()]
    started = [entry for entry in log if "node_agent.py" in entry["command"]]
    assert sorted(entry["host"] for entry in started) == ["hostA", "hostB"]
    # The first host's address was asked of it (no --master_addr), as DeepSpeed asks it.
    assert any(entry["command"] == "hostname -I" for entry in log)
    for entry in started:  # the user's ssh options kept, --ssh_port added
        assert entry["options"][:4] == ["-o", "StrictHostKeyChecking=no", "-p", "2222"]
    ranks = _ranks(hosts)
    assert sorted(ranks) == [0, 1]
    for rank, record in ranks.items():
        assert record["world"] == 2 and record["summed"] == 2 and record["node"] == rank
        assert record["local_rank_arg"] == 0
        assert record["from_env_file"] == "from-the-file" and record["forwarded"] == "7"

    # Rank 1 (on hostB) fails with status 3 while rank 0 is stuck: the launcher exits with
    # 3 and stops hostA's processes; nothing of the run is left on either "host". (Without
    # the --local_rank wrapper, whose import of zerodp costs seconds a rank here.)
    failed = _launch(hosts, "--fail-rank", "1", flags=("--no_local_rank",))
    assert failed.returncode == 3, failed.stderr[-4000:]
    assert sorted(_ranks(hosts)) == [0, 1]  # both ranks had started
    assert _processes_marked(hosts["mark"]) == []
