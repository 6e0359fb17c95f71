"""Reading srun's and mpirun's environments as torchrun's (zerodp.comm.launch_env)."""

from __future__ import annotations

import pytest

from zerodp.comm import launch_env
from zerodp.comm.launch_env import DEFAULT_MASTER_PORT, first_host, read_launch_env
from zerodp.errors import ConfigError


@pytest.mark.parametrize(
    ("node_list", "host"),
    [
        ("node01", "node01"),
        ("node[01-03,07]", "node01"),
        ("node[07,01-03]", "node07"),
        ("gpu-a[009-012],gpu-b[1-2]", "gpu-a009"),
        ("rack[1-2]-n[3-4]", "rack1-n3"),
        ("alpha,beta[1-2]", "alpha"),
        ("node[3]", "node3"),
    ],
)
def test_first_host_of_slurm_node_lists(node_list: str, host: str) -> None:
    assert first_host(node_list) == host


def test_a_broken_node_list_is_an_error_naming_it() -> None:
    with pytest.raises(ConfigError, match=r"node\[01-"):
        first_host("node[01-")


def test_srun_environment_becomes_torchruns() -> None:
    env = {
        "SLURM_PROCID": "3",
        "SLURM_NTASKS": "4",
        "SLURM_LOCALID": "1",
        "SLURM_NODELIST": "node[07-08]",
        "SLURM_JOB_ID": "12",
    }
    launch = read_launch_env(env)
    assert launch.launcher == "srun (SLURM)" and launch.world_size == 4 and launch.rendezvous
    assert launch.torchrun_variables == {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "node07",
        "MASTER_PORT": str(DEFAULT_MASTER_PORT),
    }
    # An srun of fewer tasks than the allocation: the step's count is the world.
    step = read_launch_env({**env, "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "4"})
    assert step.world_size == 4
    # The step's node list comes first; MASTER_ADDR and MASTER_PORT win when set.
    stepped = read_launch_env({**env, "SLURM_STEP_NODELIST": "node08"})
    assert stepped.torchrun_variables["MASTER_ADDR"] == "node08"
    given = read_launch_env({**env, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"})
    assert given.torchrun_variables["MASTER_ADDR"] == "10.0.0.1"
    assert given.torchrun_variables["MASTER_PORT"] == "1234"


def test_open_mpi_environment_becomes_torchruns() -> None:
    env = {
        "OMPI_COMM_WORLD_RANK": "1",
        "OMPI_COMM_WORLD_SIZE": "2",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    }
    launch = read_launch_env(env)
    assert launch.torchrun_variables == {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",  # every rank on this node
        "MASTER_PORT": str(DEFAULT_MASTER_PORT),
    }
    # Ranks on several nodes: mpirun names no host, so MASTER_ADDR must be given.
    spread = {**env, "OMPI_COMM_WORLD_SIZE": "4"}
    with pytest.raises(ConfigError, match="set MASTER_ADDR"):
        read_launch_env(spread)
    assert (
        read_launch_env({**spread, "MASTER_ADDR": "n0"}).torchrun_variables["MASTER_ADDR"] == "n0"
    )


def test_open_mpi_wins_over_the_slurm_variables_it_inherits() -> None:
    env = {
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "1",
        "SLURM_LOCALID": "0",
        "OMPI_COMM_WORLD_RANK": "1",
        "OMPI_COMM_WORLD_SIZE": "2",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    }
    assert read_launch_env(env).torchrun_variables["RANK"] == "1"


def test_pmi_environment_becomes_torchruns() -> None:
    env = {"PMI_RANK": "0", "PMI_SIZE": "2", "MPI_LOCALRANKID": "0", "MASTER_ADDR": "h"}
    launch = read_launch_env(env)
    assert launch.launcher == "mpirun (PMI)"
    assert launch.torchrun_variables["WORLD_SIZE"] == "2"


def test_mvapich_environment_gives_each_rank_its_local_rank() -> None:
    env = {
        "MV2_COMM_WORLD_RANK": "3",
        "MV2_COMM_WORLD_SIZE": "4",
        "MV2_COMM_WORLD_LOCAL_RANK": "1",
        "MV2_COMM_WORLD_LOCAL_SIZE": "2",
        "MASTER_ADDR": "n0",
    }
    variables = read_launch_env(env).torchrun_variables
    assert (variables["LOCAL_RANK"], variables["LOCAL_WORLD_SIZE"]) == ("1", "2")
    with pytest.raises(ConfigError, match="MV2_COMM_WORLD_LOCAL_RANK not set"):
        read_launch_env({k: v for k, v in env.items() if k != "MV2_COMM_WORLD_LOCAL_RANK"})


SRUN_PMI2 = {  # srun --mpi=pmi2 python train.py: PMI's rank and size, no MPI_LOCALRANKID
    "PMI_RANK": "3",
    "PMI_SIZE": "4",
    "SLURM_PROCID": "3",
    "SLURM_NTASKS": "4",
    "SLURM_LOCALID": "1",
    "SLURM_NODELIST": "node[07-08]",
}


def test_srun_with_pmi2_is_read_from_slurms_variables() -> None:
    launch = read_launch_env(SRUN_PMI2)
    assert launch.launcher == "srun (SLURM)"
    assert launch.torchrun_variables["LOCAL_RANK"] == "1"
    assert launch.torchrun_variables["MASTER_ADDR"] == "node07"
    # The step's count is the world PMI_SIZE is compared with.
    stepped = {**SRUN_PMI2, "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "4"}
    assert read_launch_env(stepped).world_size == 4


@pytest.mark.parametrize(
    ("change", "named"),
    [
        # The batch script's SLURM variables around an mpiexec: another rank, another world.
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}, "SLURM_PROCID=0, SLURM_NTASKS=1"),
        ({"SLURM_NTASKS": "8"}, "give another rank or world size"),
        ({"SLURM_LOCALID": ""}, r"MPI_LOCALRANKID not set \(while PMI_RANK, PMI_SIZE is\);"),
    ],
)
def test_partial_pmi_without_an_agreeing_complete_launcher_is_still_an_error(
    change: dict[str, str], named: str
) -> None:
    with pytest.raises(ConfigError, match=named):
        read_launch_env({**SRUN_PMI2, **change})


def test_torchruns_own_environment_is_used_as_it_is() -> None:
    env = {"RANK": "0", "WORLD_SIZE": "2", "SLURM_PROCID": "5", "SLURM_NTASKS": "8"}
    launch = read_launch_env(env)
    assert launch.launcher == "torchrun" and launch.torchrun_variables == {}
    assert launch.rendezvous


def test_no_launcher_is_one_process_without_rendezvous() -> None:
    launch = read_launch_env({"SLURM_JOB_ID": "3", "SLURM_NODELIST": "n1"})  # salloc's shell
    assert launch.world_size == 1 and not launch.rendezvous
    one = read_launch_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_LOCALID": "0"})
    assert one.world_size == 1 and not one.rendezvous  # srun -n 1: no master needed


@pytest.mark.parametrize(
    ("env", "named"),
    [
        ({"RANK": "0"}, "WORLD_SIZE not set"),
        ({"WORLD_SIZE": "2"}, "RANK not set"),
        ({"SLURM_PROCID": "0", "SLURM_LOCALID": "0"}, "SLURM_NTASKS not set"),
        ({"SLURM_NTASKS": "2"}, "SLURM_PROCID, SLURM_LOCALID not set"),
        ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}, "OMPI_COMM_WORLD_LOCAL_RANK"),
        ({"PMI_SIZE": "2"}, "PMI_RANK"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2 is not below WORLD_SIZE=2"),
        ({"SLURM_PROCID": "x", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0"}, "SLURM_PROCID='x'"),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0"}, "SLURM_NODELIST"),
        (
            {**dict.fromkeys(("RANK", "LOCAL_RANK"), "0"), "WORLD_SIZE": "0"},
            "WORLD_SIZE='0'",
        ),
    ],
)
def test_a_partial_environment_is_an_error_naming_what_is_missing(
    env: dict[str, str], named: str
) -> None:
    with pytest.raises(ConfigError, match=named.replace("(", r"\(").replace("[", r"\[")):
        read_launch_env(env)


def test_initialize_refuses_a_partial_environment_before_setting_anything_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from zerodp.comm import process_group as group

    for name in (
        "RANK",
        "WORLD_SIZE",
        *(v for launcher in launch_env.LAUNCHERS for v in (launcher.rank, launcher.size)),
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_PROCID", "1")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    monkeypatch.setattr(group, "is_initialized", lambda: False)
    with pytest.raises(ConfigError, match="SLURM_NTASKS not set"):
        group.ensure_process_group()
