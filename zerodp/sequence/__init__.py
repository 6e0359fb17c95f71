"""Sequence parallelism (Ulysses): each sequence split over the S ranks of a sequence group.

With `"sequence_parallel_size": S` in the config, `zerodp.initialize` builds an
engine whose ranks d*S .. d*S+S-1 split the sequences of replica d, and for a
Hugging Face model switches its attention and splits its forward itself
(docs/sequence-parallel.md). This package holds the parts:

- `all_to_all`: the autograd all-to-all between sequence shards and head shards
  ([Note: Ulysses all-to-all]);
- `attention`: an attention function run on head shards of the whole sequence,
  and `sequence_parallel_attention`, the wrapper for models zerodp does not
  switch itself;
- `hf_attention`, `hf_forward`, `inputs`: a Hugging Face model's attention,
  masks and inputs ([Note: sequence-parallel forwards]);
- `loss`: a loss over a split sequence ([Note: sequence-parallel loss]);
- `tiling`, `hf_tiling`: token-wise modules and the logits' loss computed a tile of
  tokens at a time ([Note: tiled compute]), and their switch in a Hugging Face model
  (`"tiled_compute"`, with or without sequence parallelism);
- `group`, `parallel`: the sequence group's state, and what the engine holds.

The rules that depend on the dimensions (which ranks form a group, which tokens
a rank holds, what a reduction is divided by) are `zerodp.parallel`'s.
"""

from zerodp.sequence.attention import UlyssesAttention, sequence_parallel_attention
from zerodp.sequence.hf_tiling import TiledCompute, TilingSettings
from zerodp.sequence.loss import count_targets, shift_labels, sum_over_sequence
from zerodp.sequence.parallel import SequenceParallel
from zerodp.sequence.sequence_group import ForwardMode, SequenceGroup
from zerodp.sequence.tiling import tiled_logits_loss, tiled_tokenwise

__all__ = [
    "ForwardMode",
    "SequenceGroup",
    "SequenceParallel",
    "TiledCompute",
    "TilingSettings",
    "UlyssesAttention",
    "count_targets",
    "sequence_parallel_attention",
    "shift_labels",
    "sum_over_sequence",
    "tiled_logits_loss",
    "tiled_tokenwise",
]
