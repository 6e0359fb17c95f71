"""`zerodp run --hostfile`: the commands that start every host (pdsh, ssh, srun, mpirun)
and the environment they export; tests/distributed/test_hostfile_launch.py runs them."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from zerodp.launch import remote_env, runner
from zerodp.launch.hostfile import LaunchError

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


def test_pdsh_runs_one_command_for_every_host(hostfile: Path) -> None:
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
    bin_dir = hostfile.parent / "bin"
    bin_dir.mkdir()
    for name in ("srun", "mpirun"):
        (bin_dir / name).write_text("#!/bin/sh\n")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    srun = _plan("--hostfile", str(hostfile), "--launcher", "slurm", "--launcher_args", "-A proj")
    command = srun.hosts.srun_command()
    assert "--kill-on-bad-exit=1" in command and command[command.index("-A") + 1] == "proj"
    tail = command[command.index("env") :]  # the exports, then the process's own command
    assert "PYTHONUNBUFFERED=1" in tail
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


def test_other_launchers_and_torchrun_options_under_srun_are_refused(hostfile: Path) -> None:
    with pytest.raises(runner.RunUsageError, match="with another MPI, run its launcher yourself"):
        _plan("--hostfile", str(hostfile), "--launcher", "mvapich")
    with pytest.raises(runner.RunUsageError, match="have no place there"):
        runner.plan_run(
            ["--hostfile", str(hostfile), "--launcher", "slurm", "--max-restarts", "2", "train.py"]
        )
