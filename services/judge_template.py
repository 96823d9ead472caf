"""The LLM judge's prompt template (``reward.judge.template``): which fields it fills in, checked where the
settings are read (services/config.py) and where the judge renders it (services/reward_service/judge.py)."""

from __future__ import annotations

import string
from collections.abc import Sequence

TEMPLATE_FIELDS = ("prompt", "response")  # every template may use these; the row's fields come on top


def template_fields(template: str) -> list[str]:
    """The names ``template`` fills in, in order; ValueError for a template ``str.format`` cannot fill by
    name (unbalanced braces, ``{}``, ``{0}``, ``{row.x}``, ``{row[0]}``)."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as err:
        raise ValueError(f"reward.judge.template is not a valid format string: {err} (write a literal brace "
                         "as {{ or }})") from None
    names = []
    for _, name, spec, _ in parsed:
        if name is None:
            continue
        if not name.isidentifier():
            raise ValueError(f"reward.judge.template has the field {{{name}}}: use named fields only, "
                             f"{{prompt}}, {{response}} or a row field such as {{answer}}")
        if spec and "{" in spec:
            raise ValueError(f"reward.judge.template nests a field in the format of {{{name}}}")
        names.append(name)
    if "response" not in names:
        raise ValueError("reward.judge.template has no {response} field: the judge would not see what it "
                         "scores")
    return names


def check_template_fields(template: str, row_fields: Sequence[str], where: str) -> None:
    """Every field of the template is {prompt}, {response} or one of ``row_fields``; ValueError naming the
    unknown ones and what ``where`` gives."""
    unknown = sorted(set(template_fields(template)) - set(TEMPLATE_FIELDS) - set(row_fields))
    if unknown:
        known = ", ".join(f"{{{f}}}" for f in (*TEMPLATE_FIELDS, *row_fields))
        raise ValueError("reward.judge.template has unknown field(s) "
                         f"{', '.join(f'{{{f}}}' for f in unknown)}: {where} gives only {known}")
