"""Strict, typed loading of nested dicts (parsed YAML) into dataclasses.

Every error names the dotted key and the file it came from, as one line.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from typing import Any, Literal, Union

from nanotron_models.families import family_of_yaml
from nanotron_train.config.errors import ConfigError


def _type_name(tp: Any) -> str:
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _value_repr(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def convert(value: Any, tp: Any, key: str, source: str) -> Any:
    """Check `value` against the type hint `tp`, converting where YAML is loose; raise ConfigError."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        return _convert_union(value, tp, key, source)
    if value is None:
        raise ConfigError(key, f"a value is required (expected {_type_name(tp)}), got null", source)
    if origin is Literal:
        return _convert_literal(value, tp, key, source)
    if origin in (list, tuple):
        if not isinstance(value, list | tuple):
            raise ConfigError(key, f"expected a list, got {type(value).__name__}", source)
        (item_tp, *_) = typing.get_args(tp) or (Any,)
        return [convert(v, item_tp, f"{key}.{i}", source) for i, v in enumerate(value)]
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(key, f"expected a mapping, got {type(value).__name__}", source)
        return dict(value)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, key, source)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return _convert_enum(value, tp, key, source)
    if tp in (bool, int, float, str):
        return _convert_scalar(value, tp, key, source)
    raise TypeError(f"unsupported type hint {tp!r} for {key}")  # a bug in our dataclasses


def _convert_union(value: Any, tp: Any, key: str, source: str) -> Any:
    """The first member of the union that takes `value`; null only where None is a member."""
    args = typing.get_args(tp)
    if value is None:
        if type(None) in args:
            return None
        raise ConfigError(key, "a value is required, got null", source)
    classes = [a for a in args if dataclasses.is_dataclass(a)]
    if len(classes) > 1 and isinstance(value, dict):
        # A union of config classes (model families): the one the mapping names by its
        # `is_<family>_config: true` key, else the first (Nanotron's order: Llama first).
        return from_dict(_named_class(classes, value), value, key, source)
    errors = []
    for arg in args:
        if arg is type(None):
            continue
        try:
            return convert(value, arg, key, source)
        except ConfigError as exc:
            errors.append(exc)
    if len(errors) == 1:
        raise errors[0]
    raise ConfigError(
        key,
        f"expected {_type_name(tp)}, got {type(value).__name__} {_value_repr(value)}",
        source,
    )


def _named_class(classes: list, value: dict) -> type:
    """The class of the model family the mapping names (its row's marker key, families.py),
    when it is one of `classes`; else the first."""
    cls = family_of_yaml(value).config_class
    return cls if cls in classes else classes[0]


def _convert_literal(value: Any, tp: Any, key: str, source: str) -> Any:
    allowed = typing.get_args(tp)
    if isinstance(value, str) and value not in allowed:
        # Enum names are case-insensitive, as Nanotron's (it upper-cases tp_mode & co).
        same = [a for a in allowed if isinstance(a, str) and a.lower() == value.lower()]
        value = same[0] if len(same) == 1 else value
    if value not in allowed:
        raise ConfigError(key, f"must be one of {list(allowed)}, got {_value_repr(value)}", source)
    return value


def _convert_enum(value: Any, tp: type[enum.Enum], key: str, source: str) -> enum.Enum:
    try:
        return tp(value)
    except ValueError:
        allowed = [m.value for m in tp]
        raise ConfigError(
            key, f"must be one of {allowed}, got {_value_repr(value)}", source
        ) from None


_EXPECTED = {int: "an integer", float: "a number", str: "a string"}


def _convert_scalar(value: Any, tp: type, key: str, source: str) -> Any:
    """bool, int, float or str: no silent casts, except a float written as a number or string."""
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(key, f"expected true or false, got {_value_repr(value)}", source)
    if tp is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if tp is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        # PyYAML (YAML 1.1) reads `1e-5` as a string; accept what is plainly a number.
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    if tp is str and isinstance(value, str):
        return value
    got = f"{type(value).__name__} {_value_repr(value)}"
    raise ConfigError(key, f"expected {_EXPECTED[tp]}, got {got}", source)


def from_dict(cls: type, data: Any, key: str = "", source: str = "<config>") -> Any:
    """Build dataclass `cls` from a mapping: unknown keys, wrong types and missing values fail."""
    if not isinstance(data, dict):
        where = key or "the top level"
        raise ConfigError(key, f"expected a mapping for {where}, got {type(data).__name__}", source)
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        name = f"{key}.{unknown[0]}" if key else str(unknown[0])
        raise ConfigError(name, f"unknown key (allowed here: {', '.join(sorted(fields))})", source)
    kwargs = {}
    for name, field in fields.items():
        sub = f"{key}.{name}" if key else name
        if name in data:
            kwargs[name] = convert(data[name], hints[name], sub, source)
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise ConfigError(sub, "missing required value", source)
    return cls(**kwargs)


def to_dict(obj: Any) -> Any:
    """Dataclasses -> plain dicts/lists (enums as their values), ready for YAML or JSON."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, list | tuple):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    if isinstance(obj, enum.Enum):
        return obj.value
    return obj


def apply_override(data: dict, assignment: str) -> None:
    """Apply one `section.key=value` (value parsed as YAML) to the raw config mapping."""
    import yaml

    if "=" not in assignment:
        raise ConfigError(
            "", f"--override {assignment!r} must look like section.key=value", "--override"
        )
    path, _, raw = assignment.partition("=")
    parts = [p for p in path.strip().split(".") if p]
    if not parts:
        raise ConfigError("", f"--override {assignment!r} has an empty key", "--override")
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        value = raw
    node: Any = data
    for i, part in enumerate(parts[:-1]):
        here = ".".join(parts[: i + 1])
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise ConfigError(here, "no such list item", "--override")
            node = node[int(part)]
        elif isinstance(node, dict):
            if node.get(part) is None:
                node[part] = {}
            node = node[part]
        else:
            raise ConfigError(here, "is not a section", "--override")
    last = parts[-1]
    if isinstance(node, list):
        if not last.isdigit() or int(last) >= len(node):
            raise ConfigError(path, "no such list item", "--override")
        node[int(last)] = value
    else:
        node[last] = value
