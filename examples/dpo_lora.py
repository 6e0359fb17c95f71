"""DPO with LoRA adapters on TRL's DPOTrainer, trained by zerodp at ZeRO stage 3.

    torchrun --standalone --nproc_per_node 2 examples/dpo_lora.py

`with_zerodp(trl.DPOTrainer)` is TRL's trainer with zerodp preparing,
stepping and saving the model (docs/post-training.md). No downloads: the
policy is a small Llama built from a config, the tokenizer a word-level one
built here, and the preference data is made up on the spot: the prompt is a
list of digits, the chosen answer the digits sorted, the rejected answer
the same digits in another order. The LoRA adapters (PEFT) are the only
trained weights; the reference is a frozen copy of the initial adapter that
TRL adds to a PEFT policy (the "ref" adapter, saved next to the trained
one). Rank 0 logs TRL's DPO metrics (rewards/accuracies rises towards 1);
the run ends with `save_model` (PEFT's adapter files), a reload with
`PeftModel.from_pretrained` on a fresh copy of the base model, and the
held-out preference accuracy of the base and of the reloaded adapter.
Under a minute on 2 CPU processes.
"""

from __future__ import annotations

import os

# Two ranks on a small machine must not each spawn a thread per core; set before torch loads.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")  # TRL reports usage to the Hub otherwise

import argparse
import random
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent
if str(_HERE.parent) not in sys.path:
    sys.path.insert(0, str(_HERE.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402

from zerodp.integrations.transformers import with_zerodp  # noqa: E402

NUM_DIGITS = 6
CONFIG = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": "auto"},
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--output-dir", default="runs/dpo_lora", help="logs and the adapter")
    p.add_argument("--steps", type=int, default=60, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=8, help="per-rank micro batch")
    p.add_argument("--lr", type=float, default=5e-3, help="learning rate of the adapters")
    p.add_argument("--beta", type=float, default=0.1, help="DPO's beta")
    p.add_argument("--rank", type=int, default=8, help="LoRA rank")
    p.add_argument("--pairs", type=int, default=4096, help="training preference pairs")
    return p.parse_args(argv)


def build_tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<s>", "</s>", "<pad>", "sort:", *[str(d) for d in range(10)]]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )


def build_base(vocab_size: int) -> LlamaForCausalLM:
    torch.manual_seed(0)  # every rank, and the reload at the end, build the same base weights
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )
    return LlamaForCausalLM(config)


def preference_pairs(num_rows: int, seed: int) -> Any:
    from datasets import Dataset

    rng = random.Random(seed)
    rows: dict[str, list[str]] = {"prompt": [], "chosen": [], "rejected": []}
    for _ in range(num_rows):
        digits = [rng.randrange(10) for _ in range(NUM_DIGITS)]
        shuffled = digits[:]
        while shuffled == sorted(digits):
            rng.shuffle(shuffled)
        rows["prompt"].append("sort: " + " ".join(map(str, digits)))
        rows["chosen"].append(" " + " ".join(map(str, sorted(digits))))
        rows["rejected"].append(" " + " ".join(map(str, shuffled)))
    return Dataset.from_dict(rows)


def preference_accuracy(model: Any, tokenizer: Any, pairs: Any) -> float:
    """The share of pairs where the model gives the chosen answer the higher log-probability."""

    def logprob(prompt: str, answer: str) -> float:
        ids = tokenizer(prompt + answer, return_tensors="pt").input_ids
        start = len(tokenizer(prompt).input_ids)
        with torch.no_grad():
            logits = model(input_ids=ids).logits.float()
        logps = torch.log_softmax(logits[0, :-1], dim=-1)
        targets = ids[0, 1:]
        return logps[start - 1 :].gather(-1, targets[start - 1 :, None]).sum().item()

    wins = [
        logprob(row["prompt"], row["chosen"]) > logprob(row["prompt"], row["rejected"])
        for row in pairs
    ]
    return sum(wins) / len(wins)


def main(argv: Sequence[str] | None = None) -> None:
    import peft
    import trl

    args = parse_args(argv)
    tokenizer = build_tokenizer()
    policy = peft.get_peft_model(
        build_base(len(tokenizer)),
        peft.LoraConfig(
            r=args.rank,
            lora_alpha=2 * args.rank,
            lora_dropout=0.0,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "down_proj"],
            task_type="CAUSAL_LM",
        ),
    )
    training = trl.DPOConfig(
        output_dir=args.output_dir,
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=1,
        max_steps=args.steps,
        learning_rate=args.lr,
        beta=args.beta,
        max_length=2 * NUM_DIGITS + 2,
        logging_steps=10,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(),
        bf16=False,
        seed=0,
    )
    trainer = with_zerodp(trl.DPOTrainer)(
        model=policy,
        args=training,
        train_dataset=preference_pairs(args.pairs, seed=1),
        processing_class=tokenizer,
        zerodp_config=CONFIG,
    )
    trainer.train()
    adapter_dir = os.path.join(args.output_dir, "adapter")
    trainer.save_model(adapter_dir)  # every rank: the adapter is gathered from its shards
    if dist.get_rank() == 0:
        held_out = preference_pairs(200, seed=2)
        reloaded = peft.PeftModel.from_pretrained(build_base(len(tokenizer)), adapter_dir).eval()
        trained = preference_accuracy(reloaded, tokenizer, held_out)
        with reloaded.disable_adapter():
            base = preference_accuracy(reloaded, tokenizer, held_out)
        print(f"adapter files in {adapter_dir}: {sorted(os.listdir(adapter_dir))}")
        print(f"held-out preference accuracy: base {base:.2f}, trained adapter {trained:.2f}")
    trainer.destroy_engines()


if __name__ == "__main__":
    main()
