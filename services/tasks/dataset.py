"""Your own prompts: ``task.name: dataset`` reads a JSONL, JSON, CSV or Parquet file, or a saved Hugging Face
dataset directory, through the ``datasets`` library.

The driver reads the file once (``path`` set). The reward actors get only what the reward reads, the
prompt column and ``task.reward_fields``, as one ``Shipment`` (``reward_actor_options``), put in the object
store once Ray is up: they never open ``task.path`` on their own node. The reward function,
``package.module:function``, is code: it is imported by name on the driver (to fail before any actor starts)
and again on each reward actor. It is called once per sample as
``function(prompt=..., completion=..., **fields)`` and returns a number; ``prompt`` is the row's
``task.prompt_field`` value as in the file (text, or the chat messages), ``completion`` the decoded response.

Rows are counted from 0, in file order, in error messages.
"""

from __future__ import annotations

import inspect
import json
import numbers
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from services.errors import load_object
from services.shipment import Shipment
from services.tasks.base import Task

FILE_READERS = {".jsonl": "from_json", ".json": "from_json", ".csv": "from_csv", ".parquet": "from_parquet"}


def read_rows(path: str, split: str, columns: list[tuple[str, str]], what: str) -> dict[str, list]:
    """The ``columns`` ((name, the setting that names it) pairs; none: every column) of a data file, or of one
    split of a saved dataset directory, as lists. Raises ValueError naming the file (the split, the row, the
    field) for anything missing or empty."""
    import datasets

    source = Path(path).expanduser()
    if not source.exists():
        raise FileNotFoundError(f"{what} {path} does not exist")
    datasets.disable_progress_bars()
    if source.is_dir():
        try:
            data = datasets.load_from_disk(str(source))
        except Exception as err:  # any reader failure is bad input, named with its file
            # datasets cannot load a split saved with no rows (no Arrow file): say so, not its IndexError
            empty = [p.parent.name for p in source.glob("**/state.json")
                     if not json.loads(p.read_text()).get("_data_files", True)]
            if empty:
                raise ValueError(f"{what} {path} has no rows (saved with none: "
                                 f"{', '.join(sorted(empty))})") from err
            raise ValueError(f"{what} {path} is not a saved Hugging Face dataset directory "
                             f"(datasets.save_to_disk): {type(err).__name__}: {err}") from err
        if isinstance(data, datasets.DatasetDict):
            if split not in data:
                raise ValueError(f"{what} {path} has no split {split!r}; its splits are {sorted(data)}")
            data = data[split]
            where = f"{path} (split {split!r})"
        else:
            where = path
    else:
        reader = FILE_READERS.get(source.suffix.lower())
        if reader is None:
            raise ValueError(f"{what} {path}: unknown format {source.suffix!r}; give a .jsonl, .json, .csv "
                             "or .parquet file, or a directory written by datasets' save_to_disk")
        if source.stat().st_size < 64 and not source.read_bytes().strip():
            raise ValueError(f"{what} {path} has no rows (the file is empty)")
        cache = tempfile.mkdtemp(prefix="tether-dataset-")  # read once: leave no Arrow cache behind
        try:
            data = getattr(datasets.Dataset, reader)(str(source), cache_dir=cache, keep_in_memory=True)
        except Exception as err:  # any reader failure is bad input, named with its file
            cause = err.__cause__ or err
            if "corresponds to no data" in str(cause):  # datasets' words for a file with a header and no rows
                raise ValueError(f"{what} {path} has no rows") from err
            raise ValueError(f"{what} {path} cannot be read as {source.suffix}: "
                             f"{type(cause).__name__}: {cause}") from err
        finally:
            shutil.rmtree(cache, ignore_errors=True)
        where = path
    if len(data) == 0:
        raise ValueError(f"{what} {where} has no rows")
    columns = columns or []
    for column, setting in columns:
        if column not in data.column_names:
            raise ValueError(f"{what} {where} has no field {column!r} ({setting}); its fields are "
                             f"{data.column_names}")
    rows = data.select_columns([c for c, _ in columns]).to_dict() if columns else data.to_dict()
    for column, setting in columns:
        missing = [i for i, v in enumerate(rows[column]) if v is None]
        if missing:
            raise ValueError(f"{what} {where}, row {missing[0]}: field {column!r} ({setting}) has no value "
                             f"({len(missing)} row(s) lack it)")
    return rows


def check_prompt(value: Any, where: str) -> None:
    """A prompt is non-empty text, or chat messages: a non-empty list of {"role": str, "content": str}."""
    if isinstance(value, str):
        if not value.strip():
            raise ValueError(f"{where} is empty")
        return
    if isinstance(value, list) and value and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in value):
        return
    raise ValueError(f"{where} holds {value!r:.120}; expected text or chat messages, a list of "
                     '{"role": ..., "content": ...}')


def reward_style(function: Callable) -> str:
    """How a reward function is called, read from its parameters: ``trl`` (TRL's batch function,
    ``(prompts, completions, **columns) -> list``), ``verl`` (verl's ``compute_score(data_source,
    solution_str, ground_truth, extra_info)``, one sample), or ``sample`` (tether's, ``(prompt, completion,
    **fields) -> score``, one sample)."""
    try:
        parameters = inspect.signature(function).parameters
    except ValueError:  # a builtin without a signature: called as tether's
        return "sample"
    if "completions" in parameters:
        return "trl"
    return "verl" if "solution_str" in parameters else "sample"


def field_argument(field_name: str) -> str:
    """The keyword a reward field reaches the function by: a nested field (``reward_model.ground_truth``,
    verl's parquet layout) by its last part."""
    return field_name.rsplit(".", 1)[-1]


def import_reward_function(name: str, setting: str = "task.reward_function") -> Callable:
    """``package.module:function``, imported and checked to be callable; ValueError naming ``setting``
    otherwise."""
    function = load_object(name, setting, "package.module:function")
    if not callable(function):
        raise ValueError(  # noqa: TRY004 - main reports ValueError as bad input
            f"{setting}={name!r} is a {type(function).__name__}, not a function")
    return function


@dataclass
class DatasetTask(Task):
    """Prompts from a data file; the reward from ``reward_function`` or from the job's reward kind (model)."""

    name: str = "dataset"
    seed: int = 1000  # accepted like every task's; the prompt order comes from run.seed
    tokenizer_kind: str = "pretrained"
    model_kind: str = "pretrained"
    path: str | None = None
    prompt_field: str = "prompt"
    split: str = "train"
    eval_path: str | None = None
    eval_split: str | None = None
    reward_function: str | None = None
    reward_fields: list[str] = field(default_factory=list)
    # on a reward actor: the driver's rows, {"train": columns, "eval": columns}, as a Shipment
    rows: Any = None

    def __post_init__(self) -> None:
        if self.rows is None:
            self.rows = self._read()
        elif isinstance(self.rows, Shipment):
            self.rows = self.rows.get()
        if self.reward_function:
            self.check_reward_function(self.function)

    # ------------------------------------------------------------------ the driver reads the data once

    def _read(self) -> dict[str, dict[str, list]]:
        if self.path is None:
            raise ValueError("task.name='dataset' needs task.path: a .jsonl, .json, .csv or .parquet file, "
                             "or a saved Hugging Face dataset directory")
        columns = [(self.prompt_field, "task.prompt_field")] + [(c, "task.reward_fields")
                                                                for c in self.field_columns()]
        train = read_rows(self.path, self.split, columns, "task.path")
        if self.eval_path:
            evaluation = read_rows(self.eval_path, self.eval_split or self.split, columns, "task.eval_path")
        elif self.eval_split:
            if not Path(self.path).expanduser().is_dir():
                raise ValueError(f"task.eval_split={self.eval_split!r} needs a saved dataset directory with "
                                 f"splits; task.path {self.path} is one file: give the evaluation file as "
                                 "task.eval_path")
            evaluation = read_rows(self.path, self.eval_split, columns, "task.path")
        else:
            evaluation = train
        for split, rows in (("train", train), ("eval", evaluation)):
            for i, value in enumerate(rows[self.prompt_field]):
                check_prompt(value, f"{self.prompt_origin(i, split)}")
        return {"train": train, "eval": evaluation}

    def prompt_origin(self, index: int, split: str = "train") -> str:
        """Where prompt ``index`` of the "train" or "eval" prompt list comes from: file, row and field."""
        if split == "eval" and self.eval_path:
            source = self.eval_path
        elif split == "eval" and self.eval_split:
            source = f"{self.path} (split {self.eval_split!r})"
        else:
            source = self.path
        return f"{source}, row {index}, field {self.prompt_field!r}"

    def prompts(self) -> list:
        """The prompt field of every training row: text, or chat messages that ``format_prompt`` renders."""
        return list(self.rows["train"][self.prompt_field])

    def eval_prompts(self) -> list:
        """The evaluation rows' prompts: task.eval_path, task.eval_split, or else the training rows."""
        return list(self.rows["eval"][self.prompt_field])

    def format_prompt(self, text, tokenizer) -> str:
        """Text as it is; chat messages through the tokenizer's chat template, ready for the assistant's
        turn."""
        if isinstance(text, str):
            return text
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"task.prompt_field {self.prompt_field!r} of {self.path} holds chat messages, "
                             "but the model's tokenizer has no chat template (tokenizer_config.json "
                             "'chat_template')")
        return tokenizer.apply_chat_template(text, tokenize=False, add_generation_prompt=True)

    # ------------------------------------------------------------------ the reward, on a reward actor

    def reward_actor_options(self) -> dict:
        """What a reward actor builds this task from: the prompt column and the reward fields as one
        ``Shipment`` (the driver ships it once Ray is up: ``Plan.shipments``); never the path."""
        if not hasattr(self, "_rows"):  # one shipment for every spec that holds these options
            self._rows = Shipment({split: self.reward_columns(rows) for split, rows in self.rows.items()})
        return self.reward_options(self._rows)

    def field_columns(self) -> list[str]:
        """The columns the reward fields are read from: a nested field (reward_model.ground_truth) with its
        column."""
        return list(dict.fromkeys(f.split(".")[0] for f in self.reward_fields))

    def reward_columns(self, rows: dict[str, list]) -> dict[str, list]:
        """Of a split's columns, those the reward reads: the prompts and the reward fields'."""
        return {c: rows[c] for c in dict.fromkeys([self.prompt_field, *self.field_columns()])}

    def reward_options(self, rows) -> dict:
        """What a task scoring ``rows`` is built from (``reward_actor_options``'s, or one row's for
        ``trial_reward``)."""
        return {"prompt_field": self.prompt_field, "reward_function": self.reward_function,
                "reward_fields": list(self.reward_fields), "rows": rows}

    @cached_property
    def function(self) -> Callable:
        return import_reward_function(self.reward_function)

    def check_reward_function(self, function: Callable) -> None:
        """The function takes the arguments its style is called with (``reward_style``), or ValueError naming
        them and task.reward_fields."""
        style, fields = reward_style(function), [field_argument(f) for f in self.reward_fields]
        text = {"trl": ["prompts", "completions"], "verl": ["solution_str"],
                "sample": ["prompt", "completion"]}
        try:
            inspect.signature(function).bind(**dict.fromkeys(text[style] + fields))
        except TypeError as err:
            arguments = ", ".join(text[style] + fields)
            called = {"trl": " (TRL's reward function, one call per batch)",
                      "verl": " (verl's compute_score: task.reward_fields gives data_source, "
                              "reward_model.ground_truth and extra_info)"}.get(style, "")
            raise ValueError(f"task.reward_function={self.reward_function!r}{called} cannot be called with "
                             f"({arguments}) (task.reward_fields={self.reward_fields}): {err}") from err
        except ValueError:
            pass  # a builtin without a signature: called as it is

    def trial_reward(self, timeout_s: float = 60.0) -> None:
        """The reward function called once before any actor starts, on the first training row with an empty
        completion (an engine's response can be one: EOS first), in a process of its own with a deadline: an
        error it raises, a hang, or an answer that is not a number is named now (ValueError), not on a reward
        actor after every actor started."""
        import math
        import multiprocessing

        if not self.reward_function:
            return
        first = {c: values[:1] for c, values in self.reward_columns(self.rows["train"]).items()}
        options = self.reward_options({"train": first})
        context = multiprocessing.get_context("spawn")
        receive, send = context.Pipe(duplex=False)
        worker = context.Process(target=_trial_score, args=(options, send), daemon=True)
        worker.start()
        try:
            if not receive.poll(timeout_s):
                raise ValueError(f"task.reward_function={self.reward_function!r} did not return within "
                                 f"{timeout_s:.0f} s on {self.prompt_origin(0)} with an empty completion")
            failed, outcome = receive.recv()
        finally:
            worker.terminate()
            worker.join(5)
        if failed:
            raise ValueError(f"{outcome} (called once on {self.prompt_origin(0)} with an empty completion, "
                             "before any actor: an engine's response can be empty)")
        real = isinstance(outcome, numbers.Real) and not isinstance(outcome, bool)
        if not (real and math.isfinite(outcome)):
            raise ValueError(f"task.reward_function={self.reward_function!r} returned {outcome!r:.80} on "
                             f"{self.prompt_origin(0)} with an empty completion; a reward is a finite number")

    def row_fields(self, rows: list[int], split: str) -> list[dict]:
        """Each row's reward fields by the keyword they reach the function by (``field_argument``)."""
        columns, out = self.rows[split], []
        for r in rows:
            fields = {}
            for name in self.reward_fields:
                column, *keys = name.split(".")
                value = columns[column][r]
                for key in keys:
                    if not isinstance(value, dict) or key not in value:
                        raise ValueError(f"task.reward_fields {name!r}: {split} row {r}'s {column!r} holds "
                                         f"no {key!r} ({value!r:.80})")
                    value = value[key]
                fields[field_argument(name)] = value
            out.append(fields)
        return out

    def reward_rows(self, prompts: list[str], completions: list[str], rows: list[int], split: str) -> list:
        if not self.reward_function:
            raise ValueError("task 'dataset' has no task.reward_function; its scores come from reward.kind")
        if len(rows) != len(completions):
            raise ValueError(f"{len(rows)} rows but {len(completions)} completions")
        row_prompts, fields = self.rows[split][self.prompt_field], self.row_fields(rows, split)
        style = reward_style(self.function)
        if style == "trl":
            return self._trl_scores([row_prompts[r] for r in rows], completions, fields, rows, split)
        scores = []
        for r, completion, kwargs in zip(rows, completions, fields, strict=True):
            try:
                score = (self.function(solution_str=completion, **kwargs) if style == "verl" else
                         self.function(prompt=row_prompts[r], completion=completion, **kwargs))
            except Exception as err:
                raise ValueError(f"{self.reward_function} raised {type(err).__name__} on {split} row {r}: "
                                 f"{err}") from err
            if style == "verl" and isinstance(score, dict):  # verl's compute_score may return {"score": ...}
                score = score.get("score")
            scores.append(float(score) if isinstance(score, numbers.Real) and not isinstance(score, bool)
                          else score)
        return scores

    def _trl_scores(self, prompts: list, completions: list[str], fields: list[dict], rows: list[int],
                    split: str) -> list:
        """TRL's call: the whole chunk at once, each row's fields as columns (lists); where the prompts are
        chat messages, each completion as TRL gives a conversational one, ``[{"role": "assistant",
        "content": ...}]``."""
        chat = all(isinstance(p, list) for p in prompts)
        given = [[{"role": "assistant", "content": c}] for c in completions] if chat else list(completions)
        columns = {name: [f[name] for f in fields] for name in (fields[0] if fields else {})}
        try:
            scores = self.function(prompts=prompts, completions=given, **columns)
        except Exception as err:
            raise ValueError(f"{self.reward_function} raised {type(err).__name__} on {split} rows "
                             f"{rows[0]}..{rows[-1]}: {err}") from err
        if not isinstance(scores, list | tuple) or len(scores) != len(completions):
            raise ValueError(f"{self.reward_function} returned {scores!r:.80} for {len(completions)} "
                             f"completions of {split} rows {rows[0]}..{rows[-1]}; a TRL reward function "
                             "returns one score per completion")
        return [float(s) if isinstance(s, numbers.Real) and not isinstance(s, bool) else s for s in scores]

    def evaluate_rows(self, prompts: list[str], completions: list[str], rows: list[int], split: str) -> dict:
        """The mean score of the reward function; none without one (the job's reward is used then)."""
        if not self.reward_function:
            return {}
        scores = self.reward_rows(prompts, completions, rows, split)
        return {"score": sum(scores) / max(len(scores), 1)}


def _trial_score(options: dict, send) -> None:
    """``DatasetTask.trial_reward``'s process: the score of the first row's empty completion, or the error's
    message."""
    try:
        task = DatasetTask(**options)
        send.send((False, task.reward_rows([""], [""], [0], "train")[0]))
    except Exception as err:  # noqa: BLE001 - whatever the user's function raised is the message
        send.send((True, str(err) if isinstance(err, ValueError) else f"{type(err).__name__}: {err}"))
