"""What a service URL a job names may be (spec.grpo.rewards[].url, agent tool urls).

The trainer POSTs the model's completions to these URLs. A URL carries no credentials
(no user:password@, no query string where a token would go): the job names a Secret for
the auth header instead, and a URL is shown in logs, events and the job's status.
"""

from __future__ import annotations

import re

from posttrain.api.locations import unsafe_character

CREDENTIALS_HINT = "put the token in a Secret and name it in authSecret"
_HOST = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?)(:[0-9]{1,5})?")


def service_url_error(value: str) -> str | None:
    """Why `value` is not an http:// or https://host[:port][/path] URL, or None."""
    if bad := unsafe_character(value):
        return f"contains {bad}; a service URL holds no control, whitespace or format characters"
    scheme, sep, rest = value.partition("://")
    if not sep or scheme.lower() not in ("http", "https"):
        return "must be an http:// or https:// URL (e.g. http://verifier.default.svc:8080/score)"
    if scheme != scheme.lower():
        return f"write the scheme in lower case, {scheme.lower()}://"
    host = rest.split("/", 1)[0]
    if "@" in host:
        return f"URLs carry no credentials; {CREDENTIALS_HINT}"
    if "?" in rest or "#" in rest:
        return f"must not hold a query string or fragment (? or #); {CREDENTIALS_HINT}"
    if not _HOST.fullmatch(host):
        return f"host {host!r} is not a host name or address (host or host:port)"
    name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
    if _metadata_server(name.strip("[]").lower()):
        return (
            f"host {name} is the cloud metadata server (link-local): its answers hold the "
            "node's credentials and would reach the model and its logs"
        )
    port = host.rpartition(":")[2] if not host.endswith("]") and ":" in host else None
    if port is not None and not 0 < int(port) < 65536:
        return f"port {port} is not a port (1-65535)"
    return None


def _metadata_server(host: str) -> bool:
    """The cloud metadata server, by name or by a link-local address (169.254.0.0/16,
    fe80::/10, AWS's fd00:ec2::254)."""
    import ipaddress

    if host.rstrip(".") in ("metadata.google.internal", "metadata", "instance-data"):
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    return address.is_link_local or address == ipaddress.ip_address("fd00:ec2::254")


def reward_auth_env(index: int) -> str:
    """The trainer's environment variable that holds spec.grpo.rewards[index].authSecret's
    value: the rendered JobSet sets it from the Secret by reference; `posttrain run` takes
    it from the caller's environment."""
    return f"POSTTRAIN_REWARD_{index}_AUTH"


def tool_auth_env(name: str) -> str:
    """The trainer's variable that holds the authSecret value of the agent tool `name`."""
    return f"POSTTRAIN_TOOL_{name.upper()}_AUTH"
