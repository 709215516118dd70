"""Read YAML manifests from users with bounded work (pure): no input may hang the CLI.

A YAML alias (``*name``) refers to an anchored node; nested aliases ("billion laughs") make a
few hundred bytes stand for billions of nodes, and everything that walks the parsed document
(shape checks, the models, messages that echo values) walks all of them. A MegatronJob has no use
for anchors, so an alias is refused outright, with its line and column. The rest is capped before
any Python object is built, by one pass over libyaml's event stream: bytes, documents, nodes,
nesting depth and scalar length. Within those caps a document is at most a few hundred thousand
nodes, parsed and checked in a few seconds. Every refusal is an InputError with a one-line message.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import yaml

#: Largest file (or stdin) read, in bytes. A MegatronJob is a few KiB; `kubectl get mj -o yaml` of
#: a thousand jobs with their status is about 4 MiB.
MAX_BYTES = 8 * 1024 * 1024
#: Objects per file: YAML documents (``---`` separated) and the items of ``kind: List`` documents,
#: each validated (about a millisecond each).
MAX_OBJECTS = 1000
#: Nodes (scalars, sequences, mappings) per file, built and walked at about 150,000 a second.
MAX_NODES = 200_000
#: Nesting of sequences and mappings. A MegatronJob is 6 levels deep (10 inside a ``kind: List``);
#: validation refuses deeper than 32 levels per object, with the path.
MAX_DEPTH = 64
#: Characters of one scalar (a Kubernetes object's annotations are 256 KiB in all).
MAX_SCALAR = 256 * 1024

_Loader: type[yaml.SafeLoader] = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml when built with it


class InputError(Exception):
    """A file that cannot be read or parsed, or is beyond the limits above."""


def read_text(path: str) -> str:
    """The text of ``path`` ('-': stdin), at most MAX_BYTES of it, as UTF-8."""
    try:
        if path == "-":
            data = sys.stdin.buffer.read(MAX_BYTES + 1)
        else:
            with Path(path).open("rb") as f:
                data = f.read(MAX_BYTES + 1)
    except OSError as exc:
        raise InputError(f"cannot read: {exc.strerror or exc}") from None
    if len(data) > MAX_BYTES:
        raise InputError(f"larger than {MAX_BYTES // (1024 * 1024)} MiB; split it into several files")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"cannot read: not UTF-8 text (byte {exc.start})") from None


def _at(mark: Any) -> str:
    return f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""


def check_events(text: str) -> None:
    """Refuse aliases and anything beyond the caps, from libyaml's events (no document is built)."""
    documents = nodes = depth = 0
    for event in yaml.parse(text, Loader=_Loader):
        if isinstance(event, yaml.AliasEvent):
            raise InputError(f"{_at(event.start_mark)}YAML alias *{event.anchor} is not allowed: a MegatronJob "
                             "has no use for anchors and aliases; write the value out")
        if isinstance(event, yaml.DocumentStartEvent):
            documents += 1
            if documents > MAX_OBJECTS:
                raise InputError(f"{_at(event.start_mark)}more than {MAX_OBJECTS} documents; split the file")
        elif isinstance(event, (yaml.ScalarEvent, yaml.CollectionStartEvent)):
            nodes += 1
            if nodes > MAX_NODES:
                raise InputError(f"{_at(event.start_mark)}more than {MAX_NODES} values; split the file")
            if isinstance(event, yaml.ScalarEvent):
                if len(event.value) > MAX_SCALAR:
                    raise InputError(f"{_at(event.start_mark)}a value of {len(event.value)} characters; "
                                     f"the limit is {MAX_SCALAR}")
            else:
                depth += 1
                if depth > MAX_DEPTH:
                    raise InputError(f"{_at(event.start_mark)}nested deeper than {MAX_DEPTH} levels")
        elif isinstance(event, yaml.CollectionEndEvent):
            depth -= 1


class _StrictLoader(_Loader):  # type: ignore[misc,valid-type]
    """safe_load, but a key given twice in one mapping is an error: YAML's "the last one wins" would
    let a file that reads ``numNodes: 1`` launch 64 nodes."""


def _mapping_without_duplicates(loader: _StrictLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: dict[Any, Any] = {}
    for key_node, _ in node.value:
        if key_node.tag == "tag:yaml.org,2002:merge":
            continue  # keys merged in with << {...} may be overridden: that is what merging is for
        key = loader.construct_object(key_node, deep=True)
        try:
            first = seen.get(key)
        except TypeError:  # an unhashable key (a list or a map): the mapping constructor says so
            break
        if first is not None:
            raise yaml.constructor.ConstructorError(
                "while reading a mapping", node.start_mark,
                f"duplicate key {str(key)[:80]!r} (first on line {first.line + 1})", key_node.start_mark)
        seen[key] = key_node.start_mark
    return loader.construct_mapping(node, deep=True)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping_without_duplicates)

#: Characters of a number (an int64 has 19 digits). Python refuses to convert integers of over
#: 4300 digits with a ValueError, and YAML 1.1's base-60 integers (1:30:00) cost quadratic time.
MAX_NUMBER = 64


def _bounded_number(kind: str) -> Any:
    base = yaml.constructor.SafeConstructor.yaml_constructors[f"tag:yaml.org,2002:{kind}"]

    def construct(loader: _StrictLoader, node: yaml.ScalarNode) -> Any:
        if len(node.value) > MAX_NUMBER:
            raise yaml.constructor.ConstructorError(
                None, None, f"a number of {len(node.value)} characters; the limit is {MAX_NUMBER} (quote it if "
                "it is a string)", node.start_mark)
        return base(loader, node)

    return construct


for _kind in ("int", "float"):
    _StrictLoader.add_constructor(f"tag:yaml.org,2002:{_kind}", _bounded_number(_kind))


def load_documents(text: str) -> list[Any]:
    """Every YAML document of ``text`` (None for an empty one), or InputError with a one-line message."""
    try:
        check_events(text)
        return list(yaml.load_all(text, Loader=_StrictLoader))  # a SafeLoader subclass
    except InputError:
        raise
    except RecursionError:
        raise InputError("invalid YAML: nested too deeply") from None
    except yaml.reader.ReaderError as exc:  # a character YAML does not allow (NUL, control characters)
        raise InputError(f"invalid YAML: character {exc.character!r} at position {exc.position} is not "
                         "allowed") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None) or str(exc)
        raise InputError(" ".join(f"invalid YAML: {_at(mark)}{problem}".split())) from None
    # PyYAML's constructors raise plain built-in errors on some scalars: ValueError for datetime(2001,
    # 2, 30), IndexError for an empty "!!int", AttributeError for an empty "!!timestamp" (found by the
    # fuzz test). Any of them is a bad file, reported in one line.
    except Exception as exc:
        raise InputError(" ".join(f"invalid YAML: {exc or type(exc).__name__}".split())[:300]) from None
