"""Read a stack file's YAML with bounded time and memory, or fail with one ConfigError.

Stack files come from users and from reviews of pull requests, so any bytes may arrive. The
reader caps the file size, decodes UTF-8 strictly, then walks libyaml's event stream once
(cheap, no Python objects per value) to refuse what a stack file never needs before
anything is built: more than MAX_NODES values, nesting deeper than MAX_DEPTH, aliases, and
duplicate or non-scalar keys. Only then does it compose and construct the document with the
same safe loader.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from yaml.constructor import SafeConstructor
from yaml.nodes import Node, ScalarNode

from training.errors import ConfigError, short_repr

try:
    from yaml import CSafeLoader as _Loader
except ImportError:  # pragma: no cover - PyYAML built without libyaml: same rules, slower
    from yaml import SafeLoader as _Loader  # type: ignore[assignment]

_STR = "tag:yaml.org,2002:str"
_INT, _FLOAT = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"


class _Yaml(_Loader):
    """PyYAML's safe loader with numbers read as Pulumi's YAML reader reads them: no
    base-60 (`steps: 1:30` is a string, not 90) and exponents without a dot (`1e3` is
    1000.0, not a string). Everything else is PyYAML's YAML 1.1."""


_Yaml.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in rules if tag not in (_INT, _FLOAT)]
    for first, rules in _Loader.yaml_implicit_resolvers.items()
}
_Yaml.add_implicit_resolver(
    _INT,
    re.compile(r"^(?:[-+]?0b[0-1_]+|[-+]?0[0-7_]+|[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+)$"),
    list("-+0123456789"),
)
_Yaml.add_implicit_resolver(
    _FLOAT,
    re.compile(
        r"^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?"
        r"|[-+]?\.[0-9][0-9_]*(?:[eE][-+]?[0-9]+)?"
        r"|[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+"
        r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
    ),
    list("-+0123456789."),
)
_DEPTH = "stack files need about 7 levels; flatten the value"
_ALWAYS_BUILDS = {f"tag:yaml.org,2002:{t}" for t in ("bool", "null", "float", "int")}
"""Plain scalars Python always builds when short (int() fails only past 4300 digits)."""
MAX_BYTES = 1 << 20
"""Largest stack file read (1 MiB). The reference 24-host stack is 4.4 kB; a 1 MiB file
holds ~100 000 values, more than any deployment declares, and parses in well under 1 s."""
MAX_NODES = 200_000
"""Most YAML values (scalars, lists, mappings) in a stack file. Stack files run ~10 bytes
per value, so every file under MAX_BYTES fits; only dense files like `[a,a,a,...]` hit it."""
MAX_DEPTH = 32
"""Deepest nesting of lists and mappings. Stack files need 7 levels (config > regions > [i]
> pool > nodes > [j] > name); the cap keeps recursive code downstream far from its limits."""


def read_yaml(path: Path, source: str) -> Any:
    """The YAML document in `path` (None when it holds none), or a ConfigError naming
    `source`, the key path or line, and the fix."""
    text = _read_text(path, source)
    _Scan(text, source).run()
    loader = _StackLoader(text)
    try:
        return loader.get_single_data()
    except yaml.YAMLError as e:
        raise _yaml_error(e, source, text) from None
    finally:
        loader.dispose()


def _read_text(path: Path, source: str) -> str:
    try:
        size = path.stat().st_size
        if size > MAX_BYTES:
            raise _too_big(source, size)
        with path.open("rb") as f:
            data = f.read(MAX_BYTES + 1)  # bounded even if the file grows after stat()
    except OSError as e:
        raise ConfigError(source, "-", f"cannot read the file: {e.strerror or e}") from None
    if len(data) > MAX_BYTES:
        raise _too_big(source, len(data))
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ConfigError(
            source,
            f"line {line}",
            f"not UTF-8 text (byte {data[e.start]:#04x} at offset {e.start}); "
            "save the file as UTF-8",
        ) from None


def _too_big(source: str, size: int) -> ConfigError:
    return ConfigError(
        source,
        "-",
        f"the file is {size} bytes ({size / (1 << 20):.1f} MiB), over the {MAX_BYTES} byte "
        f"({MAX_BYTES >> 20} MiB) limit for stack files; is this the right file?",
    )


def _yaml_error(e: yaml.YAMLError, source: str, text: str) -> ConfigError:
    if isinstance(e, yaml.reader.ReaderError):  # a character YAML forbids (NUL, ESC, ...)
        line = text.count("\n", 0, e.position) + 1
        return ConfigError(
            source,
            f"line {line}",
            f"invalid YAML: character {chr(e.character)!r} is not allowed ({e.reason}); "
            "remove it or write it as an escape in a double-quoted string",
        )
    mark = getattr(e, "problem_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "-"
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    if isinstance(e, _ValueError):
        return ConfigError(source, where, problem)
    if problem == "exceeded maximum nesting depth":  # libyaml's own cap (1000), met first
        return ConfigError(source, where, f"nested more than {MAX_DEPTH} levels deep; {_DEPTH}")
    return ConfigError(source, where, f"invalid YAML: {problem}; fix the syntax")


class _Frame:
    """An open list or mapping during the scan."""

    __slots__ = ("at", "is_map", "seen", "want_key")

    def __init__(self, is_map: bool) -> None:
        self.is_map = is_map
        self.at: Any = 0 if not is_map else None
        """Key (mapping) or index (list) of the value being read."""
        self.want_key = is_map
        """Mapping: the next value is a key."""
        self.seen: dict[Any, int] = {}
        """Mapping: key -> line it first appeared on."""


class _Scan:
    """One pass over the event stream that enforces the stack-file rules."""

    def __init__(self, text: str, source: str) -> None:
        self.text = text
        self.source = source
        self.frames: list[_Frame] = []
        self.nodes = 0
        self.docs = 0
        self.values = SafeConstructor()

    def run(self) -> None:
        loader = _Yaml(self.text)
        try:
            while (e := loader.get_event()) is not None:
                self.event(e, loader)
        except yaml.YAMLError as e:
            raise _yaml_error(e, self.source, self.text) from None
        finally:
            loader.dispose()

    def event(self, e: yaml.Event, loader: Any) -> None:
        if isinstance(e, yaml.DocumentStartEvent):
            self.docs += 1
            if self.docs > 1:
                raise self.error(e, "a second YAML document ('---'); a stack file is one document")
        elif isinstance(e, yaml.AliasEvent):
            # Aliases are refused, not counted: an alias shares a value, so nested aliases
            # grow exponentially ("billion laughs") in every consumer that walks the value
            # (pydantic, repr, JSON). Pulumi stack files are flat config and never need them.
            raise self.error(
                e, f"YAML alias *{e.anchor} is not allowed in stack files; write the value out"
            )
        elif isinstance(e, (yaml.ScalarEvent, yaml.CollectionStartEvent)):
            self.node(e, loader)
        elif isinstance(e, yaml.CollectionEndEvent):
            self.frames.pop()
            self.value_done()

    def node(self, e: yaml.NodeEvent, loader: Any) -> None:
        self.nodes += 1
        if self.nodes > MAX_NODES:
            raise self.error(e, f"more than {MAX_NODES} YAML values; a stack file needs far fewer")
        top = self.frames[-1] if self.frames else None
        if top is not None and top.want_key:
            self.key(top, e, loader)
        elif isinstance(e, yaml.ScalarEvent):
            self.scalar(e, loader, is_key=False)
            self.value_done()
        else:
            if len(self.frames) >= MAX_DEPTH:
                raise self.error(e, f"nested more than {MAX_DEPTH} levels deep; {_DEPTH}")
            self.frames.append(_Frame(isinstance(e, yaml.MappingStartEvent)))

    def key(self, top: _Frame, e: yaml.NodeEvent, loader: Any) -> None:
        if not isinstance(e, yaml.ScalarEvent):
            raise self.error(e, "a list or mapping used as a key; keys must be plain names")
        key = self.scalar(e, loader, is_key=True)
        line = _line(e)
        if key in top.seen:
            top.at = e.value
            raise self.error(
                e,
                f"duplicate key {short_repr(e.value)} (first at line {top.seen[key]}); "
                "each key may appear once: delete or merge one",
            )
        top.seen[key] = line
        top.at = e.value
        top.want_key = False

    def scalar(self, e: yaml.ScalarEvent, loader: Any, is_key: bool) -> Any:
        """The scalar as the constructor will build it (so keys `1`, `0x1` and `true`
        collide), or a ConfigError at its key path if Python cannot build it."""
        tag = loader.resolve(ScalarNode, e.value, e.implicit) if e.tag in (None, "!") else e.tag
        if tag == _STR or (not is_key and tag in _ALWAYS_BUILDS and len(e.value) < 100):
            return e.value  # most scalars: nothing to build, nothing that can fail
        try:
            value = self.values.construct_object(ScalarNode(tag, e.value))
            hash(value)
            return value
        except (ValueError, OverflowError) as err:
            raise self.error(e, _value_problem(tag, e.value, err)) from None
        except (yaml.YAMLError, TypeError):
            return (tag, e.value)  # an unknown tag, a !!binary key: the load reports it
        finally:
            self.values.constructed_objects.clear()  # each node is new: no reuse to keep

    def value_done(self) -> None:
        if not self.frames:
            return
        top = self.frames[-1]
        if top.is_map:
            top.want_key = True
        else:
            top.at += 1

    def error(self, e: yaml.Event, problem: str) -> ConfigError:
        where = _scan_path([f.at for f in self.frames])
        return ConfigError(self.source, where, f"line {_line(e)}: {problem}")


def _line(e: yaml.Event) -> int:
    return e.start_mark.line + 1 if e.start_mark else 0


def _scan_path(parts: list[Any]) -> str:
    """['config', 'geotrain:regions', 1, 'asn'] -> 'geotrain:regions[1].asn'."""
    parts = [p for p in parts if p is not None]  # a mapping before its first key
    if parts[:1] == ["config"] and len(parts) > 1:
        parts = parts[1:]
    out = ""
    for part in parts:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "-"


def _value_problem(tag: str, text: str, err: Exception) -> str:
    if tag == "tag:yaml.org,2002:int":  # int() refuses more than 4300 digits
        return f"an integer of {len(text)} characters is too large; use a smaller number"
    return f"cannot read {short_repr(text)} as {tag.rsplit(':', 1)[-1]}: {err}; fix the value"


class _ValueError(yaml.constructor.ConstructorError):
    """A scalar Python cannot build; its message is ready to show."""


class _StackLoader(_Yaml):
    """The safe loader; a value Python cannot build is reported at its line. (The scan
    already catches these with a key path; this is the net for any it does not know.)"""

    def construct_object(self, node: Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep)
        except (ValueError, OverflowError) as e:
            problem = _value_problem(node.tag, str(node.value), e)
            raise _ValueError(None, None, problem, node.start_mark) from None
