"""API keys: when the settings list any, every ``/v1`` route needs one.

A key is sent as ``Authorization: Bearer KEY`` or ``X-API-Key: KEY``. The caller's *owner* is a
digest of the key (never the key itself, which is not stored); graphs and jobs belong to an
owner and are invisible to the others. Without configured keys everyone is owner ``""``.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Annotated

from fastapi import Depends
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer

from remat.api.errors import ApiError
from remat.api.settings import Settings, get_settings

_bearer = HTTPBearer(auto_error=False, description="Authorization: Bearer API_KEY")
_header = APIKeyHeader(name="X-API-Key", auto_error=False, description="X-API-Key: API_KEY")


def owner_of(key: str) -> str:
    """The owner id of an API key."""
    return hashlib.sha256(key.encode()).hexdigest()[:24]


def get_owner(
    settings: Annotated[Settings, Depends(get_settings)],
    bearer: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
    header: Annotated[str | None, Depends(_header)],
) -> str:
    """The owner making the request (a FastAPI dependency); 401 without a valid key."""
    if not settings.api_keys:
        return ""
    given = header or (bearer.credentials if bearer is not None else None)
    if not given:
        raise ApiError(
            401,
            "an API key is required: send 'Authorization: Bearer KEY' or 'X-API-Key: KEY'",
            {"WWW-Authenticate": "Bearer"},
        )
    for key in settings.api_keys:
        if hmac.compare_digest(given.encode(), key.encode()):
            return owner_of(key)
    raise ApiError(401, "invalid API key", {"WWW-Authenticate": "Bearer"})


Owner = Annotated[str, Depends(get_owner)]
