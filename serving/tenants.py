"""Tenants of `dlo serve`: who a request comes from, what it may see, and what it may hold.

Owns: `Tenants` (the keys' digests and their names, the admin names, the per-tenant queue quota;
built once at start by `tenants_from`), `Caller` (who one request comes from: its tenant's name,
whether it sees every tenant's video jobs, and whom the quotas count it against) and `HeldRequests`
(each tenant's requests the server holds, queued or in a running wave, against `--max-queue-per-tenant`).
- Named keys (`--api-keys`): each key is a tenant named by its name; a request is its key's tenant;
  `--admin-key NAME` tenants see, fetch and delete every tenant's video jobs (and jobs recorded
  without an owner); the others only their own. The quotas (queue, video jobs) count per tenant:
  behind a gateway every client has one address.
- One key (`--api-key-file`, `DLO_API_KEY`): one tenant named `default` that sees every job; the
  quotas count per client address, as before tenants.
- No key: no tenant; every caller sees every job; the quotas count per client address.
A presented key is compared as a SHA-256 digest against every tenant's digest with
`hmac.compare_digest`, all of them every time: the time says nothing about the key or which
tenant's it is.
Must never: keep or log a key (only its digest is held), name a tenant that is not in the keys (the
name is a metric label: its values are the file's names), or decide a visibility anywhere but
`Caller.sees`.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import math
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Mapping

from dlo.serving.api_keys import DEFAULT_TENANT, ApiKeyError, read_api_key, read_api_keys
from dlo.serving.errors import TenantQueueFull

if TYPE_CHECKING:  # pragma: no cover
    from dlo.serving.config import ApiConfig


def digest(key: bytes) -> bytes:
    """Keys are compared as digests: equal length, so the comparison time says nothing about the key."""
    return hashlib.sha256(key).digest()


@dataclass(frozen=True)
class Caller:
    """Who one request comes from. `tenant`: its key's name (None: the server has no key);
    `admin`: it sees every tenant's jobs; `holder`: whom the quotas count it against (the tenant,
    or the client's address)."""

    tenant: str | None = None
    admin: bool = True
    holder: str | None = None

    def sees(self, owner: str | None) -> bool:
        """Whether a job of tenant `owner` (None: recorded without one) is this caller's to see."""
        return self.admin or (owner is not None and owner == self.tenant)


EVERYONE = Caller()  # a server without keys, and the server's own reads


class Tenants:
    """`Tenants({"alice": KEY, ...}, admins=("ops",))`; `identify(key)` -> the name or None."""

    def __init__(self, keys: Mapping[str, str] | None = None, *, admins: Iterable[str] = (),
                 per_tenant_quotas: bool = True, max_queue: int | None = None):
        self._digests = tuple((digest(key.encode()), name) for name, key in (keys or {}).items())
        self.names = tuple(name for _, name in self._digests)
        self.admins = frozenset(admins)
        unknown = sorted(self.admins - set(self.names))
        if unknown:
            raise ApiKeyError(f"--admin-key {unknown[0]}: no key of that name (the keys: {', '.join(self.names)})")
        self.per_tenant_quotas = per_tenant_quotas and bool(self._digests)
        self.max_queue = max_queue

    @classmethod
    def single(cls, key: str, max_queue: int | None = None) -> "Tenants":
        """One key: the tenant `default`, who sees every job; quotas per client address."""
        return cls({DEFAULT_TENANT: key}, admins=(DEFAULT_TENANT,), per_tenant_quotas=False, max_queue=max_queue)

    @property
    def required(self) -> bool:
        """Whether requests to the API must carry a key."""
        return bool(self._digests)

    def identify(self, presented: bytes) -> str | None:
        """The name of the tenant whose key this is (None: nobody's), in time independent of both."""
        given, found = digest(presented), None
        for expected, name in self._digests:
            if hmac.compare_digest(given, expected):
                found = name  # no early exit: every digest is compared every time
        return found

    def caller(self, tenant: str | None, address: str | None) -> Caller:
        """The `Caller` of a request from `address` that presented `tenant`'s key (None: no keys)."""
        if not self.required:
            return Caller(None, True, address)
        assert tenant is not None
        return Caller(tenant, tenant in self.admins, tenant if self.per_tenant_quotas else address)

    def describe(self) -> str:
        """For the start log: names and roles, never a key."""
        if not self.required:
            return "api keys: none (every client sees every video job)"
        admins = ",".join(sorted(self.admins)) or "-"
        quotas = "per tenant" if self.per_tenant_quotas else "per client address"
        cap = self.max_queue if self.max_queue is not None else "-"
        return (f"api keys: tenants={','.join(self.names)} admins={admins} quotas={quotas} "
                f"max_queue_per_tenant={cap}")


def tenants_from(api: "ApiConfig", environ: Mapping[str, str]) -> Tenants:
    """The tenants `dlo serve`'s flags name (`ApiKeyError`: one line). Named keys and a single key
    are two sources of the same thing: both at once are refused."""
    if api.api_keys is not None:
        if api.api_key_file is not None or environ.get("DLO_API_KEY"):
            raise ApiKeyError(f"--api-keys {api.api_keys} and {'--api-key-file' if api.api_key_file else 'DLO_API_KEY'}"
                              " both give keys; give the one key a name in --api-keys instead")
        return Tenants(read_api_keys(api.api_keys), admins=api.admin_keys, max_queue=api.max_queue_per_tenant)
    if api.admin_keys:
        raise ApiKeyError(f"--admin-key {api.admin_keys[0]} names a key of --api-keys, which is not given")
    key = read_api_key(api.api_key_file, environ)
    if key is None:
        return Tenants(max_queue=api.max_queue_per_tenant)
    return Tenants.single(key, api.max_queue_per_tenant)


class HeldRequests:
    """Each holder's requests the server holds (queued, or in a running wave) against the tenant
    queue quota; a request is released when its result, error or withdrawal settles its future."""

    def __init__(self, cap: int | None, wave_seconds: Callable[[], float] = lambda: 1.0):
        self.cap, self.wave_seconds = cap, wave_seconds
        self._held: Counter[str] = Counter()

    def held(self, holder: str | None) -> int:
        return self._held[holder] if holder is not None else 0

    def submit(self, caller: Caller, submit: Callable[[], asyncio.Future]) -> asyncio.Future:
        """`submit()` unless the caller's holder is at its quota (`TenantQueueFull`, with a hint of
        its own waves' time)."""
        holder = caller.holder
        if holder is not None and self.cap is not None and self._held[holder] >= self.cap:
            wait = max(1, math.ceil(self.wave_seconds()))
            raise TenantQueueFull(f"this {'tenant' if caller.tenant == holder else 'client'} has {self._held[holder]} "
                                  f"requests waiting or running (--max-queue-per-tenant {self.cap}); retry once "
                                  "one finishes", retry_after_s=wait)
        fut = submit()
        if holder is not None:
            self._held[holder] += 1
            fut.add_done_callback(lambda _f: self._release(holder))
        return fut

    def _release(self, holder: str) -> None:
        self._held[holder] -= 1
        if self._held[holder] <= 0:
            del self._held[holder]
