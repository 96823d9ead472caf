"""Every settings rule refuses its own example, by name, and reads settings that exist."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, ValidationError

from learner.algorithm import REGISTRIES, Algorithm
from services.config import JobConfig, _section, load_config
from services.rules import BOOKS, Rules

ALL_RULES = [(book.owner, rule) for book in BOOKS for rule in book.rules]
# the registered entries' rules (an entry's rule may serve several entries: listed once)
ENTRY_RULES = list({rule.name: ("", rule) for registry in REGISTRIES for entry in registry.entries.values()
                    for rule in entry.rules}.values())


def test_rules_are_listed_once_by_unique_names():
    names = [rule.name for _, rule in ALL_RULES + ENTRY_RULES]
    assert len(names) == len(set(names)) and len(names) >= 40


@pytest.mark.parametrize(("owner", "rule"), ENTRY_RULES, ids=[rule.name for _, rule in ENTRY_RULES])
def test_each_entry_rule_refuses_its_example_first_before_any_actor(owner, rule):
    """The config accepts the example; the check of the entries it chooses refuses it with this rule first."""
    cfg = load_config(None, rule.example)
    with pytest.raises(ValueError) as err:
        Algorithm.from_config(cfg)
    assert str(err.value).startswith(f"[{rule.name}]"), str(err.value)


@pytest.mark.parametrize(("owner", "rule"), ALL_RULES, ids=[rule.name for _, rule in ALL_RULES])
def test_each_rule_refuses_its_example_first(owner, rule):
    """The example breaks this rule and none checked before it: the refusal names the rule."""
    with pytest.raises(ValidationError) as err:
        load_config(None, rule.example)
    assert f"[{rule.name}]" in str(err.value)


def setting_exists(path: str) -> bool:
    """``path`` (dotted; a last part ``*`` means any field of that section) names a JobConfig setting."""
    model: type[BaseModel] | None = JobConfig
    *sections, last = path.split(".")
    for key in sections:
        model = _section(model, key) if model else None
    return model is not None and (last == "*" or last in model.model_fields)


@pytest.mark.parametrize(("owner", "rule"), ALL_RULES + ENTRY_RULES,
                         ids=[rule.name for _, rule in ALL_RULES + ENTRY_RULES])
def test_each_rule_reads_settings_that_exist(owner, rule):
    assert rule.reads and all(setting_exists(f"{owner}.{r}" if owner else r) for r in rule.reads), rule.reads


def test_a_rule_refuses_with_its_name_and_passes_what_it_allows():
    book = Rules("made")

    @book.rule("rollout.batch_size", example={})
    def batch_is_even(cfg):
        return None if cfg.rollout.batch_size % 2 == 0 else \
            f"rollout.batch_size={cfg.rollout.batch_size} is odd"

    BOOKS.remove(book)
    book.enforce(load_config(None, {}))
    with pytest.raises(ValueError, match=r"^\[batch_is_even\] rollout.batch_size=3 is odd$"):
        book.enforce(load_config(None, {"rollout": {"batch_size": 3, "samples_per_prompt": 1}}))
    assert not setting_exists("rollout.no_such_field") and not setting_exists("nowhere.batch_size")
