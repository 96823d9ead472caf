"""Registered entries: each advantage estimator, policy loss, rollout correction and KL estimator is one
``Entry`` in the ``Registry`` of the setting that chooses it (``ppo.advantage``, ``ppo.policy_loss``,
``ppo.correction``, ``kl.estimator``), as verl's ``@register_policy_loss``. An entry carries its function,
the settings it reads (each one a field of the config tree, the only source of settings, with what the field
is to this entry), its rules, its documented objective (the settings-space harness's reference) and its line
in the settings reference; a registry checks a config against the chosen entry (``Registry.check``) when
``Algorithm.from_config`` resolves it, before any actor starts.

The config holds an entry's name as a string, since the config (``services``) may not import the learner:
an unknown name, a setting the chosen entry does not read, and each rule of the chosen entry are refused
here, each message naming the settings."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from services.rules import Refusal, Rule


def entry_rule(*reads: str, example: dict[str, Any]) -> Callable[[Refusal], Rule]:
    """The decorated function as an entry's rule named after it (``services.rules.Rule``: the dotted settings
    it reads, and a ``load_config`` override it refuses)."""
    return lambda refusal: Rule(refusal.__name__, reads, refusal, example)


def shown(value: Any) -> str:
    """A setting's value as the YAML and the command line write it: true, false, null, 'text', 0.5."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return "null" if value is None else repr(value)


@dataclass(frozen=True, kw_only=True)
class Entry:
    """What every entry carries. ``reads``: the fields of the chosen setting's section that this entry reads
    and others may not, each with what it is to this entry (its default and description are the config
    field's); ``rules``: refusals of settings this entry cannot run with (``entry_rule``), checked only where
    it is chosen; ``doc``: its line in the settings reference."""

    name: str
    doc: str
    reads: dict[str, str]
    rules: tuple[Rule, ...] = ()


E = TypeVar("E", bound=Entry)


class Registry(Generic[E]):
    """The entries of one setting (``setting``: its dotted path, ``ppo.policy_loss``; ``kind``: what an entry
    is, in messages), by name, in the order registered."""

    def __init__(self, setting: str, kind: str | None = None) -> None:
        self.setting = setting
        self.section, self.field = setting.split(".")
        self.kind = kind or self.field.replace("_", " ")
        self.entries: dict[str, E] = {}

    def register(self, entry: E) -> E:
        if entry.name in self.entries:
            raise ValueError(f"{self.setting} {entry.name!r} is registered already")
        self.entries[entry.name] = entry
        return entry

    @contextmanager
    def registered(self, entry: E) -> Iterator[E]:
        """``entry`` registered for the ``with`` block only (a test's own entry)."""
        self.register(entry)
        try:
            yield entry
        finally:
            del self.entries[entry.name]

    def names(self) -> tuple[str, ...]:
        return tuple(self.entries)

    def get(self, name: str) -> E:
        if name not in self.entries:
            raise ValueError(f"{self.setting}={name!r} is not a registered {self.kind}; "
                             f"registered: {', '.join(self.entries)}")
        return self.entries[name]

    def owners(self, field: str) -> list[str]:
        """The entries that read ``field`` of the section."""
        return [name for name, entry in self.entries.items() if field in entry.reads]

    def check(self, cfg: Any) -> E:
        """The entry ``cfg`` chooses, after refusing (ValueError naming the settings) an unknown name, a field
        that other entries read set away from its default while this one ignores it (by value: a dumped
        config sets every field), and this entry's rules in order."""
        section = getattr(cfg, self.section)
        entry = self.get(getattr(section, self.field))
        defaults = type(section).model_fields
        read_by_others = {field for other in self.entries.values() for field in other.reads}
        read_by_others -= set(entry.reads)
        for field in sorted(read_by_others, key=list(defaults).index):
            value, default = getattr(section, field), defaults[field].default
            if value != default:
                owners = self.owners(field)
                what = self.entries[owners[0]].reads[field]
                raise ValueError(
                    f"[{self.field}_reads] {self.section}.{field}={shown(value)} is set but {self.setting}="
                    f"{entry.name!r} ignores it ({what}, read by {', '.join(owners)}); set {self.setting}="
                    f"{owners[0]!r}, or {self.section}.{field}={shown(default)} (its default)")
        for rule in entry.rules:
            if (message := rule.refusal(cfg)) is not None:
                raise ValueError(f"[{rule.name}] {message}")
        return entry
