"""Push a stage 3 policy's weights to a generation server after each update (a vLLM-style sync).

The trainer ranks (torchrun) train a small Llama with zerodp at ZeRO stage 3. Rank 0
also starts a separate process (this script with `--serve`), the "server", which holds
a plain copy of the model (random weights at first) and joins rank 0 in a two-member
process group of its own, apart from the training group, as a generation server's
workers would. After each training round:

1. every trainer rank iterates `engine.full_parameters(bucket_bytes=...).buckets()`
   (a collective: buckets are assembled from the shards, one at a time); rank 0 sends
   each bucket to the server: its names, shapes and dtypes through the store, its
   tensors as one flat broadcast per dtype;
2. the server copies each received tensor into its model by name (what vLLM's
   `model.load_weights(iterable)` does), and generates greedily from a fixed prompt;
3. the trainers generate from the same prompt at stage 3 inside
   `engine.gathered_for_generation()`, and rank 0 checks that the server's tokens are
   the trainers'.

    torchrun --standalone --nproc_per_node 2 examples/stream_weights.py

On GPUs the side group would be NCCL (`ProcessGroupNCCL`) between rank 0's device and
the server's; the example uses gloo so that it runs anywhere.
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

# Trainer rank 1 waits in a collective while rank 0 sends to the server; torch would log
# each second of that wait.
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import zerodp  # noqa: E402
from zerodp.comm import destroy_process_group_if_owned  # noqa: E402

ROUNDS = 3
STEPS_PER_ROUND = 4
BUCKET_BYTES = 64 * 1024
VOCAB = 256
PROMPT = torch.tensor([[5, 17, 42, 99, 7, 3]])
NEW_TOKENS = 12
CONFIG = {
    "train_micro_batch_size_per_gpu": 4,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
}
TIMEOUT = datetime.timedelta(seconds=300)


def build_model(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )
    return LlamaForCausalLM(config)


def generate(model: torch.nn.Module) -> list[int]:
    tokens = model.generate(
        PROMPT,
        attention_mask=torch.ones_like(PROMPT),
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        do_sample=False,
        pad_token_id=2,
    )
    return tokens[0].tolist()


# -- the side group: rank 0 and the server ------------------------------------------------


def side_group(port: int, rank: int) -> tuple[dist.TCPStore, dist.ProcessGroup]:
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=TIMEOUT)
    return store, dist.ProcessGroupGloo(dist.PrefixStore("sync", store), rank, 2, TIMEOUT)


def send_bucket(store: dist.TCPStore, group: dist.ProcessGroup, key: str, bucket: list) -> None:
    """Names, shapes and dtypes through the store; the tensors as one broadcast per dtype."""
    meta = [(name, list(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in bucket]
    store.set(key, json.dumps(meta))
    for dtype in sorted({d for _, _, d in meta}):
        flat = torch.cat([t.reshape(-1) for _, t in bucket if str(t.dtype).endswith(dtype)])
        group.broadcast(flat, 0).wait()


def receive_bucket(
    store: dist.TCPStore, group: dist.ProcessGroup, key: str
) -> list[tuple[str, torch.Tensor]] | None:
    meta = json.loads(store.get(key))
    if meta is None:
        return None
    received: dict[str, torch.Tensor] = {}
    for dtype in sorted({d for _, _, d in meta}):
        entries = [(n, s) for n, s, d in meta if d == dtype]
        sizes = [torch.Size(s).numel() for _, s in entries]
        flat = torch.empty(sum(sizes), dtype=getattr(torch, dtype))
        group.broadcast(flat, 0).wait()
        for (name, shape), part in zip(entries, flat.split(sizes), strict=True):
            received[name] = part.view(shape)
    return [(name, received[name]) for name, _, _ in meta]


def server(port: int, rounds: int) -> None:
    """The generation server: load each round's weights by name, generate, report tokens."""
    torch.set_num_threads(1)
    store, group = side_group(port, rank=1)
    model = build_model(seed=999).eval()  # not the trainer's weights until the first sync
    targets = model.state_dict()
    for round_ in range(rounds):
        loaded, index = set(), 0
        while (bucket := receive_bucket(store, group, f"{round_}/{index}")) is not None:
            with torch.no_grad():
                for name, tensor in bucket:
                    targets[name].copy_(tensor)  # a tied weight's other name follows
                    loaded.add(name)
            index += 1
        store.set(f"{round_}/tokens", json.dumps({"tokens": generate(model), "names": len(loaded)}))


# -- the trainers ----------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run(rounds: int = ROUNDS) -> list[str]:
    """Train and sync `rounds` times; rank 0 returns what it printed (the others nothing)."""
    engine, *_ = zerodp.initialize(model=build_model(seed=0), config=CONFIG)
    rank = engine.global_rank
    side, process = None, None
    if rank == 0:
        port = free_port()
        command = [sys.executable, str(Path(__file__).resolve()), "--serve", str(port), str(rounds)]
        process = subprocess.Popen(command)
        side = side_group(port, rank=0)
    generator = torch.Generator().manual_seed(rank)
    lines = []
    for round_ in range(rounds):
        for _ in range(STEPS_PER_ROUND):
            ids = torch.randint(3, VOCAB, (4, 32), generator=generator)
            engine.backward(engine(input_ids=ids, labels=ids).loss)
            engine.step()
        stream = engine.full_parameters(bucket_bytes=BUCKET_BYTES)
        for index, bucket in enumerate(stream.buckets()):  # every rank: a collective
            if side is not None:
                send_bucket(*side, f"{round_}/{index}", bucket)
        if side is not None:
            side[0].set(f"{round_}/{stream.report.num_buckets}", json.dumps(None))
        with engine.gathered_for_generation():
            ours = generate(engine.module)
        if side is not None:
            theirs = json.loads(side[0].get(f"{round_}/tokens"))
            same = theirs["tokens"] == ours
            lines.append(
                f"round {round_ + 1}: {stream.report.num_buckets} buckets (at most "
                f"{stream.report.peak_bucket_bytes} bytes assembled at once), "
                f"{theirs['names']} tensors loaded; server tokens equal the trainers': {same}"
            )
            print(lines[-1], flush=True)
            if not same:
                raise SystemExit("the server generated other tokens than the trainers")
    if process is not None:
        process.wait(timeout=60)
    engine.destroy()
    return lines


def main() -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    if sys.argv[1:2] == ["--serve"]:  # the server process rank 0 starts
        server(int(sys.argv[2]), int(sys.argv[3]))
        return
    run()
    destroy_process_group_if_owned()


if __name__ == "__main__":
    main()
