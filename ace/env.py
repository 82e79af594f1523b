"""Read settings from the environment; a bad value stops start-up naming the variable."""

from __future__ import annotations

import ipaddress
import os
import re
from datetime import timedelta
from pathlib import Path
from urllib.parse import urlparse


class ConfigError(RuntimeError):
    """Raised at start-up when an environment variable holds a bad value."""


def env_str(name: str, default: str) -> str:
    return os.environ.get(name, default)


def env_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name}={raw!r} is not a boolean (use true/false, 1/0, yes/no, on/off)")


def env_int(name: str, default: int, *, minimum: int | None = None) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError as exc:
        raise ConfigError(f"{name}={raw!r} is not an integer") from exc
    if minimum is not None and value < minimum:
        raise ConfigError(f"{name}={raw!r} must be >= {minimum}")
    return value


def env_float(name: str, default: float, *, minimum: float | None = None) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError as exc:
        raise ConfigError(f"{name}={raw!r} is not a number") from exc
    if minimum is not None and value < minimum:
        raise ConfigError(f"{name}={raw!r} must be >= {minimum}")
    return value


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhd])\s*$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def env_duration(name: str, default: str, *, minimum: timedelta | None = None) -> timedelta:
    """A duration written as a number and a unit: s, m, h or d (`90m`, `36h`, `7d`)."""
    raw = os.environ.get(name) or default
    match = _DURATION.match(raw)
    if match is None:
        raise ConfigError(f"{name}={raw!r} is not a duration (a number and a unit: 90m, 36h, 7d)")
    value = timedelta(seconds=float(match.group(1)) * _UNIT_S[match.group(2)])
    if minimum is not None and value < minimum:
        raise ConfigError(f"{name}={raw!r} must be at least {minimum}")
    return value


def env_choice(name: str, default: str, *, pattern: str, what: str) -> str:
    """A value matching ``pattern`` (a regular expression, in full); ``what`` names the values it allows."""
    raw = (os.environ.get(name) or default).strip()
    if not re.fullmatch(pattern, raw):
        raise ConfigError(f"{name}={raw!r} is not {what}")
    return raw


def env_url(name: str, default: str, *, schemes: tuple[str, ...]) -> str:
    raw = os.environ.get(name) or default
    parsed = urlparse(raw)
    if parsed.scheme not in schemes:
        raise ConfigError(f"{name}={_redact(raw)!r} must use one of the schemes {', '.join(schemes)}")
    return raw


def env_networks(name: str, default: str) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    raw = os.environ.get(name) or default
    networks = []
    for part in raw.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            networks.append(ipaddress.ip_network(part, strict=False))
        except ValueError as exc:
            raise ConfigError(f"{name}: {part!r} is not a network in CIDR form (e.g. 10.0.0.0/8)") from exc
    if not networks:
        raise ConfigError(f"{name} lists no network")
    return networks


def env_paths(name: str, default: str) -> list[Path]:
    """A list of absolute directories separated by ':' (like PATH); each kept as given, made canonical."""
    raw = os.environ.get(name) or default
    paths = []
    for part in raw.split(os.pathsep):
        part = part.strip()
        if not part:
            continue
        path = Path(part).expanduser()
        if not path.is_absolute():
            raise ConfigError(f"{name}: {part!r} is not an absolute path")
        paths.append(Path(os.path.realpath(path)))
    if not paths:
        raise ConfigError(f"{name} lists no directory")
    return paths


def _redact(url: str) -> str:
    parsed = urlparse(url)
    if parsed.password:
        return url.replace(parsed.password, "***")
    return url
