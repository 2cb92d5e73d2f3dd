"""Encryption of secrets at rest (credentials, API keys) with MultiFernet.

Keys come from settings.RAMDECK_ENCRYPTION_KEYS, newest first: new values are encrypted with the first key,
and any listed key decrypts. `manage.py rotate_encryption_key` re-encrypts every stored value with the
first key so an old key can then be dropped from the list.
"""

from __future__ import annotations

from functools import cache

from cryptography.fernet import Fernet, InvalidToken, MultiFernet
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured


class SecretUnreadable(Exception):
    """A stored secret cannot be decrypted with any configured key."""


@cache
def _fernet_for(keys: tuple[str, ...]) -> MultiFernet:
    if not keys:
        raise ImproperlyConfigured("RAMDECK_ENCRYPTION_KEYS is empty.")
    try:
        return MultiFernet([Fernet(key.encode()) for key in keys])
    except ValueError as exc:
        raise ImproperlyConfigured(
            "RAMDECK_ENCRYPTION_KEYS must hold Fernet keys (32 url-safe base64 bytes each)."
        ) from exc


def _fernet() -> MultiFernet:
    return _fernet_for(tuple(settings.RAMDECK_ENCRYPTION_KEYS))


def encrypt(plaintext: str) -> str:
    if plaintext == "":
        return ""
    return _fernet().encrypt(plaintext.encode()).decode()


def decrypt(token: str) -> str:
    if token == "":
        return ""
    try:
        return _fernet().decrypt(token.encode()).decode()
    except InvalidToken as exc:
        raise SecretUnreadable("A stored secret cannot be decrypted with the configured keys.") from exc


def rotate(token: str) -> str:
    """Re-encrypt a token with the newest key (no-op for empty values)."""
    if token == "":
        return ""
    return _fernet().rotate(token.encode()).decode()


def generate_key() -> str:
    return Fernet.generate_key().decode()
