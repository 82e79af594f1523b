"""What ACE keeps secret at rest is encrypted with Fernet (settings.ENDPOINT_KEY_ENCRYPTION_KEY): endpoint API keys
(`encrypt` / `decrypt`) and captured traffic (`seal` / `unseal`, speculation.services.captures)."""

from __future__ import annotations

from cryptography.fernet import Fernet, InvalidToken
from django.conf import settings


def _fernet() -> Fernet:
    return Fernet(settings.ENDPOINT_KEY_ENCRYPTION_KEY)


def encrypt(plaintext: str) -> str:
    return _fernet().encrypt(plaintext.encode()).decode() if plaintext else ""


def decrypt(token: str) -> str:
    if not token:
        return ""
    try:
        return _fernet().decrypt(token.encode()).decode()
    except InvalidToken as exc:
        raise ValueError("endpoint API key cannot be decrypted: was ACE_ENCRYPTION_KEY changed?") from exc


def seal(data: bytes) -> str:
    """Encrypt (and authenticate) bytes: a URL-safe token."""
    return _fernet().encrypt(data).decode()


def unseal(token: str) -> bytes:
    """The bytes `seal` encrypted; ValueError when the token was altered or sealed with another key."""
    try:
        return _fernet().decrypt(token.encode())
    except InvalidToken as exc:
        raise ValueError("sealed data cannot be decrypted: altered, or was ACE_ENCRYPTION_KEY changed?") from exc


def mask(plaintext: str) -> str:
    """What the UI and API may show of a key: that one is set, and its last two characters at most."""
    if not plaintext:
        return ""
    return "•" * 8 + (plaintext[-2:] if len(plaintext) >= 12 else "")
