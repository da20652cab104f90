"""``--help`` in click's usual style: ``MODEL`` for a required argument, ``[MODEL]`` for an optional one, ``TEXT``,
``INTEGER``, ``FLOAT``, ``PATH`` after an option, nothing after a flag.

Typer (0.29) writes its own metavars (``{model}``, ``<str>``, ``<list[str]>``), which read as Python internals. The
group class :class:`EdgeqGroup` gives every parameter of every command click's names instead; it is passed to
``typer.Typer(cls=...)`` so the CLI and typer's test runner show the same help.
"""

from __future__ import annotations

from typing import get_args

from typer.core import TyperArgument, TyperGroup, TyperOption

_CLICK_NAMES = {str: "TEXT", int: "INTEGER", float: "FLOAT", bool: "BOOLEAN"}


def click_metavar(param) -> str:
    """Click's metavar for a typer parameter: its own ``metavar`` if it has one, else by type."""
    if param.metavar:
        return param.metavar
    d = param.type_descriptor
    if d.is_choice:
        return "[" + "|".join(str(c) for c in d.choices) + "]"
    if d.is_path:
        return "PATH"
    kind = get_args(d.annotation)[0] if d.is_list else d.annotation  # a repeatable option names its element
    return _CLICK_NAMES.get(kind, getattr(kind, "__name__", str(kind)).upper())


class ClickStyleOption(TyperOption):
    def display_type_rich(self, ctx) -> str:
        return click_metavar(self)


class ClickStyleArgument(TyperArgument):
    def display_type_rich(self, ctx) -> None:
        return None  # the argument's name already is its metavar

    def _rich_display_name(self) -> str:
        if self.metavar:
            return self.metavar
        return self.name.upper() + ("..." if self.nargs != 1 else "")

    def get_error_hint(self) -> str:
        return f"'{self._rich_display_name()}'"

    def _usage_display_name(self) -> str:
        name = self._rich_display_name()
        return name if self.required else f"[{name}]"


def restyle(command) -> None:
    """Give the parameters of ``command`` click's help style (same state, subclasses that only format)."""
    for p in command.params:
        if type(p) is TyperOption:
            p.__class__ = ClickStyleOption
        elif type(p) is TyperArgument:
            p.__class__ = ClickStyleArgument


class EdgeqGroup(TyperGroup):
    """The ``edgeq`` group: every command (and the group's own options) in click's help style."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        restyle(self)
        for command in self.commands.values():
            restyle(command)
