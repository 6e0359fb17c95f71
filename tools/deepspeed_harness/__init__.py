"""DeepSpeed's unit-test harness for running a DeepSpeed test file against zerodp.

`python tools/run_deepspeed_tests.py PATH/test_file.py` runs an unchanged DeepSpeed test
file (DeepSpeed's code is never copied into this repository: the file is read from where
it lies). This package supplies what the file imports besides DeepSpeed:

- `alias`: the name `deepspeed` (and every `deepspeed.x`) re-pointed to zerodp;
- `unit.common` / `unit.simple_model`: DeepSpeed's `DistributedTest` base class and the
  helpers its tests import, written for zerodp's worker pools;
- `plugin`: the pytest plugin that runs each `DistributedTest` method on `world_size`
  ranks (gloo, reusing one pool of processes per world size);
- `worker`: what each rank runs.
"""
