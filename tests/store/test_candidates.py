"""Candidates in the store, on both backends (`location`: a directory store, then PostgreSQL):
one per bot, stored but not active; promote and discard; what rollback, removal and another
process see of them. The serving side (shadow scoring, canary routing) is
tests/service/core/test_candidates.py."""
from __future__ import annotations

import numpy as np
import pytest

from accounts import BotOwnedElsewhere, CandidateMode, InvalidCandidate, NoCandidate
from heads import HeadLoadError, UnknownBot
from store import UnknownVersion, open_store
from tests.support.heads import listening, random_head, store_digest, stored_entries, version_of
from tests.support.polling import wait_until

# The contract is 1 s from commit to every other store knowing (tests/store/test_changes.py); on
# a loaded 2-core machine we allow 2 s of stated slack on top.
SEEN_WITHIN_S = 1.0 + 2.0


@pytest.mark.parametrize("text, mode", [
    ("shadow", CandidateMode("shadow")), (" shadow ", CandidateMode("shadow")),
    ("canary:30", CandidateMode("canary", 30.0)), ("canary:0.5", CandidateMode("canary", 0.5)),
    ("canary:99.9", CandidateMode("canary", 99.9))])
def test_a_candidate_mode_is_shadow_or_canary_with_a_percent(text, mode):
    assert CandidateMode.parse(text) == mode
    assert CandidateMode.parse(str(mode)) == mode


@pytest.mark.parametrize("text", ["canary:0", "canary:100", "canary:x", "canary:", "canary",
                                  "canary:-5", "canary:nan", "canary:inf", "canary:1e3",
                                  "shadow:5", "blue-green", "", None, 30, True])
def test_any_other_mode_is_refused_in_one_line_naming_it(text):
    with pytest.raises(InvalidCandidate) as err:
        CandidateMode.parse(text)
    message = str(err.value)
    assert "\n" not in message and "canary:P with 0 < P < 100" in message
    assert repr(text) in message or repr(str(text).strip()) in message
    with pytest.raises(InvalidCandidate):
        CandidateMode("canary", 100)


def test_a_shadow_candidate_is_stored_but_not_active(any_store):
    s = any_store
    w1, b1, labels1 = random_head(3, seed=1)
    assert s.register("acme", w1, b1, labels1) == 1
    assert not s.has_candidate("acme") and s.candidate("acme") is None
    w2, b2, labels2 = random_head(4, seed=2)
    assert s.register("acme", w2, b2, labels2, candidate="shadow", source="retrained") == 2
    assert s.get("acme").version == 1  # the live version answers
    info = s.info("acme")
    assert (info.version, info.versions) == (1, [1])  # not a version rollback may activate
    assert info.candidate.to_dict() == {
        "version": 2, "mode": "shadow", "percent": None, "n_classes": 4,
        "labels": list(labels2), "created": info.candidate.created, "source": "retrained"}
    assert [i.candidate.version for i in s.list()] == [2]
    candidate = s.candidate("acme")
    assert candidate.mode == CandidateMode("shadow") and s.has_candidate("acme")
    np.testing.assert_array_equal(candidate.head.weights, w2)
    assert candidate.head.labels == tuple(labels2) and candidate.head.version == 2
    assert [(h["action"], h["version"], h["previous"]) for h in s.history("acme")] == [
        ("register", 1, None), ("candidate", 2, 1)]
    record = s.audit()[-1]
    assert (record.action, record.bot_id, record.version, record.tenant, record.detail) == (
        "candidate_add", "acme", 2, "default", "shadow, retrained")
    assert record.digest is not None and len(record.digest) == 64
    # Its head stays resident beside the live one, in a slot of its own (never pinned).
    assert set(s._cache.resident_bot_ids()) == {"acme", "acme#candidate"}


def test_refusals_write_nothing(location):
    with open_store(location) as s:
        s.add_tenant("t1")
        s.register("acme", *random_head(3, seed=1), tenant="t1")
    before = store_digest(location)
    with open_store(location) as s:
        for bad in ("canary:0", "canary:100", "canary:x"):
            with pytest.raises(InvalidCandidate):
                s.register("acme", *random_head(3, seed=2), tenant="t1", candidate=bad)
        with pytest.raises(UnknownBot):  # a candidate to nothing
            s.register("nobody", *random_head(3, seed=2), candidate="shadow")
        with pytest.raises(BotOwnedElsewhere):
            s.register("acme", *random_head(3, seed=2), candidate="shadow")  # default tenant
        for act in (s.promote, s.discard):
            with pytest.raises(NoCandidate, match="bot 'acme' has no candidate"):
                act("acme")
            with pytest.raises(UnknownBot):
                act("nobody")
    assert store_digest(location) == before


def test_a_new_candidate_replaces_the_old_one_whose_version_goes(any_store, location):
    s = any_store
    s.register("acme", *random_head(3, seed=1))
    s.register("acme", *random_head(3, seed=2), candidate="shadow")
    s.get("acme"), s.candidate("acme")
    assert s.register("acme", *random_head(5, seed=3), candidate="canary:30") == 3
    candidate = s.candidate("acme")
    assert (candidate.head.version, candidate.mode) == (3, CandidateMode("canary", 30.0))
    assert stored_entries(location, "acme") == ["v1", "v3"]
    with pytest.raises(HeadLoadError):
        s._backend.blobs.load("acme", 2)
    assert "acme#candidate" in s._cache.resident_bot_ids()
    assert [(r.action, r.version, r.detail) for r in s.audit()][-2:] == [
        ("candidate_discard", 2, "shadow, replaced by v3"),
        ("candidate_add", 3, "canary:30, api")]
    assert [(h["action"], h["version"]) for h in s.history("acme")][-2:] == [
        ("candidate", 3), ("discard", 2)]


def test_promote_makes_the_candidate_active_and_rollback_goes_back(any_store):
    s = any_store
    s.register("acme", *random_head(3, seed=1))
    w2, b2, labels2 = random_head(4, seed=2)
    s.register("acme", w2, b2, labels2, candidate="canary:10")
    assert s.promote("acme") == (1, 2)
    head = s.get("acme")
    assert head.version == 2 and head.labels == tuple(labels2)
    np.testing.assert_array_equal(head.weights, w2)
    info = s.info("acme")
    assert (info.version, info.versions, info.candidate) == (2, [1, 2], None)
    assert s.candidate("acme") is None and not s.has_candidate("acme")
    assert "acme#candidate" not in s._cache.resident_bot_ids()
    record = s.audit()[-1]
    assert (record.action, record.version, record.detail) == (
        "candidate_promote", 2, "canary:10, from v1")
    assert record.digest == s.audit()[-2].digest  # the candidate_add's: the same head
    assert s.history("acme")[-1]["action"] == "promote"
    with pytest.raises(NoCandidate):
        s.promote("acme")
    assert s.rollback("acme") == 1 and s.get("acme").version == 1


def test_discard_deletes_the_candidate_and_numbers_are_never_reused(any_store, location):
    s = any_store
    s.register("acme", *random_head(3, seed=1))
    s.register("acme", *random_head(3, seed=2), candidate="shadow")
    assert s.discard("acme") == 2
    assert s.candidate("acme") is None and s.info("acme").candidate is None
    assert stored_entries(location, "acme") == ["v1"] and s.get("acme").version == 1
    record = s.audit()[-1]
    assert (record.action, record.version, record.detail) == ("candidate_discard", 2, "shadow")
    with pytest.raises(NoCandidate):
        s.discard("acme")
    assert s.register("acme", *random_head(3, seed=3)) == 3  # v2 was given once
    assert s.register("acme", *random_head(3, seed=4), candidate="shadow") == 4


def test_rollback_never_picks_the_candidate(any_store):
    s = any_store
    s.register("acme", *random_head(3, seed=1))
    s.register("acme", *random_head(3, seed=2))
    s.register("acme", *random_head(3, seed=3), candidate="shadow")  # v3
    s.register("acme", *random_head(3, seed=4))  # v4 active; the candidate stays
    assert s.info("acme").versions == [1, 2, 4] and s.candidate("acme").head.version == 3
    with pytest.raises(UnknownVersion, match="version 3 of bot 'acme' is its candidate"):
        s.rollback("acme", to=3)
    assert s.rollback("acme") == 2  # not 3
    assert s.candidate("acme").head.version == 3  # still the candidate, now against v2


def test_removing_a_bot_or_its_tenant_removes_its_candidate(any_store, location):
    s = any_store
    s.register("acme", *random_head(3, seed=1))
    s.register("acme", *random_head(3, seed=2), candidate="shadow")
    s.remove("acme")
    assert stored_entries(location, "acme") == []
    s.register("acme", *random_head(3, seed=3))
    assert s.candidate("acme") is None and s.info("acme").version == 3
    s.add_tenant("t1")
    s.register("beta", *random_head(3, seed=4), tenant="t1")
    s.register("beta", *random_head(3, seed=5), tenant="t1", candidate="canary:50")
    s.remove_tenant("t1", force=True)
    assert s.list() == [s.info("acme")] and stored_entries(location, "beta") == []


def test_another_process_sees_a_candidate_its_promotion_and_its_discard(location):
    """Two stores on one location (each its own connections, as two processes have): what one
    writes, the other serves within a second, without being told."""
    with open_store(location) as writer, open_store(location) as reader:
        writer.register("acme", *random_head(3, seed=1))
        if location.startswith("postgresql"):
            listening(reader)
        assert version_of(reader, "acme") == 1 and reader.candidate("acme") is None
        writer.register("acme", *random_head(4, seed=2), candidate="canary:40")
        wait_until(lambda: reader.has_candidate("acme"), SEEN_WITHIN_S, what="the candidate")
        candidate = reader.candidate("acme")
        assert (candidate.head.version, candidate.mode.percent) == (2, 40.0)
        writer.promote("acme")
        wait_until(lambda: version_of(reader, "acme") == 2, SEEN_WITHIN_S, what="the promotion")
        assert reader.candidate("acme") is None
        assert reader.get("acme").n_classes == 4
        writer.register("acme", *random_head(3, seed=3), candidate="shadow")
        wait_until(lambda: reader.has_candidate("acme"), SEEN_WITHIN_S, what="the new candidate")
        assert reader.candidate("acme").head.version == 3
        writer.discard("acme")
        wait_until(lambda: not reader.has_candidate("acme"), SEEN_WITHIN_S, what="the discard")
        assert version_of(reader, "acme") == 2
        assert "acme#candidate" not in reader._cache.resident_bot_ids()


def test_a_refused_change_is_audited_in_the_asking_tenant(any_store):
    """`record_refusal`: a "refused" record in the asking tenant's log, naming the id asked
    for (issue 34: probing another tenant's ids shows in the audit log)."""
    s = any_store
    s.add_tenant("acme")
    s.record_refusal("globex-bot", tenant="acme", actor="key:abc", detail="remove: unknown bot")
    (record,) = [r for r in s.audit(tenant="acme") if r.action == "refused"]
    assert (record.actor, record.tenant, record.bot_id, record.detail) == \
        ("key:abc", "acme", "globex-bot", "remove: unknown bot")
    assert s.list() == []  # nothing else written
