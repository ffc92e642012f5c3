"""A small declarative schema for experiment YAML: frozen dataclasses whose fields carry a parser.

Each configuration section is a frozen dataclass; every field is declared with `spec(...)`, which
holds the parser (a function from the YAML value to the typed value, usually one of
`testbed.units`), an optional default and the documentation string that `experiments/README.md`
repeats. `build(cls, data, key)` validates a mapping against the class: unknown keys, missing
keys, wrong types and bad units all raise `ConfigError` naming the dotted key path.

Sections owned by later stages (the link model, the workload) declare their own dataclasses in
their own modules with the same helpers, so the schema grows where the feature lives.
"""

import dataclasses
import typing
import unicodedata

from testbed.errors import ConfigError

_MISSING = dataclasses.MISSING


def spec(parse, default=_MISSING, doc="", factory=_MISSING):
    """Declare a config field: `parse(value)` returns the typed value or raises ValueError."""
    meta = {"parse": parse, "doc": doc}
    if factory is not _MISSING:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def section(cls):
    """Parser for a nested section: a mapping validated against dataclass `cls`."""

    def parse(value, key=""):
        return build(cls, value, key)

    parse.section = cls
    return parse


def optional(parse):
    """Parser that accepts null (None) as well as what `parse` accepts."""

    def p(value, key=""):
        if value is None:
            return None
        return _call(parse, value, key)

    p.section = getattr(parse, "section", None)
    return p


def choice(*options):
    """Parser for one string out of `options`."""

    def p(value):
        if value not in options:
            raise ValueError(f"expected one of {', '.join(map(str, options))}, got {value!r}")
        return value

    p.options = options
    return p


def integer(lo=None, hi=None):
    """Parser for an integer in [lo, hi]."""

    def p(value):
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                value = int(value)
            else:
                raise ValueError(f"expected an integer, got {value!r}")
        if lo is not None and value < lo:
            raise ValueError(f"expected an integer >= {lo}, got {value}")
        if hi is not None and value > hi:
            raise ValueError(f"expected an integer <= {hi}, got {value}")
        return value

    return p


def string(value):
    if not isinstance(value, str) or not value:
        raise ValueError(f"expected a non-empty string, got {value!r}")
    return value


MAX_NAME_CHARS = 100


def path_component(value):
    """A name that becomes one directory name under results/: no separators, no '..', no
    control characters, not empty, at most MAX_NAME_CHARS characters."""
    if not isinstance(value, str):
        raise ValueError(f"expected a name (text), got {value!r}")
    why = None
    if not value.strip():
        why = "it is empty"
    elif len(value) > MAX_NAME_CHARS:
        why = f"it is {len(value)} characters long (at most {MAX_NAME_CHARS})"
    elif "/" in value or "\\" in value:
        why = "it contains a path separator"
    elif ".." in value:
        why = "it contains '..'"
    elif value != value.strip():
        why = "it starts or ends with white space"
    elif value == ".":
        why = "it is '.'"
    elif any(unicodedata.category(ch)[0] in "CZ" and ch != " " for ch in value):
        bad = next(ch for ch in value if unicodedata.category(ch)[0] in "CZ" and ch != " ")
        why = f"it contains the control or separator character U+{ord(bad):04X}"
    if why:
        raise ValueError(f"expected a name usable as one directory name (letters, digits, "
                         f"'-', '_', '.', ',', '='), but {why}: {value!r}")
    return value


def at_most(parse, hi, what, hint="a hard limit"):
    """Wrap a numeric parser to require a value <= hi (`what` formats hi in messages)."""

    def p(value):
        x = parse(value)
        if x > hi:
            raise ValueError(f"expected at most {what} ({hint}), got {value!r}")
        return x

    return p


def boolean(value):
    if not isinstance(value, bool):
        raise ValueError(f"expected true or false, got {value!r}")
    return value


def positive(parse):
    """Wrap a numeric parser to require a value > 0."""

    def p(value):
        x = parse(value)
        if not x > 0:
            raise ValueError(f"expected a value > 0, got {value!r}")
        return x

    return p


def list_of(parse):
    def p(value, key=""):
        if not isinstance(value, list):
            raise ValueError(f"expected a list, got {value!r}")
        return tuple(_call(parse, v, f"{key}[{i}]") for i, v in enumerate(value))

    return p


def _takes_key(parse):
    code = getattr(parse, "__code__", None)
    return getattr(parse, "section", None) is not None or (code is not None and code.co_argcount == 2)


def _call(parse, value, key):
    try:
        return parse(value, key) if _takes_key(parse) else parse(value)
    except (ValueError, TypeError, OverflowError) as e:
        raise ConfigError(str(e), key=key or None) from None


def build(cls, data, key=""):
    """Validate mapping `data` against dataclass `cls`; returns a frozen instance."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"expected a mapping, got {data!r}", key=key or None)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(map(str, data)) - set(fields))
    if unknown:
        raise ConfigError(f"unknown key {unknown[0]!r}; expected one of {', '.join(fields)}",
                          key=_join(key, unknown[0]))
    values = {}
    for name, f in fields.items():
        sub = _join(key, name)
        if name in data:
            values[name] = _call(f.metadata["parse"], data[name], sub)
        elif f.default is _MISSING and f.default_factory is _MISSING:
            if getattr(f.metadata.get("parse"), "section", None) is not None:
                values[name] = _call(f.metadata["parse"], {}, sub)
            else:
                raise ConfigError("missing required key", key=sub)
    obj = cls(**values)
    check = getattr(obj, "check", None)
    if check is not None:
        try:
            check()
        except ValueError as e:
            raise ConfigError(str(e), key=key or None) from None
    return obj


def _join(key, name):
    return f"{key}.{name}" if key else name


def describe(cls, prefix=""):
    """Yield (dotted key, default, doc) for every field, depth first: feeds the docs and `--help`."""
    for f in dataclasses.fields(cls):
        key = _join(prefix, f.name)
        sub = getattr(f.metadata.get("parse"), "section", None)
        if sub is not None:
            yield key, None, f.metadata.get("doc", "")
            yield from describe(sub, key)
        else:
            default = f.default if f.default is not _MISSING else (
                "(required)" if f.default_factory is _MISSING else f.default_factory())
            yield key, default, f.metadata.get("doc", "")


def to_dict(obj):
    """Plain-data form of a config object (for config.yaml and metadata.json)."""
    if dataclasses.is_dataclass(obj):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (tuple, list)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


__all__ = ["spec", "section", "optional", "choice", "integer", "string", "boolean", "positive",
           "path_component", "at_most",
           "list_of", "build", "describe", "to_dict", "typing"]
