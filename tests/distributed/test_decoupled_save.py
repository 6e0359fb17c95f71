"""The decoupled checkpoint writer (`"checkpoint": {"writer": {"decoupled": true}}`).

- The saved values are those at the call, though training steps on at once: the writer is
  held before it writes a byte until the engine has taken two more micro-steps; the
  checkpoint then loads exactly the uninterrupted run's state at that micro-step
  (weights, kept gradients of the open window, optimizer state, lr, counters, random
  generators) and resumes as the uninterrupted run (AdamW and SGD with momentum, at
  every stage). The saving run itself stays the uninterrupted run.
- A second save waits for the first; a failure in the background (a full disk on one
  rank, for its data file or its JSON file) is one CheckpointError on every rank, naming
  the rank and the file, raised at `wait_for_checkpoint`, at the next save or at
  `destroy`; `latest` still names the checkpoint before it, which loads.
- A rank that waits for the last save beside one that saves is `UnevenInputsError` on every
  rank, at once (`wait_for_checkpoint` is an activity of its own).
- A process killed while it writes (fresh ranks, SIGKILL from the writer's own thread at
  its last steps: rank 1 after its report, rank 0 with every report in, just before the
  commit) leaves the previous `latest`, which loads the uninterrupted run's state.
- A script that ends without waiting has its save committed before the process ends; a
  failed one is logged at exit, naming the file.

Each reference is computed here: the same run without a save.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch.distributed as dist

import zerodp
from tests import decoupled_setup as run
from zerodp.checkpoint_io import background_save, checksums, json_state
from zerodp.comm.agreement import agreement
from zerodp.testing.ranks import run_ranks

SCRIPT = Path(__file__).with_name("decoupled_save_script.py")


@contextlib.contextmanager
def _writer_held_at(step: str, release: threading.Event) -> Iterator[None]:
    """Every decoupled save's writer waits at `step` until `release` is set."""

    def hold(reached: str) -> None:
        if reached == step and not release.wait(timeout=60):
            raise RuntimeError("the test never released the writer")

    background_save.on_write_step = hold
    try:
        yield
    finally:
        background_save.on_write_step = background_save._no_fault


def saved_at_the_call(cases: list[tuple[int, str]], directory: str) -> int:
    checked = 0
    for stage, optimizer in cases:
        folder = Path(directory) / f"stage{stage}_{optimizer}"
        # The reference: the same run, never saved; its state at micro-step 3 and 5.
        model, engine, loader = run.build(stage, optimizer, decoupled=False)
        run.micro_steps(engine, loader, 3)  # one boundary, then a window begun
        at_call = run.state(model, engine, optimizer)
        run.micro_steps(engine, loader, 2)
        straight = run.state(model, engine, optimizer)
        engine.destroy()

        model, engine, loader = run.build(stage, optimizer, decoupled=True)
        run.micro_steps(engine, loader, 3)
        trained_on = threading.Event()
        with _writer_held_at("started", trained_on):
            engine.save_checkpoint(folder, "t")
            run.micro_steps(engine, loader, 2)  # the live state changes before a byte is written
            assert not (folder / "latest").exists()
            trained_on.set()
            assert engine.wait_for_checkpoint() == str(folder / "t")
        run.assert_same(straight, run.state(model, engine, optimizer), "the saving run")
        engine.destroy()

        model, engine, loader = run.build(stage, optimizer, decoupled=False, seed=5)
        engine.load_checkpoint(folder)
        what = f"stage {stage}, {optimizer}"
        run.assert_same(at_call, run.state(model, engine, optimizer), f"{what}: loaded")
        run.micro_steps(engine, loader, 2)
        run.assert_same(straight, run.state(model, engine, optimizer), f"{what}: resumed")
        engine.destroy()
        checked += 1
    return checked


def test_a_decoupled_save_holds_the_values_at_the_call(pools, tmp_path: Path) -> None:
    cases = [(0, "SGD"), (1, "AdamW"), (2, "SGD"), (3, "AdamW")]
    done = pools(2).run(saved_at_the_call, cases, str(tmp_path), timeout_s=300)
    assert done == [4, 4]


@contextlib.contextmanager
def _full_disk_on(rank: int, what: str) -> Iterator[None]:
    """Writes of this rank's data file ("tensors") or JSON files ("json") fail with ENOSPC."""
    from torch.distributed.checkpoint import filesystem

    create_stream, write_file = filesystem.FileSystem.create_stream, json_state.write_file_synced

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    if dist.get_rank() == rank and what == "tensors":
        filesystem.FileSystem.create_stream = lambda self, path, mode: (  # type: ignore[method-assign]
            no_space() if "w" in mode else create_stream(self, path, mode)
        )
    elif dist.get_rank() == rank:
        json_state.write_file_synced = no_space  # type: ignore[assignment]
    try:
        yield
    finally:
        filesystem.FileSystem.create_stream = create_stream  # type: ignore[method-assign]
        json_state.write_file_synced = write_file


def _raised(call) -> str:
    with pytest.raises(zerodp.CheckpointError) as error:
        call()
    return str(error.value)


def failures_surface(directory: str) -> dict[str, object]:
    folder = Path(directory)
    model, engine, loader = run.build(1)
    run.micro_steps(engine, loader, 2)
    out: dict[str, object] = {}
    paused = threading.Event()
    threading.Timer(0.5, paused.set).start()
    with _writer_held_at("started", paused):
        engine.save_checkpoint(folder, "a")
        engine.save_checkpoint(folder, "b")  # waits for 'a'
        out["a_committed_first"] = (folder / "a" / checksums.CHECKSUM_FILE).is_file()
        out["latest_while_b_writes"] = (folder / "latest").read_text()
    engine.wait_for_checkpoint()
    expected = run.state(model, engine)

    with _full_disk_on(1, "tensors"):
        engine.save_checkpoint(folder, "c")
        run.micro_steps(engine, loader, 1)  # training goes on
        out["at_wait"] = _raised(engine.wait_for_checkpoint)
    assert engine.wait_for_checkpoint() is None  # raised once, not again; nothing committed
    with _full_disk_on(0, "json"):
        engine.save_checkpoint(folder, "d")
        run.micro_steps(engine, loader, 1)
        out["at_next_save"] = _raised(lambda: engine.save_checkpoint(folder, "e"))
    out["names_after_failures"] = sorted(p.name for p in folder.iterdir())
    with _full_disk_on(1, "tensors"):
        engine.save_checkpoint(folder, "f")
        out["at_destroy"] = _raised(engine.destroy)

    model, engine, loader = run.build(1, seed=3)
    path, _ = engine.load_checkpoint(folder)
    out["loaded"] = Path(path).name
    run.assert_same(expected, run.state(model, engine), "'latest' after the failures")
    engine.destroy()
    return out


def test_background_failures_surface_on_every_rank(pools, tmp_path: Path) -> None:
    results = pools(2).run(failures_surface, str(tmp_path / "ckpt"), timeout_s=120)
    assert results[0] == results[1]
    out = results[0]
    assert out["a_committed_first"] and out["latest_while_b_writes"] == "a"
    assert out["names_after_failures"] == ["a", "b", "latest"]
    assert out["loaded"] == "b"
    for key, tag, rank, file in (
        ("at_wait", "c", 1, "__1_0.distcp"),
        ("at_next_save", "d", 0, "rank0.json"),
        ("at_destroy", "f", 1, "__1_0.distcp"),
    ):
        message = str(out[key])
        assert f"the decoupled save of checkpoint '{tag}'" in message, (key, message)
        assert f"(rank {rank}, writing" in message and file in message, (key, message)
        assert "No space left on device" in message and "'latest' are intact" in message


def save_beside_wait(directory: str) -> dict[str, object]:
    """Rank 0 saves while rank 1 waits for the last save (committed): both start with the same
    agreement on the last save's verdict, and only the save goes on to its collectives."""
    _, engine, loader = run.build(1)
    run.micro_steps(engine, loader, 2)
    engine.save_checkpoint(directory, "a")
    engine.wait_for_checkpoint()
    start = time.monotonic()
    error = ""
    try:
        if dist.get_rank() == 0:
            engine.save_checkpoint(directory, "b")
        else:
            engine.wait_for_checkpoint()
    except zerodp.UnevenInputsError as caught:
        error = str(caught)
    seconds = time.monotonic() - start
    agreement().reset()  # nothing is left running: the ranks may go on together
    engine.destroy()
    return {"error": error, "seconds": seconds}


def test_a_wait_beside_a_save_is_uneven_inputs_on_every_rank(pools, tmp_path: Path) -> None:
    """Not a save on one rank hanging in its collectives until the timeout."""
    for result in pools(2).run(save_beside_wait, str(tmp_path / "ckpt"), timeout_s=120):
        message = str(result["error"])
        assert "rank 0 is saving a checkpoint after 1 optimizer steps" in message, result
        assert "rank 1 is waiting for a checkpoint save after 1 optimizer steps" in message
        assert float(str(result["seconds"])) < 10, result


def load_latest(directory: str) -> dict[str, object]:
    folder = Path(directory)
    model, engine, loader = run.build(2, decoupled=False)
    run.micro_steps(engine, loader, 2)
    expected = run.state(model, engine)
    expected.pop("python_random")  # the killed process's own, not this one's
    engine.destroy()
    model, engine, _ = run.build(2, decoupled=False, seed=3)
    path, _ = engine.load_checkpoint(folder)
    run.assert_same(expected, run.state(model, engine), "the previous 'latest'")
    engine.save_checkpoint(folder, "again")  # a later save removes what the killed one left
    engine.destroy()
    return {"loaded": Path(path).name, "names": sorted(p.name for p in folder.iterdir())}


def test_a_kill_while_writing_keeps_the_previous_latest(pools, tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    exits = run_ranks([str(SCRIPT), "kill", str(folder)], timeout_s=120)
    assert [e.status for e in exits] == [-9, -9], [(e.status, e.output[-2000:]) for e in exits]
    assert all("TRAINED ON" in e.output for e in exits), [e.output[-2000:] for e in exits]
    assert (folder / "latest").read_text() == "before"
    leftovers = [p.name for p in folder.iterdir() if p.name.startswith(".tmp.after.")]
    assert len(leftovers) == 1, leftovers  # every rank's files were written, never committed
    result = pools(2).run(load_latest, str(folder))[0]
    assert result == {"loaded": "before", "names": ["again", "before", "latest"]}


def test_the_end_of_a_script_waits_for_its_save(tmp_path: Path) -> None:
    """One rank each (a process start is the cost), both at once: a save the script never
    waited for is committed before the process ends; one that failed is logged at exit,
    naming the file (after the interpreter waited for the writer)."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = {
            mode: pool.submit(run_ranks, [str(SCRIPT), mode, str(tmp_path / mode)], 1, 120)
            for mode in ("finish", "exit")
        }
        finish, failed = runs["finish"].result()[0], runs["exit"].result()[0]
    assert finish.status == 0, finish.output[-3000:]
    assert (tmp_path / "finish" / "latest").read_text() == "after", finish.output[-3000:]
    assert (tmp_path / "finish" / "after" / checksums.CHECKSUM_FILE).is_file()
    assert failed.status == 0, failed.output[-3000:]
    output = failed.output
    assert "the script ended without waiting for it" in output, output[-3000:]
    assert "the decoupled save of checkpoint 'after'" in output, output[-3000:]
    assert "__0_0.distcp" in output and "No space left on device" in output, output[-3000:]
    assert (tmp_path / "exit" / "latest").read_text() == "before"
