"""`zerodp run --hostfile`: the commands that start every host (pdsh, ssh, srun, mpirun)
and the environment they export; tests/distributed/test_hostfile_launch.py runs them."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from zerodp.errors import ConfigError
from zerodp.launch import host_supervisor, remote_env, runner
from zerodp.launch.hostfile import LaunchError
from zerodp.launch.local_rank import deepspeed_environment, tasks_per_node
from zerodp.launch.multinode_runner import unattended_options

ENV = {"PATH": "/usr/bin", "PDSH_SSH_ARGS_APPEND": "-o ConnectTimeout=9 -i key"}


@pytest.fixture
def hostfile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    (tmp_path / "train.py").write_text("print('hi')\n")
    path = tmp_path / "hosts"
    path.write_text("node-a slots=2\nnode-b slots=2\nnode-c slots=2\n")
    return path


def _installed(hostfile: Path, monkeypatch: pytest.MonkeyPatch, *names: str) -> Path:
    """Stand-ins named `names` (doing nothing) as the only programs on PATH."""
    bin_dir = hostfile.parent / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name in names:
        (bin_dir / name).write_text("#!/bin/sh\n")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    return bin_dir


def _plan(*argv: str) -> runner.HostsPlan:
    planned = runner.plan_run([*argv, "train.py", "--lr", "0.1"])
    assert isinstance(planned, runner.HostsPlan)
    return planned


def test_ssh_per_host_with_node_ranks_the_users_options_and_the_port(hostfile: Path) -> None:
    launch = _plan("--hostfile", str(hostfile), "--exclude", "node-c", "--ssh_port", "2222").hosts
    commands = launch.ssh_commands("10.1.1.1", ENV)
    assert [command[:8] for command in commands] == [
        ["ssh", "-o", "ConnectTimeout=9", "-i", "key", "-p", "2222", host]
        for host in ("node-a", "node-b")
    ]
    for rank, command in enumerate(commands):
        words = shlex.split(command[-1])
        agent = words[words.index("--run-id") - 2 :]
        assert agent[1].endswith("zerodp/launch/node_agent.py")
        assert agent[agent.index("--node-rank") + 1] == str(rank)
        assert agent[agent.index("--nnodes") + 1] == "2"
        assert agent[agent.index("--node-slots") + 1] == "0,1/0,1"
        assert agent[agent.index("--master-addr") + 1] == "10.1.1.1"
        assert "--watch-stdin" in agent
        assert agent[agent.index("--") + 1 :] == [
            *("-m", "zerodp.launch.local_rank", "--as", "script", "train.py", "--lr", "0.1")
        ]


def test_a_given_master_address_is_used_and_torchruns_rendezvous_is_zerodps(
    hostfile: Path,
) -> None:
    given = _plan("--hostfile", str(hostfile), "--master_addr", "10.0.0.5", "--master_port", "7")
    assert given.hosts.several.master_addr == "10.0.0.5"  # not the first host's name
    assert given.hosts.several.master_port == 7
    assert _plan("--hostfile", str(hostfile)).hosts.several.master_addr is None  # asked
    with pytest.raises(runner.RunUsageError, match="--nnodes: with a hostfile zerodp starts"):
        runner.plan_run(["--hostfile", str(hostfile), "--nnodes", "3", "train.py"])
    with pytest.raises(runner.RunUsageError, match="one process per slot"):
        runner.plan_run(["--hostfile", str(hostfile), "-n", "2", "train.py"])


def test_pdsh_runs_one_command_for_every_host(
    hostfile: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _installed(hostfile, monkeypatch, "pdsh")
    launch = _plan(
        *("--hostfile", str(hostfile), "--num_nodes", "2", "--num_gpus", "1"),
        *("--ssh_port", "2200", "--launcher_args", "-u 30"),
    ).hosts
    command = launch.pdsh_command("10.1.1.1")
    assert command[:9] == [
        "pdsh",
        "-S",
        "-f",
        "1024",
        "-w",
        "node-a,node-b",
        "-u",
        "30",
        command[8],
    ]
    words = shlex.split(command[-1])
    assert words[words.index("--node-rank") + 1] == "%n"  # pdsh writes each host's rank
    assert "--watch-stdin" not in words  # pdsh forwards no input: stopped by the stop command
    env = launch.pdsh_environment(ENV)
    assert env["PDSH_RCMD_TYPE"] == "ssh"
    assert (
        env["PDSH_SSH_ARGS_APPEND"] == "-o ConnectTimeout=9 -i key -p 2200"
    )  # added, not replaced
    (stop,) = launch.stop_commands(["node-b"], True, ENV)
    assert stop[:5] == ["pdsh", "-f", "1024", "-w", "node-b"] and "--stop" in stop[-1]
    assert stop[5:7] == ["-u", "30"]  # pdsh's arguments reach the stop's pdsh too
    # The stops run in the launch's pdsh environment, never asking for a password nor
    # waiting long for a dead host; the user's ConnectTimeout stays the only one.
    stop_env = launch.stop_environment(ENV, pdsh=True)
    assert stop_env["PDSH_RCMD_TYPE"] == "ssh"
    assert stop_env["PDSH_SSH_ARGS_APPEND"] == "-o ConnectTimeout=9 -i key -p 2200 -o BatchMode=yes"


def _pdsh_expands(argument: str, rank: int) -> str:
    """What pdsh runs for one argument on the host of node rank `rank` (its `%h`, `%u`,
    `%n` and `%%`, as pdsh's manual gives them)."""
    words = {"h": "node-x", "u": "user", "n": str(rank), "%": "%"}
    return re.sub(r"%(.)", lambda found: words.get(found[1], found[0]), argument)


def test_pdsh_passes_every_percent_sign_on_as_it_is(
    hostfile: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (hostfile.parent / ".deepspeed_env").write_text("FMT=%h-%u\n")
    _installed(hostfile, monkeypatch, "pdsh")
    planned = runner.plan_run(["--hostfile", str(hostfile), "train.py", "--name", "run-%n-100%"])
    assert isinstance(planned, runner.HostsPlan)
    words = shlex.split(_pdsh_expands(planned.hosts.pdsh_command("10.1.1.1")[-1], rank=1))
    assert words[words.index("--node-rank") + 1] == "1"
    assert words[-2:] == ["--name", "run-%n-100%"]
    assert "export FMT=%h-%u;" in _pdsh_expands(planned.hosts.pdsh_command("h")[-1], rank=0)


def test_launcher_args_are_pdshs_and_never_go_to_ssh(
    hostfile: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _installed(hostfile, monkeypatch, "ssh")  # no pdsh: each host over ssh
    with pytest.raises(runner.RunUsageError, match=r"are pdsh's arguments .* install pdsh"):
        _plan("--hostfile", str(hostfile), "--launcher_args", "-l admin")
    with_pdsh = _installed(hostfile, monkeypatch, "pdsh", "ssh")
    launch = _plan("--hostfile", str(hostfile), "--launcher_args", "-R exec").hosts
    asked: list[list[str]] = []

    def answer(command: list[str], **_: object) -> subprocess.CompletedProcess:
        asked.append(command)
        return subprocess.CompletedProcess(command, 0, stdout="10.0.0.7 fe80::1\n", stderr="")

    monkeypatch.setattr(host_supervisor.subprocess, "run", answer)
    assert host_supervisor.ask_address(launch, ENV) == "10.0.0.7"
    assert asked == [["ssh", "-o", "ConnectTimeout=9", "-i", "key", "node-a", "hostname -I"]]
    assert "-R" not in launch.ssh_commands("h", ENV)[0]
    # Found out again when the launch starts (the PATH may have changed since).
    (with_pdsh / "pdsh").unlink()
    with pytest.raises(LaunchError, match="are pdsh's arguments"):
        host_supervisor.launch_on_hosts(launch, {**ENV, "PATH": str(with_pdsh)})


def test_stops_over_ssh_keep_the_users_options_and_cannot_hang(hostfile: Path) -> None:
    launch = _plan("--hostfile", str(hostfile), "--ssh_port", "2200").hosts
    (stop,) = launch.stop_commands(["node-b"], False, ENV)
    assert stop[:10] == [
        *("ssh", "-o", "ConnectTimeout=9", "-i", "key", "-p", "2200"),
        *("-o", "BatchMode=yes", "node-b"),
    ]
    assert launch.stop_environment(ENV, pdsh=False) == ENV
    assert unattended_options([]) == ["-o", "BatchMode=yes", "-o", "ConnectTimeout=10"]
    assert unattended_options(["-oBatchMode=no", "-o", "connecttimeout 3"]) == []


def test_the_exports_are_deepspeeds(hostfile: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    monkeypatch.setenv("PYTHONPATH", "/opt/lib")
    monkeypatch.setenv("UNRELATED", "x")
    home = Path.home()
    (home / ".deepspeed_env").write_text("FROM_HOME=1\nBOTH=home\n")
    (hostfile.parent / ".deepspeed_env").write_text(
        "# comment\nBOTH=cwd\nLD_LIBRARY_PATH=/opt/x:$LD_LIBRARY_PATH\nNCCL_DEBUG=WARN\n"
    )
    exports = _plan("--hostfile", str(hostfile)).hosts.exports
    values = exports.values
    assert values["PYTHONPATH"] == f"{hostfile.parent.resolve()}:/opt/lib"
    assert values["PYTHONUNBUFFERED"] == "1" and "UNRELATED" not in values
    assert (values["FROM_HOME"], values["BOTH"], values["NCCL_DEBUG"]) == ("1", "cwd", "WARN")
    text = exports.shell_text()
    assert "export LD_LIBRARY_PATH=/opt/x:$LD_LIBRARY_PATH;" in text  # expanded on the host
    monkeypatch.setenv("DS_ENV_FILE", "other.env")
    (hostfile.parent / "other.env").write_text("ONLY_OTHER=1\n")
    assert "BOTH" not in remote_env.exported_environment().values
    (hostfile.parent / "other.env").write_text("not a pair\n")
    with pytest.raises(LaunchError, match=r"other\.env, line 1: expected KEY=VALUE"):
        remote_env.exported_environment()


def test_srun_and_mpirun_commands_or_a_refusal_naming_them(
    hostfile: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(hostfile.parent / "empty"))
    with pytest.raises(runner.RunUsageError) as refused:
        _plan("--hostfile", str(hostfile), "--launcher", "slurm")
    assert "srun is not installed here; run this on a node of the SLURM allocation" in str(
        refused.value
    )
    assert "srun --ntasks 6 --nodes 3 --ntasks-per-node 2 --nodelist node-a,node-b,node-c" in str(
        refused.value
    )
    _installed(hostfile, monkeypatch, "srun", "mpirun")
    srun = _plan("--hostfile", str(hostfile), "--launcher", "slurm", "--launcher_args", "-A proj")
    command = srun.hosts.srun_command()
    assert "--kill-on-bad-exit=1" in command and command[command.index("-A") + 1] == "proj"
    tail = command[command.index("sh") :]  # the exports in sh, then the process's command
    assert tail[:2] == ["sh", "-c"] and "export PYTHONUNBUFFERED=1;" in tail[2]
    assert tail[-8:] == [
        *("-u", "-m", "zerodp.launch.local_rank", "--as", "script"),
        *("train.py", "--lr", "0.1"),
    ]
    mpirun = _plan(
        "--hostfile", str(hostfile), "--launcher", "openmpi", "--include", "node-a@node-c"
    )
    command = mpirun.hosts.mpirun_command()
    assert command[:5] == ["mpirun", "-n", "4", "--host", "node-a:2,node-c:2"]
    assert "MASTER_ADDR=node-a" in command
    with pytest.raises(runner.RunUsageError, match="choose whole hosts"):
        _plan(
            "--hostfile", str(hostfile), "--launcher", "openmpi", "--include", "node-a:1@node-b"
        ).hosts.mpirun_command()


def test_srun_and_mpirun_expand_the_env_files_values_on_the_host(
    hostfile: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (hostfile.parent / ".deepspeed_env").write_text("LD_LIBRARY_PATH=/opt/x:$LD_LIBRARY_PATH\n")
    monkeypatch.setenv("ZERODP_NOTE", "100% of $HOME")  # forwarded: passed as it is
    _installed(hostfile, monkeypatch, "srun", "mpirun")
    for launcher in ("slurm", "openmpi"):
        launch = _plan("--hostfile", str(hostfile), "--launcher", launcher).hosts
        command = launch.srun_command() if launcher == "slurm" else launch.mpirun_command()
        start = command.index("sh")
        # What srun or mpirun runs on a host: the shell words, then the process's command
        # (here one that prints what the process sees).
        show = 'echo "$LD_LIBRARY_PATH|$ZERODP_NOTE|$0"'
        on_host = [*command[start : start + 4], "sh", "-c", show, "%n"]
        shown = subprocess.run(
            on_host,
            env={"PATH": os.defpath, "LD_LIBRARY_PATH": "/host/lib", "HOME": "/h"},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert shown == "/opt/x:/host/lib|100% of $HOME|%n\n"


def test_other_launchers_and_torchrun_options_under_srun_are_refused(hostfile: Path) -> None:
    with pytest.raises(runner.RunUsageError, match="with another MPI, run its launcher yourself"):
        _plan("--hostfile", str(hostfile), "--launcher", "mvapich")
    with pytest.raises(runner.RunUsageError, match="have no place there"):
        runner.plan_run(
            ["--hostfile", str(hostfile), "--launcher", "slurm", "--max-restarts", "2", "train.py"]
        )


def test_srun_tasks_get_deepspeeds_node_layout_from_srun() -> None:
    srun_task = {
        "SLURM_PROCID": "6",
        "SLURM_NTASKS": "7",
        "SLURM_LOCALID": "0",
        "SLURM_NODELIST": "n[1-4]",
        "SLURM_NODEID": "3",
        "SLURM_NNODES": "4",
        "SLURM_STEP_TASKS_PER_NODE": "2(x3),1",
        "SLURM_TASKS_PER_NODE": "2(x4)",  # the allocation's: the step's comes first
    }
    deepspeed_environment(env := dict(srun_task))
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"]) == ("6", "0", "7")
    assert (env["LOCAL_SIZE"], env["CROSS_RANK"], env["CROSS_SIZE"]) == ("1", "3", "4")
    del srun_task["SLURM_STEP_TASKS_PER_NODE"]
    deepspeed_environment(env := {**srun_task, "SLURM_NODEID": "1", "SLURM_NTASKS": "8"})
    assert (env["LOCAL_SIZE"], env["CROSS_RANK"], env["CROSS_SIZE"]) == ("2", "1", "4")
    # torchrun's layout wins where torchrun started the process (srun torchrun ...).
    torchrun = {**srun_task, "RANK": "5", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4"}
    deepspeed_environment(env := {**torchrun, "GROUP_RANK": "1"})
    assert (env["LOCAL_SIZE"], env["CROSS_RANK"], env["CROSS_SIZE"]) == ("4", "1", "2")
    assert tasks_per_node("3,2(x2)") == [3, 2, 2]
    with pytest.raises(ConfigError, match=r"SLURM tasks per node '2\(x\)': expected"):
        tasks_per_node("2(x)")
