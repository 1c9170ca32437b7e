"""Settings: dataclass fields that are also command-line flags.

A library type's field says once what its flag needs (`setting`: help, choices, metavar, the flag's
name where it is not the field's), so each command generates its flags from the type
(`add_setting_arguments`) and builds it from what the user gave (`given_settings`): a flag left
out parses as None, and the type's own default holds. A value a type refuses raises
`SettingError`, whose text names its fields as `{field}`: a Python caller reads the field's name,
and the command line reads the flag that set it (`in_flags`), from the map each generated flag
records in the parsed namespace.

Imports nothing but the standard library, so every layer (the engine's config included) can use it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import string
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from typing import Any

FLAGS_KEY = "setting_flags"  # the namespace entry mapping field names to the flags that set them


def setting(default: Any = dataclasses.MISSING, help: str = "", choices: tuple[str, ...] | None = None, *,
            flag: str | None = None, metavar: str | None = None, parse: Callable[[str], Any] | None = None,
            default_factory: Any = dataclasses.MISSING) -> Any:
    """A dataclass field that is also a flag, described by `help`: `flag` defaults to the field's
    name (`max_num_seqs` → `--max-num-seqs`); `parse` turns the flag's text into the value
    (default: the field's type)."""
    if not help:
        raise TypeError("a setting needs its help text")
    metadata = {"help": help, "flag": flag, "choices": choices, "metavar": metavar, "parse": parse}
    return dataclasses.field(default=default, default_factory=default_factory, metadata=metadata)


def flag_of(f: dataclasses.Field[Any]) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def settings_of(cls: type) -> list[dataclasses.Field[Any]]:
    """The fields of `cls` that are settings (declared with `setting`)."""
    return [f for f in dataclasses.fields(cls) if "help" in f.metadata]


class SettingError(ValueError):
    """A value a settings type refuses. `template` names fields as `{field}` and may format `values`
    (`{got!r}`, `{seconds:g}`): the message names each field as its reader knows it."""

    def __init__(self, template: str, **values: Any) -> None:
        self.template, self.values = template, values
        self.fields = tuple(name for _, name, _, _ in string.Formatter().parse(template)
                            if name and name not in values)
        super().__init__(self.render({}))

    def render(self, names: Mapping[str, str]) -> str:
        """The message with each field called by `names` (its own name where `names` has none)."""
        return self.template.format(**{name: names.get(name, name) for name in self.fields}, **self.values)


def add_setting_arguments(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    *,
    only: Iterable[str] | None = None,
    exclude: Iterable[str] = (),
    defaults: Mapping[str, Any] | None = None,
    help: Mapping[str, str] | None = None,
) -> list[str]:
    """A flag for each setting of `cls` (those in `only`, if given; none in `exclude`), with
    dest = the field's name. `defaults` (the command's own choices, which count as given) and
    `help` replace a field's default and help for this command. Returns the fields added."""
    defaults, help = defaults or {}, help or {}
    chosen = [f for f in settings_of(cls) if (only is None or f.name in only) and f.name not in exclude]
    unknown = ({*(only or ()), *exclude, *defaults, *help}) - {f.name for f in settings_of(cls)}
    if unknown:
        raise ValueError(f"not settings of {cls.__name__}: {sorted(unknown)}")
    hints = typing.get_type_hints(cls)
    for f in chosen:
        default = defaults.get(f.name)  # None: not given
        shown = defaults.get(f.name, None if f.default is dataclasses.MISSING else f.default)
        text = help.get(f.name, f.metadata["help"])
        kind = _scalar_type(hints[f.name])
        if kind is bool:
            parser.add_argument(flag_of(f), dest=f.name, default=default, action=argparse.BooleanOptionalAction,
                                help=f"{text} (default: {'on' if shown else 'off'})")
        else:
            # Choices show themselves; any other value is named after its flag (--timeout TIMEOUT).
            named = flag_of(f)[2:].upper().replace("-", "_")
            metavar = f.metadata["metavar"] or (None if f.metadata["choices"] else named)
            parser.add_argument(flag_of(f), dest=f.name, default=default, type=f.metadata["parse"] or kind,
                                choices=f.metadata["choices"], metavar=metavar,
                                help=text + ("" if shown is None else f" (default: {_shown(shown)})"))
    name_flags(parser, **{f.name: flag_of(f) for f in chosen})
    return [f.name for f in chosen]


def name_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, **flags: str) -> None:
    """Record that these fields are set by these flags (or words: `input="the input"`), for `in_flags`."""
    known = dict(parser.get_default(FLAGS_KEY) or {})
    parser.set_defaults(**{FLAGS_KEY: {**known, **flags}})


def given_settings(args: argparse.Namespace, cls: type, *, exclude: Iterable[str] = ()) -> dict[str, Any]:
    """The settings of `cls` the command line gave (not None), as keyword arguments for `cls`."""
    names = [f.name for f in settings_of(cls) if f.name not in exclude]
    return {name: getattr(args, name) for name in names if getattr(args, name, None) is not None}


def in_flags(exc: BaseException, args: argparse.Namespace) -> str:
    """`exc`'s message as the command line says it: a SettingError's fields named by their flags."""
    if isinstance(exc, SettingError):
        return exc.render(getattr(args, FLAGS_KEY, None) or {})
    return str(exc)


def json_object(text: str) -> dict[str, Any]:
    """A flag's JSON object (`parse=json_object`); argparse names the flag where it is not one."""
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"not a JSON object: {text}")
    return value


def _shown(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _scalar_type(hint: Any) -> type:
    """`int | None` → int: the type a flag's value is parsed as."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        (hint,) = [t for t in typing.get_args(hint) if t is not type(None)]
    return typing.cast(type, hint)
