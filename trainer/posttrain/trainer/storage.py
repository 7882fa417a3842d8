"""Reading and writing files by URI: local paths and gs://bucket/path.

Data loading, checkpoints and the Hugging Face export all go through these functions,
so every output location can be a local path, a mounted volume or Cloud Storage.
gs:// goes through google-cloud-storage here; Orbax checkpoints reach gs:// through
tensorstore (arrays) and gcsfs (directories). STORAGE_EMULATOR_HOST points all three at
a GCS-compatible emulator (tests use a local fake-gcs-server): see `configure_gcs_clients`.
Credentials come from the environment (Workload Identity,
GOOGLE_APPLICATION_CREDENTIALS), never from this module.
"""

from __future__ import annotations

import functools
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

GS_SCHEME = "gs://"


class StorageError(OSError):
    """A URI that cannot be read or written (bad form, missing object)."""


class Unreachable(OSError):
    """A source whose server did not answer (network down, the Hub offline): worth a retry,
    unlike a wrong name. The message is one line naming the field and the address."""


def is_gcs(uri: str | os.PathLike[str]) -> bool:
    """True for gs://bucket/path URIs."""
    return str(uri).startswith(GS_SCHEME)


def split_gcs(uri: str) -> tuple[str, str]:
    """gs://bucket/a/b -> ("bucket", "a/b"); the object path has no leading slash."""
    if not is_gcs(uri):
        raise StorageError(f"{uri}: not a gs:// URI")
    rest = uri[len(GS_SCHEME) :]
    bucket, _, path = rest.partition("/")
    if not bucket:
        raise StorageError(f"{uri}: a gs:// URI needs a bucket name (gs://bucket/path)")
    return bucket, path.strip("/")


def join(uri: str, *parts: str) -> str:
    """Join path parts onto a local path or gs:// URI with '/'."""
    out = str(uri)
    for part in parts:
        part = str(part).strip("/")
        if not part:
            continue
        out = out.rstrip("/") + "/" + part if out else part
    return out


def basename(uri: str) -> str:
    """The last path component of a local path or URI."""
    return str(uri).rstrip("/").rsplit("/", 1)[-1]


# ---------------------------------------------------------------------------- gcs


def configure_gcs_clients() -> None:
    """Configure every gs:// client in the process for GCS semantics, and for the emulator
    at STORAGE_EMULATOR_HOST when it is set.

    - fsspec/gcsfs must not cache listings: Orbax lists checkpoint steps that tensorstore
      wrote behind gcsfs's back.
    - google-cloud-storage and gcsfs read STORAGE_EMULATOR_HOST themselves; tensorstore
      has its own endpoint variable, and an emulator takes any bearer token. gcsfs's
      bucket-type probe needs the real GCS control API, so it is turned off there.
    """
    import fsspec.config

    fsspec.config.conf.setdefault("gcs", {})["use_listings_cache"] = False
    host = os.environ.get("STORAGE_EMULATOR_HOST", "")
    if host in ("", "default"):
        return
    os.environ["TENSORSTORE_GCS_HTTP_URL"] = host if "://" in host else f"http://{host}"
    os.environ.setdefault("GOOGLE_AUTH_TOKEN_FOR_TESTING", "emulator")
    os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")


@functools.lru_cache(maxsize=4)
def _client_for(emulator_host: str | None) -> Any:
    from google.cloud import storage

    # The client reads STORAGE_EMULATOR_HOST itself (anonymous credentials there);
    # caching per emulator host keeps tests that change it correct.
    return storage.Client()


def gcs_client() -> Any:
    """A google.cloud.storage.Client (cached; follows STORAGE_EMULATOR_HOST)."""
    return _client_for(os.environ.get("STORAGE_EMULATOR_HOST"))


def blob(uri: str) -> Any:
    """The google.cloud.storage Blob of a gs:// object URI."""
    bucket, path = split_gcs(uri)
    if not path:
        raise StorageError(f"{uri}: names a bucket, not an object")
    return gcs_client().bucket(bucket).blob(path)


def _gcs_prefix_has_objects(uri: str) -> bool:
    bucket, path = split_gcs(uri)
    prefix = path + "/" if path else ""
    blobs = gcs_client().list_blobs(bucket, prefix=prefix, max_results=1)
    return any(True for _ in blobs)


# ---------------------------------------------------------------------- functions


def exists(uri: str | os.PathLike[str]) -> bool:
    """True when uri is an existing file/object or a non-empty directory/prefix."""
    uri = str(uri)
    if not is_gcs(uri):
        return os.path.exists(uri)
    bucket, path = split_gcs(uri)
    if not path:
        return gcs_client().bucket(bucket).exists()
    return blob(uri).exists() or _gcs_prefix_has_objects(uri)


def is_dir(uri: str | os.PathLike[str]) -> bool:
    """True for a local directory or a gs:// prefix that holds objects (and is not one)."""
    uri = str(uri)
    if not is_gcs(uri):
        return os.path.isdir(uri)
    bucket, path = split_gcs(uri)
    if not path:
        return True
    if uri.endswith("/"):
        return _gcs_prefix_has_objects(uri)
    return not blob(uri).exists() and _gcs_prefix_has_objects(uri)


def list_uri(uri: str | os.PathLike[str], *, recursive: bool = False) -> list[str]:
    """Files under a directory (or gs:// prefix), as sorted full paths/URIs.

    Non-recursive lists only the files directly in uri; recursive lists every file below.
    A missing directory gives an empty list.
    """
    uri = str(uri)
    if not is_gcs(uri):
        root = Path(uri)
        if not root.is_dir():
            return []
        if not recursive:
            return sorted(str(p) for p in root.iterdir() if p.is_file())
        # os.walk skips a directory that vanishes mid-walk (Orbax renames its
        # *-tmp directories while another process lists them); rglob raises.
        return sorted(os.path.join(d, f) for d, _, files in os.walk(root) for f in files)
    bucket, path = split_gcs(uri)
    prefix = path + "/" if path else ""
    kwargs: dict[str, Any] = {"prefix": prefix}
    if not recursive:
        kwargs["delimiter"] = "/"
    names = [b.name for b in gcs_client().list_blobs(bucket, **kwargs)]
    return sorted(f"{GS_SCHEME}{bucket}/{n}" for n in names if not n.endswith("/"))


@contextmanager
def open_uri(uri: str | os.PathLike[str], mode: str = "rb", **kwargs: Any) -> Iterator[IO[Any]]:
    """Open a local file or gs:// object like open(); 'w' modes create parent dirs."""
    uri = str(uri)
    if not is_gcs(uri):
        if any(m in mode for m in "wax"):
            Path(uri).parent.mkdir(parents=True, exist_ok=True)
        with open(uri, mode, **kwargs) as f:
            yield f
        return
    obj = blob(uri)
    if "r" in mode and not obj.exists():
        raise FileNotFoundError(f"{uri}: no such object")
    with obj.open(mode, **kwargs) as f:
        yield f


def read_bytes(uri: str | os.PathLike[str]) -> bytes:
    """The whole content of a file or gs:// object."""
    uri = str(uri)
    if not is_gcs(uri):
        return Path(uri).read_bytes()
    from google.api_core import exceptions as gexc

    try:
        return blob(uri).download_as_bytes()
    except gexc.NotFound as e:
        raise FileNotFoundError(f"{uri}: no such object") from e


def read_text(uri: str | os.PathLike[str], encoding: str = "utf-8") -> str:
    """read_bytes decoded as text."""
    return read_bytes(uri).decode(encoding)


def write_bytes(uri: str | os.PathLike[str], data: bytes) -> None:
    """Write (replace) a file or gs:// object; local parent dirs are created."""
    uri = str(uri)
    if not is_gcs(uri):
        path = Path(uri)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
        return
    blob(uri).upload_from_string(data)


def write_text(uri: str | os.PathLike[str], text: str, encoding: str = "utf-8") -> None:
    """write_bytes of encoded text."""
    write_bytes(uri, text.encode(encoding))


def delete(uri: str | os.PathLike[str], *, recursive: bool = False) -> None:
    """Remove a file/object, or with recursive a whole directory/prefix. Missing is fine."""
    uri = str(uri)
    if not is_gcs(uri):
        p = Path(uri)
        if p.is_dir():
            if not recursive:
                raise StorageError(f"{uri}: is a directory (pass recursive=True)")
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()
        return
    targets = list_uri(uri, recursive=True) if recursive else []
    bucket, path = split_gcs(uri)
    if path and blob(uri).exists():
        targets.append(uri)
    for t in targets:
        blob(t).delete()


def move(uri: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
    """Rename a file or directory (on gs://: copy then delete every object below uri)."""
    uri, dst = str(uri), str(dst)
    if not is_gcs(uri):
        os.replace(uri, dst)
        return
    root = uri.rstrip("/")
    for f in list_uri(root, recursive=True) or [root]:
        target = blob(join(dst, f[len(root) + 1 :])) if f != root else blob(dst)
        source = blob(f)
        source.bucket.copy_blob(source, target.bucket, target.name)
        source.delete()


def download_dir(
    uri: str, local_dir: str | os.PathLike[str], *, skip: tuple[str, ...] = ()
) -> Path:
    """Copy every file under uri (recursively) into local_dir, except names ending with
    one of `skip`; returns local_dir. A local uri is copied too, so callers need not
    special-case it.
    """
    local = Path(local_dir)
    local.mkdir(parents=True, exist_ok=True)
    root = str(uri).rstrip("/")
    for f in list_uri(root, recursive=True):
        if skip and f.endswith(skip):
            continue
        rel = f[len(root) + 1 :]
        dst = local / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if is_gcs(f):
            blob(f).download_to_filename(str(dst))
        else:
            shutil.copyfile(f, dst)
    return local


def upload_dir(local_dir: str | os.PathLike[str], uri: str) -> None:
    """Copy every file under local_dir (recursively) to uri (gs:// or local)."""
    root = Path(local_dir)
    for f in sorted(p for p in root.rglob("*") if p.is_file()):
        dst = join(uri, f.relative_to(root).as_posix())
        if is_gcs(dst):
            blob(dst).upload_from_filename(str(f))
        else:
            Path(dst).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, dst)


def check_reachable(uri: str, field: str) -> None:
    """One bounded request to a gs:// location's bucket before a run relies on it: a
    server that does not answer is Unreachable (worth a retry), a missing bucket, missing
    access or missing credentials a ValueError naming `field`. Local paths pass."""
    if not is_gcs(uri):
        return
    import google.auth.exceptions
    import requests
    from google.api_core import exceptions as api

    bucket, _ = split_gcs(uri)
    try:
        next(iter(gcs_client().list_blobs(bucket, max_results=1, timeout=10, retry=None)), None)
    except api.NotFound:
        raise ValueError(f"{field}: {uri}: bucket {bucket!r} does not exist") from None
    except api.Forbidden:
        raise ValueError(f"{field}: {uri}: this identity may not list bucket {bucket!r}") from None
    except google.auth.exceptions.DefaultCredentialsError:
        raise ValueError(
            f"{field}: {uri} needs Google credentials (Workload Identity on GKE, or "
            "GOOGLE_APPLICATION_CREDENTIALS)"
        ) from None
    except (
        requests.exceptions.RequestException,
        google.auth.exceptions.TransportError,
        OSError,
    ) as e:
        endpoint = os.environ.get("STORAGE_EMULATOR_HOST") or "storage.googleapis.com"
        raise Unreachable(f"{field}: cannot reach {uri} at {endpoint} ({root_cause(e)})") from None


def root_cause(e: BaseException, limit: int = 160) -> str:
    """'Type: message' of the innermost exception of a chain, on one line: the socket's
    own words rather than the wrappers' of the HTTP and client libraries."""
    root = e
    while root.__cause__ or root.__context__:
        root = root.__cause__ or root.__context__  # type: ignore[assignment]
    return f"{type(root).__name__}: {' '.join(str(root).split())}"[:limit]


def check_writable(uri: str, field: str) -> None:
    """Before a run writes under a gs:// location: its bucket answers (check_reachable),
    and this identity may create and delete objects there, found by writing one empty
    probe object under `uri` and deleting it. A ValueError names `field`; a server that
    does not answer is Unreachable. Local paths pass (posttrain.local_paths checks them)."""
    if not is_gcs(uri):
        return
    import uuid

    from google.api_core import exceptions as api

    check_reachable(uri, field)
    bucket, _ = split_gcs(uri)
    probe = blob(join(uri, f".posttrain-probe-{uuid.uuid4().hex}"))
    once: dict[str, Any] = {"timeout": 10, "retry": None}  # bounded, like check_reachable
    for verb, permission, act in (
        ("write", "storage.objects.create", lambda: probe.upload_from_string(b"", **once)),
        ("delete", "storage.objects.delete", lambda: probe.delete(**once)),
    ):
        try:
            _answered(uri, field, act)
        except api.Forbidden:
            left = f"; remove gs://{bucket}/{probe.name}" if verb == "delete" else ""
            raise ValueError(
                f"{field}: {uri}: this identity may not {verb} objects in bucket {bucket!r} "
                f"(a run needs {permission}){left}"
            ) from None
        except api.GoogleAPICallError as e:
            why = " ".join(str(e.message or e).split())[:160]
            raise ValueError(f"{field}: {uri}: cannot {verb} there ({e.code}: {why})") from None


def _answered(uri: str, field: str, act: Any) -> Any:
    """act(), with a server that does not answer raised as Unreachable naming `field`."""
    import google.auth.exceptions
    import requests

    try:
        return act()
    except (
        requests.exceptions.RequestException,
        google.auth.exceptions.TransportError,
        ConnectionError,
        TimeoutError,
    ) as e:
        endpoint = os.environ.get("STORAGE_EMULATOR_HOST") or "storage.googleapis.com"
        raise Unreachable(f"{field}: cannot reach {uri} at {endpoint} ({root_cause(e)})") from None


def list_dirs(uri: str) -> list[str]:
    """The names of the directories directly under a local directory or gs:// prefix
    (on gs://, the prefixes that hold objects), sorted; none when it is not there."""
    if not is_gcs(uri):
        root = Path(uri)
        return sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
    bucket, path = split_gcs(uri)
    prefix = path + "/" if path else ""
    pages = gcs_client().list_blobs(bucket, prefix=prefix, delimiter="/", timeout=10)
    for _ in pages:  # the prefixes fill in as the pages are read
        pass
    return sorted(p[len(prefix) :].rstrip("/") for p in pages.prefixes)


def credentials_found() -> bool:
    """Whether Google credentials are at hand without asking a server: an emulator
    (STORAGE_EMULATOR_HOST), GOOGLE_APPLICATION_CREDENTIALS, gcloud's application-default
    credentials file, or a Compute Engine VM or GKE node (its metadata server)."""
    if os.environ.get("STORAGE_EMULATOR_HOST") or os.environ.get("GOOGLE_APPLICATION_CREDENTIALS"):
        return True
    config = os.environ.get("CLOUDSDK_CONFIG") or os.path.expanduser("~/.config/gcloud")
    if os.path.isfile(os.path.join(config, "application_default_credentials.json")):
        return True
    try:
        return "Google" in Path("/sys/class/dmi/id/product_name").read_text()
    except OSError:
        return False
