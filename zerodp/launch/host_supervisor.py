"""Start a run on several hosts, wait for it, and stop every host when one fails.

The launcher's exit status is 0 when every host's processes ended with 0; otherwise the
first failed host's (its failed rank's, as `zerodp run` reports it on one machine). As
soon as one host fails, the others are stopped: over ssh by closing each one's input
(its node agent stops torchrun and every process below it), then by the stop command
for any still running, then by ending the local ssh; over pdsh by the stop command on
every host, under the environment the launch had (its `PDSH_RCMD_TYPE`, its ssh options
and port). The stop commands run side by side, each for at most `STOP_TIMEOUT_S`; one
that fails or hangs (a dead host) is reported and the others go on, and the local ssh
or pdsh processes still left are killed at the end whatever the stops did. A signal to
the launcher (Ctrl-C, SIGTERM) stops every host the same way. So a failed run leaves no
process behind on any host (DeepSpeed's launcher returned 0 for failed nodes, issue
#1722, and left the others running).

Under srun and mpirun, which stop every process of the job themselves, the launcher's
SIGTERM and SIGINT are passed on to srun or mpirun (a SIGTERM would otherwise end the
launcher alone and leave the job running).
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from typing import IO, Any

from zerodp.launch.hostfile import LaunchError
from zerodp.launch.multinode_runner import HostLaunch
from zerodp.launch.node_agent import STOP_GRACE_S

POLL_S = 0.2
STOP_TIMEOUT_S = STOP_GRACE_S + 30
"""How long a stop command may run (its agents take up to STOP_GRACE_S to stop)."""
KILL_AFTER_S = STOP_GRACE_S + 10
"""How long the local ssh / pdsh processes get to end after the stops before being killed."""
_PDSH_FAILURE = re.compile(r"^pdsh@\S+: (\S+): .*exit(?:ed with exit)? code (\d+)")


def launch_on_hosts(launch: HostLaunch, environ: Mapping[str, str] | None = None) -> int:
    """Run `launch` and return the launcher's exit status (see the module docstring)."""
    env = dict(os.environ if environ is None else environ)
    launcher = launch.several.launcher
    if launcher in ("slurm", "openmpi"):
        command = launch.srun_command() if launcher == "slurm" else launch.mpirun_command()
        return _run_one(command, env)
    pdsh = shutil.which("pdsh", path=env.get("PATH")) is not None
    if not pdsh:
        launch.refuse_launcher_args_over_ssh()
    master = launch.several.master_addr or ask_address(launch, env)
    if pdsh:
        command = launch.pdsh_command(master)
        return _Supervisor(launch, env, pdsh=True).run([command], launch.pdsh_environment(env))
    return _Supervisor(launch, env, pdsh=False).run(launch.ssh_commands(master, env), env)


def ask_address(launch: HostLaunch, env: Mapping[str, str]) -> str:
    """The first host's address (`hostname -I` there, as DeepSpeed asks it), over ssh with
    the user's ssh options (never `--launcher_args`, which are pdsh's)."""
    host = launch.hosts[0]
    command = ["ssh", *launch.ssh_options(env), host, "hostname -I"]
    try:
        done = subprocess.run(
            command, env=dict(env), capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        raise LaunchError(
            f"could not ask {host} for its address ({error}); pass --master_addr"
        ) from None
    words = done.stdout.split()
    if done.returncode != 0 or not words:
        raise LaunchError(
            f"could not ask {host} for its address ({' '.join(command)} exited "
            f"{done.returncode}: {done.stderr.strip()[-300:]}); pass --master_addr"
        )
    return words[0]


def _run_one(command: list[str], env: dict[str, str]) -> int:
    """srun or mpirun: they stop every process of the job when one fails themselves, and
    when they get SIGTERM or SIGINT, which the launcher passes on to them (a Ctrl-C in a
    terminal reaches srun twice then, which srun takes as: cancel the step)."""
    print(f"zerodp run: {' '.join(command)}", file=sys.stderr, flush=True)
    process = subprocess.Popen(command, env=env)

    def forward(signum: int, _frame: Any) -> None:
        if process.poll() is None:
            process.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return process.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_stops(commands: list[list[str]], env: Mapping[str, str], timeout: float) -> None:
    """Run the stop commands side by side, each for at most `timeout` seconds; one that
    cannot start or does not end in time is reported (and killed), never raised: the
    launcher must still end its local processes."""
    started: list[tuple[list[str], subprocess.Popen[bytes]]] = []
    for command in commands:
        try:
            started.append(
                (command, subprocess.Popen(command, env=dict(env), stdin=subprocess.DEVNULL))
            )
        except OSError as error:
            _warn(f"could not run the stop command {shlex.join(command)}: {error}")
    deadline = time.monotonic() + timeout
    for command, process in started:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            _warn(f"the stop command {shlex.join(command)} did not end in {timeout:.0f} s")


def _warn(text: str) -> None:
    print(f"zerodp run: {text}; ending the local processes", file=sys.stderr, flush=True)


class _Supervisor:
    """The local ssh (or pdsh) processes of one launch, and how to stop their hosts."""

    def __init__(self, launch: HostLaunch, environ: Mapping[str, str], *, pdsh: bool) -> None:
        self.launch = launch
        self.environ = dict(environ)  # the launcher's: the stops' environment is made of it
        self.pdsh = pdsh
        self.processes: list[subprocess.Popen[bytes]] = []
        self.failure: tuple[str, int] | None = None  # pdsh: the host and status it reported
        self.signalled: int | None = None

    def run(self, commands: list[list[str]], env: Mapping[str, str]) -> int:
        previous = {
            sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)
        }
        try:
            for command in commands:
                stdin = subprocess.DEVNULL if self.pdsh else subprocess.PIPE
                stderr = subprocess.PIPE if self.pdsh else None
                process = subprocess.Popen(command, env=dict(env), stdin=stdin, stderr=stderr)
                self.processes.append(process)
                if process.stderr is not None:
                    self._read_pdsh_errors(process.stderr)
            return self._wait()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self.signalled = signum

    def _read_pdsh_errors(self, stream: IO[bytes]) -> None:
        """Pass pdsh's errors on, and note the first host whose command failed."""

        def read() -> None:
            for raw in stream:
                line = raw.decode(errors="replace")
                sys.stderr.write(line)
                found = _PDSH_FAILURE.match(line)
                if found and int(found.group(2)) != 0 and self.failure is None:
                    self.failure = (found.group(1), int(found.group(2)))

        threading.Thread(target=read, daemon=True, name="zerodp pdsh errors").start()

    def _wait(self) -> int:
        while True:
            codes = [process.poll() for process in self.processes]
            failed = [code for code in codes if code not in (None, 0)]
            if self.signalled is not None:
                self._stop_all()
                return 128 + self.signalled
            if self.failure is not None or failed:
                status = self.failure[1] if self.failure is not None else int(failed[0])
                self._stop_all()
                return status if status > 0 else 1
            if all(code == 0 for code in codes):
                return 0
            time.sleep(POLL_S)

    def _stop_all(self) -> None:
        running = [i for i, process in enumerate(self.processes) if process.poll() is None]
        if not running:
            return
        try:
            for i in running:  # ssh: the agent stops at the end of its input
                stdin = self.processes[i].stdin
                if stdin is not None:
                    with contextlib.suppress(OSError):
                        stdin.close()
            if self.pdsh or not self._ended(running, 5.0):
                hosts = self.launch.hosts if self.pdsh else [self.launch.hosts[i] for i in running]
                commands = self.launch.stop_commands(hosts, self.pdsh, self.environ)
                env = self.launch.stop_environment(self.environ, self.pdsh)
                run_stops(commands, env, STOP_TIMEOUT_S)
        finally:
            if not self._ended(running, KILL_AFTER_S):
                for i in running:
                    self.processes[i].kill()
            for i in running:
                self.processes[i].wait()

    def _ended(self, indices: list[int], seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if all(self.processes[i].poll() is not None for i in indices):
                return True
            time.sleep(POLL_S)
        return False
