"""Kubernetes value formats the rendered objects must satisfy: names, label values,
resource quantities and priority class names.

The regular expressions are written for both engines that use them: the API server's
(RE2, in the CRD's `pattern`) and Python's (`fullmatch`, never `$`, which also matches
before a trailing newline).
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

# RFC 1035 label: the job's name becomes a Service and JobSet name.
DNS_LABEL = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
# RFC 1123 subdomain (PriorityClass, LocalQueue, Secret and PVC names).
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
# Label values (Kueue reads the queue and the priority class from labels) are at most 63
# characters; an RFC 1123 subdomain that short is one.
LABEL_VALUE_MAX = 63
# A resource quantity without a sign (requests are never negative).
QUANTITY = (
    r"^(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
    r"(([KMGTPE]i)|[numkMGTPE]|([eE][+-]?[0-9]+))?$"
)
_SUFFIX = {
    "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
    "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "": 1,
    "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
}  # fmt: skip
SYSTEM_PRIORITY_PREFIX = "system-"


def matches(pattern: str, value: str) -> bool:
    """`pattern` (anchored with ^...$ for RE2) matches all of `value`."""
    return re.fullmatch(pattern.removeprefix("^").removesuffix("$"), value) is not None


def parse_quantity(text: str) -> Decimal:
    """The value of a Kubernetes quantity ("500m" -> 0.5, "64Gi" -> 68719476736);
    ValueError when `text` is not one."""
    m = re.fullmatch(r"([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))([KMGTPE]i|[numkMGTPE]?)", text)
    try:
        if m:
            return Decimal(m.group(1)) * Decimal(_SUFFIX[m.group(2)])
        m = re.fullmatch(r"([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))[eE]([+-]?[0-9]{1,3})", text)
        if m:
            return Decimal(m.group(1)) * Decimal(10) ** int(m.group(2))
    except InvalidOperation:
        pass
    raise ValueError(f"{text!r} is not a Kubernetes quantity (like 8, 500m or 64Gi)")


# The largest quantities the scheduler counts: it sums memory in bytes and CPU in
# millicores, each in an int64 (a larger one, `1e400`, saturates and fits any node).
INT64_MAX = 2**63 - 1
MEMORY_MAX = Decimal(INT64_MAX)
CPU_MAX = Decimal(INT64_MAX) / 1000


def quantity_error(text: str, most: Decimal = MEMORY_MAX) -> str | None:
    """Why `text` is not a positive resource quantity of at most `most`, or None."""
    try:
        value = parse_quantity(text)
    except ValueError as e:
        return str(e)
    if value <= 0:
        return f"{text!r} must be more than zero"
    if value > most:
        return f"{text!r} is more than the scheduler can count (at most {most:.4g})"
    return None


def cpu_error(text: str) -> str | None:
    return quantity_error(text, CPU_MAX)


def priority_class_error(text: str) -> str | None:
    if not matches(DNS_SUBDOMAIN, text):
        return f"{text!r} is not a PriorityClass name (lowercase letters, digits, '-', '.')"
    if text.startswith(SYSTEM_PRIORITY_PREFIX):
        return (
            f"{text!r} is reserved for cluster components (system-node-critical, "
            "system-cluster-critical); training pods must not preempt them"
        )
    return None


# metadata, as the API server checks it (apimachinery's validation of ObjectMeta).
NAMESPACE = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"  # an RFC 1123 label, at most 63
QUALIFIED_NAME = r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$"  # a label or annotation key's name
ANNOTATIONS_MAX_BYTES = 256 * 1024  # all keys and values together


def namespace_error(text: str) -> str | None:
    """Why `text` is not a namespace name, or None."""
    if len(text) > 63 or not matches(NAMESPACE, text):
        return (
            f"{text!r} is not a namespace name: at most 63 lowercase letters, digits and "
            "'-', starting and ending with a letter or digit"
        )
    return None


def key_error(key: str) -> str | None:
    """Why `key` is not a label or annotation key ([prefix/]name), or None."""
    prefix, slash, name = key.rpartition("/")
    if slash and (not prefix or len(prefix) > 253 or not matches(DNS_SUBDOMAIN, prefix)):
        return f"key {key!r}: its prefix must be a DNS subdomain (example.com/), at most 253"
    if len(name) > 63 or not matches(QUALIFIED_NAME, name):
        return (
            f"key {key!r}: its name must be at most 63 letters, digits, '-', '_' and '.', "
            "starting and ending with a letter or digit"
        )
    return None


def label_value_error(value: str) -> str | None:
    if value and (len(value) > LABEL_VALUE_MAX or not matches(QUALIFIED_NAME, value)):
        return (
            f"value {value!r} must be empty or at most 63 letters, digits, '-', '_' and "
            "'.', starting and ending with a letter or digit"
        )
    return None


def metadata_errors(meta: dict) -> list[tuple[str, str]]:
    """(field, why) for what the API server would refuse in metadata's namespace,
    labels and annotations (the name is checked by the caller, with its own reason)."""
    out = []
    namespace = meta.get("namespace")
    if isinstance(namespace, str) and (why := namespace_error(namespace)):
        out.append(("metadata.namespace", why))
    for section in ("labels", "annotations"):
        for key, value in (meta.get(section) or {}).items():
            if why := key_error(key):
                out.append((f"metadata.{section}", why))
            elif section == "labels" and (why := label_value_error(value)):
                out.append(("metadata.labels", why))
    annotations = meta.get("annotations") or {}
    size = sum(len(k.encode()) + len(v.encode()) for k, v in annotations.items())
    if size > ANNOTATIONS_MAX_BYTES:
        out.append(
            ("metadata.annotations", f"{size} bytes in all; the API server takes at most 256 KiB")
        )
    return out
