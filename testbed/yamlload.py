"""Strict YAML for experiment files: what was written is what is read, or a one-line error.

`load_file(path)` and `load_text(text, source)` read YAML with PyYAML's safe loader, made strict:

- **Plain YAML 1.2 scalars.** `true`/`false` are booleans, `null`/`~`/empty is null, decimal,
  `0x`/`0o` integers and decimal floats (`1e-3` included) are numbers; everything else is a
  string. So `yes`, `no`, `on`, `off` are the strings they look like (a boolean key then says
  it expected true or false), and dates stay strings.
- **YAML 1.1 surprises are errors**, not silent conversions: sexagesimal numbers (`3:1`, which
  YAML 1.1 reads as 181), leading-zero integers (`012`, octal 10 in YAML 1.1), numbers with
  underscores (`1_000`) and `.inf`/`.nan`. Quote them to mean the string.
- **Duplicate keys are errors** (naming the key and both lines); keys must be strings.
- **Bounded**: the file at most `MAX_FILE_BYTES`, nesting at most `MAX_DEPTH` levels, at most
  `MAX_VALUES` values counting every alias expansion (so "billion laughs" is refused before it
  is built), no recursive aliases, scalars at most `MAX_SCALAR_CHARS` characters, integers within
  64 bits. These are hard limits: an experiment file is a few hundred values.
- Undecodable or binary files, a directory or a missing file, and every parser error become a
  `ConfigError` naming the file, the line and (where there is one) the key path.
"""

import math
import pathlib
import re

import yaml
from yaml.nodes import MappingNode, ScalarNode, SequenceNode

from testbed.errors import ConfigError

MAX_FILE_BYTES = 1 << 20          # 1 MiB
MAX_DEPTH = 32                    # nested mappings/sequences
MAX_VALUES = 10_000               # values after expanding every alias
MAX_SCALAR_CHARS = 10_000
MAX_INT = 2**63 - 1

_STR, _INT, _FLOAT, _BOOL, _NULL = (f"tag:yaml.org,2002:{t}" for t in
                                    ("str", "int", "float", "bool", "null"))
_MERGE = "tag:yaml.org,2002:merge"
_REJECT = "tag:prfaas-testbed:yaml11"

_INT_RE = re.compile(r"^(?:[-+]?(?:0|[1-9][0-9]*)|0x[0-9a-fA-F]+|0o[0-7]+)$")
_FLOAT_RE = re.compile(r"^[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?$")
_REJECTS = (
    (re.compile(r"^[-+]?\.(?:inf|Inf|INF|nan|NaN|NAN)$"), "is not a finite number"),
    (re.compile(r"^[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+(?:\.[0-9_]*)?$"),
     "is a YAML 1.1 sexagesimal number (YAML 1.1 reads it as {sexa})"),
    (re.compile(r"^[-+]?0[0-9]+$"), "has a leading zero (YAML 1.1 reads it as octal)"),
    (re.compile(r"^[-+]?(?:[0-9][0-9_]*_[0-9_]*|[0-9_]*_[0-9][0-9_]*)(?:\.[0-9_]*)?$"),
     "is a number with underscores (YAML 1.1 drops them)"),
)


class StrictLoader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 core scalars, YAML 1.1 surprises tagged for rejection, and a
    bounded composer (depth, value count)."""

    yaml_implicit_resolvers = {}

    def __init__(self, stream):
        super().__init__(stream)
        self._depth = 0
        self._nodes = 0

    def compose_node(self, parent, index):
        self._depth += 1
        self._nodes += 1
        if self._depth > MAX_DEPTH:
            raise _Refused(f"nested deeper than {MAX_DEPTH} levels", self.peek_event().start_mark)
        if self._nodes > MAX_VALUES:
            raise _Refused(f"more than {MAX_VALUES:,} values", self.peek_event().start_mark)
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _resolver(tag, regexp, first):
    StrictLoader.add_implicit_resolver(tag, regexp, list(first))


_resolver(_BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), "tTfF")
_resolver(_NULL, re.compile(r"^(?:~|null|Null|NULL|)$"), ["~", "n", "N", ""])
for _rx, _ in _REJECTS:
    _resolver(_REJECT, _rx, "-+.0123456789")
_resolver(_INT, _INT_RE, "-+0123456789")
_resolver(_FLOAT, _FLOAT_RE, "-+.0123456789")
_resolver(_MERGE, re.compile(r"^(?:<<)$"), "<")


def _int_of(text):
    if text.startswith(("0x", "0o")):
        return int(text[2:], 16 if text[1] == "x" else 8)
    return int(text)


def _construct_int(loader, node):
    return _int_of(loader.construct_scalar(node))


StrictLoader.add_constructor(_INT, _construct_int)
StrictLoader.add_constructor(_FLOAT, lambda loader, node: float(loader.construct_scalar(node)))


class _Refused(Exception):
    def __init__(self, message, mark=None, key=None):
        super().__init__(message)
        self.mark, self.key = mark, key


def _line(node_or_mark):
    mark = getattr(node_or_mark, "start_mark", node_or_mark)
    return None if mark is None else mark.line + 1


def _sexagesimal(text):
    sign = -1 if text.startswith("-") else 1
    parts = text.lstrip("+-").replace("_", "").split(":")
    total = 0.0 if "." in parts[-1] else 0
    for p in parts:
        total = total * 60 + (float(p) if "." in p else int(p))
    return sign * total


def _check_scalar(node, key):
    value = node.value
    if len(value) > MAX_SCALAR_CHARS:
        raise _Refused(f"a value of {len(value):,} characters (at most {MAX_SCALAR_CHARS:,})",
                       node.start_mark, key)
    if node.tag == _REJECT:
        for rx, why in _REJECTS:
            if rx.match(value):
                why = why.format(value=value, sexa=_sexagesimal(value) if ":" in value else "")
                raise _Refused(f"{value} {why}; quote it ('{value}') for the text, or write "
                               f"the plain number", node.start_mark, key)
    if node.tag == _INT:
        digits = value.lstrip("+-")
        if len(digits) > 25 or abs(_int_of(value)) > MAX_INT:
            shown = value if len(value) <= 40 else value[:40] + "..."
            raise _Refused(f"integer {shown} is out of range (at most {MAX_INT})",
                           node.start_mark, key)
    if node.tag == _FLOAT and not math.isfinite(float(value)):
        raise _Refused(f"{value} is out of range for a number", node.start_mark, key)


def _join(key, name):
    return f"{key}.{name}" if key else str(name)


def _check(root):
    """Walk the composed node graph once: recursion, expanded size, keys, scalars.

    Returns the number of values the document expands to (aliases counted at every use).
    """
    size = {}           # id(node) -> expanded value count
    active = set()      # nodes on the current path (a recursive alias comes back to one)

    def walk(node, key, depth):
        nid = id(node)
        if nid in size:
            return size[nid]
        if nid in active:
            raise _Refused("an alias refers to a value that contains it (recursive alias)",
                           node.start_mark, key)
        if depth > MAX_DEPTH:
            raise _Refused(f"nested deeper than {MAX_DEPTH} levels (aliases included)",
                           node.start_mark, key)
        active.add(nid)
        n = 1
        if isinstance(node, ScalarNode):
            _check_scalar(node, key)
        elif isinstance(node, SequenceNode):
            for i, child in enumerate(node.value):
                n += walk(child, f"{key}[{i}]", depth + 1)
                if n > MAX_VALUES:
                    break
        elif isinstance(node, MappingNode):
            seen = {}
            for knode, vnode in node.value:
                if knode.tag == _MERGE:
                    n += walk(vnode, key, depth + 1)
                    continue
                if not isinstance(knode, ScalarNode) or knode.tag != _STR:
                    shown = (f"key {knode.value!r} is" if isinstance(knode, ScalarNode)
                             else "a list or mapping as a key is")
                    raise _Refused(f"{shown} not a string (keys are names; quote it)",
                                   knode.start_mark, key or None)
                name = knode.value
                if name in seen:
                    raise _Refused(f"duplicate key {name!r} (first at line {seen[name]})",
                                   knode.start_mark, _join(key, name))
                seen[name] = _line(knode)
                _check_scalar(knode, _join(key, name))
                n += 1 + walk(vnode, _join(key, name), depth + 1)
                if n > MAX_VALUES:
                    break
        active.discard(nid)
        if n > MAX_VALUES:
            raise _Refused(f"expands to more than {MAX_VALUES:,} values (aliases counted at "
                           f"each use; a hard limit)", node.start_mark, key or None)
        size[nid] = n
        return n

    walk(root, "", 0)


def load_text(text, source="<text>", key=None):
    """The one YAML document in `text`, strictly (see the module docstring); None when empty.

    Errors are `ConfigError(path=source, key=key path inside the document or `key`)`.
    """
    loader = None
    try:
        loader = StrictLoader(text)
        node = loader.get_single_node()
        if node is None:
            return None
        _check(node)
        return loader.construct_document(node)
    except _Refused as e:
        where = f"line {_line(e.mark)}: " if e.mark is not None else ""
        raise ConfigError(where + str(e), path=source,
                          key=_join(key or "", e.key or "") or None) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        if isinstance(e, yaml.reader.ReaderError):
            problem = (f"character U+{e.character:04X} at position {e.position} is not "
                       f"allowed in YAML (a control character, or a binary file)")
            where = ""
        raise ConfigError(f"not valid YAML{where}: {problem}", path=source, key=key) from None
    except (RecursionError, MemoryError):
        raise ConfigError("too deeply nested or too large to read", path=source,
                          key=key) from None
    finally:
        if loader is not None:
            loader.dispose()


def read_text(path, what="a file", max_bytes=MAX_FILE_BYTES, key=None):
    """The UTF-8 text of a regular file (a BOM is dropped), or ConfigError naming what is wrong."""
    p = pathlib.Path(path)
    try:
        if p.is_dir():
            raise ConfigError(f"is a directory; expected {what}", path=str(path), key=key)
        if not p.exists():
            raise ConfigError(f"no such file; expected {what}", path=str(path), key=key)
        if not p.is_file():
            raise ConfigError(f"not a regular file; expected {what}", path=str(path), key=key)
        size = p.stat().st_size
        if size > max_bytes:
            raise ConfigError(f"{size:,} bytes, larger than {what} may be "
                              f"({max_bytes:,} bytes; a hard limit)", path=str(path), key=key)
        with open(p, "rb") as f:
            data = f.read(max_bytes + 1)
    except OSError as e:
        raise ConfigError(f"cannot read it ({e.strerror}); expected {what}", path=str(path),
                          key=key) from None
    if len(data) > max_bytes:
        raise ConfigError(f"larger than {what} may be ({max_bytes:,} bytes)", path=str(path),
                          key=key)
    if bytes(1) in data:
        raise ConfigError(f"contains NUL bytes at offset {data.index(bytes(1))}: a binary file, "
                          f"not {what}", path=str(path), key=key)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"not UTF-8 text (byte {e.start}): a binary file or another "
                          f"encoding; expected {what}", path=str(path), key=key) from None
    return text.removeprefix("\ufeff")


def load_file(path, what="a YAML file"):
    """`load_text` of `read_text(path)`."""
    return load_text(read_text(path, what), str(path))


__all__ = ["load_file", "load_text", "read_text", "StrictLoader", "MAX_FILE_BYTES", "MAX_DEPTH",
           "MAX_VALUES"]
