"""`HeadStore`: the bots of one store, its snapshot, and the resident cache of heads.

    store = open_store("checkpoints")                         # a directory: SQLite + files
    store = open_store("postgresql://multihead@db:5432/heads")  # PostgreSQL: rows + tensors

One class over two backends (`store.backend`, each of bots, blobs, accounts and leases parts):
a directory with a SQLite registry and one immutable folder per version
(`store.directory`, the default) and PostgreSQL with LISTEN/NOTIFY (`store.pg`). Everything the
backends share lives here: the validation of what is registered (a refusal touches nothing),
the resident LRU cache by bytes with pinned bots, the snapshot the lookups answer from and the
rollback-target rules. Either way a registration is one transaction: a crash at any point
leaves nothing visible, and version numbers are never reused (also after a removal).

The snapshot (`store.snapshot`): the lookups on the request path (`get`'s version, `exists`,
`owner`, `has_candidate`, `candidate_mode`, `candidate`, `key_table`, `tenant_limits`) read
only the current `StoreSnapshot`, never the registry; a head not resident yet is loaded from its
blobs on first use. A background thread (one per watched store) polls the backend's data
version every `change_poll_s` (PostgreSQL's notifications wake it at once), reads the rows
when it moved and publishes a new snapshot; a write through this `HeadStore` publishes before
it returns. The thread starts with `watch()` (the service calls it at bring-up) or else at the
first lookup, and stops at `close()`: a one-shot use that only writes and lists (the CLI's
commands) starts none, nor joins `processes` (`store.leases`), as the service does at bring-up.

Tenants (`accounts.tenants`): every bot belongs to one tenant (`default` unless registered into
another; older stores: all in `default`), an id live under one tenant cannot be registered by
another, and API keys belong to tenants. Every change to bots, tenants, their limits and keys
appends an audit record in its own transaction (a refused one: `record_refusal`); `key_table()`
and `tenant_limits()` (`accounts.tenants.TenantLimits`) are served from the snapshot.

Candidates (`accounts.candidates`): a bot may have one candidate, a stored version that is not
active (registered with `candidate=`), scored beside the live version as a shadow or a canary;
`promote` makes it active, `discard` deletes it; every process sees these as a new version."""
from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

import numpy as np

from accounts.candidates import Candidate, CandidateMode
from accounts.errors import InvalidLimits, InvalidTenant, UnknownKey
from accounts.tenants import (
    DEFAULT_TENANT,
    LIMIT_NAMES,
    OPERATOR,
    TOKEN_PREFIX,
    ApiKey,
    AuditRecord,
    TenantInfo,
    TenantLimits,
    new_token,
    normalize_actor,
    token_hash,
    utc_now,
    validate_limits,
    validate_scope,
    validate_tenant,
)
from heads import files
from heads.cache import CANDIDATE, HeadCache
from heads.errors import HeadLoadError, UnknownBot
from heads.head import Head, validate_bot_id, validate_head_arrays
from store.backend import POSTGRESQL, Backend, parse_location, redact_url
from store.bots import BotInfo, rollback_target
from store.directory.backend import DirectoryBackend
from store.errors import StoreUnavailable, UnknownVersion
from store.processes import ServingProcesses
from store.snapshot import Snapshots, StoreSnapshot
from store.sources import checkpoint_head, labels_arg, slim_head

log = logging.getLogger(__name__)

# NOTE: a test seam. Called with the name of each registration step so tests can simulate a
# crash (`os._exit`) or a failure between steps: "written", "renamed", "rows_added" for a dir
# store; "written" (blobs inserted), "rows_added" (rows and NOTIFY, before COMMIT) for PostgreSQL.
_fault_hook: Callable[[str], None] | None = None


def _step(name: str) -> None:
    if _fault_hook is not None:
        _fault_hook(name)


def _open_backend(location: str | os.PathLike) -> Backend:
    kind, where = parse_location(location)
    if kind == POSTGRESQL:
        from store.pg import PgBackend  # psycopg is imported only for a PostgreSQL store

        return PgBackend(where)
    return DirectoryBackend(where)


def open_store(location: str | os.PathLike, *, heads_memory_mb: float = 2048.0,
               pinned: Iterable[str] = ()) -> HeadStore:
    """Open the head store at `location` (the one entry point for every kind of store).

    Args:
        location: a directory path (SQLite registry and head files; nothing is created until
            the first registration or serving process), or
            `postgresql://user[:password]@host[:port]/dbname` (also `postgres://`, and any libpq
            URI parameter) for a store shared by many machines. Any other `scheme://` is refused.
        heads_memory_mb, pinned: see `HeadStore`.
    Raises:
        InvalidStoreLocation: an unsupported scheme or a malformed URL; nothing is created.
    """
    return HeadStore(location, heads_memory_mb=heads_memory_mb, pinned=pinned)


class HeadStore:
    """The bots of one store: registration, lookups (a snapshot, a resident LRU), changes.

    Thread-safe: the event loop, the batch thread and executor threads may call it concurrently.
    Several processes (on several machines, for PostgreSQL) may open the same store; writes are
    serialised, and each watched store publishes a change committed elsewhere within
    `change_poll_s` of the backend learning of it, without re-reading any head. While the
    backend cannot be read (a locked SQLite file, PostgreSQL down), resident heads and the last
    snapshot keep being served.

    Args:
        location: a store directory, or a `postgresql://` URL; see `open_store` (the same
            thing; `HeadStore(path)` stays for existing callers).
        heads_memory_mb: byte budget (MiB) of resident heads (default: about 3,400 heads of
            100 classes, 0.6 MiB each); least recently used unpinned heads are evicted beyond it.
        pinned: bot ids whose heads, once loaded, are never evicted.

    Attributes:
        location: what was opened (a path, or the URL as given, password included).
        kind: "sqlite" or "postgresql". processes: the serving processes (`store.leases`).
        root, heads_dir: the store directory and its `heads/` (None for PostgreSQL).
    """

    change_poll_s = 0.25

    def __init__(self, location: str | os.PathLike, *, heads_memory_mb: float = 2048.0,
                 pinned: Iterable[str] = ()) -> None:
        if not heads_memory_mb >= 0:
            raise ValueError("heads_memory_mb must be >= 0")
        pinned = frozenset(validate_bot_id(b) for b in pinned)
        self._backend = _open_backend(location)
        self.location = os.fspath(location)
        self.kind = self._backend.kind
        disk = self._backend if isinstance(self._backend, DirectoryBackend) else None
        self.root: Path | None = disk.root if disk is not None else None
        self.heads_dir: Path | None = disk.heads_dir if disk is not None else None
        self._cache = HeadCache(int(heads_memory_mb * 2**20), pinned)
        self._snapshots = Snapshots(self._backend, poll_s=lambda: self.change_poll_s,
                                    published=self._published, log=log)
        self._loads_lock = threading.Lock()
        self._loading: dict[tuple[str, int], threading.Lock] = {}
        self.processes = ServingProcesses(self._backend.leases, self._backend.describe())

    @property
    def pinned(self) -> frozenset[str]:
        return self._cache.pinned

    # -- the snapshot --------------------------------------------------------------------------

    @property
    def snapshot(self) -> StoreSnapshot:
        """The current snapshot: what the lookups answer from (reading it starts nothing)."""
        return self._snapshots.current

    def snapshot_age_s(self) -> float:
        """Seconds since the snapshot was last confirmed current (its read, or the refresher's
        last poll that found the store unchanged); since the store was opened if it was never
        read. Grows while the registry cannot be read, or while nobody watches the store."""
        return self._snapshots.age_s()

    def watch(self) -> None:
        """Read the first snapshot now (unless one is current) and keep it current from a
        background thread until `close()`. Idempotent. The service calls it at bring-up, so
        that no request ever meets a store that is not watched; otherwise the first lookup
        calls it (the one lookup that reads the registry).

        Raises:
            RuntimeError: the store is closed.
        """
        self._snapshots.watch()

    def _published(self, snapshot: StoreSnapshot) -> None:
        active, candidates = snapshot.active, snapshot.candidates
        self._cache.retain(lambda h: h.version in (active.get(h.bot_id),
                                                   candidates.get(h.bot_id, (None,))[0]))

    # -- lookup (hot path: the snapshot only) --------------------------------------------------

    def get(self, bot_id: str) -> Head:
        """The active head of `bot_id`, loaded on first use and kept resident (LRU).

        Raises:
            UnknownBot: no such bot (InvalidBotId if the id itself is malformed).
            HeadLoadError: its files or blobs are missing or corrupt; StoreUnavailable (a
                HeadLoadError) if it is not resident and the database is unreachable.
        """
        version = self._snapshots.for_lookup().active.get(bot_id)
        if version is None:
            validate_bot_id(bot_id)
            raise UnknownBot(bot_id)
        head = self._cache.get(bot_id, version)
        if head is not None:
            return head
        try:
            return self._load(bot_id, version)
        except StoreUnavailable:
            raise  # nothing to learn from the registry either
        except HeadLoadError:
            # Removed or replaced by another process since the snapshot? Then say so. NOTE: the
            # one registry read a lookup of a watched store makes: after its blobs failed.
            self._snapshots.refresh(force=True)
            now = self._snapshots.current.active.get(bot_id)
            if now is None:
                raise UnknownBot(bot_id) from None
            if now != version:
                return self._load(bot_id, now)
            raise

    def exists(self, bot_id: str) -> bool:
        """Whether `bot_id` is registered (from the snapshot: no file or database access)."""
        return bot_id in self._snapshots.for_lookup().active

    def owner(self, bot_id: str) -> str:
        """The tenant of a live bot, from the snapshot (like `exists`: no store round trip).
        Raises UnknownBot (InvalidBotId for a malformed id)."""
        tenant = self._snapshots.for_lookup().owners.get(bot_id)
        if tenant is None:
            validate_bot_id(bot_id)
            raise UnknownBot(bot_id)
        return tenant

    def _load(self, bot_id: str, version: int, slot: str = "") -> Head:
        key = (bot_id, version)
        with self._loads_lock:
            lock = self._loading.setdefault(key, threading.Lock())
        try:
            with lock:  # one load per head at a time; the others wait and then hit the cache
                head = self._cache.peek(bot_id, version, slot)
                if head is None:
                    head = self._backend.blobs.load(bot_id, version)
                    self._cache.put(head, slot)
                return head
        finally:
            with self._loads_lock:
                self._loading.pop(key, None)

    def has_candidate(self, bot_id: str) -> bool:
        """Whether `bot_id` has a candidate (from the snapshot: no store access)."""
        return bot_id in self._snapshots.for_lookup().candidates

    def candidate_mode(self, bot_id: str) -> tuple[int, CandidateMode] | None:
        """(version, mode) of the candidate of `bot_id`, or None (from the snapshot, as
        `has_candidate`)."""
        return self._snapshots.for_lookup().candidates.get(bot_id)

    def candidate(self, bot_id: str) -> Candidate | None:
        """The candidate of `bot_id` with its head (loaded on first use and kept resident, like
        an active head, but never pinned), or None if it has none.

        Raises:
            HeadLoadError: its files or blobs are missing or corrupt, or (StoreUnavailable)
                it is not resident and the database is unreachable.
        """
        found = self._snapshots.for_lookup().candidates.get(bot_id)
        if found is None:
            return None
        version, mode = found
        head = self._cache.get(bot_id, version, CANDIDATE)
        if head is None:
            head = self._load(bot_id, version, CANDIDATE)
        return Candidate(head, mode)

    def key_table(self) -> Mapping[str, ApiKey]:
        """The live (unrevoked) keys by id, from the snapshot: a revoke in another process is
        seen within `change_poll_s` of the backend learning of it, with no store round trip
        per call. The same (read-only) mapping until the keys change."""
        return self._snapshots.for_lookup().keys

    def tenant_limits(self) -> Mapping[str, TenantLimits]:
        """{tenant: its limits} of every tenant ("default" always; a None limit is the serve
        default), from the snapshot: a change made in another process is seen within
        `change_poll_s` of the backend learning of it, with no store round trip per call. The
        same (read-only) mapping until the limits change."""
        return self._snapshots.for_lookup().limits

    # -- registration --------------------------------------------------------------------------

    def register(self, bot_id: str, weights: np.ndarray, biases: np.ndarray, labels,
                 *, source: str = "api", tenant: str = DEFAULT_TENANT,
                 actor: str = OPERATOR, candidate: str | CandidateMode | None = None,
                 defaults: TenantLimits | None = None) -> int:
        """Register a new version of `bot_id` and make it active (audited: "register" for a new
        bot, "replace" for a new version of a live one), or, with `candidate`, store it as the
        bot's candidate without making it active (audited "candidate_add").

        Args:
            weights: [1536, n], biases: [n], n >= 2, all finite (cast to float32).
            labels: n class names, or the path of a labels file (one per line).
            source: free text recorded in the manifest and the history. tenant: the owner.
            actor: who registers, as the audit log records it.
            candidate: "shadow" or "canary:P" (0 < P < 100), or a `CandidateMode`: the new
                version becomes the bot's candidate (`accounts.candidates`), replacing the
                candidate it had (whose version is deleted, audited "candidate_discard").
        Returns:
            The new version number.
        Raises:
            InvalidBotId, InvalidHead, InvalidTenant, InvalidCandidate, ValueError (actor),
            UnknownTenant, BotOwnedElsewhere (the id is live under another tenant), UnknownBot
            (a candidate to no bot), TenantLimitExceeded: before anything is written.
        """
        bot_id = validate_bot_id(bot_id)
        tenant = validate_tenant(tenant)
        actor = normalize_actor(actor)
        mode = CandidateMode.parse(candidate) if candidate is not None else None
        w, b, labels_t = validate_head_arrays(weights, biases, labels_arg(labels))
        version = self._backend.bots.add_version(
            bot_id, w, b, labels_t, " ".join(str(source).split()), _step, tenant=tenant,
            actor=actor, candidate=mode, defaults=defaults)
        self._snapshots.refresh(force=True)  # read-your-writes in this process
        return version

    def register_checkpoint(self, bot_id: str, prefix: str | os.PathLike, labels, *,
                            weights_name: str = files.WEIGHTS_KEY,
                            biases_name: str = files.BIASES_KEY,
                            source: str | None = None, tenant: str = DEFAULT_TENANT,
                            actor: str = OPERATOR,
                            candidate: str | CandidateMode | None = None,
                            defaults: TenantLimits | None = None) -> int:
        """Register the head held by a TF checkpoint (tensors `weights_name`, `biases_name`);
        `candidate` as for `register`."""
        bot_id = validate_bot_id(bot_id)
        if candidate is not None:
            candidate = CandidateMode.parse(candidate)  # refused before the checkpoint is read
        w, b, labels_t = checkpoint_head(prefix, labels, weights_name=weights_name,
                                         biases_name=biases_name)
        if source is None:
            source = f"checkpoint:{os.path.abspath(prefix)}"
        return self.register(bot_id, w, b, labels_t, source=source, tenant=tenant, actor=actor,
                             candidate=candidate, defaults=defaults)

    def register_from_slim(self, bot_id: str, prefix: str | os.PathLike, labels, *,
                           serving_trunk_prefix: str | os.PathLike | None = None,
                           force: bool = False, tenant: str = DEFAULT_TENANT,
                           actor: str = OPERATOR,
                           candidate: str | CandidateMode | None = None,
                           defaults: TenantLimits | None = None) -> int:
        """Import the classifier layer `InceptionV4/Logits/Logits` of a slim Inception-V4
        checkpoint (the official one, or one fine-tuned with any class count) as a head.

        With `serving_trunk_prefix`, the checkpoint's trunk is compared with the serving trunk
        (`backbone.trunk_digest`): every bot shares the serving trunk, so a checkpoint whose
        trunk was fine-tuned too would predict differently here than on its own.

        `candidate` as for `register`.

        Raises:
            TrunkMismatch: the trunks differ and not `force`.
            HeadLoadError: not a checkpoint, or no Logits layer.
        """
        bot_id = validate_bot_id(bot_id)
        if candidate is not None:
            candidate = CandidateMode.parse(candidate)
        w, b, labels_t, source = slim_head(bot_id, prefix, labels, force=force,
                                           serving_trunk_prefix=serving_trunk_prefix)
        return self.register(bot_id, w, b, labels_t, source=source, tenant=tenant, actor=actor,
                             candidate=candidate, defaults=defaults)

    def promote(self, bot_id: str, *, actor: str = OPERATOR) -> tuple[int, int]:
        """Make the bot's candidate its active version (audited "candidate_promote"); the
        version that was active stays stored, so `rollback` goes back to it.

        Returns:
            (the version active before, the version active now).
        Raises:
            InvalidBotId, UnknownBot, NoCandidate (nothing written).
        """
        bot_id = validate_bot_id(bot_id)
        actor = normalize_actor(actor)
        result = self._backend.bots.promote(bot_id, actor=actor)
        self._snapshots.refresh(force=True)
        return result

    def discard(self, bot_id: str, *, actor: str = OPERATOR) -> int:
        """Delete the bot's candidate and its version (audited "candidate_discard"); returns
        its version. Raises InvalidBotId, UnknownBot, NoCandidate (nothing written)."""
        bot_id = validate_bot_id(bot_id)
        actor = normalize_actor(actor)
        version = self._backend.bots.discard(bot_id, actor=actor)
        self._snapshots.refresh(force=True)
        return version

    # -- administration ------------------------------------------------------------------------

    def list(self, tenant: str | None = None) -> list[BotInfo]:
        """Every registered bot, ordered by id; only `tenant`'s if given (InvalidTenant).
        Read from the registry now (an administration call, not a lookup)."""
        if tenant is not None:
            tenant = validate_tenant(tenant)
        rows = [row for row in self._backend.bots.rows() if tenant is None or row.tenant == tenant]
        candidates = self._backend.bots.candidates() if rows else {}
        return [BotInfo.of(row, candidates.get(row.active.bot_id)) for row in rows]

    def info(self, bot_id: str) -> BotInfo:
        """The registry's view of one bot, read now. Raises UnknownBot."""
        bot_id = validate_bot_id(bot_id)
        rows = self._backend.bots.rows(bot_id)
        if not rows:
            raise UnknownBot(bot_id)
        return BotInfo.of(rows[0], self._backend.bots.candidates(bot_id).get(bot_id))

    def history(self, bot_id: str) -> list[dict]:
        """Every registration, rollback and removal of `bot_id` (and its candidates: stored,
        promoted, discarded), oldest first."""
        return self._backend.bots.history(validate_bot_id(bot_id))

    def remove(self, bot_id: str, *, actor: str = OPERATOR) -> None:
        """Unregister `bot_id` and delete all its versions (audited). Raises UnknownBot."""
        bot_id = validate_bot_id(bot_id)
        actor = normalize_actor(actor)
        self.info(bot_id)  # refuse an unknown bot without opening a write transaction
        self._backend.bots.remove(bot_id, actor=actor)
        self._snapshots.refresh(force=True)

    def rollback(self, bot_id: str, to: int | None = None, *, actor: str = OPERATOR) -> int:
        """Make an earlier (or any other stored) version of `bot_id` active (audited, unless
        it was active already).

        Args:
            to: the version to activate; default: the highest version below the active one.
        Returns:
            The active version afterwards.
        Raises:
            UnknownBot, UnknownVersion.
        """
        bot_id = validate_bot_id(bot_id)
        actor = normalize_actor(actor)
        if to is not None and (isinstance(to, bool) or not isinstance(to, (int, np.integer))):
            raise UnknownVersion(f"version must be an integer, got {to!r}")
        info = self.info(bot_id)
        if to is not None and info.candidate is not None and int(to) == info.candidate.version:
            raise UnknownVersion(f"version {int(to)} of bot '{bot_id}' is its candidate: "
                                 "promote it (multihead bots promote) to make it active")
        rollback_target(bot_id, info.version, info.versions, to)  # refuse before writing
        target = self._backend.bots.rollback(
            bot_id, lambda active, versions: rollback_target(bot_id, active, versions, to),
            actor=actor)
        self._snapshots.refresh(force=True)
        return target

    # -- tenants, keys, audit ------------------------------------------------------------------

    def add_tenant(self, name: str, *, actor: str = OPERATOR,
                   limits: TenantLimits | None = None) -> TenantInfo:
        """Create a tenant, with its `limits` if given (else every serve default), audited.
        Raises InvalidTenant, TenantExists (also for "default", which always exists),
        InvalidLimits (`limits` not a TenantLimits)."""
        name = validate_tenant(name)
        actor = normalize_actor(actor)
        if limits is not None and not isinstance(limits, TenantLimits):
            raise InvalidLimits(f"limits must be a TenantLimits, got {type(limits).__name__}")
        info = self._backend.accounts.add_tenant(name, actor=actor, limits=limits)
        self._snapshots.refresh(force=True)
        return info

    def tenants(self) -> list[TenantInfo]:
        """Every tenant with its count of live bots and its limits, ordered by name ("default"
        always)."""
        return self._backend.accounts.tenants()

    def set_tenant_limits(self, name: str, *, actor: str = OPERATOR,
                          **changes: float | int | None) -> TenantLimits:
        """Change a tenant's limits (`accounts.tenants.LIMITS`: fair sharing and storage),
        audited as "tenant_set". "default" is a tenant like the others here. `changes`: each
        given takes its value, None putting it back to the serve default; the others keep theirs.

        Returns:
            The tenant's limits now. Every store open on this location serves them from
            `tenant_limits()` within `change_poll_s` of learning of the change.
        Raises:
            InvalidTenant, UnknownTenant; InvalidLimits (a ValueError: no change given, an
            unknown name, a value out of its range), before anything is written.
        """
        name = validate_tenant(name)
        actor = normalize_actor(actor)
        if not changes:
            raise InvalidLimits(f"no limit to change: give one or more of "
                                f"{', '.join(LIMIT_NAMES)}")
        changes = validate_limits(**changes)
        limits = self._backend.accounts.set_limits(name, changes, actor=actor)
        self._snapshots.refresh(force=True)
        return limits

    def remove_tenant(self, name: str, *, force: bool = False, actor: str = OPERATOR) -> None:
        """Delete a tenant and revoke its keys, in one transaction, each change audited.

        Args:
            force: also remove every bot it owns (otherwise TenantNotEmpty while it owns any).
        Raises:
            InvalidTenant (also for "default", which cannot be removed), UnknownTenant,
            TenantNotEmpty.
        """
        name = validate_tenant(name)
        actor = normalize_actor(actor)
        if name == DEFAULT_TENANT:
            raise InvalidTenant("the default tenant cannot be removed")
        self._backend.accounts.remove_tenant(name, force=bool(force), actor=actor)
        self._snapshots.refresh(force=True)

    def add_key(self, tenant: str, scope: str, *, actor: str = OPERATOR) -> tuple[ApiKey, str]:
        """Make an API key of `tenant` with `scope` (one of accounts.tenants.SCOPES), audited.

        Returns:
            (the key, its token). The token is returned this once: the store keeps only its
            sha256 (`accounts.tenants.token_hash`).
        Raises:
            InvalidTenant, UnknownTenant, ValueError (scope or actor).
        """
        tenant = validate_tenant(tenant)
        scope = validate_scope(scope)
        actor = normalize_actor(actor)
        key_id, token = new_token()
        key = ApiKey(key_id, tenant, scope, f"{TOKEN_PREFIX}{key_id}", utc_now(), None, None,
                     token_hash(token))
        self._backend.accounts.add_key(key, actor=actor)
        self._snapshots.refresh(force=True)
        return key, token

    def keys(self, tenant: str | None = None) -> list[ApiKey]:
        """Every key, revoked ones included (`revoked` set), in creation order; only
        `tenant`'s if given."""
        if tenant is not None:
            tenant = validate_tenant(tenant)
        return self._backend.accounts.keys(tenant)

    def revoke_key(self, key_id: str, *, actor: str = OPERATOR) -> ApiKey:
        """Revoke a key (audited); a key revoked already is returned as it is. Every store
        open on this location stops listing it in `key_table()` within `change_poll_s` of
        learning of the change. Raises UnknownKey."""
        actor = normalize_actor(actor)
        if not isinstance(key_id, str):
            raise UnknownKey(key_id)
        key = self._backend.accounts.revoke_key(key_id, actor=actor)
        self._snapshots.refresh(force=True)
        return key

    def mark_used(self, used: dict[str, str]) -> None:
        """Record when keys were last used ({key id: ISO 8601 UTC}), keeping the later time.
        Best effort (no audit record, no change notification): a store error is logged, never
        raised."""
        if not used:
            return
        try:
            self._backend.accounts.mark_used({str(k): str(v) for k, v in used.items()})
        except Exception as exc:  # noqa: BLE001 - best effort by contract
            log.warning("could not record the last use of %d API key(s) in store %s: %s",
                        len(used), self._backend.describe(), exc)

    def record_refusal(self, bot_id: str, *, tenant: str, actor: str, detail: str) -> None:
        """Audit ("refused", in `tenant`'s log) `actor`'s refused change of `bot_id` (`detail`)."""
        self._backend.accounts.record_refusal(at=utc_now(), actor=normalize_actor(actor),
                                              tenant=validate_tenant(tenant),
                                              bot_id=validate_bot_id(bot_id), detail=detail)

    def audit(self, *, tenant: str | None = None, since: str | None = None,
              limit: int = 1000) -> list[AuditRecord]:
        """The audit log, oldest first: its newest `limit` records, only `tenant`'s and only
        those at or after `since` (ISO 8601 UTC compared as text: "2026-01-31", or a record's
        `at`) if given."""
        if tenant is not None:
            tenant = validate_tenant(tenant)
        if since is not None and not isinstance(since, str):
            raise ValueError(f"since must be an ISO 8601 text, got {type(since).__name__}")
        if isinstance(limit, bool) or not isinstance(limit, (int, np.integer)) or limit < 1:
            raise ValueError(f"limit must be a positive integer, got {limit!r}")
        return self._backend.accounts.audit(tenant=tenant, since=since, limit=int(limit))

    # -- housekeeping --------------------------------------------------------------------------

    def cache_stats(self) -> dict:
        """resident_heads, resident_bytes, hits, misses, evictions (and the budget, pins)."""
        return self._cache.stats()

    def close(self) -> None:
        """Leave `processes`, stop the refresher, close the registry connections (and the
        PostgreSQL listener), drop resident heads. Idempotent; a lookup after it: RuntimeError."""
        self.processes.leave()
        self._snapshots.close()
        self._backend.close()
        self._cache.clear()

    def __enter__(self) -> HeadStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        shown = redact_url(self.location) if self.kind == POSTGRESQL else str(self.root)
        return f"HeadStore({shown!r})"
