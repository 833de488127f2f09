"""Options as frozen dataclasses: each field carries its default and its help, and the command
line's flags are generated from the fields (`--field-name`, typed from the annotation)."""

from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import field


def opt(default, help: str, **extra):
    """A dataclass field with its documentation (the generated flag's help)."""
    return field(default=default, metadata={"help": help, **extra})


def add_arguments(parser: argparse.ArgumentParser, cls, defaults: dict | None = None, exclude: tuple[str, ...] = ()) -> None:
    """One flag per field of `cls` (except `exclude` and fields made with `cli=False`): bool fields
    get --x/--no-x (optional ones stay None when neither is given), Literal fields their choices,
    tuple fields are repeatable. `defaults` overrides a field's default for this command line only."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in exclude or not f.metadata.get("cli", True):
            continue
        default = (defaults or {}).get(f.name, f.default)
        hint = hints[f.name]
        text = f.metadata["help"].replace("%", "%%")  # argparse formats help with %
        kwargs: dict = {"default": default, "help": f"{text} (default: {default})"}
        if hint is bool or hint == bool | None:  # --x / --no-x; unset: None, the field's "decide for me"
            kwargs["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(hint) is typing.Literal:
            kwargs["choices"] = typing.get_args(hint)
        elif typing.get_origin(hint) is tuple:
            kwargs.update(action="append", type=typing.get_args(hint)[0], default=None,
                          help=f"{text} (repeatable; default: {default})")
        else:
            args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
            kwargs["type"] = args[0]
        parser.add_argument(flag(f.name), **kwargs)


def from_args(args: argparse.Namespace, cls, **fixed):
    """`cls` built from parsed flags (add_arguments'); `fixed` gives fields that have no flag."""
    values = {}
    for f in dataclasses.fields(cls):
        if f.name in fixed or not f.metadata.get("cli", True):
            continue
        value = getattr(args, f.name)
        if typing.get_origin(typing.get_type_hints(cls)[f.name]) is tuple:  # a repeatable flag: None when not given
            value = f.default if value is None else tuple(value)
        values[f.name] = value
    return cls(**values, **fixed)


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")
