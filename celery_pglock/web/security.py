"""Who may act on the dashboard, and the guards of every action: credentials (basic auth
or a bearer token, compared in constant time), a CSRF token (an HMAC of the identity and
an expiry, so a form works for ``CSRF_TTL`` and only for whom it was made), the Origin
check, and the headers of every response (the Content-Security-Policy first)."""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

CSRF_TTL = 3600.0  # seconds a form's token is good for
CSP = (
    "default-src 'none'; style-src 'self'; img-src 'self' data:; form-action 'self'; "
    "frame-ancestors 'none'; base-uri 'none'"
)
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}


@dataclass(frozen=True)
class Identity:
    """Who asks: ``name`` (audited as ``web:<name>``), and what they may do;
    ``wrong_credentials``: anonymous because the credentials sent proved nothing (a
    refusal says so, rather than asking for credentials)."""

    name: str | None
    can_read: bool = True
    can_act: bool = False
    wrong_credentials: bool = False

    @property
    def actor(self) -> str:
        return f"web:{self.name}"


ANONYMOUS = Identity(None)
WRONG_CREDENTIALS = Identity(None, wrong_credentials=True)


class Credentials:
    """The standalone dashboard's credentials (``config.web_credentials``): a basic-auth
    user and password, a bearer token, or none at all (then nobody acts)."""

    def __init__(self, found: Mapping[str, str]) -> None:
        self._user = found.get("user")
        self._password = found.get("password")
        self._token = found.get("token")

    @property
    def configured(self) -> bool:
        return bool(self._token or (self._user and self._password))

    def identify(self, authorization: str | None) -> Identity:
        """The identity an ``Authorization`` header proves: anonymous when none was sent or
        none is configured, ``WRONG_CREDENTIALS`` when one was sent and proved nothing."""
        if not authorization or not self.configured:
            return ANONYMOUS
        scheme, _, value = authorization.partition(" ")
        if scheme.lower() == "bearer" and self._token and _same(value.strip(), self._token):
            return Identity("token", can_act=True)
        if scheme.lower() == "basic" and self._user and self._password:
            user, password = _basic(value.strip())
            if _same(user, self._user) & _same(password, self._password):
                return Identity(self._user, can_act=True)
        return WRONG_CREDENTIALS


def _same(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode(), expected.encode())


def _basic(value: str) -> tuple[str, str]:
    try:
        decoded = base64.b64decode(value, validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        return "", ""
    user, _, password = decoded.partition(":")
    return user, password


class Csrf:
    """Tokens for forms: ``<expiry>.<hmac(identity, expiry)>`` under a key of the process
    (or the one given: several processes behind one address need the same); and the seals
    of the notices a confirmed action's redirect carries (``seal``), under a key derived
    from it, so neither can pass for the other."""

    def __init__(self, key: bytes | None = None, ttl: float = CSRF_TTL) -> None:
        self._key = key or os.urandom(32)
        self._ttl = ttl
        self._notice_key = hmac.new(self._key, b"celery-pglock notice", hashlib.sha256).digest()

    def token(self, identity: Identity, now: float | None = None) -> str:
        expires = int((now or time.time()) + self._ttl)
        return f"{expires}.{self._sign(identity, expires)}"

    def check(self, identity: Identity, token: str | None, now: float | None = None) -> bool:
        expires_text, _, signature = (token or "").partition(".")
        if not expires_text.isdigit() or int(expires_text) < (now or time.time()):
            return False
        return _same(signature, self._sign(identity, int(expires_text)))

    def seal(self, notice: str) -> str:
        """The signature that shows ``notice`` was written by this dashboard."""
        return hmac.new(self._notice_key, notice.encode(), hashlib.sha256).hexdigest()

    def sealed(self, notice: str | None, signature: str | None) -> str | None:
        """``notice`` if ``signature`` is its seal, else None."""
        if not notice or not signature:
            return None
        return notice if _same(signature, self.seal(notice)) else None

    def _sign(self, identity: Identity, expires: int) -> str:
        message = f"{identity.name or ''}|{expires}".encode()
        return hmac.new(self._key, message, hashlib.sha256).hexdigest()


def same_origin(origin: str | None, referer: str | None, host_url: str) -> bool:
    """Whether a POST comes from a page of ours: its ``Origin`` (else its ``Referer``) has
    our scheme, host and port. Neither header: refused (every browser sends one)."""
    ours = urlsplit(host_url)
    claimed = origin if origin and origin != "null" else referer
    if not claimed:
        return False
    theirs = urlsplit(claimed)
    return (theirs.scheme, theirs.netloc) == (ours.scheme, ours.netloc)
