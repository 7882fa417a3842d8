"""Read PostTrainJob YAML files as kubectl reads them, within limits.

kubectl turns YAML into JSON with sigs.k8s.io/yaml, whose scalars are go-yaml v2's (YAML
1.1 as Go reads it), and sends that JSON. libyaml's C parser (yaml.CSafeLoader) does the
parsing here; scalars are resolved by go-yaml v2's rules (`_resolve`): `y`/`n`/`on`/`off`
are booleans, `0o10`, `010` and `0x1F` integers, `1e3` a number, timestamps and base-60
forms (`1:30`) strings, a number out of range (`1e400`) a string; a merge key (`<<`)
applies where it stands, later keys winning; a duplicate key keeps its last value;
`!!binary` is its decoded text. Then as the JSON round trip leaves them: a float with no
fraction is an integer (`8.0` is 8), bytes that are not UTF-8 are U+FFFD, and a null
value in a mapping is no value (the API server prunes it from an object's fields).

Bytes are decoded as kubectl decodes a file (cli-runtime's FileVisitor: x/text's
BOMOverride over a UTF-8 decoder): a UTF-8, UTF-16LE or UTF-16BE byte order mark selects
that encoding and is dropped; without one the bytes are UTF-8, so UTF-16 without a BOM
(NUL bytes between the characters) is refused, as kubectl refuses it.

Before anything is built, the file's size, nesting depth and node count (aliases
expanded, so "billion laughs" documents stop early, naming the key where they do) are
checked. Errors name the line and column; the caller names the file.
"""

from __future__ import annotations

import base64
import binascii
import math
import os
import re
from pathlib import Path
from typing import Any

import yaml

# posttrain reads no larger job file: a job's whole spec must fit in the 240 KiB of its
# JobSet's config annotation (render.trainer_config), and the API server stores no
# object over etcd's 1.5 MiB request limit.
MAX_BYTES = 1024 * 1024
MAX_DEPTH = 64
MAX_NODES = 100_000
MERGE_TAG = "tag:yaml.org,2002:merge"


class DocumentError(ValueError):
    """A file that is not readable YAML within the limits; the message says why and
    `field` names where, when it can (the key whose aliases expand past the limit)."""

    def __init__(self, message: str, field: str = "(yaml)"):
        super().__init__(message)
        self.field = field


BOOL_TAG, NULL_TAG = "tag:yaml.org,2002:bool", "tag:yaml.org,2002:null"
INT_TAG, FLOAT_TAG = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
STR_TAG = "tag:yaml.org,2002:str"
BINARY_TAG = "tag:yaml.org,2002:binary"
# go-yaml v2's resolve table (resolve.go).
_TRUE = {"y", "Y", "yes", "Yes", "YES", "true", "True", "TRUE", "on", "On", "ON"}
_FALSE = {"n", "N", "no", "No", "NO", "false", "False", "FALSE", "off", "Off", "OFF"}
_NULL = {"", "~", "null", "Null", "NULL"}
_SPECIAL_FLOATS = {
    **dict.fromkeys([".nan", ".NaN", ".NAN"], math.nan),
    **dict.fromkeys([".inf", ".Inf", ".INF", "+.inf", "+.Inf", "+.INF"], math.inf),
    **dict.fromkeys(["-.inf", "-.Inf", "-.INF"], -math.inf),
}
_YAML_FLOAT = re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?")
_GO_FLOAT = re.compile(r"[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?|[-+]?(inf|infinity|nan)",
                       re.IGNORECASE)  # fmt: skip
_GO_INT = re.compile(r"([-+]?)(0[xX][0-9a-fA-F]+|0[oO][0-7]+|0[bB][01]+|0[0-7]*|[1-9][0-9]*)")
_INT64 = 2**63


def _go_int(text: str, signed: bool = True) -> int | None:
    """strconv.ParseInt(text, 0, 64) (ParseUint when not signed), or None."""
    m = _GO_INT.fullmatch(text)
    if m is None or (m.group(1) and not signed):
        return None
    digits = m.group(2)
    if digits[:2].lower() in ("0x", "0o", "0b"):
        value = int(digits[2:], {"x": 16, "o": 8, "b": 2}[digits[1].lower()])
    elif digits.startswith("0") and len(digits) > 1:
        value = int(digits[1:], 8)
    else:
        value = int(digits)
    value = -value if m.group(1) == "-" else value
    ok = -_INT64 <= value < _INT64 if signed else 0 <= value < 2 * _INT64
    return value if ok else None


def _go_float(text: str) -> float | None:
    """strconv.ParseFloat(text, 64) for decimal forms, or None (out of range too)."""
    if not _GO_FLOAT.fullmatch(text):
        return None
    value = float(text)
    return None if math.isinf(value) and "inf" not in text.lower() else value


def _timestamp(text: str) -> bool:
    return re.match(r"[0-9]{4}-[0-9]", text) is not None


def resolve_plain(text: str) -> tuple[str, Any]:
    """(tag, value) of a plain scalar by go-yaml v2's `resolve`."""
    if text in _TRUE or text in _FALSE:
        return BOOL_TAG, text in _TRUE
    if text in _NULL:
        return NULL_TAG, None
    if text in _SPECIAL_FLOATS:
        return FLOAT_TAG, _SPECIAL_FLOATS[text]
    if text == "<<":
        return MERGE_TAG, text
    if text[:1] == ".":
        value = _go_float(text)
        return (FLOAT_TAG, value) if value is not None else (STR_TAG, text)
    if text[:1] in "+-0123456789" and text:
        if _timestamp(text):  # go-yaml keeps a timestamp as its text for an untyped value
            return STR_TAG, text
        plain = text.replace("_", "")
        for signed in (True, False):
            if (value := _go_int(plain, signed)) is not None:
                return INT_TAG, value
        if _YAML_FLOAT.fullmatch(plain) and (value := _go_float(plain)) is not None:
            return FLOAT_TAG, value
    return STR_TAG, text


class _Loader(yaml.CSafeLoader):  # type: ignore[misc,name-defined]
    def resolve(self, kind: type, value: Any, implicit: tuple[bool, bool]) -> str:
        if kind is yaml.ScalarNode and implicit[0]:
            return resolve_plain(value)[0]
        return super().resolve(kind, value, implicit)

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

    def _typed(self, node: yaml.Node, tag: str) -> Any:
        text = self.construct_scalar(node)
        found, value = resolve_plain(text)
        if found == tag or (tag == FLOAT_TAG and found == INT_TAG):
            return float(value) if tag == FLOAT_TAG else value
        kind = {INT_TAG: "an integer", FLOAT_TAG: "a number", BOOL_TAG: "a boolean"}[tag]
        raise yaml.constructor.ConstructorError(
            None, None, f"cannot read {text!r} as {kind}", node.start_mark
        )

    def construct_yaml_int(self, node: yaml.Node) -> Any:
        return self._typed(node, INT_TAG)

    def construct_yaml_float(self, node: yaml.Node) -> Any:
        return self._typed(node, FLOAT_TAG)

    def construct_yaml_bool(self, node: yaml.Node) -> Any:
        return self._typed(node, BOOL_TAG)

    def construct_yaml_binary(self, node: yaml.Node) -> Any:
        text = self.construct_scalar(node)
        try:
            return base64.b64decode("".join(text.split()), validate=True).decode(
                "utf-8", errors="replace"
            )
        except (binascii.Error, ValueError):
            raise yaml.constructor.ConstructorError(
                None, None, "!!binary that is not base64", node.start_mark
            ) from None


_Loader.add_constructor(INT_TAG, _Loader.construct_yaml_int)
_Loader.add_constructor(FLOAT_TAG, _Loader.construct_yaml_float)
_Loader.add_constructor(BOOL_TAG, _Loader.construct_yaml_bool)
_Loader.add_constructor("tag:yaml.org,2002:binary", _Loader.construct_yaml_binary)
_Loader.add_constructor("tag:yaml.org,2002:timestamp", _Loader.construct_yaml_str)


def as_sent(value: Any) -> Any:
    """A value as kubectl's JSON round trip leaves it: floats with no fraction become
    integers, null values in mappings are dropped (the API server prunes them)."""
    if isinstance(value, dict):
        return {k: as_sent(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [as_sent(v) for v in value]
    if isinstance(value, float) and value.is_integer() and abs(value) < _INT64:
        return int(value)
    return value


def _check_events(text: str) -> None:
    """Depth from the event stream (iterative in C: no recursion on hostile input),
    naming the key where the nesting runs over."""
    loader = _Loader(text)
    # One frame per open collection: its path, and for a mapping the key last read and
    # whether the next node is a key; for a sequence the index of the last item.
    frames: list[dict[str, Any]] = []

    def place(event: yaml.Event) -> str:
        """The path of the node `event` starts, advancing its parent's frame."""
        if not frames:
            return ""
        top = frames[-1]
        if top["map"]:
            if top["expect_key"]:
                top["key"] = event.value if isinstance(event, yaml.ScalarEvent) else "?"
                top["expect_key"] = False
                return top["path"]
            top["expect_key"] = True
            return f"{top['path']}.{top['key']}" if top["path"] else str(top["key"])
        top["index"] += 1
        return f"{top['path']}[{top['index']}]"

    try:
        while (event := loader.get_event()) is not None:
            if isinstance(event, yaml.CollectionStartEvent):
                path = place(event)
                if len(frames) >= MAX_DEPTH:
                    mark = event.start_mark
                    raise DocumentError(
                        f"line {mark.line + 1}, column {mark.column + 1}: nested deeper than "
                        f"{MAX_DEPTH} levels",
                        path or "(yaml)",
                    )
                is_map = isinstance(event, yaml.MappingStartEvent)
                frames.append({"path": path, "map": is_map, "expect_key": True, "key": None,
                               "index": -1})  # fmt: skip
            elif isinstance(event, yaml.CollectionEndEvent):
                frames.pop()
            elif isinstance(event, (yaml.ScalarEvent, yaml.AliasEvent)):
                place(event)
    finally:
        loader.dispose()


def _check_size(node: yaml.Node) -> None:
    """Count nodes with aliases expanded; stop at MAX_NODES, naming the key reached."""
    count, stack = 0, [(node, "")]
    while stack:
        node, path = stack.pop()
        count += 1
        if count > MAX_NODES:
            raise DocumentError(
                f"more than {MAX_NODES} values (with aliases expanded)", path or "(yaml)"
            )
        if node.tag == BINARY_TAG and isinstance(node, yaml.ScalarNode):
            try:
                base64.b64decode("".join(node.value.split()), validate=True)
            except (binascii.Error, ValueError):
                mark = node.start_mark
                raise DocumentError(
                    f"line {mark.line + 1}, column {mark.column + 1}: !!binary that is not base64",
                    path or "(yaml)",
                ) from None
        if isinstance(node, yaml.SequenceNode):
            stack.extend((item, f"{path}[{i}]") for i, item in enumerate(node.value))
        elif isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                name = key.value if isinstance(key, yaml.ScalarNode) else "?"
                stack += [(key, path), (value, f"{path}.{name}" if path else str(name))]


def _yaml_error(e: yaml.YAMLError) -> str:
    """A parser's error as `line L, column C: problem (context at line, column)`, without
    the name of a string the parser was given (the caller names the file)."""
    if isinstance(e, yaml.MarkedYAMLError) and e.problem_mark is not None:
        mark = e.problem_mark
        out = f"line {mark.line + 1}, column {mark.column + 1}: {e.problem}"
        if e.context:
            where = e.context_mark
            at = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
            out += f" ({e.context}{at})"
        return " ".join(out.split())
    return " ".join(str(e).replace('"<unicode string>"', "the file").split())


def too_large(size: int) -> DocumentError:
    return DocumentError(
        f"the file is {size / 2**20:.2f} MiB ({size} bytes), over the {MAX_BYTES} bytes "
        "(1 MiB) posttrain reads of a job file: a job's whole spec must fit in the 240 KiB "
        "of its JobSet's config annotation",
        "(file size)",
    )


def decode(data: bytes) -> str:
    """The text of a file's bytes as kubectl reads them (see the module's docstring); bytes
    that are not valid in the encoding are U+FFFD, as kubectl's decoders make them."""
    for bom, codec in ((b"\xff\xfe", "utf-16-le"), (b"\xfe\xff", "utf-16-be")):
        if data.startswith(bom):
            return data[2:].decode(codec, errors="replace")
    if b"\x00" in data[:2] and not data.startswith(b"\xef\xbb\xbf"):
        raise DocumentError(
            "UTF-16 text without a byte order mark, which kubectl refuses too: save the file "
            "as UTF-8 (or as UTF-16 with a BOM)",
            "(encoding)",
        )
    # kubectl sends bytes that are not UTF-8 as U+FFFD (its JSON encoder replaces them).
    return data.decode("utf-8", errors="replace").removeprefix("\ufeff")


def parse_documents(data: bytes) -> list[Any]:
    """Every non-empty YAML document in `data`; DocumentError says what is wrong."""
    if len(data) > MAX_BYTES:
        raise too_large(len(data))
    text = decode(data)
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
        raise DocumentError(_yaml_error(e)) from None
    except RecursionError:
        raise DocumentError(f"nested deeper than {MAX_DEPTH} levels") from None
    return [as_sent(d) for d in docs if d is not None]


def read_documents(path: str | Path) -> list[Any]:
    """parse_documents of a file (OSError when it cannot be read)."""
    with open(path, "rb") as f:
        data = f.read(MAX_BYTES + 1)
        if len(data) > MAX_BYTES:
            size = os.fstat(f.fileno()).st_size
            raise too_large(max(size, len(data)))
    return parse_documents(data)
