"""Host-side and file-backed tensors for offload, and the files' lifetime.

Host tensors are pinned when an accelerator is there, so that copies to and
from the device can run without blocking. File-backed tensors (NVMe offload)
are shared memory maps of files private to this run and rank: the operating
system pages them in when the optimizer reads them and writes them back, so
a rank's optimizer state can exceed its memory. Reads of the next group are
announced ahead (`prefetch`) and writes are flushed behind (`write_behind`)
on I/O threads, so disk time overlaps the optimizer's work. The files are
removed at `close()` (the engine's `destroy()`), and directories left by a
process that died are removed the next time a run starts on that host.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from zerodp.offload.policy import OffloadPolicy
from zerodp.torch_internals import storage_key

_PREFIX = "zerodp-offload"


@dataclass
class _MappedFile:
    path: Path
    fd: int
    nbytes: int


class OffloadStorage:
    """Allocates one engine's offloaded tensors; `close()` frees them and removes the files."""

    def __init__(self, policy: OffloadPolicy, rank: int, io_threads: int = 4) -> None:
        self.policy = policy
        self.rank = rank
        self._dirs: dict[Path, Path] = {}  # nvme_path -> this run's directory in it
        self._files: dict[int, _MappedFile] = {}  # storage_key -> its file
        self._io = ThreadPoolExecutor(
            max_workers=max(1, io_threads), thread_name_prefix="zerodp-io"
        )
        self._pending: list[Future[None]] = []

    # -- host memory -----------------------------------------------------------------

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device="cpu", pin_memory=self.policy.pin_memory)

    def host_copy(self, tensor: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        out = self.host_empty(tensor.numel(), dtype or tensor.dtype)
        out.copy_(tensor.detach().reshape(-1))
        return out

    # -- files ---------------------------------------------------------------------------

    def file_empty(self, root: Path, name: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A tensor backed by `<root>/<this run's directory>/<name>` (contents undefined)."""
        path = self._directory(root) / f"{name}.bin"
        nbytes = max(1, numel) * torch.empty((), dtype=dtype).element_size()
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        os.ftruncate(fd, nbytes)
        tensor = torch.from_file(str(path), shared=True, size=numel, dtype=dtype)
        self._files[storage_key(tensor)] = _MappedFile(path, fd, nbytes)
        return tensor

    def file_copy(self, root: Path, name: str, tensor: torch.Tensor) -> torch.Tensor:
        out = self.file_empty(root, name, tensor.numel(), tensor.dtype)
        out.copy_(tensor.detach().reshape(-1))
        return out

    def is_file_backed(self, tensor: torch.Tensor) -> bool:
        return storage_key(tensor) in self._files

    def prefetch(self, tensors: list[torch.Tensor]) -> None:
        """Ask the OS to read these file-backed tensors ahead (an I/O thread does it)."""
        files = [f for f in map(self._file_of, tensors) if f is not None]
        if files:
            self._pending.append(self._io.submit(_advise, files, os.POSIX_FADV_WILLNEED, False))

    def write_behind(self, tensors: list[torch.Tensor]) -> None:
        """Flush these file-backed tensors to disk and drop their pages (an I/O thread does it)."""
        files = [f for f in map(self._file_of, tensors) if f is not None]
        if files:
            self._pending.append(self._io.submit(_advise, files, os.POSIX_FADV_DONTNEED, True))

    def wait(self) -> None:
        """Wait for every read-ahead and write-behind issued so far."""
        pending, self._pending = self._pending, []
        for future in pending:
            future.result()

    def close(self) -> None:
        self.wait()
        self._io.shutdown(wait=True)
        for mapped in self._files.values():
            with contextlib.suppress(OSError):
                os.close(mapped.fd)
        self._files.clear()
        for directory in self._dirs.values():
            shutil.rmtree(directory, ignore_errors=True)
        self._dirs.clear()

    # -- internals -------------------------------------------------------------------

    def _file_of(self, tensor: torch.Tensor) -> _MappedFile | None:
        return self._files.get(storage_key(tensor))

    def _directory(self, root: Path) -> Path:
        directory = self._dirs.get(root)
        if directory is None:
            _remove_dead_runs(root)
            directory = root / f"{_PREFIX}-{socket.gethostname()}-{os.getpid()}-rank{self.rank}"
            directory.mkdir(parents=True, exist_ok=True)
            self._dirs[root] = directory
        return directory


def _advise(files: list[_MappedFile], advice: int, sync: bool) -> None:
    for mapped in files:
        if sync:
            os.fsync(mapped.fd)
        os.posix_fadvise(mapped.fd, 0, mapped.nbytes, advice)


def _remove_dead_runs(root: Path) -> None:
    """Remove this host's offload directories whose process is gone (a crashed run's)."""
    if not root.is_dir():
        return
    host = socket.gethostname()
    for entry in root.glob(f"{_PREFIX}-{host}-*-rank*"):
        try:
            pid = int(entry.name.removeprefix(f"{_PREFIX}-{host}-").split("-")[0])
        except ValueError:
            continue
        if pid != os.getpid() and not _alive(pid):
            shutil.rmtree(entry, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def free_bytes(path: Path) -> int:
    """Free space on the file system holding `path` (its nearest existing parent)."""
    for candidate in [path, *path.absolute().parents]:
        if candidate.exists():
            return shutil.disk_usage(candidate).free
    return 0
