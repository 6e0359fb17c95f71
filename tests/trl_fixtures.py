"""What TRL's trainers need beyond `tests/hf_models.py`, made locally (no download).

- A word-level tokenizer over the tiny Llama's 96 ids: `w3` ... `w95` are
  ids 3..95; ids 0, 1, 2 are BOS, EOS and PAD, as in the model's config.
- Datasets (`datasets.Dataset`) drawn from seeded generators: SFT rows of
  fixed length (so every rank normalises its loss by the same token count),
  DPO preference triples, GRPO prompts.
- `build_gumbel_llama`: the tiny Llama whose `generate` samples with the
  Gumbel-max trick, its noise drawn from a generator seeded by the tokens so
  far and the row's place in its group of `num_generations` (completion k of
  a prompt gets noise seed (k, prefix)). Each completion is a true sample of
  the model's distribution, but one that does not depend on which process
  generates it, nor on how many rows that process generates at once: so
  GRPO on 2 ranks can be compared with GRPO in one process on the global
  batch, which plain multinomial sampling (one global generator per process)
  would not allow.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import LogitsProcessor, LogitsProcessorList, PreTrainedTokenizerFast

from tests.hf_models import SEQ_LEN, VOCAB, build_llama

FIRST_WORD = 3


def build_tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<s>": 0, "</s>": 1, "<pad>": 2}
    vocab.update({f"w{i}": i for i in range(FIRST_WORD, VOCAB)})
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        unk_token="<pad>",
    )


def _words(generator: torch.Generator, length: int) -> str:
    ids = torch.randint(FIRST_WORD, VOCAB, (length,), generator=generator)
    return " ".join(f"w{int(i)}" for i in ids)


def sft_dataset(num_rows: int) -> Any:
    """Pre-tokenized rows of `SEQ_LEN` ids (all one length: equal token counts per rank)."""
    from datasets import Dataset

    rows = []
    for index in range(num_rows):
        generator = torch.Generator().manual_seed(2000 + index)
        rows.append(torch.randint(FIRST_WORD, VOCAB, (SEQ_LEN,), generator=generator).tolist())
    return Dataset.from_dict({"input_ids": rows})


def dpo_dataset(num_rows: int) -> Any:
    """Prompt, chosen and rejected texts, each a fixed number of words."""
    from datasets import Dataset

    columns: dict[str, list[str]] = {"prompt": [], "chosen": [], "rejected": []}
    for index in range(num_rows):
        generator = torch.Generator().manual_seed(3000 + index)
        columns["prompt"].append(_words(generator, 4))
        # A leading space: the completion's first word stays a word of its own after the prompt.
        columns["chosen"].append(" " + _words(generator, 5))
        columns["rejected"].append(" " + _words(generator, 5))
    return Dataset.from_dict(columns)


def grpo_dataset(num_rows: int) -> Any:
    from datasets import Dataset

    prompts = []
    for index in range(num_rows):
        generator = torch.Generator().manual_seed(4000 + index)
        prompts.append(_words(generator, 4))
    return Dataset.from_dict({"prompt": prompts})


def low_ids_reward(completion_ids: list[list[int]], **_: Any) -> list[float]:
    """A reward with spread: the share of completion tokens below the middle of the vocabulary."""
    return [sum(1 for t in ids if t < VOCAB // 2) / max(len(ids), 1) for ids in completion_ids]


class GroupSeededGumbel(LogitsProcessor):
    """Adds Gumbel noise seeded by (row's place in its group, prefix); greedy then samples."""

    def __init__(self, num_generations: int) -> None:
        self.num_generations = num_generations

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        noise = torch.empty_like(scores, dtype=torch.float32, device="cpu")
        for row, prefix in enumerate(input_ids.tolist()):
            seed = hash((row % self.num_generations, *prefix)) % (2**62)
            generator = torch.Generator().manual_seed(seed)
            uniform = torch.rand(scores.shape[-1], generator=generator).clamp_(1e-9, 1 - 1e-9)
            noise[row] = -torch.log(-torch.log(uniform))
        return scores.float() + noise.to(scores.device)


def build_gumbel_llama(num_generations: int, seed: int = 0) -> Any:
    model = build_llama(seed)
    plain_generate = model.generate

    def generate(*args: Any, **kwargs: Any) -> Any:
        processors = LogitsProcessorList(kwargs.pop("logits_processor", None) or [])
        processors.append(GroupSeededGumbel(num_generations))
        return plain_generate(*args, logits_processor=processors, **kwargs)

    model.generate = generate  # type: ignore[method-assign]
    return model
