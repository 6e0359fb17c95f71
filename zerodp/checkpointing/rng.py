"""Named random-generator states for Megatron-style code: DeepSpeed's RNG tracker.

Model-parallel code draws dropout masks from a second generator state
("model-parallel-rng") while the default generator stays the data-parallel
one: `get_cuda_rng_tracker().fork()` swaps the named state in for a block and
saves where it got to. The states are those of the device zerodp trains on
(the CPU generator on a CPU run), as DeepSpeed's accelerator gives them.
`zerodp.checkpointing.checkpoint` restores these states, not only the default
one, when it recomputes a block in backward, so dropout inside a fork draws
the same mask twice.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from zerodp.accelerator import get_accelerator
from zerodp.errors import UsageError

MODEL_PARALLEL_RNG = "model-parallel-rng"  # DeepSpeed's (and Megatron's) name
_SEED_OFFSET = 2718  # DeepSpeed's: the model-parallel seed is seed + 2718 + tensor rank


class CudaRNGStatesTracker:
    """Generator states by name (DeepSpeed's class name; any device, not only CUDA)."""

    def __init__(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def reset(self) -> None:
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        """A copy of the name -> state map (the states themselves are replaced, never
        changed in place, so the copy keeps them as they are now)."""
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        """Track a new state `name`, seeded with `seed`; the current state is left as it was."""
        if seed in self.seeds_:
            raise UsageError(f"RNG tracker: seed {seed} is already used; pick another seed")
        if name in self.states_:
            raise UsageError(f"RNG tracker: state {name!r} already exists; reset() first")
        accelerator = get_accelerator()
        current = accelerator.get_rng_state()
        accelerator.manual_seed(seed)
        self.states_[name] = accelerator.get_rng_state()
        accelerator.set_rng_state(current)
        self.seeds_.add(seed)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Draw from state `name` inside the block; afterwards it is saved, and the state
        from before the block is back."""
        if name not in self.states_:
            raise UsageError(
                f"RNG tracker: no state {name!r}; add it first (tracker.add(name, seed), or "
                "model_parallel_cuda_manual_seed(seed))"
            )
        accelerator = get_accelerator()
        outside = accelerator.get_rng_state()
        accelerator.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = accelerator.get_rng_state()
            accelerator.set_rng_state(outside)


_TRACKER = CudaRNGStatesTracker()


def get_cuda_rng_tracker() -> CudaRNGStatesTracker:
    """The process's tracker (DeepSpeed's name)."""
    return _TRACKER


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """Seed the default generator with `seed` and the tracker's "model-parallel-rng" state
    with `seed + 2718` (DeepSpeed's offset; zerodp has no tensor ranks to add)."""
    _TRACKER.reset()
    get_accelerator().manual_seed(seed)
    _TRACKER.add(MODEL_PARALLEL_RNG, seed + _SEED_OFFSET)
