"""Processes started by srun or mpirun (their variables, not torchrun's) form one world."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from zerodp.comm.launch_env import LAUNCHERS
from zerodp.testing import free_port

ROOT = Path(__file__).resolve().parents[2]
_LAUNCH_VARIABLES = {
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    *(name for launcher in LAUNCHERS for name in (launcher.rank, launcher.size)),
    *(
        name
        for launcher in LAUNCHERS
        for name in (launcher.local_rank, launcher.local_size)
        if name
    ),
}


def _slurm(rank: int, port: int) -> dict[str, str]:
    # srun's variables for 2 tasks on one node; the master is the first host of the list.
    return {
        "SLURM_PROCID": str(rank),
        "SLURM_NTASKS": "2",
        "SLURM_LOCALID": str(rank),
        "SLURM_NODELIST": "localhost",
        "SLURM_JOB_ID": "4242",
        "MASTER_PORT": str(port),
    }


def _open_mpi(rank: int, port: int) -> dict[str, str]:
    # mpirun's: no host named; every rank on this node, so rank 0's host is this one.
    return {
        "OMPI_COMM_WORLD_RANK": str(rank),
        "OMPI_COMM_WORLD_SIZE": "2",
        "OMPI_COMM_WORLD_LOCAL_RANK": str(rank),
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        "MASTER_PORT": str(port),
    }


@pytest.mark.timeout(180)
def test_srun_and_mpirun_processes_form_one_world() -> None:
    """Two processes with SLURM's variables, and two with Open MPI's, start at once (4
    processes, 2 worlds on 2 ports); each trains and matches the 2-rank reference."""
    base = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARIABLES}
    base.update({"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "ZERODP_DEVICE": "cpu"})
    procs = {}
    for name, variables in (("srun", _slurm), ("mpirun", _open_mpi)):
        port = free_port()
        for rank in range(2):
            procs[(name, rank)] = subprocess.Popen(
                [sys.executable, "-m", "tests.distributed.launcher_env_script"],
                cwd=ROOT,
                env={**base, **variables(rank, port)},
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
    outputs = {key: proc.communicate(timeout=170) for key, proc in procs.items()}
    for (name, rank), (out, err) in outputs.items():
        assert procs[(name, rank)].returncode == 0, f"{name} rank {rank}:\n{err[-3000:]}"
        assert f"rank {rank} of 2, LOCAL_RANK {rank}: ok" in out, (name, out)
