"""The environment every host's processes get, as DeepSpeed's launcher exports it.

A process started over ssh (or pdsh, srun, mpirun) on another host does not inherit
this shell's environment. DeepSpeed's launcher exports two things to every host,
and so does `zerodp run`:

- this shell's variables whose names start with one of `FORWARDED_PREFIXES`
  (Python's: PYTHONPATH with the working directory in front, as DeepSpeed puts it;
  NCCL's, UCX's, MVAPICH's, MLflow's), and the ones `zerodp run` itself sets
  (`PYTHONUNBUFFERED`);
- the `KEY=VALUE` lines of `.deepspeed_env` (or the file `DS_ENV_FILE` names) in the
  home directory, then in the working directory, whose values win. As with DeepSpeed,
  a file's value is shell text that the host's shell expands (`LD_LIBRARY_PATH=/opt/x:
  $LD_LIBRARY_PATH` extends the host's own); a forwarded value is passed as it is.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from zerodp.launch.hostfile import LaunchError

FORWARDED_PREFIXES = ("PYTHON", "NCCL", "UCX", "MV2", "MLFLOW", "ZERODP_")
"""Name prefixes of the variables forwarded to every host (DeepSpeed's, and zerodp's own)."""

ENV_FILE_VARIABLE = "DS_ENV_FILE"
DEFAULT_ENV_FILE = ".deepspeed_env"


@dataclass(frozen=True)
class Exports:
    """The variables set on every host: `values`, of which those named in `shell_words`
    came from an env file and are shell text for the host's shell to expand."""

    values: dict[str, str]
    shell_words: frozenset[str] = frozenset()

    def shell_text(self) -> str:
        """`export NAME=VALUE; ...` for a remote shell."""
        return "".join(
            f"export {name}={value if name in self.shell_words else shlex.quote(value)}; "
            for name, value in self.values.items()
        )


def exported_environment(
    environ: Mapping[str, str] | None = None,
    *,
    cwd: Path | None = None,
    home: Path | None = None,
    extra: Mapping[str, str] | None = None,
) -> Exports:
    """The variables to set on every host."""
    env = os.environ if environ is None else environ
    cwd = Path.cwd() if cwd is None else cwd
    home = Path.home() if home is None else home
    exported = {name: value for name, value in env.items() if name.startswith(FORWARDED_PREFIXES)}
    here = str(cwd.resolve())
    path = env.get("PYTHONPATH", "")
    exported["PYTHONPATH"] = f"{here}:{path}" if path else here
    exported.update(extra or {})
    from_files: dict[str, str] = {}
    for file in env_files(env, cwd, home):
        from_files.update(read_env_file(file))
    for name in from_files:
        exported.pop(name, None)  # a file's value wins, in the file's place
    return Exports({**exported, **from_files}, frozenset(from_files))


def env_files(env: Mapping[str, str], cwd: Path, home: Path) -> list[Path]:
    """The `.deepspeed_env` files that exist: the home directory's, then the working
    directory's (`DS_ENV_FILE` may name another file name, or a path)."""
    name = env.get(ENV_FILE_VARIABLE, DEFAULT_ENV_FILE)
    if os.path.isabs(name):
        return [Path(name)] if Path(name).is_file() else []
    found: list[Path] = []
    for folder in (home, cwd):
        file = folder / name
        if file.is_file() and file.resolve() not in {f.resolve() for f in found}:
            found.append(file)
    return found


def read_env_file(file: Path) -> dict[str, str]:
    """`KEY=VALUE` lines (blank lines and `#` comments skipped); a line without `=` or with
    a name that is not a variable name is a `LaunchError` naming the file and line."""
    variables = {}
    for number, raw in enumerate(file.read_text().splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, equals, value = line.partition("=")
        name = name.strip().removeprefix("export ").strip()
        if not equals or not name.isidentifier():
            raise LaunchError(f"{file}, line {number}: expected KEY=VALUE, got {raw!r}")
        variables[name] = value.strip()
    return variables
