"""The demo's collectives outside training: validation loss, the mean loss, sampling.

At ZeRO stage 3 every forward gathers parameter shards from all ranks, so
each function here must be called by every rank, the same number of times,
with the same number of forwards; each one says how it keeps to that.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

import zerodp
from examples.stdlib_text import ByteWindows


def mean_over_ranks(value: torch.Tensor) -> float:
    """The mean of a scalar across ranks: each rank's loss is over its own batch only."""
    total = value.detach().float().reshape(1).clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def eval_indices(valid: ByteWindows, count: int, rank: int, world_size: int) -> list[int]:
    """This rank's share of a fixed, evenly spread subset of the validation windows.

    Every rank gets the same number of windows: at stage 3 each forward is a
    collective, so unequal shares would leave one rank waiting forever.
    """
    count = max(world_size, min(count, len(valid)) // world_size * world_size)
    spread = [i * len(valid) // count for i in range(count)]
    return spread[rank::world_size]


@torch.no_grad()
def evaluate(engine: zerodp.ZeroEngine, valid: ByteWindows, indices: list[int]) -> float:
    """Mean validation loss over every rank's windows (eval mode, no autograd)."""
    engine.eval()
    batch_size = engine.train_micro_batch_size_per_gpu()
    loss_sum = torch.zeros((), device=engine.device)
    for start in range(0, len(indices), batch_size):
        chunk = [valid[i] for i in indices[start : start + batch_size]]
        x = torch.stack([item[0] for item in chunk]).to(engine.device)
        y = torch.stack([item[1] for item in chunk]).to(engine.device)
        logits = engine(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss_sum += loss.float() * len(chunk)
    count = torch.tensor(float(len(indices)), device=engine.device)
    sums = torch.stack([loss_sum, count])
    dist.all_reduce(sums)
    engine.train()
    return (sums[0] / sums[1]).item()


@torch.no_grad()
def generate(
    engine: zerodp.ZeroEngine,
    prompt: bytes,
    length: int,
    seq_len: int,
    temperature: float,
    seed: int,
) -> bytes:
    """Continue `prompt` byte by byte; every rank runs the same loop (stage 3 forwards gather)."""
    engine.eval()
    generator = torch.Generator().manual_seed(seed)
    tokens = list(prompt) or [ord("\n")]
    for _ in range(length):
        context = torch.tensor([tokens[-seq_len:]], device=engine.device)
        logits = engine(context)[0, -1].float().cpu()
        if temperature <= 0:
            token = int(logits.argmax())
        else:
            probs = torch.softmax(logits / temperature, dim=-1)
            token = int(torch.multinomial(probs, 1, generator=generator))
        tokens.append(token)
    engine.train()
    return bytes(tokens)
