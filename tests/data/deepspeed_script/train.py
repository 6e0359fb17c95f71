"""A training script in the shape of DeepSpeed's "getting started" tutorial, written for DeepSpeed.

    deepspeed --num_gpus 2 train.py --deepspeed --deepspeed_config ds_config.json --losses out.json

It is kept as DeepSpeed users write it (`import deepspeed`); zerodp runs it with
only its imports rewritten (tests/distributed/test_deepspeed_script.py, and
`python bench/deepspeed_script.py`, which also runs it under DeepSpeed). Rank 0
writes the loss of every micro-step, averaged over ranks, to --losses.
"""

import argparse
import json

import deepspeed
import deepspeed.comm as dist
import torch
from deepspeed.accelerator import get_accelerator
from script_parts import INIT_SEED, SyntheticData, TinyNet


def parse_arguments():
    parser = argparse.ArgumentParser(description="tiny classifier")
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the launcher")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--save_dir", default=None, help="checkpoint folder")
    parser.add_argument("--losses", default=None, help="JSON file for the losses (rank 0)")
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def main():
    args = parse_arguments()
    deepspeed.init_distributed()
    torch.manual_seed(INIT_SEED)
    net = TinyNet()
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    engine, _optimizer, trainloader, _ = deepspeed.initialize(
        args=args, model=net, model_parameters=parameters, training_data=SyntheticData()
    )
    device = get_accelerator().current_device_name()
    criterion = torch.nn.CrossEntropyLoss()
    losses = []
    for _ in range(args.epochs):
        for inputs, labels in trainloader:
            outputs = engine(inputs.to(device))
            loss = criterion(outputs, labels.to(device))
            engine.backward(loss)
            engine.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(mean.item() / dist.get_world_size())
    if args.save_dir:
        client_state = {"epochs": args.epochs, "steps": engine.global_steps}
        engine.save_checkpoint(args.save_dir, client_state=client_state)
        _, restored = engine.load_checkpoint(args.save_dir)
        if restored["steps"] != engine.global_steps:
            raise RuntimeError(f"client state came back as {restored}")
    if dist.get_rank() == 0 and args.losses:
        with open(args.losses, "w") as out:
            json.dump({"losses": losses, "global_steps": engine.global_steps}, out)
    dist.barrier()


if __name__ == "__main__":
    main()
