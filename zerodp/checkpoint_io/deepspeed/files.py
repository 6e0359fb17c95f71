"""Which DeepSpeed checkpoint a directory holds, and where its files are.

A DeepSpeed save directory holds `latest` (the newest tag) and one folder per
tag. A ZeRO stage 1 or 2 folder holds `mp_rank_00_model_states.pt` and one
`zero_pp_rank_<r>_mp_rank_00_optim_states.pt` per data-parallel rank (named
`bf16_zero_pp_rank_...` in a bf16 run); at stage 3 each rank also writes its
own `zero_pp_rank_<r>_mp_rank_00_model_states.pt`. A universal checkpoint
(made by DeepSpeed's `ds_to_universal`) holds the model-states files and a
`zero/` folder with one folder per parameter; its tag is in
`latest_universal`.

`find_checkpoint` says which of these a directory and tag name (or None
when they name no DeepSpeed checkpoint, e.g. a zerodp one), without reading
a pickle.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from pathlib import Path

from zerodp.errors import CheckpointError

LATEST = "latest"
LATEST_UNIVERSAL = "latest_universal"
ZERODP_STATE_FILE = "zerodp_state.json"  # a zerodp checkpoint (see zerodp.checkpoint_io.json_state)
MODEL_STATES = "mp_rank_00_model_states.pt"
UNIVERSAL_FOLDER = "zero"
UNIVERSAL_OPTIMIZER = "optimizer_state.pt"

_OPTIM = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt")
_ZERO3_MODEL = re.compile(r"zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt")
_EXPERTS = re.compile(r"(layer_\d+_)?expert_\d+_mp_rank_\d+_model_states\.pt|expp_rank_.*")


class DeepSpeedFormat(enum.Enum):
    """How a DeepSpeed checkpoint lays out its optimizer state."""

    ZERO = "ZeRO stage 1/2"  # one flat fp32 partition per param group and rank
    ZERO3 = "ZeRO stage 3"  # every parameter partitioned over the ranks
    UNIVERSAL = "universal"  # one folder per parameter (ds_to_universal)


@dataclass(frozen=True)
class DeepSpeedFiles:
    """The files of one DeepSpeed checkpoint folder, in data-parallel rank order."""

    folder: Path
    format: DeepSpeedFormat
    model_files: tuple[Path, ...]  # one (stage 1/2), or one per rank (stage 3)
    optim_files: tuple[Path, ...]  # one per rank; empty for a universal checkpoint

    @property
    def world_size(self) -> int:
        """Ranks that wrote the checkpoint (for a universal one: ranks that wrote its source)."""
        return len(self.optim_files) or len(self.model_files)

    @property
    def universal_folder(self) -> Path:
        return self.folder / UNIVERSAL_FOLDER


def find_checkpoint(
    load_dir: object, tag: object, prefer_universal: bool = False
) -> DeepSpeedFiles | None:
    """The DeepSpeed checkpoint `load_dir` and `tag` name, or None if they name none.

    `tag` None reads `latest` (else `latest_universal`; the other way round with
    `prefer_universal`, the config's `checkpoint.load_universal`, as DeepSpeed reads
    `latest_universal` then); `load_dir` may also be a checkpoint folder itself.
    Raises `CheckpointError` for a folder that is DeepSpeed's but cannot be loaded
    (missing ranks, model parallelism).
    """
    if not isinstance(load_dir, (str, Path)):
        return None
    directory = Path(load_dir)
    if not directory.is_dir():
        return None
    folder = _folder(directory, tag, prefer_universal)
    if folder is None or (folder / ZERODP_STATE_FILE).is_file():
        return None
    return _describe(folder)


def _folder(directory: Path, tag: object, prefer_universal: bool) -> Path | None:
    if tag is not None:
        if not isinstance(tag, str) or not tag or "/" in tag or tag in (".", ".."):
            return None  # zerodp's own checks name the problem
        folder = directory / tag
        return folder if folder.is_dir() else None
    pointers = (LATEST_UNIVERSAL, LATEST) if prefer_universal else (LATEST, LATEST_UNIVERSAL)
    for name in pointers:
        pointer = directory / name
        if pointer.is_file():
            try:
                named = pointer.read_text(encoding="utf-8").strip()
            except (OSError, UnicodeDecodeError):
                return None
            folder = directory / named
            if named and "/" not in named and folder.is_dir():
                return folder
            return None
    return directory  # perhaps the checkpoint folder itself


def _describe(folder: Path) -> DeepSpeedFiles | None:
    names = sorted(p.name for p in folder.iterdir() if p.is_file())
    optim = _by_rank(folder, names, _OPTIM)
    zero3_models = _by_rank(folder, names, _ZERO3_MODEL)
    has_model = MODEL_STATES in names
    universal = (folder / UNIVERSAL_FOLDER / UNIVERSAL_OPTIMIZER).is_file()
    if not (optim or zero3_models or has_model or universal):
        return None
    if any(_EXPERTS.fullmatch(name) for name in names):
        raise CheckpointError(
            f"'{folder}' is a DeepSpeed checkpoint with mixture-of-experts files, which zerodp "
            "does not read; convert it with DeepSpeed's zero_to_fp32 and load the weights with "
            "engine.load_state_dict"
        )
    if universal:
        models = zero3_models or ((folder / MODEL_STATES,) if has_model else ())
        if not models:
            raise CheckpointError(
                f"'{folder}' is a DeepSpeed universal checkpoint without its model-states file "
                f"({MODEL_STATES} or zero_pp_rank_0_mp_rank_00_model_states.pt); it is incomplete"
            )
        return DeepSpeedFiles(folder, DeepSpeedFormat.UNIVERSAL, models, ())
    if not optim:
        raise CheckpointError(
            f"'{folder}' holds DeepSpeed model states but no ZeRO optimizer files "
            "(*zero_pp_rank_*_optim_states.pt): zerodp reads ZeRO stage 1-3 checkpoints; a "
            "checkpoint saved without ZeRO can be loaded with engine.load_state_dict("
            f"'{folder / MODEL_STATES}')"
        )
    if zero3_models:
        if len(zero3_models) != len(optim):
            raise CheckpointError(
                f"'{folder}' has {len(zero3_models)} stage 3 model-states files and "
                f"{len(optim)} optimizer files; the DeepSpeed checkpoint is incomplete"
            )
        return DeepSpeedFiles(folder, DeepSpeedFormat.ZERO3, zero3_models, optim)
    if not has_model:
        raise CheckpointError(
            f"'{folder}' has DeepSpeed optimizer files but no {MODEL_STATES}; the checkpoint "
            "is incomplete"
        )
    return DeepSpeedFiles(folder, DeepSpeedFormat.ZERO, (folder / MODEL_STATES,), optim)


def _by_rank(folder: Path, names: list[str], pattern: re.Pattern[str]) -> tuple[Path, ...]:
    """The files matching `pattern`, in rank order; every rank 0..N-1 exactly once."""
    found: dict[int, str] = {}
    for name in names:
        match = pattern.fullmatch(name)
        if match is None:
            continue
        if int(match.group(2)) != 0:
            raise CheckpointError(
                f"'{folder / name}' belongs to a model-parallel DeepSpeed checkpoint (mp_rank "
                f"{int(match.group(2))}); zerodp reads data-parallel ZeRO checkpoints only"
            )
        rank = int(match.group(1))
        if rank in found:
            raise CheckpointError(
                f"'{folder}' has two files for rank {rank} ({found[rank]} and {name}); remove "
                "the stale one"
            )
        found[rank] = name
    missing = sorted(set(range(len(found))) - set(found))
    if missing:
        raise CheckpointError(
            f"'{folder}' lacks the files of ranks {missing} ({pattern.pattern}); the DeepSpeed "
            "checkpoint is incomplete"
        )
    return tuple(folder / found[rank] for rank in sorted(found))
