"""`TopN`: which keys (bot ids, tenant names) get a label of their own in the metrics: the
`n` busiest so far; every other one counts under `OTHER` (`service.core.metrics`)."""
from __future__ import annotations

OTHER = "other"


class TopN:
    """Which keys (bot ids, tenant names) deserve their own label: the `n` busiest so far.

    Counts are kept for at most `capacity` keys with the space-saving algorithm (Metwally et
    al. 2005): a new key arriving at a full table replaces the least-counted one and inherits
    its count + 1, so memory is bounded however many keys appear, and any key that is truly among
    the busiest keeps a count at least as large as its real one.

    A key outside the labelled set replaces the least busy labelled key only once its count
    exceeds that key's by a margin (10 %, at least 1), so two keys of equal traffic at the
    boundary do not swap labels on every observation.

    A key literally named "other" (`OTHER`) never gets a label: it is always counted under the
    "other" aggregate, which it would otherwise be indistinguishable from.

    Not thread-safe by itself; `Metrics` holds a lock around it.

    Args:
        n: how many keys may be labelled at once (0: none, everything is "other").
        capacity: how many keys are counted (default: 64 n, at least 1024; never below n).
        name: the argument's name in the error for a negative `n` (`top_bots`, `top_tenants`).
    """

    def __init__(self, n: int, capacity: int | None = None, *, name: str = "n") -> None:
        if n < 0:
            raise ValueError(f"{name} must be >= 0, got {n}")
        self.n = n
        self.capacity = max(capacity if capacity is not None else max(64 * n, 1024), n)
        self.counts: dict[str, int] = {}
        self.labelled: set[str] = set()

    def observe(self, key: str, n: int = 1) -> tuple[str, str | None]:
        """Count `n` for `key` (requests of a bot, images and refusals of a tenant).

        Returns:
            (label to use for this observation, key that just lost its label or None).
        """
        count = self.counts.get(key)
        if count is None:
            if len(self.counts) >= self.capacity:
                victim = min(
                    (k for k in self.counts if k not in self.labelled),
                    key=self.counts.__getitem__,
                    default=None,
                )
                if victim is None:  # capacity == n and all labelled: count it under other
                    return OTHER, None
                count = self.counts.pop(victim)
            else:
                count = 0
        count += n
        self.counts[key] = count

        if key in self.labelled:
            return key, None
        if key == OTHER or self.n == 0:
            # A key literally named "other" is never given a label of its own: it would merge
            # with the overflow series.
            return OTHER, None
        if len(self.labelled) < self.n:
            self.labelled.add(key)
            return key, None
        weakest = min(self.labelled, key=self.counts.__getitem__)
        weakest_count = self.counts[weakest]
        if count > weakest_count + max(1, weakest_count // 10):
            self.labelled.discard(weakest)
            self.labelled.add(key)
            return key, weakest
        return OTHER, None
