"""Where a PostTrainJob may read and write: URIs parsed, not pattern-matched.

Each location field allows some kinds of location:

    path   a local path, or a path on a volume mounted in the trainer pods
    gs     gs://bucket/object/prefix
    hf     hf://org/name or hf://org/name@revision (a Hugging Face repository)

Every location refuses: control, whitespace and bidirectional-override characters;
credentials (user:password@ or a token in the URI: use spec.hfTokenSecret); other
schemes (file://, s3://, http://...) and schemes not in lower case (`GS://` would be
a local path to the trainer, whose outputs stay on the pod's disk); `.` and `..` segments (no way out of a mounted
volume); query strings and fragments. Buckets follow the Cloud Storage naming rules,
which also keeps out IP addresses and the metadata server. The checks are pure: the
spec's validators call `location_error`, so `posttrain validate`, the admission webhook
and the trainer refuse the same locations.
"""

from __future__ import annotations

import ipaddress
import re
import unicodedata
from collections.abc import Collection
from posixpath import normpath

PATH, GS, HF = "path", "gs", "hf"
KINDS = {PATH: "a path", GS: "gs://bucket/path", HF: "hf://org/name[@revision]"}

_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:")
# Cloud Storage bucket names: lowercase letters, digits, '-', '_' and '.', starting and
# ending with a letter or digit, at most 63 characters per dot-separated part and 222 in
# all. (Cloud Storage also wants 3 characters at least; that is left to it.)
_BUCKET = re.compile(r"[a-z0-9](?:[a-z0-9_.-]{0,220}[a-z0-9])?")
_BUCKET_PART = re.compile(r"[a-z0-9_-]{1,63}")
# Hugging Face repository ids (org/name) and revisions (branch, tag or commit).
_HF_PART = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?")
_HF_REVISION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,254}")
# Directories of the trainer container a volume may not be mounted over or inside.
RESERVED_DIRS = ("/bin", "/dev", "/etc", "/lib", "/lib64", "/proc", "/run", "/sbin", "/sys",
                 "/usr", "/var/run", "/var/lib/kubelet")  # fmt: skip
CREDENTIALS_HINT = "put tokens in a Secret and name it in spec.hfTokenSecret"


def unsafe_character(text: str) -> str | None:
    """The first control, whitespace or format (bidi, zero-width) character, or U+FFFD
    (what a byte that is not UTF-8 becomes), escaped."""
    for ch in text:
        if ch == "\ufffd":
            return "\\ufffd (a byte that is not UTF-8)"
        if ch.isspace() or unicodedata.category(ch) in ("Cc", "Cf", "Cs", "Co", "Zl", "Zp"):
            return ch.encode("unicode_escape").decode() if ch != " " else "a space"
    return None


def _segments_error(path: str) -> str | None:
    if any(seg in (".", "..") for seg in path.split("/")):
        return "must not contain '.' or '..' segments (no way out of a mounted volume)"
    return None


def _gs_error(rest: str) -> str | None:
    bucket, _, obj = rest.partition("/")
    if "@" in bucket or ":" in bucket:
        return f"gs:// URIs carry no credentials or ports; {CREDENTIALS_HINT}"
    if not bucket:
        return "a gs:// URI needs a bucket: gs://bucket/path"
    try:
        ipaddress.ip_address(bucket)
        return f"bucket {bucket!r} is an IP address; gs:// names a Cloud Storage bucket"
    except ValueError:
        pass
    parts = bucket.split(".")
    if (
        not _BUCKET.fullmatch(bucket)
        or not all(_BUCKET_PART.fullmatch(p) for p in parts)
        or ("." not in bucket and len(bucket) > 63)
    ):
        return (
            f"bucket {bucket!r} is not a Cloud Storage bucket name (lowercase letters, "
            "digits, '-', '_' and '.')"
        )
    if bucket.startswith("goog") or "google" in bucket:
        return (
            f"bucket {bucket!r}: Cloud Storage bucket names cannot start with goog or hold google"
        )
    return _segments_error(obj)


def _hf_error(rest: str) -> str | None:
    repo, at, revision = rest.partition("@")
    if "/" not in repo and at:  # user@org/name or user:token@org/name
        return f"hf:// URIs carry no credentials; {CREDENTIALS_HINT}"
    if ":" in repo:
        return f"hf:// URIs carry no credentials; {CREDENTIALS_HINT}"
    parts = repo.split("/")
    if len(parts) != 2 or not all(_HF_PART.fullmatch(p) for p in parts):
        return "must be hf://org/name or hf://org/name@revision"
    if ".." in repo or (at and not _HF_REVISION.fullmatch(revision)):
        return "must be hf://org/name or hf://org/name@revision"
    if at and _segments_error(revision):
        return _segments_error(revision)
    return None


NAME_MAX = 255  # bytes of one file name: what Linux file systems (ext4, xfs, overlay) hold


def _path_error(path: str) -> str | None:
    if path.startswith("~"):
        return "a path must not start with ~ (nothing expands it in a pod)"
    for seg in path.split("/"):
        if (size := len(seg.encode("utf-8", "surrogatepass"))) > NAME_MAX:
            return (
                f"the name {seg[:24]}... is {size} bytes; a file or directory name is at "
                f"most {NAME_MAX} bytes"
            )
    return _segments_error(path)


def location_error(value: str, kinds: Collection[str]) -> str | None:
    """Why `value` is not an acceptable location of one of `kinds`; None when it is."""
    allowed = " or ".join(KINDS[k] for k in kinds)
    if bad := unsafe_character(value):
        return f"contains {bad}; locations hold no control, whitespace or format characters"
    scheme = _SCHEME.match(value)
    if scheme and value[scheme.end() :].startswith("//"):
        name = scheme.group(0)[:-1].lower()
        if scheme.group(0)[:-1] != name:
            return f"write the scheme in lower case, {name}://, as the trainer reads it"
        rest = value[scheme.end() + 2 :]
        if "?" in rest or "#" in rest:
            return "must not hold a query string or fragment (? or #)"
        if name == "gs" and GS in kinds:
            return _gs_error(rest)
        if name == "hf" and HF in kinds:
            return _hf_error(rest)
        if "@" in rest.partition("/")[0]:
            return f"URIs carry no credentials; {CREDENTIALS_HINT}"
        return f"{name}:// is not supported here; use {allowed}"
    if scheme and not re.fullmatch(r"[A-Za-z]:", scheme.group(0)):
        return f"{scheme.group(0)} is not a supported scheme here; use {allowed}"
    if PATH not in kinds:
        return f"must be {allowed}"
    return _path_error(value)


def mount_path_error(path: str) -> str | None:
    """Why a volume may not be mounted at `path` (an absolute path), or None."""
    clean = normpath(path)
    if clean == "/":
        return "cannot be / (a volume mounted over the container's root)"
    if clean == "/tmp":
        # Two volumes at one path make the Job invalid, which only the JobSet's Events
        # would say: a3-highgpu (TCPX) trainers mount the daemon's sockets at /tmp.
        return (
            "cannot be /tmp (H100 jobs mount their network daemon's sockets there); "
            "mount it at a directory of its own, such as /outputs"
        )
    for reserved in RESERVED_DIRS:
        if clean == reserved or clean.startswith(reserved + "/"):
            return f"cannot be under {reserved} (a directory the container needs)"
    return None


def image_error(value: str) -> str | None:
    """Why `value` is not a container image reference (registry/name[:tag][@digest])."""
    if bad := unsafe_character(value):
        return f"contains {bad}; an image reference holds no control or whitespace characters"
    if "://" in value:
        return "an image reference has no scheme (registry/name:tag, without https://)"
    ref = re.fullmatch(
        r"[a-z0-9]+(?:[._-][a-z0-9]+)*(?:\.[a-z0-9-]+)*(?::[0-9]+)?"
        r"(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*"
        r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(?:@sha256:[a-f0-9]{64})?",
        value,
    )
    if ref is None:
        return "is not an image reference (registry/name:tag or registry/name@sha256:digest)"
    return None


TRACKING_CREDENTIALS_HINT = (
    "put credentials in a Secret and name it in spec.tracking.mlflow.tokenSecret "
    "(or usernameSecret and passwordSecret) or spec.tracking.wandb.apiKeySecret"
)


def tracking_uri_error(value: str) -> str | None:
    """Why `value` is not an experiment tracker's address (http:// or https://host[:port]
    [/path]), or None. Like the other locations it carries no credentials: no user:password@
    and no query string (where a token would go)."""
    if bad := unsafe_character(value):
        return f"contains {bad}; a tracking URI holds no control, whitespace or format characters"
    scheme = _SCHEME.match(value)
    name = scheme.group(0)[:-1] if scheme else ""
    if name.lower() not in ("http", "https") or not value[scheme.end() :].startswith("//"):
        return "must be an http:// or https:// URI of the tracking server"
    if name != name.lower():
        return f"write the scheme in lower case, {name.lower()}://"
    rest = value[scheme.end() + 2 :]
    host = rest.split("/", 1)[0]
    if "@" in host:
        return f"URIs carry no credentials; {TRACKING_CREDENTIALS_HINT}"
    if "?" in rest or "#" in rest:
        return (
            "must not hold a query string or fragment (? or #: tokens do not go in URIs); "
            f"{TRACKING_CREDENTIALS_HINT}"
        )
    if not re.fullmatch(
        r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?)(:[0-9]{1,5})?", host
    ):
        return f"host {host!r} is not a host name or address (host or host:port)"
    return None
