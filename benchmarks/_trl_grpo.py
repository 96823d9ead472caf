"""TRL's GRPOTrainer on a tether task, run by ``benchmarks/trl_compare.py`` inside TRL's own virtualenv
(never the project's: TRL pins other versions). Trains ``--model`` for ``--steps`` optimizer steps and saves
the policy and per-step timings to ``--out``. Imports only the task's module from tether
(``services.tasks.randomwalks``: numpy; ``services.tasks.sentiment``: vaderSentiment), for the prompts and
the reward, so both sides are scored by the same function.

- randomwalks: plain-text prompts, the task's optimality as the reward.
- smollm2-sentiment: the prompts as one user turn (TRL applies the chat template, as the task's
  ``format_prompt`` does), VADER's compound score as the reward, and ``--missing-eos-penalty`` for a
  completion cut at the cap without EOS (the preset's ``reward.missing_eos_penalty``).

    <trl venv>/bin/python benchmarks/_trl_grpo.py --model SFT_DIR --steps 20 --out OUT_DIR
    <trl venv>/bin/python benchmarks/_trl_grpo.py --task smollm2-sentiment --model SMOLLM2_DIR --steps 3 \
        --prompts-per-step 8 --samples-per-prompt 8 --beta 0.05 --max-completion-length 32 --lr 5e-5 \
        --out OUT_DIR
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

START = time.perf_counter()
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True, help="the SFT start (a Hugging Face model dir)")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps")
    parser.add_argument("--out", required=True, help="where the trained policy and timings.json go")
    parser.add_argument("--prompts-per-step", type=int, default=16)
    parser.add_argument("--samples-per-prompt", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--task", choices=("randomwalks", "smollm2-sentiment"), default="randomwalks")
    parser.add_argument("--beta", type=float, default=0.0, help="KL coefficient; > 0 loads a reference model")
    parser.add_argument("--max-completion-length", type=int, help="default: the task's")
    parser.add_argument("--missing-eos-penalty", type=float, help="reward of a completion without EOS")
    parser.add_argument("--ignore-eos", action="store_true", help="every completion runs to the cap: EOS is "
                        "never sampled (generate's min_new_tokens; TRL masks what follows a sampled EOS)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--lora-rank", type=int, default=0, help="> 0: train PEFT LoRA adapters of this rank "
                        "on every linear layer (the reference is then the base model, adapters disabled)")
    parser.add_argument("--lora-alpha", type=float, default=16.0)
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype))
    if args.task == "randomwalks":
        from services.tasks.randomwalks import MAX_LENGTH, RandomWalksTask

        task = RandomWalksTask()
        prompts = task.prompts()
        max_completion = args.max_completion_length or MAX_LENGTH - 1
    else:
        from services.tasks.sentiment import SentimentTask

        task = SentimentTask()
        prompts = [[{"role": "user", "content": text}] for text in task.prompts()]
        max_completion = args.max_completion_length or task.max_new_tokens
    # the trainer draws prompts_per_step distinct prompts a step and repeats each samples_per_prompt times
    dataset = Dataset.from_dict({"prompt": prompts * 1000})
    eos = tokenizer.eos_token_id

    def task_reward(prompts: list, completions: list, completion_ids: list[list[int]], **_) -> list[float]:
        texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
        prompt_texts = [p if isinstance(p, str) else p[-1]["content"] for p in prompts]
        rewards = task.reward(prompt_texts, texts)
        if args.missing_eos_penalty is None:
            return rewards
        # TRL keeps the first EOS in completion_ids; a completion cut at the cap has none
        return [r if ids and ids[-1] == eos else args.missing_eos_penalty
                for r, ids in zip(rewards, completion_ids, strict=True)]

    step_ends: list[float] = []

    class StepTimes(TrainerCallback):
        def on_step_end(self, *_, **__):
            step_ends.append(time.perf_counter())

    batch = args.prompts_per_step * args.samples_per_prompt
    config = GRPOConfig(
        output_dir=str(Path(args.out) / "trainer"),
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
        num_generations=args.samples_per_prompt,
        max_completion_length=max_completion,
        temperature=1.0,
        top_k=0,
        learning_rate=args.lr,
        lr_scheduler_type="constant",  # tether's default schedule
        beta=args.beta,
        max_steps=args.steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=args.dtype == "bfloat16",
        seed=args.seed,
        dataloader_num_workers=0,
        generation_kwargs={"min_new_tokens": max_completion} if args.ignore_eos else None,
    )
    peft_config = None
    if args.lora_rank:
        from peft import LoraConfig

        peft_config = LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha, lora_dropout=0.0,
                                 target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=model, reward_funcs=task_reward, args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[StepTimes()], peft_config=peft_config)
    ready = time.perf_counter() - START
    t0 = time.perf_counter()
    trainer.train()
    train_seconds = time.perf_counter() - t0
    out = Path(args.out)
    trainer.model.save_pretrained(out / "model")
    tokenizer.save_pretrained(out / "model")
    (out / "timings.json").write_text(json.dumps({
        "ready_seconds": ready, "train_seconds": train_seconds, "steps": args.steps,
        "seconds_per_step": train_seconds / args.steps, "completions_per_step": batch,
        "step_seconds": [b - a for a, b in zip([t0, *step_ends], step_ends)], "task": args.task,
        "beta": args.beta, "dtype": args.dtype, "max_completion_length": max_completion,
        "lora_rank": args.lora_rank,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # Linux: KiB
        "reward_by_step": [r["reward"] for r in trainer.state.log_history if "reward" in r],
        "completion_length_by_step": [r["completions/mean_length"] for r in trainer.state.log_history
                                      if "completions/mean_length" in r],
    }, indent=2))


if __name__ == "__main__":
    main()
