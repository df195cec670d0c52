"""`troupe run`'s cluster flags, made from `ClusterConfig`'s fields: one ``--name-with-dashes`` per field
that declares a `Flag`.

The field's type gives the option's kind: a bool is ``--x/--no-x``, a ``Literal[...]`` takes
its values as choices, an integer takes `integer` (the command line's own check, >= 1; a field
with its own check takes any int and judges it), a float a number, a str its text. Every flag
defaults to None ("not given"), so `given` returns only what the user set; `sources.resolve`
lays that over the preset or file. A field the user does not name
travels to the ranks anyway, inside the ``TROUPE_CLUSTER`` JSON of the whole config.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from troupe.cluster.configuration.config import ClusterConfig, choices, flag_fields


def add_flags(group: Any, integer: Callable[[str], int], config: type = ClusterConfig) -> None:
    """One option per flagged field of `config` on `group` (an argparse parser or argument group)."""
    for f in flag_fields(config):
        flag = f.metadata["flag"]
        kwargs: dict[str, Any] = {"default": None}
        if flag.help is not None:
            kwargs["help"] = flag.help
        if flag.metavar is not None:
            kwargs["metavar"] = flag.metavar
        if f.type == "bool":
            kwargs["action"] = argparse.BooleanOptionalAction
        elif choices(f.name, config):
            kwargs["choices"] = choices(f.name, config)
        elif f.type in ("int", "int | None"):
            # a field with its own check (delay: 0 is valid) judges the value itself
            kwargs["type"] = integer if f.metadata["check"] is None else int
        elif f.type in ("float", "float | None"):
            kwargs["type"] = float
        elif f.type == "str":
            kwargs["type"] = str
        else:  # a new kind of field: say what to add here rather than guess its parsing
            raise TypeError(f"ClusterConfig.{f.name}: no command-line kind for type {f.type!r}")
        group.add_argument("--" + f.name.replace("_", "-"), **kwargs)


def given(args: argparse.Namespace, config: type = ClusterConfig) -> dict[str, Any]:
    """Every flagged field's value from parsed `args` (None where the flag was not given)."""
    return {f.name: getattr(args, f.name) for f in flag_fields(config)}
