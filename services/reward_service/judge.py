"""An LLM judge: a model run by vLLM reads each response and answers; a rule the user sets reads the score
from the answer (``reward.kind: judge`` in the reward actors, ``--judge`` in the reward service).

* The judge's prompt is ``reward.judge.template`` with ``{prompt}``, ``{response}`` and the row's fields
  (a dataset's ``task.reward_fields``) filled in, sent as a user message through the judge's chat template
  when it has one.
* The answer is read by ``AnswerRule``: the first number (within ``score_range``, if set), or the first of
  ``labels`` (a label-to-score map), or whatever a ``pattern``'s first group captures. An answer the rule
  cannot read scores ``unparseable_score`` and is counted; it is never a silent 0.
* Greedy by default (temperature 0) with a fixed seed: the same response in the same batch gets the same
  score.
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

from services.judge_template import template_fields

if TYPE_CHECKING:
    from services.config import JudgeConfig

log = logging.getLogger(__name__)

NUMBER = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)"


class AnswerRule:
    """Reads a score from a judge's answer; None when it cannot."""

    def __init__(self, parse: str, pattern: str | None = None, score_range: tuple[float, float] | None = None,
                 labels: dict[str, float] | None = None) -> None:
        self.parse, self.score_range = parse, score_range
        self.labels = {k.strip().lower(): float(v) for k, v in (labels or {}).items()}
        if pattern is not None:
            self.pattern = re.compile(pattern, re.IGNORECASE | re.DOTALL)
        elif parse == "number":
            self.pattern = re.compile(NUMBER)
        else:  # the first label, as a whole word; the longest wins where two start at the same place
            alternatives = sorted(self.labels, key=len, reverse=True)
            self.pattern = re.compile(r"(?<!\w)(" + "|".join(map(re.escape, alternatives)) + r")(?!\w)",
                                      re.IGNORECASE)

    def __call__(self, answer: str) -> float | None:
        match = self.pattern.search(answer)
        if match is None:
            return None
        text = (match.group(1) if self.pattern.groups else match.group(0)).strip()
        if self.parse == "labels":
            return self.labels.get(text.lower())
        try:
            value = float(text)
        except ValueError:
            return None
        if not math.isfinite(value):
            return None
        if self.score_range is not None and not self.score_range[0] <= value <= self.score_range[1]:
            return None
        return value


class Judge:
    """The judge model on vLLM and its rule: ``judge(prompts, responses, fields) -> scores``.

    ``answers`` and ``unparseable`` count what it has judged; ``last_unparseable`` is the latest answer the
    rule could not read (for the log)."""

    def __init__(self, cfg: JudgeConfig, model_dir: str, device: str = "cpu",
                 engine_args: dict | None = None) -> None:
        from services.devices import build_llm

        self.cfg = cfg
        self.rule = AnswerRule(cfg.parse, cfg.pattern, cfg.score_range, cfg.labels)
        self.fields = template_fields(cfg.template)
        self.llm = build_llm(model_dir, cfg.seed, cfg.max_model_len, cfg.kv_cache_mib, cfg.dtype, device,
                             engine_args)
        self.tokenizer = self.llm.get_tokenizer()
        self.chat = cfg.chat and bool(getattr(self.tokenizer, "chat_template", None))
        self.answers = self.unparseable = 0
        self.last_unparseable: str | None = None

    def render(self, prompt: str, response: str, fields: dict) -> str:
        """The judge's prompt for one sample; ValueError naming a template field the sample lacks."""
        values = {**fields, "prompt": prompt, "response": response}
        missing = [f for f in self.fields if f not in values]
        if missing:
            raise ValueError(f"reward.judge.template needs the row field(s) {missing}, which this sample "
                             f"lacks (it has {sorted(fields)})")
        text = self.cfg.template.format(**values)
        if self.chat:
            return self.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                      add_generation_prompt=True)
        return text

    def count_tokens(self, prompt: str, response: str) -> int:
        """What a sample costs a batch, about: its prompt and response, the template and the answer."""
        return len(self.tokenizer.encode(self.cfg.template + prompt + response)) + self.cfg.max_new_tokens

    def judge(self, prompts: Sequence[str], responses: Sequence[str],
              fields: Sequence[dict] | None = None) -> tuple[list[float], list[str]]:
        """(scores, answers), one per sample, in one batched ``generate``."""
        from vllm import SamplingParams, TokensPrompt

        fields = list(fields) if fields is not None else [{} for _ in prompts]
        texts = [self.render(p, r, f) for p, r, f in zip(prompts, responses, fields, strict=True)]
        # a chat template writes the special tokens itself
        encoded = [self.tokenizer.encode(text, add_special_tokens=not self.chat) for text in texts]
        room = self.cfg.max_model_len - self.cfg.max_new_tokens
        for i, ids in enumerate(encoded):
            if len(ids) > room:
                raise ValueError(f"the judge's prompt for sample {i} has {len(ids)} tokens, more than "
                                 f"reward.judge.max_model_len - max_new_tokens = {room}")
        params = SamplingParams(temperature=self.cfg.temperature, max_tokens=self.cfg.max_new_tokens,
                                seed=self.cfg.seed)
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in encoded], params,
                                    use_tqdm=False)
        answers = [out.outputs[0].text for out in outputs]
        scores = []
        for answer in answers:
            score = self.rule(answer)
            if score is None:
                self.unparseable += 1
                self.last_unparseable = answer
                score = self.cfg.unparseable_score
            scores.append(float(score))
        self.answers += len(answers)
        return scores, answers

    def __call__(self, prompts: Sequence[str], responses: Sequence[str],
                 fields: Sequence[dict] | None = None) -> list[float]:
        return self.judge(prompts, responses, fields)[0]

    def take_counts(self) -> dict[str, int]:
        """Answers and unparseable answers since the last call (then zero)."""
        counts = {"judge_answers": self.answers, "judge_unparseable": self.unparseable}
        if self.unparseable:
            log.warning("reward judge: %d of %d answers unparseable, scored %s; the latest: %r",
                        self.unparseable, self.answers, self.cfg.unparseable_score,
                        (self.last_unparseable or "")[:200])
        self.answers = self.unparseable = 0
        return counts
