"""API keys: when the settings list any, every ``/v1`` route needs one.

A key is sent as ``Authorization: Bearer KEY`` or ``X-API-Key: KEY``. The caller's *owner* is a
digest of the key (never the key itself, which is not stored); graphs and jobs belong to an
owner and are invisible to the others. Without configured keys everyone is owner ``""``.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer

from remat.api.errors import ApiError
from remat.api.settings import Settings, get_settings

_bearer = HTTPBearer(auto_error=False, description="Authorization: Bearer API_KEY")
_header = APIKeyHeader(name="X-API-Key", auto_error=False, description="X-API-Key: API_KEY")


def owner_of(key: str) -> str:
    """The owner id of an API key."""
    return hashlib.sha256(key.encode()).hexdigest()[:24]


def get_owner(
    request: Request,
    settings: Annotated[Settings, Depends(get_settings)],
    bearer: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
    header: Annotated[str | None, Depends(_header)],
) -> str:
    """The owner making the request (a FastAPI dependency); 401 without a valid key.

    Every credential sent must be valid: an ``Authorization`` header that is not a valid
    ``Bearer`` key is refused even beside a valid ``X-API-Key`` (and two different keys are).
    """
    if not settings.api_keys:
        return ""
    challenge = {"WWW-Authenticate": "Bearer"}
    sent: list[str] = []
    if "authorization" in request.headers:
        if bearer is None:
            raise ApiError(401, "invalid Authorization header: expected 'Bearer KEY'", challenge)
        sent.append(bearer.credentials)
    if header is not None:
        sent.append(header)
    if not sent or not all(sent):
        raise ApiError(
            401,
            "an API key is required: send 'Authorization: Bearer KEY' or 'X-API-Key: KEY'",
            challenge,
        )
    owners = {_match(settings.api_keys, key) for key in sent}
    if None in owners or len(owners) != 1:
        raise ApiError(401, "invalid API key", challenge)
    owner = owners.pop()
    assert owner is not None
    return owner


def _match(keys: tuple[str, ...], given: str) -> str | None:
    for key in keys:
        if hmac.compare_digest(given.encode(), key.encode()):
            return owner_of(key)
    return None


Owner = Annotated[str, Depends(get_owner)]
