"""TRL's GRPOTrainer on randomwalks, run by ``benchmarks/trl_compare.py`` inside TRL's own virtualenv
(never the project's: TRL pins other versions). Trains ``--model`` for ``--steps`` optimizer steps and saves
the policy to ``--out``. Imports only ``services.tasks.randomwalks`` (numpy) from tether, for the prompts
and the reward, so both sides are scored by the same function.

    <trl venv>/bin/python benchmarks/_trl_grpo.py --model SFT_DIR --steps 20 --out OUT_DIR
"""

from __future__ import annotations

import argparse
import json
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
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from services.tasks.randomwalks import MAX_LENGTH, RandomWalksTask

    task = RandomWalksTask()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    prompts = task.prompts()
    # 20 prompts; the trainer draws prompts_per_step distinct ones a step and repeats each samples_per_prompt times
    dataset = Dataset.from_dict({"prompt": prompts * 1000})

    def walk_optimality(prompts: list[str], completions: list[str], **_) -> list[float]:
        return task.reward(prompts, completions)

    batch = args.prompts_per_step * args.samples_per_prompt
    config = GRPOConfig(
        output_dir=str(Path(args.out) / "trainer"),
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
        num_generations=args.samples_per_prompt,
        max_completion_length=MAX_LENGTH - 1,
        temperature=1.0,
        top_k=0,
        learning_rate=args.lr,
        lr_scheduler_type="constant",  # tether's default schedule
        beta=0.0,
        max_steps=args.steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        seed=args.seed,
        dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=walk_optimality, args=config, train_dataset=dataset,
                          processing_class=tokenizer)
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
        "reward_by_step": [r["reward"] for r in trainer.state.log_history if "reward" in r],
    }, indent=2))


if __name__ == "__main__":
    main()
