"""The commands that start a run on several hosts (pure: nothing runs here).

- `--launcher pdsh` (the default, as DeepSpeed's): one `pdsh` command for every host when
  pdsh is installed (its `%n` is the host's node rank), otherwise one `ssh` per host.
  Each host runs zerodp's node agent (`zerodp.launch.node_agent`), which runs torchrun
  with the host's node rank, process count, devices and the master's address and port,
  under the exported environment (`zerodp.launch.remote_env`). Over ssh the agent also
  watches its standard input: when the launcher closes it (or the connection drops) the
  host's processes are stopped. `stop_commands` stop a run's agents on each host
  (pdsh forwards no input).
- `--launcher slurm`: one `srun` for every process (`--kill-on-bad-exit`: one failed task
  ends the step); `--launcher openmpi`: one `mpirun`. Each process runs the script
  itself, and `zerodp.initialize` reads its rank from srun's or mpirun's variables
  (`zerodp.comm.launch_env`).

The user's ssh options are kept: `PDSH_SSH_ARGS_APPEND` (pdsh's variable for them) goes
to ssh as it is, and `--ssh_port` and `--launcher_args` are added, never put in its place.
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from zerodp.launch.deepspeed_flags import SeveralHosts
from zerodp.launch.hostfile import LaunchError
from zerodp.launch.node_agent import FILE as NODE_AGENT
from zerodp.launch.remote_env import Exports

PDSH_FAN_OUT = 1024  # DeepSpeed's pdsh fan-out
SSH_ARGS_VARIABLE = "PDSH_SSH_ARGS_APPEND"


@dataclass(frozen=True)
class HostLaunch:
    """Everything the commands for one run on several hosts are made of.

    `node_args`: torchrun's arguments after the rendezvous and the process count (log
    options, the user's torchrun options, the script and its arguments); `direct_command`:
    one process's own command line, for srun and mpirun.
    """

    several: SeveralHosts
    node_args: tuple[str, ...]
    direct_command: tuple[str, ...]
    exports: Exports
    cwd: str
    run_id: str

    @property
    def hosts(self) -> list[str]:
        return list(self.several.pool)

    @property
    def total_processes(self) -> int:
        return sum(len(slots) for slots in self.several.pool.values())

    # -- pdsh and ssh: a node agent on each host ------------------------------------------

    def node_slots(self) -> str:
        """Each node's device slots, `0,1/0,2`: the agent takes its node rank's."""
        return "/".join(",".join(map(str, slots)) for slots in self.several.pool.values())

    def node_command(self, node_rank: str, master_addr: str, *, watch_stdin: bool) -> str:
        """The shell text a host runs: the exports, then the node agent."""
        agent = [
            *(sys.executable, "-u", NODE_AGENT, "--run-id", self.run_id),
            *("--node-rank", node_rank, "--nnodes", str(len(self.several.pool))),
            *("--node-slots", self.node_slots(), "--master-addr", master_addr),
            *("--master-port", str(self.several.master_port)),
            *(("--watch-stdin",) if watch_stdin else ()),
            "--",
            *self.node_args,
        ]
        return f"{self.exports.shell_text()}cd {shlex.quote(self.cwd)} && {shlex.join(agent)}"

    def stop_text(self) -> str:
        return shlex.join([sys.executable, NODE_AGENT, "--stop", self.run_id])

    def ssh_options(self, environ: Mapping[str, str]) -> list[str]:
        """The user's ssh options (`PDSH_SSH_ARGS_APPEND`), then `--ssh_port`, then
        `--launcher_args`."""
        options = shlex.split(environ.get(SSH_ARGS_VARIABLE, ""))
        if self.several.ssh_port is not None:
            options += ["-p", str(self.several.ssh_port)]
        return options

    def ssh_commands(self, master_addr: str, environ: Mapping[str, str]) -> list[list[str]]:
        """One ssh per host, node ranks in the hostfile's order."""
        options = [*self.ssh_options(environ), *self.several.launcher_args]
        return [
            ["ssh", *options, host, self.node_command(str(rank), master_addr, watch_stdin=True)]
            for rank, host in enumerate(self.hosts)
        ]

    def pdsh_command(self, master_addr: str) -> list[str]:
        """One pdsh for every host; pdsh writes each host's node rank for `%n`."""
        return [
            *("pdsh", "-S", "-f", str(PDSH_FAN_OUT), "-w", ",".join(self.hosts)),
            *self.several.launcher_args,
            self.node_command("%n", master_addr, watch_stdin=False),
        ]

    def pdsh_environment(self, environ: Mapping[str, str]) -> dict[str, str]:
        """pdsh's variables: ssh as its remote shell (unless chosen), the user's ssh options
        with `--ssh_port` added to them."""
        env = dict(environ)
        env.setdefault("PDSH_RCMD_TYPE", "ssh")
        if self.several.ssh_port is not None:
            env[SSH_ARGS_VARIABLE] = shlex.join(self.ssh_options(environ))
        return env

    def stop_commands(
        self, hosts: list[str], pdsh: bool, environ: Mapping[str, str]
    ) -> list[list[str]]:
        """Commands that stop this run's node agents on `hosts`."""
        if pdsh:
            return [["pdsh", "-f", str(PDSH_FAN_OUT), "-w", ",".join(hosts), self.stop_text()]]
        options = [*self.ssh_options(environ), *self.several.launcher_args]
        return [["ssh", *options, host, self.stop_text()] for host in hosts]

    # -- srun and mpirun: one command for every process -----------------------------------

    def _per_node(self, launcher: str) -> int:
        counts = {len(slots) for slots in self.several.pool.values()}
        whole = all(slots == list(range(len(slots))) for slots in self.several.pool.values())
        if len(counts) > 1 or not whole:
            raise LaunchError(
                f"--launcher {launcher} starts the same processes on every host, on devices "
                f"0..N-1: the hosts have slots {dict(self.several.pool)}; choose whole hosts "
                "(--include host@host, --num_gpus N), or use --launcher pdsh"
            )
        return counts.pop()

    def _with_exports(self) -> list[str]:
        """The process's command, the exports set by `env` first (values as they are: no
        shell expands them here)."""
        pairs = [f"{name}={value}" for name, value in self.exports.values.items()]
        return ["env", *pairs, *self.direct_command]

    def srun_command(self) -> list[str]:
        per_node = self._per_node("slurm")
        return [
            *("srun", "--ntasks", str(self.total_processes), "--nodes", str(len(self.hosts))),
            *("--ntasks-per-node", str(per_node), "--nodelist", ",".join(self.hosts)),
            "--kill-on-bad-exit=1",
            f"--export=ALL,MASTER_PORT={self.several.master_port}",
            *self.several.launcher_args,
            *self._with_exports(),
        ]

    def mpirun_command(self) -> list[str]:
        per_node = self._per_node("openmpi")
        master = self.several.master_addr or self.hosts[0]
        return [
            *("mpirun", "-n", str(self.total_processes)),
            *("--host", ",".join(f"{host}:{per_node}" for host in self.hosts)),
            *("-x", f"MASTER_ADDR={master}", "-x", f"MASTER_PORT={self.several.master_port}"),
            *self.several.launcher_args,
            *self._with_exports(),
        ]


def direct_command(target: list[str], *, module: bool, no_python: bool) -> list[str]:
    """How srun or mpirun runs one process of `target` (the script, or the `--local_rank`
    wrapper, and their arguments)."""
    if no_python:
        return list(target)
    if module or target[:1] == ["-m"]:
        rest = target[1:] if target[:1] == ["-m"] else target
        return [sys.executable, "-u", "-m", *rest]
    return [sys.executable, "-u", *target]
