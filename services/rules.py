"""Named settings rules: each one a name, the settings it reads, the refusal it gives and an example of
settings it refuses. A section's rules (or JobConfig's, across sections) are one ``Rules`` book, enforced by
the section's validator, so every refusal says which rule gave it; ``tests/test_rules.py`` loads each rule's
example and checks that exactly that rule refuses it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

Refusal = Callable[[Any], "str | None"]


# every book made, in import order: the settings reference and tests/test_rules.py list them
BOOKS: list[Rules] = []


@dataclass(frozen=True)
class Rule:
    """``refusal(settings)`` is the message when the settings break the rule, else None. ``reads`` are the
    dotted settings it looks at; ``example`` is a nested dict of settings (a ``load_config`` override) it
    refuses."""

    name: str
    reads: tuple[str, ...]
    refusal: Refusal
    example: dict[str, Any]


@dataclass
class Rules:
    """The rules of one settings section (``owner``: its path, "" for the whole job), in the order checked."""

    owner: str
    rules: list[Rule] = field(default_factory=list)

    def __post_init__(self) -> None:
        BOOKS.append(self)

    def rule(self, *reads: str, example: dict[str, Any]) -> Callable[[Refusal], Refusal]:
        """Registers the decorated function as the rule named after it."""

        def register(refusal: Refusal) -> Refusal:
            self.rules.append(Rule(refusal.__name__, reads, refusal, example))
            return refusal

        return register

    def enforce(self, settings: Any) -> None:
        """ValueError (pydantic reports it at the section) from the first rule ``settings`` break, its message
        led by the rule's name."""
        for rule in self.rules:
            if (message := rule.refusal(settings)) is not None:
                raise ValueError(f"[{rule.name}] {message}")
