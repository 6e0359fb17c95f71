"""The commands that start a run on several hosts (pure: nothing runs here).

- `--launcher pdsh` (the default, as DeepSpeed's): one `pdsh` command for every host when
  pdsh is installed (its `%n` is the host's node rank; every other `%` of the command is
  written `%%`, which pdsh turns back into `%`), otherwise one `ssh` per host.
  Each host runs zerodp's node agent (`zerodp.launch.node_agent`), which runs torchrun
  with the host's node rank, process count, devices and the master's address and port,
  under the exported environment (`zerodp.launch.remote_env`). Over ssh the agent also
  watches its standard input: when the launcher closes it (or the connection drops) the
  host's processes are stopped. `stop_commands` stop a run's agents on each host
  (pdsh forwards no input), with ssh options that neither ask for a password nor wait
  long for a dead host (`UNATTENDED_SSH_OPTIONS`, unless the user's options set them).
- `--launcher slurm`: one `srun` for every process (`--kill-on-bad-exit`: one failed task
  ends the step); `--launcher openmpi`: one `mpirun`. Each process runs the script
  itself under `sh -c`, which sets the exports first (the host's shell expands an env
  file's values, as over ssh and pdsh), and `zerodp.initialize` reads its rank from srun's
  or mpirun's variables (`zerodp.comm.launch_env`).

`--launcher_args` are the launcher program's arguments, as in DeepSpeed: pdsh's (never
ssh's: without pdsh they are refused), srun's or mpirun's. The user's ssh options are
`PDSH_SSH_ARGS_APPEND` (pdsh's variable for them), which goes to ssh as it is (the
address lookup's and the ssh fallback's too), with `--ssh_port` added, never put in its
place.
"""

from __future__ import annotations

import re
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from zerodp.launch.deepspeed_flags import SeveralHosts
from zerodp.launch.hostfile import LaunchError
from zerodp.launch.node_agent import FILE as NODE_AGENT
from zerodp.launch.remote_env import Exports

PDSH_FAN_OUT = 1024  # DeepSpeed's pdsh fan-out
SSH_ARGS_VARIABLE = "PDSH_SSH_ARGS_APPEND"
UNATTENDED_SSH_OPTIONS = (("BatchMode", "yes"), ("ConnectTimeout", "10"))
"""The stop commands' ssh options, where the user's set none of them: a stop runs while
the launcher is ending, with nobody to type a password and a host that may be gone."""


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
        """The user's ssh options (`PDSH_SSH_ARGS_APPEND`), then `--ssh_port`."""
        options = shlex.split(environ.get(SSH_ARGS_VARIABLE, ""))
        if self.several.ssh_port is not None:
            options += ["-p", str(self.several.ssh_port)]
        return options

    def refuse_launcher_args_over_ssh(self) -> None:
        """`--launcher_args` are pdsh's (as DeepSpeed passes them): without pdsh there is
        no program to give them to, and ssh would read them otherwise."""
        if self.several.launcher_args:
            raise LaunchError(
                f"--launcher_args {shlex.join(self.several.launcher_args)!r} are pdsh's "
                "arguments (as with DeepSpeed), and pdsh is not installed here, so each host "
                "would be reached with ssh; install pdsh, or drop --launcher_args and give "
                f"ssh's options in {SSH_ARGS_VARIABLE} (the port with --ssh_port)"
            )

    def ssh_commands(self, master_addr: str, environ: Mapping[str, str]) -> list[list[str]]:
        """One ssh per host, node ranks in the hostfile's order."""
        options = self.ssh_options(environ)
        return [
            ["ssh", *options, host, self.node_command(str(rank), master_addr, watch_stdin=True)]
            for rank, host in enumerate(self.hosts)
        ]

    def pdsh_command(self, master_addr: str) -> list[str]:
        """One pdsh for every host; pdsh writes each host's node rank for `%n`, and every
        other `%` is escaped (pdsh rewrites `%h`, `%u`, `%n` in any argument)."""
        placeholder = f"@zerodp-node-rank-{self.run_id}@"
        text = pdsh_literal(self.node_command(placeholder, master_addr, watch_stdin=False))
        return [
            *("pdsh", "-S", "-f", str(PDSH_FAN_OUT), "-w", ",".join(self.hosts)),
            *self.several.launcher_args,
            text.replace(placeholder, "%n"),
        ]

    def pdsh_environment(
        self, environ: Mapping[str, str], extra_ssh_options: Sequence[str] = ()
    ) -> dict[str, str]:
        """pdsh's variables: ssh as its remote shell (unless chosen), the user's ssh options
        as they are written (pdsh splits them at spaces) with `--ssh_port` added to them."""
        env = dict(environ)
        env.setdefault("PDSH_RCMD_TYPE", "ssh")
        added = list(extra_ssh_options)
        if self.several.ssh_port is not None:
            added = ["-p", str(self.several.ssh_port), *added]
        if added:
            own = environ.get(SSH_ARGS_VARIABLE, "").strip()
            env[SSH_ARGS_VARIABLE] = " ".join([own, *added] if own else added)
        return env

    def stop_commands(
        self, hosts: list[str], pdsh: bool, environ: Mapping[str, str]
    ) -> list[list[str]]:
        """Commands that stop this run's node agents on `hosts` (run them with
        `stop_environment`)."""
        if pdsh:
            return [
                [
                    *("pdsh", "-f", str(PDSH_FAN_OUT), "-w", ",".join(hosts)),
                    *self.several.launcher_args,
                    pdsh_literal(self.stop_text()),
                ]
            ]
        options = self.ssh_options(environ)
        options += unattended_options(options)
        return [["ssh", *options, host, self.stop_text()] for host in hosts]

    def stop_environment(self, environ: Mapping[str, str], pdsh: bool) -> dict[str, str]:
        """The launch's own environment (pdsh's variables over pdsh), with the unattended
        ssh options added to pdsh's."""
        if not pdsh:
            return dict(environ)
        given = shlex.split(environ.get(SSH_ARGS_VARIABLE, ""))
        return self.pdsh_environment(environ, unattended_options(given))

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
        """The process's command, run by the host's shell after the exports, as over ssh
        and pdsh: an env file's `$LD_LIBRARY_PATH` is the host's, a forwarded value is
        quoted; `exec "$@"` then runs the command's words as they are."""
        text = f'{self.exports.shell_text()}exec "$@"'
        return ["sh", "-c", text, "sh", *self.direct_command]

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


def pdsh_literal(text: str) -> str:
    """`text` with every `%` escaped, so that pdsh passes it on as it is."""
    return text.replace("%", "%%")


def unattended_options(options: Sequence[str]) -> list[str]:
    """The `-o Name=value` options of `UNATTENDED_SSH_OPTIONS` that `options` (ssh's
    command line) does not set itself: the user's choice is never overridden."""
    given = set()
    for index, word in enumerate(options):
        if word == "-o" and index + 1 < len(options):
            text = options[index + 1]
        elif word.startswith("-o") and len(word) > 2:
            text = word[2:]
        else:
            continue
        given.add(re.split(r"[\s=]", text.strip(), maxsplit=1)[0].lower())
    return [
        word
        for name, value in UNATTENDED_SSH_OPTIONS
        if name.lower() not in given
        for word in ("-o", f"{name}={value}")
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
