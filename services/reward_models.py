"""Rewards that are models: a Hugging Face sequence classifier, and ``ScoreBatcher``, which scores the
samples of requests that arrive together in one forward (the reward service's dynamic batching).

Both the reward actors (``reward.kind: model``) and the reward service (``--model``) score with
``SequenceClassifierReward``, so a model served over HTTP gives the scores the job computes in-process.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch


def reward_label_index(label: int | str | None, id2label: dict, where: str) -> int:
    """The classifier output a score is read from: ``reward.label`` as an index or a name of
    ``id2label`` ({index: name}, as in a transformers config). Required when there is more than one
    label: an SST-2 classifier's label 0 is NEGATIVE. Raises ValueError naming the labels."""
    labels = {int(i): str(name) for i, name in id2label.items()}
    listed = ", ".join(f"{i}={name!r}" for i, name in sorted(labels.items()))
    if label is None:
        if len(labels) == 1:
            return next(iter(labels))
        raise ValueError(f"{where} has {len(labels)} labels ({listed}): set reward.label to the index or the "
                         "name of the one whose logit is the reward")
    by_name = [i for i, name in labels.items() if name == label]
    if by_name:
        return by_name[0]
    # CLI values are text
    index = label if isinstance(label, int) else int(label) if label.isdigit() else None
    if index is not None and index in labels:
        return index
    raise ValueError(f"reward.label={label!r} is not a label of {where}; its labels are {listed}")


def check_classifier_config(config, where: str) -> None:
    """Refuse a model whose config says it is not a sequence classifier (a causal LM, a base encoder):
    transformers would load it with a randomly initialised head and score noise."""
    architectures = getattr(config, "architectures", None) or []
    if architectures and not any(a.endswith("ForSequenceClassification") for a in architectures):
        raise ValueError(f"{where} is a {', '.join(architectures)}, not a sequence classifier: a reward "
                         "model needs a classification head (an architecture named "
                         "*ForSequenceClassification)")


class SequenceClassifierReward:
    """A sequence-classification model's logit of one label, at each (prompt + response)'s last real token.

    ``where`` names the model in errors (the setting it came from and the process)."""

    def __init__(self, path: str | Path, label: int | str | None, device: str = "cpu",
                 where: str = "") -> None:
        from transformers import AutoConfig, AutoModelForSequenceClassification

        from services.models import load_tokenizer

        where = where or f"reward model {path}"
        check_classifier_config(AutoConfig.from_pretrained(path), where)
        model, info = AutoModelForSequenceClassification.from_pretrained(path, output_loading_info=True)
        head = sorted(k for k in info["missing_keys"]
                      if k.split(".")[0] in ("score", "classifier", "classification_head"))
        if head:
            raise ValueError(f"{where} has no trained classification head ({', '.join(head)} missing from "
                             "its weights): transformers would score with a random head")
        self.model = model.eval().to(device)
        self.device = device
        self.label_index = reward_label_index(label, self.model.config.id2label, where)
        self.tokenizer = load_tokenizer(path)
        # HF classifiers score the last token that is not config.pad_token_id: pad with a real token
        # (eos for GPT-2-style tokenizers that have none) and make the model look for that one
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model.config.pad_token_id = self.tokenizer.pad_token_id

    def texts(self, prompts: Sequence[str], completions: Sequence[str]) -> list[str]:
        return [p + c for p, c in zip(prompts, completions, strict=True)]

    def count_tokens(self, prompt: str, completion: str) -> int:
        return len(self.tokenizer(prompt + completion)["input_ids"])

    def score_batch(self, prompts: Sequence[str], completions: Sequence[str],
                    fields: Sequence[dict]) -> list[float]:
        """``ScoreBatcher``'s call: the samples' fields are not the model's business."""
        return self(prompts, completions)

    @torch.no_grad()
    def __call__(self, prompts: Sequence[str], completions: Sequence[str]) -> list[float]:
        """[B] scores, in one right-padded forward."""
        enc = self.tokenizer(self.texts(prompts, completions), return_tensors="pt", padding=True,
                             padding_side="right").to(self.device)
        logits = self.model(**enc).logits[:, self.label_index]
        return [float(x) for x in logits]


@dataclass
class _Request:
    samples: list[tuple]  # (prompt, completion, fields) per sample
    tokens: list[int] | None = None  # counted on the worker thread
    scores: list = field(default_factory=list)
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


class ScoreBatcher:
    """Dynamic batching: ``score(prompts, completions, fields)`` from many threads at once; one worker thread
    scores whatever samples are waiting, oldest first, in calls of at most ``max_batch_tokens`` tokens (one
    sample longer than that goes alone), so requests that arrive together share one forward.

    ``score_batch(prompts, completions, fields) -> scores`` is the model's call; ``count_tokens(prompt,
    completion) -> int`` what a sample costs. Both run on the worker thread alone: a fast tokenizer is not
    safe to call from several threads at once (its padding settings are the tokenizer's state; requests'
    threads counting while the worker padded a batch broke the batch). ``forwards`` counts the calls made."""

    def __init__(self, score_batch: Callable[[list[str], list[str], list[dict]], Sequence[float]],
                 count_tokens: Callable[[str, str], int], max_batch_tokens: int) -> None:
        if not isinstance(max_batch_tokens, int) or max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be a positive integer, got {max_batch_tokens!r}")
        self.score_batch, self.count_tokens, self.max_batch_tokens = (score_batch, count_tokens,
                                                                      max_batch_tokens)
        self.forwards = 0
        self._waiting: list[tuple[_Request, int]] = []  # (request, index of its next unscored sample)
        self._wake = threading.Condition()
        threading.Thread(target=self._work, name="score-batcher", daemon=True).start()

    def __call__(self, prompts: Sequence[str], completions: Sequence[str],
                 fields: Sequence[dict] | None = None) -> list[float]:
        fields = list(fields) if fields is not None else [{} for _ in prompts]
        request = _Request(list(zip(prompts, completions, fields, strict=True)))
        if not request.samples:
            return []
        with self._wake:
            self._waiting.append((request, 0))
            self._wake.notify()
        request.done.wait()
        if request.error is not None:
            raise request.error
        return request.scores

    def _take(self) -> list[tuple[_Request, int, int]]:
        """(request, first, end) slices of the waiting samples for one call, oldest first, within the
        budget."""
        taken, budget = [], self.max_batch_tokens
        while self._waiting:
            request, start = self._waiting[0]
            if request.tokens is None:
                try:
                    request.tokens = [self.count_tokens(p, c) for p, c, _ in request.samples]
                except Exception as err:  # noqa: BLE001 - the request fails with it; the worker goes on
                    request.error = err
                    request.done.set()
                    self._waiting.pop(0)
                    continue
            end = start
            while end < len(request.samples) and (request.tokens[end] <= budget
                                                  or (not taken and end == start)):
                budget -= request.tokens[end]
                end += 1
            if end > start:
                taken.append((request, start, end))
            if end < len(request.samples):
                self._waiting[0] = (request, end)
                break
            self._waiting.pop(0)
        return taken

    def _work(self) -> None:
        while True:
            with self._wake:
                while not self._waiting:
                    self._wake.wait()
                taken = self._take()
            samples = [s for request, start, end in taken for s in request.samples[start:end]]
            try:
                scores = list(self.score_batch([s[0] for s in samples], [s[1] for s in samples],
                                               [s[2] for s in samples]))
                if len(scores) != len(samples):
                    raise RuntimeError(f"the model returned {len(scores)} scores for {len(samples)} samples")
                error = None
            except BaseException as err:  # noqa: BLE001 - handed to the requests that were in the call
                scores, error = [], err
            self.forwards += 1
            if error is not None:  # the requests in this call fail whole: their other samples are not scored
                with self._wake:
                    failed = {id(request) for request, _, _ in taken}
                    self._waiting = [(r, s) for r, s in self._waiting if id(r) not in failed]
                for request, _, _ in taken:
                    request.error = error
                    request.done.set()
                continue
            offset = 0
            for request, start, end in taken:
                request.scores.extend(scores[offset:offset + end - start])
                offset += end - start
                if end == len(request.samples):
                    request.done.set()
