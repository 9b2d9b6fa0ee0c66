"""Credentials never reach a report, an error line or a log: URLs are shown without their userinfo and
without the values of their query parameters (a presigned URL's ``X-Amz-Signature``, a ``token=``), and
the values of the credential variables of the usual chains are blanked wherever they would appear.

Pure string work, no imports beyond the standard library: the ground floor, below ``errors`` and ``inventory``.
"""

from __future__ import annotations

import os
import re

MASK = "REDACTED"
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"<>()\[\]{}]*")
# Query parameters whose values name a version, not a secret: shown as they are. Everything else is masked,
# since signed URLs carry their secrets under many names (X-Amz-Signature, X-Amz-Credential, sig, token, ...).
_HARMLESS = frozenset({"versionid", "revision", "generation", "alt", "download", "ref", "raw"})
# Variables the credential chains read (botocore, google-auth, Azure, huggingface_hub, fsspec's own config).
_SECRET_VARS = (
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_ACCESS_KEY_ID",
    "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN",
    "HUGGINGFACE_TOKEN",
    "AZURE_STORAGE_KEY",
    "AZURE_STORAGE_ACCOUNT_KEY",
    "AZURE_STORAGE_SAS_TOKEN",
    "AZURE_CLIENT_SECRET",
    "GOOGLE_OAUTH_ACCESS_TOKEN",
)
_MIN_SECRET = 8
"""Shorter values are not searched for: blanking every ``1`` in a message would say nothing."""


def redact_url(url: str) -> str:
    """``url`` without userinfo, and with every query value but a version's masked (and those noted: ``remember``)."""
    remember(url)
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    cut = len(rest)
    for ch in "/?#":
        i = rest.find(ch)
        if 0 <= i < cut:
            cut = i
    authority, tail = rest[:cut], rest[cut:]
    if "@" in authority:
        authority = f"{MASK}@{authority.rsplit('@', 1)[1]}"
    path, qmark, query = tail.partition("?")
    if qmark:
        query, hash_, fragment = query.partition("#")
        params = []
        for part in re.split(r"([&;])", query):
            if part in ("&", ";") or "=" not in part:
                params.append(part if part in ("&", ";") or not part else MASK)
                continue
            key, _, value = part.partition("=")
            params.append(f"{key}={value if key.lower() in _HARMLESS else MASK}")
        tail = f"{path}?{''.join(params)}" + (f"#{MASK}" if hash_ else "")
    else:
        path, hash_, _ = path.partition("#")
        tail = path + (f"#{MASK}" if hash_ else "")
    return f"{scheme}://{authority}{tail}"


_GIVEN: set[str] = set()
"""Credentials read from the URLs this process was given: a backend quotes them outside any URL too (botocore
names the bucket of ``s3://KEY:SECRET@bucket`` as ``KEY:SECRET@bucket`` in its error), so they are masked as
values, like the environment's."""
_MIN_GIVEN = 4


def remember(url: str) -> None:
    """Note the userinfo and query values of ``url``, so that ``redact`` masks them wherever they appear."""
    from urllib.parse import unquote

    _scheme, sep, rest = url.partition("://")
    if not sep:
        return
    authority = re.split(r"[/?#]", rest, maxsplit=1)[0]
    parts = authority.rsplit("@", 1)[0].split(":", 1) if "@" in authority else []
    query = rest.partition("?")[2].partition("#")[0]
    for part in re.split(r"[&;]", query):
        key, eq, value = part.partition("=")
        if eq and key.lower() not in _HARMLESS:
            parts.append(value)
    for value in parts:
        for form in (value, unquote(value)):
            if len(form) >= _MIN_GIVEN:
                _GIVEN.add(form)


def _redact_match(m: re.Match[str]) -> str:
    url = m.group(0)
    core = url.rstrip(".,;:!?")  # the sentence's punctuation, not the URL's
    return redact_url(core) + url[len(core) :]


def _secrets() -> list[str]:
    values = [os.environ.get(name, "") for name in _SECRET_VARS]
    return sorted({v for v in values if len(v) >= _MIN_SECRET} | _GIVEN, key=len, reverse=True)


def redact(text: str) -> str:
    """``text`` with every URL in it redacted (``redact_url``), and every credential value of the environment and of
    the URLs seen so far masked."""
    if "://" in text:
        text = _URL.sub(_redact_match, text)
    for secret in _secrets():
        if secret in text:
            text = text.replace(secret, MASK)
    return text
