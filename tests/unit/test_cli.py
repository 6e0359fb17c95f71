"""The `zerodp` command: env report, argument handling, and one real torchrun launch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

import zerodp
from zerodp.launch import runner
from zerodp.launch.cli import main

ALLREDUCE_SCRIPT = textwrap.dedent(
    """
    import sys
    from pathlib import Path

    import torch
    import torch.distributed as dist

    from zerodp.comm import ensure_process_group

    ensure_process_group()
    rank = dist.get_rank()
    value = torch.tensor([float(rank)])
    dist.all_reduce(value)
    out = Path(sys.argv[1]) / f"rank{rank}.txt"
    out.write_text(f"{dist.get_world_size()} {value.item()} {' '.join(sys.argv[2:])}")
    dist.destroy_process_group()
    """
)


def _script(tmp_path: Path, body: str = "pass\n") -> Path:
    path = tmp_path / "train.py"
    path.write_text(body)
    return path


# --- zerodp env ---------------------------------------------------------------------------


def test_env_in_process_reports_versions(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert torch.__version__ in out
    assert f"zerodp version: {zerodp.__version__}" in out
    assert "gloo=" in out
    assert "OMP_NUM_THREADS" in out
    assert "pydantic:" in out


def test_env_json_parses(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["env", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["torch"] == torch.__version__
    assert report["zerodp"] == zerodp.__version__
    assert report["distributed_backends"]["gloo"] == torch.distributed.is_gloo_available()
    assert set(report["env"]) >= {"WORLD_SIZE", "RANK", "LOCAL_RANK", "CUDA_VISIBLE_DEVICES"}
    assert "deepspeed" in report["packages"]
    assert report["cpus"]["logical"] >= 1
    assert isinstance(report["torch_build"]["kind"], str)
    if torch.cuda.is_available():
        assert len(report["accelerators"]) == torch.cuda.device_count()


def test_env_as_subprocess_reports_torch_version() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "zerodp.launch.cli", "env"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert f"torch: {torch.__version__}" in done.stdout


# --- top-level arguments ------------------------------------------------------------------


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"zerodp {zerodp.__version__}"


def test_help_lists_subcommands(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for command in ("run", "env", "consolidate", "convert"):
        assert command in out


def test_unknown_subcommand_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["frobnicate"]) == 2
    assert "invalid choice" in capsys.readouterr().err


def test_no_subcommand_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "choose a subcommand" in capsys.readouterr().err


def test_consolidate_without_implementation_or_bad_dir_fails_cleanly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Whether or not consolidation is implemented yet, a missing checkpoint
    # directory must give an error message and a nonzero status, not a traceback.
    status = main(["consolidate", str(tmp_path / "missing"), str(tmp_path / "out.pt")])
    assert status in {1, 2}
    assert "zerodp consolidate: error:" in capsys.readouterr().err
    assert not (tmp_path / "out.pt").exists()


def test_convert_of_a_directory_without_a_deepspeed_checkpoint_names_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status = main(["convert", "deepspeed", str(tmp_path), str(tmp_path / "out")])
    assert status == 1
    err = capsys.readouterr().err
    assert f"zerodp convert: error: '{tmp_path}' holds no DeepSpeed checkpoint" in err
    assert not (tmp_path / "out").exists()
    assert main(["convert", "megatron", str(tmp_path), str(tmp_path / "out")]) == 2


# --- zerodp run: argument handling --------------------------------------------------------


def test_run_help_mentions_torchrun_passthrough(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--help"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "--nproc-per-node" in out
    assert "passed to torchrun unchanged" in out


@pytest.mark.parametrize("count", ["0", "-1", "two"])
def test_run_rejects_bad_process_counts(
    tmp_path: Path, count: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["run", "-n", count, str(_script(tmp_path))]) == 2
    assert "positive number of processes" in capsys.readouterr().err


def test_run_without_script_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "-n", "2"]) == 2
    assert "missing the script" in capsys.readouterr().err


def test_run_with_missing_script_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "-n", "2", str(tmp_path / "nope.py")]) == 2
    assert "script not found" in capsys.readouterr().err


def test_plan_single_node_is_standalone_and_keeps_script_args(tmp_path: Path) -> None:
    script = str(_script(tmp_path))
    plan = runner.plan_run(["-n", "2", "--max-restarts", "0", script, "-n", "5", "--help"])
    assert plan.standalone_added
    assert plan.nproc_per_node == "2"
    assert plan.script_args == ("-n", "5", "--help")
    assert plan.torchrun_argv == (
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "0",
        script,
        "-n",
        "5",
        "--help",
    )


@pytest.mark.parametrize(
    "flags",
    [
        [
            "--nnodes",
            "2",
            "--node-rank",
            "1",
            "--master-addr",
            "10.0.0.1",
            "--master-port",
            "29400",
        ],
        ["--nnodes=2", "--node_rank=0"],
        ["--rdzv-backend", "c10d", "--rdzv-endpoint", "host:29400", "--rdzv-id", "job7"],
    ],
)
def test_plan_multi_node_flags_pass_through_unchanged(tmp_path: Path, flags: list[str]) -> None:
    script = str(_script(tmp_path))
    plan = runner.plan_run(["--nproc_per_node=4", *flags, script, "x"])
    assert not plan.standalone_added
    assert plan.torchrun_argv == ("--nproc-per-node", "4", *flags, script, "x")


def test_plan_module_mode_needs_no_file() -> None:
    plan = runner.plan_run(["-n", "auto", "-m", "some.module", "arg"])
    assert plan.nproc_per_node == "auto"
    assert plan.torchrun_argv[-3:] == ("-m", "some.module", "arg")


def test_run_rejects_options_torchrun_does_not_know(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["run", "--no-such-flag", str(_script(tmp_path))]) == 2
    assert "--no-such-flag" in capsys.readouterr().err


# --- zerodp run: exit status --------------------------------------------------------------


@pytest.mark.parametrize(("exitcode", "status"), [(3, 3), (1, 1), (-9, 137)])
def test_failing_script_status_propagates(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, exitcode: int, status: int
) -> None:
    # torchrun reports a failed rank as ChildFailedError; zerodp returns that
    # rank's exit status (a real launch with exit status 3 behaves the same).
    failure = ProcessFailure(local_rank=0, pid=1, exitcode=exitcode, error_file="")
    seen: list[list[str]] = []

    def fake_torchrun(argv: list[str]) -> None:
        seen.append(argv)
        raise ChildFailedError(name="train.py", failures={0: failure})

    monkeypatch.setattr("torch.distributed.run.main", fake_torchrun)
    script = str(_script(tmp_path))
    assert main(["run", "-n", "2", script]) == status
    assert seen == [["--standalone", "--nproc-per-node", "2", script]]


@pytest.mark.timeout(120)
def test_run_two_processes_all_reduce(tmp_path: Path) -> None:
    script = _script(tmp_path, ALLREDUCE_SCRIPT)
    command = [sys.executable, "-m", "zerodp.launch.cli", "run", "-n", "2", str(script)]
    done = subprocess.run(
        [*command, str(tmp_path), "--flag", "-n", "9"],
        capture_output=True,
        text=True,
        timeout=110,
        check=False,
        cwd=tmp_path,
        env={**os.environ, "ZERODP_DEVICE": "cpu"},  # gloo even on a one-GPU machine
    )
    assert done.returncode == 0, done.stderr[-4000:]
    for rank in range(2):
        world_size, total, script_args = (tmp_path / f"rank{rank}.txt").read_text().split(" ", 2)
        assert world_size == "2"
        assert float(total) == 1.0  # 0 + 1
        assert script_args == "--flag -n 9"
