"""Read PostTrainJob YAML files as kubectl reads them, within limits.

libyaml's C parser (yaml.CSafeLoader) does the parsing. Before anything is built, the
file's size, nesting depth and node count (aliases expanded, so "billion laughs"
documents stop early) are checked, and it must be UTF-8. What is read follows kubectl
(sigs.k8s.io/yaml) where PyYAML differs: a merge key (`<<`) is applied where it stands,
later keys winning; timestamps and base-60 numbers (`1:30`) stay strings.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

MAX_BYTES = 1024 * 1024  # the API server refuses larger requests of this kind anyway
MAX_DEPTH = 64
MAX_NODES = 100_000
MERGE_TAG = "tag:yaml.org,2002:merge"


class DocumentError(ValueError):
    """A file that is not readable YAML within the limits; the message says why."""


class _Loader(yaml.CSafeLoader):  # type: ignore[misc,name-defined]
    def flatten_mapping(self, node: yaml.MappingNode) -> None:
        pairs: list[tuple[yaml.Node, yaml.Node]] = []
        for key, value in node.value:
            if key.tag != MERGE_TAG:
                pairs.append((key, value))
                continue
            sources = value.value if isinstance(value, yaml.SequenceNode) else [value]
            for source in reversed(sources):  # earlier entries of a merge list win
                if not isinstance(source, yaml.MappingNode):
                    raise yaml.constructor.ConstructorError(
                        None, None, "a merge key (<<) needs a mapping", source.start_mark
                    )
                self.flatten_mapping(source)
                pairs.extend(source.value)
        node.value = pairs

    def construct_yaml_int(self, node: yaml.Node) -> Any:
        text = self.construct_scalar(node)
        return text if ":" in text else super().construct_yaml_int(node)

    def construct_yaml_float(self, node: yaml.Node) -> Any:
        text = self.construct_scalar(node)
        return text if ":" in text else super().construct_yaml_float(node)


_Loader.add_constructor("tag:yaml.org,2002:int", _Loader.construct_yaml_int)
_Loader.add_constructor("tag:yaml.org,2002:float", _Loader.construct_yaml_float)
_Loader.add_constructor("tag:yaml.org,2002:timestamp", _Loader.construct_yaml_str)


def _check_events(text: str) -> None:
    """Depth from the event stream (iterative in C: no recursion on hostile input)."""
    loader = _Loader(text)
    depth = 0
    try:
        while (event := loader.get_event()) is not None:
            if isinstance(event, yaml.CollectionStartEvent):
                depth += 1
                if depth > MAX_DEPTH:
                    raise DocumentError(f"nested deeper than {MAX_DEPTH} levels")
            elif isinstance(event, yaml.CollectionEndEvent):
                depth -= 1
    finally:
        loader.dispose()


def _check_size(node: yaml.Node) -> None:
    """Count nodes with aliases expanded; stop at MAX_NODES."""
    count, stack = 0, [node]
    while stack:
        node = stack.pop()
        count += 1
        if count > MAX_NODES:
            raise DocumentError(f"more than {MAX_NODES} values (with aliases expanded)")
        if isinstance(node, yaml.SequenceNode):
            stack.extend(node.value)
        elif isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                stack += [key, value]


def parse_documents(data: bytes) -> list[Any]:
    """Every non-empty YAML document in `data`; DocumentError says what is wrong."""
    if len(data) > MAX_BYTES:
        raise DocumentError(f"larger than {MAX_BYTES // 1024} KiB")
    try:
        text = data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as e:
        raise DocumentError(f"not UTF-8 text (byte {e.start})") from None
    try:
        _check_events(text)
        loader = _Loader(text)
        try:
            docs = []
            while loader.check_node():
                node = loader.get_node()
                _check_size(node)
                docs.append(loader.construct_document(node))
        finally:
            loader.dispose()
    except yaml.YAMLError as e:
        raise DocumentError(" ".join(str(e).split())) from None
    except RecursionError:
        raise DocumentError(f"nested deeper than {MAX_DEPTH} levels") from None
    return [d for d in docs if d is not None]


def read_documents(path: str | Path) -> list[Any]:
    """parse_documents of a file (OSError when it cannot be read)."""
    with open(path, "rb") as f:
        data = f.read(MAX_BYTES + 1)
    return parse_documents(data)
