"""The check of a user's prompt template, which imports nothing heavy (the command line checks --template with it
before torch loads)."""

from __future__ import annotations

import string

TEMPLATE_FIELDS = ("document", "question")


def check_template(template: str) -> str:
    """Refuse a template that would ask every question alike, or that names fields it is not given."""
    if not isinstance(template, str):
        raise TypeError(f"template must be a string, got {type(template).__name__}")
    try:
        fields = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    except ValueError as err:
        raise ValueError(f"template {template!r} is not a valid format string: {err}") from None
    unknown = sorted(fields - set(TEMPLATE_FIELDS))
    if unknown:
        raise ValueError(f"template {template!r} names {unknown}; it may use only {{document}} and {{question}}")
    if "question" not in fields:
        raise ValueError(f"template {template!r} has no {{question}} field, so every question would get one prompt")
    return template
