"""YAML output for people: key order kept, multi-line strings as literal blocks."""

from __future__ import annotations

from typing import Any

import yaml


class _Dumper(yaml.SafeDumper):
    pass


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def dump_yaml(objects: list[Any]) -> str:
    """Several objects as one multi-document YAML stream."""
    return yaml.dump_all(objects, Dumper=_Dumper, sort_keys=False, width=100)
