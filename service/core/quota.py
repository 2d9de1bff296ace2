"""Per-tenant quotas: a token bucket of trunk images for each tenant with a rate.

A tenant's bucket holds at most `burst` tokens and fills at `rate` tokens per second; a request
of n images needs the bucket to hold min(n, burst) tokens and then takes n (a request larger
than the burst empties a full bucket and leaves a debt that the rate pays back, so every request
can pass, and the long-run rate is `rate` whatever the request sizes). A request the bucket
does not hold is refused with `RateLimited` (429) and a Retry-After of the time until it will:
nothing is taken, so a client that waits that long (and is the tenant's only client) is then
accepted.

What costs tokens: an image's decoding, `backbone.preprocess.decode_cost` (1 for an image up
to 640 x 480 RGB 8-bit, its decoded bytes / 640 x 480 x 3 beyond), or its encoded bytes /
640 x 480 x 3 when they are more (`service.core.decoding.cost_of`; `n` may be fractional). The
engine takes its cache misses' costs once a request's images are digested and their headers
read, before any is decoded (a feature-cache hit costs nothing; one image scored by several
bots costs once), and gives them back (`refund`) if the request is refused before
any image is decoded; a decoded image stays charged even when the request then fails (a bad
image after it: the decodes not started yet are cancelled and given back).

    quotas = Quotas(lambda tenant: (rate, burst), clock=time.monotonic)
    quotas.take("acme", 8)        # the request's cache misses, before decoding: or RateLimited
    quotas.refund("acme", 8)      # it was refused by the queue: nothing ran

A tenant without a rate has no bucket (unlimited). Limits are read on every call, so a change
(`multihead tenants set`) applies at the next request: the tokens are kept, capped at the new
burst.

Several processes: a tenant's quota is the whole service's, so with N processes sharing the
traffic each enforces rate / N and burst / N (rounded up, at least 1: `divisor`). Under Ray N is
the replica count (`Settings.quota_divisor`); otherwise it is the processes serving the same
store, counted by their leases (`store.leases`: `HeadStore.processes.count`, from memory,
renewed every 2 s), so that N `multihead serve` processes on one store directory or PostgreSQL
database hold a tenant to its quota, not to N times it. The divisor is read at every call: when
it changes, each bucket follows at its next call (its tokens capped at the new burst). What it
implies: a tenant whose traffic reaches only one of N processes gets rate / N (as under Ray):
put a load balancer that spreads every tenant's requests in front of them. A process that died
is counted until its lease expires (10 s): the others' shares are then smaller, never larger.

Before a request's body is read, `claim` refuses it when the bucket cannot hold what its head
says it will cost at least (one image; a native upload's declared length / 640 x 480 x 3:
`service.codecs.pipeline.head_images`) beside the tenant's requests already past that door and
not yet charged (their claims' sizes): without counting them, every one of many concurrent
requests would pass while the bucket held one token, each would have its body read, and all but
the first would then be refused anyway (a tenant's 30 clients sending 10 MB bodies made the
server read gigabytes a second that way); without the size, a 10 MB body (11 images' worth)
passed a bucket holding one token, was read whole, and then refused. A claim ends when its
request is charged (`take`, in the same task or one it started) or ends.

    with quotas.claim("acme", 1): # the request's head: or RateLimited
        ...                       # its body read, its images digested
        quotas.take("acme", 8)    # charged: the claim ends here

Memory: one small bucket per tenant with a rate that called recently; a bucket
that has refilled to its burst is dropped (a new one is the same); the open claims' count and
sizes per tenant that has any.
"""
from __future__ import annotations

import contextlib
import contextvars
import math
import threading
import time
from collections.abc import Callable, Iterator

from service.core.errors import RateLimited

# (rate in images per second or None for unlimited, burst in images or None for the default)
Limits = Callable[[str], tuple[float | None, int | None]]

_PRUNE_EVERY = 256  # calls between sweeps of full buckets


class _Claim:
    """One request's claim (`Quotas.claim`), open until it is charged or ends."""
    __slots__ = ("quotas", "tenant", "n", "open")

    def __init__(self, quotas: Quotas, tenant: str, n: float) -> None:
        self.quotas, self.tenant, self.n, self.open = quotas, tenant, n, True


# The claim of the request running in this context (its task, and the tasks it started).
_CLAIM: contextvars.ContextVar[_Claim | None] = contextvars.ContextVar("quota_claim",
                                                                       default=None)


# What a refusal raises: refuse(tenant, seconds until the bucket holds the request, the rate
# this process enforces) -> the error (RateLimited or a subclass).
Refuse = Callable[[str, float, float], RateLimited]


def _over_quota(tenant: str, wait: float, rate: float) -> RateLimited:
    return RateLimited(wait, f"tenant '{tenant}' is over its quota of {rate:g} images/s; "
                             f"retry after {wait:.2f} s")


def default_burst(rate: float) -> int:
    """The burst of a rate without one: one second of it, at least one image."""
    return max(1, math.ceil(rate))


class _Bucket:
    __slots__ = ("tokens", "stamp")

    def __init__(self, tokens: float, stamp: float) -> None:
        self.tokens = tokens
        self.stamp = stamp


class Quotas:
    """Token buckets by tenant. Thread-safe.

    Args:
        limits: `limits(tenant) -> (rate, burst)`: images per second (None: unlimited) and
            bucket size (None: `default_burst(rate)`), as configured for the whole service.
        divisor: processes sharing one tenant's traffic, or a function returning it (read at
            every call: cheap, from memory; below 1 counts as 1); each enforces rate / divisor
            and burst / divisor (rounded up, at least 1).
        clock: monotonic seconds (tests pass a fake one).
        refuse: the error a refusal raises (default: RateLimited, "over its quota").
    """

    def __init__(self, limits: Limits, *, divisor: int | Callable[[], int] = 1,
                 clock: Callable[[], float] = time.monotonic,
                 refuse: Refuse | None = None) -> None:
        if not callable(divisor) and (not isinstance(divisor, int) or divisor < 1):
            raise ValueError(f"divisor must be an int >= 1, got {divisor!r}")
        self._limits = limits
        self._divisor = divisor if callable(divisor) else (lambda: divisor)
        self._clock = clock
        self._refuse = refuse or _over_quota
        self._buckets: dict[str, _Bucket] = {}
        # The open claims' sizes summed by tenant (only those with any), and their number.
        self._claims: dict[str, float] = {}
        self._claim_count: dict[str, int] = {}
        self._lock = threading.Lock()
        self._calls = 0

    def limits_of(self, tenant: str) -> tuple[float, int] | None:
        """The (rate, burst) this process enforces for `tenant`, or None (unlimited)."""
        rate, burst = self._limits(tenant)
        if rate is None:
            return None
        if burst is None:
            burst = default_burst(rate)
        divisor = max(1, self._divisor())
        return rate / divisor, max(1, math.ceil(burst / divisor))

    def _bucket(self, tenant: str, rate: float, burst: int, now: float) -> _Bucket:
        bucket = self._buckets.get(tenant)
        if bucket is None:
            bucket = self._buckets[tenant] = _Bucket(float(burst), now)
        else:
            elapsed = max(0.0, now - bucket.stamp)
            bucket.tokens = min(float(burst), bucket.tokens + elapsed * rate)
            bucket.stamp = now
        return bucket

    def take(self, tenant: str, n: float) -> None:
        """Takes `n` tokens if the bucket holds min(n, burst) now, else raises RateLimited
        (taking nothing). Ends this context's claim of `tenant`, if any, either way."""
        claim = _CLAIM.get()
        if claim is not None and claim.quotas is self and claim.tenant == tenant:
            self._end(claim)
        self._take(tenant, n, n)

    def check(self, tenant: str, n: float = 1.0) -> None:
        """Raises what `take(tenant, n)` would raise now, taking nothing."""
        self._take(tenant, n, 0.0)

    @contextlib.contextmanager
    def claim(self, tenant: str, n: float = 1.0) -> Iterator[None]:
        """A request's claim from its head until it is charged (`take` in this context) or
        the block ends: raises what `take(tenant, n)` would raise if the tenant's open claims
        had taken their sizes, taking nothing; else counts this one, of size `n` (at least 1:
        what the request will cost at least), among them."""
        if self.limits_of(tenant) is None:
            yield
            return
        n = max(1.0, float(n))
        self._take(tenant, n, 0.0, claim=True)  # counted among the open claims if it passes
        claim = _Claim(self, tenant, n)
        token = _CLAIM.set(claim)
        try:
            yield
        finally:
            _CLAIM.reset(token)
            self._end(claim)

    def claimed(self, tenant: str) -> int:
        """The tenant's open claims."""
        with self._lock:
            return self._claim_count.get(tenant, 0)

    def _end(self, claim: _Claim) -> None:
        with self._lock:
            if not claim.open:
                return
            claim.open = False
            left = self._claim_count.get(claim.tenant, 0) - 1
            if left > 0:
                self._claim_count[claim.tenant] = left
                self._claims[claim.tenant] = max(0.0, self._claims[claim.tenant] - claim.n)
            else:
                self._claim_count.pop(claim.tenant, None)
                self._claims.pop(claim.tenant, None)

    def _take(self, tenant: str, n: float, taken: float, claim: bool = False) -> None:
        limits = self.limits_of(tenant)
        if limits is None:
            return
        rate, burst = limits
        with self._lock:
            now = self._clock()
            bucket = self._bucket(tenant, rate, burst, now)
            pending = self._claims.get(tenant, 0.0) if claim else 0.0
            need = min(n, burst) + min(pending, burst)
            if bucket.tokens < need:
                raise self._refuse(tenant, (need - bucket.tokens) / rate, rate)
            bucket.tokens -= taken
            if claim:  # checked and counted under one lock: no two claims pass on one token
                self._claims[tenant] = pending + n
                self._claim_count[tenant] = self._claim_count.get(tenant, 0) + 1
            self._calls += 1
            if self._calls % _PRUNE_EVERY == 0:
                self._prune(now)

    def refund(self, tenant: str, n: int) -> None:
        """Gives back `n` tokens taken for images that did not need the trunk (capped at the
        burst)."""
        if n <= 0:
            return
        limits = self.limits_of(tenant)
        if limits is None:
            return
        rate, burst = limits
        with self._lock:
            bucket = self._bucket(tenant, rate, burst, self._clock())
            bucket.tokens = min(float(burst), bucket.tokens + n)

    def tokens(self, tenant: str) -> float | None:
        """The tokens `tenant` holds now (None: unlimited)."""
        limits = self.limits_of(tenant)
        if limits is None:
            return None
        rate, burst = limits
        with self._lock:
            return self._bucket(tenant, rate, burst, self._clock()).tokens

    def _prune(self, now: float) -> None:
        """Drops the buckets that have refilled to their burst (held: the lock)."""
        for tenant in list(self._buckets):
            limits = self.limits_of(tenant)
            bucket = self._buckets[tenant]
            if limits is None:
                del self._buckets[tenant]
                continue
            rate, burst = limits
            if bucket.tokens + max(0.0, now - bucket.stamp) * rate >= burst:
                del self._buckets[tenant]

    def __len__(self) -> int:
        return len(self._buckets)
