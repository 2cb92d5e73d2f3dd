"""Validation of node addresses: a hostname (RFC 1123) or an IPv4/IPv6 address."""

from __future__ import annotations

import ipaddress
import re

from django.core.exceptions import ValidationError

_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")


def is_valid_host(value: str) -> bool:
    value = value.strip()
    if not value:
        return False
    try:
        ipaddress.ip_address(value.strip("[]"))
        return True
    except ValueError:
        pass
    if len(value) > 253 or value.endswith(".") and len(value) == 1:
        return False
    labels = value.rstrip(".").split(".")
    # A dotted name whose last label is all digits is a malformed IPv4 address, not a hostname.
    if len(labels) > 1 and labels[-1].isdigit():
        return False
    return all(_LABEL.match(label) for label in labels)


def validate_host(value: str) -> None:
    if not is_valid_host(value):
        raise ValidationError(
            "%(value)s is not a valid hostname or IP address.", code="invalid_host", params={"value": value}
        )


def validate_cache_folder(value: str) -> None:
    """A node's llama.cpp cache folder: empty, or an absolute path without control characters, POSIX or on
    a Windows drive (the form checks it against the node's platform where it knows it)."""
    from llamacpp.rpc_cache import CacheError, check_any_folder

    try:
        check_any_folder(value)
    except CacheError as exc:
        raise ValidationError(str(exc)) from exc
