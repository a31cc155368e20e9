"""API keys and the `CurrentTenant` dependency.

A key is `sk-lq-` + 43 url-safe characters (256 random bits). The database holds only its
prefix (for listing and revoking) and HMAC-SHA256(server secret, key): a stolen database does
not yield usable keys, and a lookup by digest is compared again with `hmac.compare_digest`.
The server secret is `LORAQ_SECRET_KEY`, else a random one generated once under the data dir.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any

from fastapi import Depends, Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy import Connection, Select, bindparam, select
from sqlalchemy.orm import Session

from service.db.models import ApiKey, Tenant, now_s
from service.db.session import read_first
from service.errors import AuthenticationError, InvalidRequestError, NotFoundError
from service.ratelimit import check_rate
from service.secret_files import read_or_create
from service.settings import Settings, get_settings

KEY_PREFIX = "sk-lq-"
PREFIX_CHARS = len(KEY_PREFIX) + 8  # shown by `loraq keys list`: "sk-lq-" + 8 characters
SECRET_FILE = "secret_key"
DEFAULT_TENANT = "default"


@dataclass(frozen=True)
class AuthenticatedTenant:
    """The tenant a request's key belongs to (what `CurrentTenant` gives a route)."""

    id: str
    name: str


@dataclass(frozen=True)
class KeyInfo:
    prefix: str
    tenant: str
    created_at: int
    revoked_at: int | None


@lru_cache(maxsize=8)
def _secret_for(secret_key: str | None, data_dir: Path) -> bytes:
    if secret_key:
        return secret_key.encode()
    path = data_dir / SECRET_FILE
    secret = read_or_create(path, lambda: secrets.token_hex(32))
    if len(secret) < 32:
        raise RuntimeError(f"server secret {path} is too short: restore it from a backup")
    return secret.encode()


_secret_cache: tuple[Settings, bytes] | None = None


def server_secret() -> bytes:
    """The HMAC key, looked up once per Settings object (every request hashes its key with it)."""
    global _secret_cache
    settings = get_settings()
    if _secret_cache is None or _secret_cache[0] is not settings:
        _secret_cache = (settings, _secret_for(settings.secret_key, settings.resolved_data_dir))
    return _secret_cache[1]


def hash_key(plaintext: str) -> str:
    return hmac.new(server_secret(), plaintext.encode(), hashlib.sha256).hexdigest()


def get_or_create_tenant(session: Session, name: str) -> Tenant:
    name = name.strip()
    if not name or len(name) > 128:
        raise InvalidRequestError("tenant name must be 1-128 characters", param="tenant")
    tenant = session.scalar(select(Tenant).where(Tenant.name == name))
    if tenant is None:
        tenant = Tenant(name=name)
        session.add(tenant)
        session.flush()
    return tenant


def _store_key(session: Session, tenant: Tenant, plaintext: str) -> None:
    session.add(ApiKey(tenant_id=tenant.id, prefix=plaintext[:PREFIX_CHARS], key_hash=hash_key(plaintext)))
    session.flush()


def create_key(session: Session, tenant_name: str) -> str:
    """Create a key for `tenant_name` (creating the tenant if new); return the plaintext once."""
    tenant = get_or_create_tenant(session, tenant_name)
    plaintext = KEY_PREFIX + secrets.token_urlsafe(32)
    _store_key(session, tenant, plaintext)
    return plaintext


def ensure_bootstrap_key(
    session: Session, plaintext: str, tenant_name: str = DEFAULT_TENANT
) -> AuthenticatedTenant:
    """Make `plaintext` (from `LORAQ_API_KEY`) a key of `tenant_name` unless it already is one."""
    if len(plaintext) < 16:
        raise InvalidRequestError("LORAQ_API_KEY must be at least 16 characters", param="LORAQ_API_KEY")
    existing = session.scalar(select(ApiKey).where(ApiKey.key_hash == hash_key(plaintext)))
    if existing is not None:
        return tenant_by_id(session, existing.tenant_id)
    tenant = get_or_create_tenant(session, tenant_name)
    _store_key(session, tenant, plaintext)
    return AuthenticatedTenant(id=tenant.id, name=tenant.name)


def tenant_by_id(session: Session, tenant_id: str) -> AuthenticatedTenant:
    tenant = session.get(Tenant, tenant_id)
    if tenant is None:
        raise NotFoundError(f"no tenant {tenant_id!r}", param="tenant")
    return AuthenticatedTenant(id=tenant.id, name=tenant.name)


def revoke_key(session: Session, prefix: str) -> None:
    key = session.scalar(select(ApiKey).where(ApiKey.prefix == prefix))
    if key is None:
        raise NotFoundError(f"no API key with prefix {prefix!r}", param="prefix")
    if key.revoked_at is None:
        key.revoked_at = now_s()
    session.flush()


def list_keys(session: Session) -> list[KeyInfo]:
    rows = session.execute(
        select(ApiKey.prefix, Tenant.name, ApiKey.created_at, ApiKey.revoked_at)
        .join(Tenant, Tenant.id == ApiKey.tenant_id)
        .order_by(ApiKey.id)
    ).all()
    return [KeyInfo(prefix=p, tenant=t, created_at=c, revoked_at=r) for p, t, c, r in rows]


# Built once: the hot path of every request. Core rows, not ORM objects (a few hundred µs less).
# Labelled, and first in the row, so a route may extend the statement with outer-joined rows of
# its own (`authenticate_request`) without a name clash: `tenant_of_key_row` reads row[0:4].
KEY_QUERY = (
    select(
        ApiKey.key_hash.label("key_hash"),
        ApiKey.revoked_at.label("key_revoked_at"),
        Tenant.id.label("key_tenant_id"),
        Tenant.name.label("key_tenant_name"),
    )
    .join(Tenant, Tenant.id == ApiKey.tenant_id)
    .where(ApiKey.key_hash == bindparam("key_hash"))
)


def authenticate(session: Session, plaintext: str) -> AuthenticatedTenant:
    return authenticate_digest(session.connection(), hash_key(plaintext))


def authenticate_digest(conn: Connection, digest: str) -> AuthenticatedTenant:
    """The tenant of the key whose HMAC is `digest` (the request path hashes each key once)."""
    return tenant_of_key_row(conn.execute(KEY_QUERY, {"key_hash": digest}).first(), digest)


def tenant_of_key_row(row: Any, digest: str) -> AuthenticatedTenant:
    """The tenant of `KEY_QUERY`'s row for `digest`, or why the key is refused."""
    # compare_digest: the equality the index lookup implied, re-checked in constant time
    if row is None or not hmac.compare_digest(row[0], digest):
        raise AuthenticationError("Incorrect API key provided")
    if row[1] is not None:
        raise AuthenticationError("This API key has been revoked", code="revoked_api_key")
    return AuthenticatedTenant(id=row[2], name=row[3])


def bearer_token(request: Request) -> str:
    header = request.headers.get("authorization")
    if not header:
        raise AuthenticationError(
            "You didn't provide an API key: send 'Authorization: Bearer YOUR_KEY'", code="missing_api_key"
        )
    scheme, _, token = header.partition(" ")
    token = token.strip()
    if scheme.lower() != "bearer" or not token:
        raise AuthenticationError(
            "The Authorization header must be 'Bearer YOUR_KEY'", code="invalid_api_key"
        )
    return token


# Declares the scheme in the OpenAPI spec (the "Authorize" button of /docs; clients and
# Schemathesis see which routes need a key). Parsing stays in `bearer_token` for precise errors.
_bearer_scheme = HTTPBearer(
    auto_error=False, scheme_name="ApiKey", description="Authorization: Bearer sk-lq-..."
)
BearerScheme = Annotated[HTTPAuthorizationCredentials | None, Security(_bearer_scheme)]
"""What a route that authenticates itself (`authenticate_request`) declares, as `current_tenant`
does: the OpenAPI spec lists the key for it."""


async def authenticate_request(
    request: Request,
    stmt: Select[Any] = KEY_QUERY,
    params: dict[str, Any] | None = None,
    *,
    digest: str | None = None,
) -> tuple[AuthenticatedTenant, Any]:
    """The request's tenant and the row of `stmt`: `KEY_QUERY`, or `KEY_QUERY` with more columns
    of rows outer-joined to the key's tenant, so that a hot route reads its row in the same round
    trip as the key (`params` binds the statement's other parameters). The key is read on every
    request: a revoked key is refused at once, by every API process (an in-process cache measured
    15% more status reads/s, at the price of a revocation delay). Then the request counts against
    the key's rate limit (429), after authentication, so bad keys cannot spend it. `digest`: the
    request's key digest (`request_key_digest`), where the caller computed it already."""
    digest = digest or request_key_digest(request)
    row = await read_first(stmt, {"key_hash": digest, **params} if params else {"key_hash": digest})
    tenant = tenant_of_key_row(row, digest)
    request.state.tenant_id = tenant.id
    await check_key_rate(digest)
    return tenant, row


async def check_key_rate(digest: str) -> None:
    """Count a request against its key's rate limit (429 past it)."""
    await check_rate(digest[:24])


def request_key_digest(request: Request) -> str:
    """The HMAC of the request's bearer key (401 without one): what the database is asked for."""
    return hash_key(bearer_token(request))


async def current_tenant(request: Request, _: BearerScheme) -> AuthenticatedTenant:
    """Async, so no request pays a threadpool handoff for it (`read_first` reads the key row on
    the event loop)."""
    return (await authenticate_request(request))[0]


CurrentTenant = Annotated[AuthenticatedTenant, Depends(current_tenant)]
