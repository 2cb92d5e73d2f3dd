"""What a download or a registration may touch on the console's own host, and how a download URL is shown.

- Model folders (`RAMDECK_MODEL_DIRS`): a download onto a Local-transport node lands under one of them and
  only a file under one of them can be registered by path there, symlinks resolved, so neither can reach
  site-packages, the var folder with its keys, or anything else the console's user may write or read.
- Targets: on the console's own host a download fetches only from public addresses, each redirect resolved
  and checked before it is followed and the connection pinned to the checked address (`curl --resolve`), so
  neither a URL nor a redirect (nor a DNS answer that changes in between) reaches loopback, link-local,
  private or reserved addresses unless an admin lists the network in `RAMDECK_DOWNLOAD_ALLOW_NETWORKS`.
- URLs: a query string often carries a token (signed CDN links, `?token=`); jobs, logs, pages and the audit
  history get `redact_url(url)`, and the real URL travels encrypted in the job's `url_secret` parameter.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import posixpath
import socket
from urllib.parse import urlsplit, urlunsplit

from django.conf import settings

from ramdeck_site import crypto

QUERY_HIDDEN = "[query hidden]"


# --------------------------------------------------------------------------------------------------
# URLs


def redact_url(url: str) -> str:
    """The URL without its query string and fragment (marked when there was one), for showing and logging."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "[an unparseable URL]"
    netloc = parts.hostname or ""
    if ":" in netloc:
        netloc = f"[{netloc}]"
    if parts.port:
        netloc += f":{parts.port}"
    shown = urlunsplit((parts.scheme, netloc, parts.path, "", ""))
    return f"{shown}?{QUERY_HIDDEN}" if parts.query or parts.fragment else shown


def url_fingerprint(url: str) -> str:
    """Which URL a part file belongs to, without writing the URL (and its token) next to it."""
    return "sha256:" + hashlib.sha256(url.encode()).hexdigest()


def secret_params(url: str) -> dict[str, str]:
    """Job parameters for a download URL: shown redacted, the real one encrypted (audit redacts the key)."""

    return {"url": redact_url(url), "url_secret": crypto.encrypt(url)}


def real_url(params: dict) -> str:
    """The URL to fetch: decrypted from `url_secret`; older jobs kept it in plain `url`."""

    token = params.get("url_secret")
    return crypto.decrypt(token) if token else params.get("url", "")


# --------------------------------------------------------------------------------------------------
# Model folders


def model_dirs() -> list[str]:
    return [os.path.realpath(d) for d in settings.RAMDECK_MODEL_DIRS]


def under_model_dirs(path: str) -> bool:
    """True when `path`, symlinks resolved (the part that exists), lies inside a model folder."""
    real = os.path.realpath(path)
    return any(real == d or real.startswith(d.rstrip(os.sep) + os.sep) for d in model_dirs())


def model_dirs_text() -> str:
    return ", ".join(settings.RAMDECK_MODEL_DIRS)


def local_dest_refusal(dest: str) -> str:
    """Why `dest` (absolute, normalised) may not receive a download on the console's own host, or ""."""
    if not dest.startswith("/") or posixpath.normpath(dest) != dest:
        return "Give an absolute path without . or .. parts."
    if not under_model_dirs(dest) or os.path.realpath(dest) in model_dirs():
        return f"On the console's own host a download goes into its model folder: {model_dirs_text()}."
    return ""


# --------------------------------------------------------------------------------------------------
# Targets


class TargetRefused(Exception):
    """A download target (or a redirect's) that the console's own host may not fetch from."""


def _allowed_networks() -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    networks = []
    for item in settings.RAMDECK_DOWNLOAD_ALLOW_NETWORKS:
        try:
            networks.append(ipaddress.ip_network(item, strict=False))
        except ValueError:
            continue  # A typo allows nothing rather than everything.
    return networks


# IPv6 forms whose packets go to an IPv4 address they carry: the checks apply to that address. NAT64's
# well-known prefix (RFC 6052; the last 32 bits), 6to4 (2002::/16), IPv4-mapped (::ffff:a.b.c.d) and the
# deprecated IPv4-compatible form (::a.b.c.d). Python calls most of these "global" whatever they carry.
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
# RFC 8215's local-use NAT64 prefix: translated by the site's own NAT64 to an address that cannot be read
# from it (the operator picks where in the address the IPv4 part goes).
_LOCAL_NAT64 = ipaddress.ip_network("64:ff9b:1::/48")


def embedded_ipv4(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address carries (and delivers to), or None."""
    if not isinstance(ip, ipaddress.IPv6Address):
        return None
    if ip.ipv4_mapped:
        return ip.ipv4_mapped
    if ip.sixtofour:
        return ip.sixtofour
    if ip in _NAT64:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    if int(ip) >> 32 == 0 and int(ip) > 1:  # ::a.b.c.d, not :: or ::1
        return ipaddress.IPv4Address(int(ip))
    return None


def address_refusal(address: str) -> str:
    """Why the console's own host may not fetch from this IP address, or ""."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    allowed = _allowed_networks()
    if any(ip.version == network.version and ip in network for network in allowed):
        return ""
    if (carried := embedded_ipv4(ip)) is not None:
        reason = address_refusal(str(carried))
        return f"{address} carries the IPv4 address {carried}: {reason}" if reason else ""
    if ip in _LOCAL_NAT64:
        return (
            f"{address} is local-use NAT64, translated to an address the console cannot check: downloads on "
            "the console's own host fetch only from public addresses (an admin can allow a network with "
            "RAMDECK_DOWNLOAD_ALLOW_NETWORKS)."
        )
    if ip.is_global and not ip.is_multicast:
        return ""
    kinds = [
        (ip.is_loopback, "loopback"),
        (ip.is_link_local, "link-local"),
        (ip.is_unspecified, "unspecified (every interface)"),
        (ip.is_private, "private"),
    ]
    what = next((label for matches, label in kinds if matches), "not a public address")
    return (
        f"{address} is {what}: downloads on the console's own host fetch only from public addresses "
        "(an admin can allow a network with RAMDECK_DOWNLOAD_ALLOW_NETWORKS)."
    )


def host_and_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise TargetRefused(f"Only http and https URLs with a host can be fetched, not {redact_url(url)}.")
    if parts.username or parts.password:
        raise TargetRefused("A URL with a user name or password is not fetched.")
    return parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)


def checked_address(url: str) -> tuple[str, int, str]:
    """(host, port, address): the URL's host resolved, every address it has checked, the first one to use.

    Raises TargetRefused when the host does not resolve or any of its addresses is not allowed (a name that
    resolves to a public and a private address is refused: curl might pick either)."""
    host, port = host_and_port(url)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise TargetRefused(f"{host} does not resolve: {exc}") from None
    addresses = list(dict.fromkeys(info[4][0] for info in infos))
    for address in addresses:
        if reason := address_refusal(address):
            raise TargetRefused(f"{host} resolves to {reason}" if address != host else reason)
    return host, port, addresses[0]


def literal_refusal(url: str) -> str:
    """A quick check for the form (no DNS): an IP literal or `localhost` that a download may not fetch."""
    try:
        host, _ = host_and_port(url)
    except TargetRefused as exc:
        return str(exc)
    if host.lower() == "localhost" or host.lower().endswith(".localhost"):
        return address_refusal("127.0.0.1")
    try:
        return address_refusal(host)
    except ValueError:
        return ""  # A name: resolved and checked by the job, redirect by redirect.


def curl_resolve(host: str, port: int, address: str) -> str:
    """curl's --resolve entry pinning host:port to the checked address."""
    return f"{host}:{port}:{f'[{address}]' if ':' in address else address}"
