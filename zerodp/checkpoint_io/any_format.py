"""`load_any_checkpoint`: a zerodp checkpoint, or a DeepSpeed one, whichever `load_dir` holds.

The format is recognised from the files alone (see
`zerodp.checkpoint_io.deepspeed.files`), on every rank; the ranks must see the
same one before either loader runs a collective.
"""

from __future__ import annotations

from typing import Any

from zerodp.checkpoint_io.deepspeed import find_checkpoint, load_deepspeed_checkpoint
from zerodp.checkpoint_io.integrity import CHECKPOINT_FAILURES
from zerodp.checkpoint_io.load_options import LoadOptions
from zerodp.checkpoint_io.report import LoadReport
from zerodp.checkpoint_io.save_load import load_checkpoint
from zerodp.checkpoint_io.subject import CheckpointSubject
from zerodp.errors import CheckpointError
from zerodp.parallel.composition import Feature, refusal_for


def load_any_checkpoint(
    subject: CheckpointSubject, load_dir: Any, options: LoadOptions
) -> tuple[str | None, Any, LoadReport | None]:
    """(path, client_state, report); (None, None, None) when nothing is saved yet."""
    comm = subject.comm
    error: BaseException | None = None
    files = None
    try:
        files = find_checkpoint(load_dir, options.tag, options.prefer_universal)
    except CHECKPOINT_FAILURES as caught:
        error = caught
    comm.raise_if_any_failed(error)
    seen = comm.all_gather_object(None if files is None else str(files.folder))
    if len(set(seen)) > 1:
        raise CheckpointError(
            f"ranks see different checkpoints under '{load_dir}' ({sorted(set(map(str, seen)))}); "
            "put it on storage every rank reads alike"
        )
    refused = refusal_for(Feature.DEEPSPEED_CHECKPOINT, subject.dims)
    if files is not None and refused is not None:
        raise CheckpointError(f"'{files.folder}' is a DeepSpeed checkpoint: {refused}")
    if files is not None:
        return load_deepspeed_checkpoint(subject, files, options)
    path, client, left = load_checkpoint(subject, load_dir, options)
    if path is None:
        return None, None, None
    report = LoadReport(f"zerodp checkpoint '{path}'", ["model weights (fp32 masters)"])
    if options.load_module_only:
        report.not_restored.append("everything but the weights (load_module_only=True)")
        return path, client, report
    if options.load_optimizer_states:
        report.restored.append("optimizer state and settings, loss scaler")
    else:
        report.not_restored.append("optimizer state (load_optimizer_states=False)")
    if not options.load_lr_scheduler_states:
        report.not_restored.append("LR scheduler (load_lr_scheduler_states=False)")
    pieces = ["counters", "LR scheduler", "random generators", "data-loader position"]
    if not options.load_lr_scheduler_states:
        pieces.remove("LR scheduler")
    pieces = [piece for piece in pieces if piece not in left]
    report.restored.append(", ".join([*pieces, "kept gradients", "client_state"]) + ", as saved")
    report.not_restored += [f"{piece} ({why})" for piece, why in left.items()]
    return path, client, report
