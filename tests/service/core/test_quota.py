"""Token buckets per tenant (`service.core.quota`) on a fake clock."""
from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.core.errors import RateLimited, error_status, grpc_status
from service.core.quota import Quotas, default_burst
from tests.support.fakes import FakeClock


def quotas(limits: dict, *, divisor: int = 1, clock=None) -> Quotas:
    return Quotas(lambda tenant: limits.get(tenant, (None, None)), divisor=divisor,
                  clock=clock or FakeClock())


def test_a_tenant_without_a_rate_is_never_limited():
    q = quotas({})
    for _ in range(1000):
        q.take("free", 32)
    assert q.tokens("free") is None and len(q) == 0


def test_the_burst_passes_then_the_rate():
    clock = FakeClock()
    q = quotas({"t": (2.0, 4)}, clock=clock)
    for _ in range(4):
        q.take("t", 1)
    with pytest.raises(RateLimited) as refused:
        q.take("t", 1)
    assert refused.value.retry_after_s == pytest.approx(0.5)
    assert error_status(refused.value) == (429, "rate_limited", {"Retry-After": "1"})
    assert grpc_status(refused.value) == ("RESOURCE_EXHAUSTED", "rate_limited")
    clock.advance(0.5)
    q.take("t", 1)  # honouring Retry-After is accepted


def test_a_check_takes_nothing_and_refuses_what_a_take_of_one_would():
    clock = FakeClock()
    q = quotas({"t": (2.0, 2)}, clock=clock)
    q.check("t")
    q.check("t")
    assert q.tokens("t") == 2  # checked twice, nothing taken
    q.take("t", 2)
    with pytest.raises(RateLimited) as refused:
        q.check("t")
    assert refused.value.retry_after_s == pytest.approx(0.5)
    clock.advance(0.5)
    q.check("t")
    q.check("free")  # no rate: never refused


def test_claims_past_the_door_hold_an_image_each_until_charged():
    """Requests past their heads (their bodies being read) hold one image each of the bucket:
    with 2 tokens, a third claim is refused before its body would be read, taking nothing. A
    claim charged by `take` in its context stops holding; one that ends uncharged gives its
    place back."""
    clock = FakeClock()
    q = quotas({"t": (1.0, 2)}, clock=clock)
    first, second = q.claim("t"), q.claim("t")
    first.__enter__()
    second.__enter__()
    assert q.claimed("t") == 2 and q.tokens("t") == 2  # claimed, nothing taken
    with pytest.raises(RateLimited) as refused, q.claim("t"):
        pass
    assert refused.value.retry_after_s == pytest.approx(1.0)  # 3 needed, 2 held, 1 a second
    assert q.claimed("t") == 2
    q.take("t", 1)  # the innermost claim's request is charged: it holds no more
    assert q.claimed("t") == 1 and q.tokens("t") == 1
    second.__exit__(None, None, None)
    assert q.claimed("t") == 1
    with pytest.raises(RateLimited), q.claim("t"):  # 1 token, held by the first claim
        pass
    first.__exit__(None, None, None)  # ends uncharged: its place is given back
    assert q.claimed("t") == 0
    with q.claim("t"):
        pass
    with q.claim("free"):  # no rate: never refused, nothing counted
        assert q.claimed("free") == 0


def test_a_claim_holds_its_size_what_its_head_says_it_costs_at_least():
    """A claim of n images needs the bucket to hold min(n, burst) beside the open claims'
    sizes, and holds n until it ends or is charged: a 10 MB body's claim (11 images' worth)
    is refused by a bucket of 4 tokens, where a claim of one image passed and the body was
    read whole, then refused."""
    clock = FakeClock()
    q = quotas({"t": (1.0, 8)}, clock=clock)
    q.take("t", 4)
    with pytest.raises(RateLimited) as refused, q.claim("t", 11.4):
        pass
    assert refused.value.retry_after_s == pytest.approx(4.0)  # min(11.4, 8) = 8 needed
    assert q.claimed("t") == 0
    big = q.claim("t", 3)
    big.__enter__()
    with pytest.raises(RateLimited) as refused, q.claim("t", 2):  # 3 + 2 > 4
        pass
    assert refused.value.retry_after_s == pytest.approx(1.0)
    with q.claim("t", 0.2):  # at least one image: 3 + 1 = 4 held
        assert q.claimed("t") == 2
        with pytest.raises(RateLimited), q.claim("t"):
            pass
    big.__exit__(None, None, None)  # ends uncharged: its 3 are free again
    with q.claim("t", 4):
        q.take("t", 4)  # charged: the claim ends, the tokens taken
    assert q.claimed("t") == 0 and q.tokens("t") == pytest.approx(0.0)


def _claims_at_once(threads: int, tokens: int) -> tuple[int, int]:
    """`threads` threads claiming at once on a bucket of `tokens`, each holding what it got:
    (claims that passed, claims left open after all ended)."""
    import threading

    q = quotas({"t": (0.001, tokens)})
    start, hold = threading.Barrier(threads), threading.Event()
    passed = []

    def one() -> None:
        start.wait()
        try:
            with q.claim("t"):
                passed.append(1)
                hold.wait(5)
        except RateLimited:
            pass

    running = [threading.Thread(target=one) for _ in range(threads)]
    for t in running:
        t.start()
    deadline = time.monotonic() + 5  # the refused end at once; those that passed hold
    while (sum(not t.is_alive() for t in running) < threads - tokens
           and time.monotonic() < deadline):
        time.sleep(0.001)
    hold.set()
    for t in running:
        t.join(5)
    return len(passed), q.claimed("t")


def test_claims_from_many_threads_at_once_never_pass_more_than_the_tokens():
    """The check and the count of a claim are one step: 16 threads claiming at once on a
    bucket of 3 tokens pass 3 times, however they interleave (the interpreter switching
    threads every microsecond, so that interleavings are many)."""
    import sys

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        results = [_claims_at_once(16, 3) for _ in range(50)]
    finally:
        sys.setswitchinterval(interval)
    assert set(results) == {(3, 0)}, results


async def test_a_claim_is_charged_by_a_take_in_a_task_its_request_started():
    import asyncio

    q = quotas({"t": (1.0, 1)})
    with q.claim("t"):
        await asyncio.create_task(asyncio.sleep(0, q.take("t", 1)))
        assert q.claimed("t") == 0
        with pytest.raises(RateLimited), q.claim("t"):
            pass


def test_a_refusal_takes_nothing_and_its_retry_after_is_enough():
    clock = FakeClock()
    q = quotas({"t": (3.0, 10)}, clock=clock)
    q.take("t", 9)
    with pytest.raises(RateLimited) as refused:
        q.take("t", 5)
    assert q.tokens("t") == pytest.approx(1.0)
    clock.advance(refused.value.retry_after_s)
    q.take("t", 5)


def test_a_request_over_the_burst_empties_a_full_bucket_and_leaves_a_debt():
    clock = FakeClock()
    q = quotas({"t": (4.0, 8)}, clock=clock)
    q.take("t", 20)  # needs a full bucket (8), takes 20
    assert q.tokens("t") == pytest.approx(-12.0)
    with pytest.raises(RateLimited) as refused:
        q.take("t", 1)
    assert refused.value.retry_after_s == pytest.approx(13 / 4)


def test_cache_hits_are_given_back_up_to_the_burst():
    q = quotas({"t": (1.0, 4)})
    q.take("t", 4)
    q.refund("t", 3)
    assert q.tokens("t") == pytest.approx(3.0)
    q.refund("t", 100)
    assert q.tokens("t") == pytest.approx(4.0)


def test_limits_are_read_at_each_call_and_a_smaller_burst_caps_the_tokens():
    limits = {"t": (1.0, 10)}
    q = quotas(limits)
    assert q.tokens("t") == pytest.approx(10.0)
    limits["t"] = (1.0, 3)
    assert q.tokens("t") == pytest.approx(3.0)
    limits["t"] = (None, None)
    q.take("t", 100)  # unlimited now


def test_processes_sharing_a_tenant_each_enforce_their_part():
    q = quotas({"t": (10.0, 5)}, divisor=2)
    assert q.limits_of("t") == (5.0, 3)
    assert default_burst(0.2) == 1 and default_burst(7.5) == 8
    with pytest.raises(ValueError):
        quotas({}, divisor=0)


def test_a_divisor_that_changes_is_followed_at_the_next_call():
    clock, processes = FakeClock(), [1]
    q = Quotas(lambda tenant: (8.0, 8), divisor=lambda: processes[0], clock=clock)
    assert q.limits_of("t") == (8.0, 8)
    q.take("t", 2)
    assert q.tokens("t") == pytest.approx(6.0)
    processes[0] = 2  # a second process joined: half each, the tokens capped at the new burst
    assert q.limits_of("t") == (4.0, 4)
    assert q.tokens("t") == pytest.approx(4.0)
    q.take("t", 4)
    with pytest.raises(RateLimited) as refused:
        q.take("t", 1)
    assert refused.value.retry_after_s == pytest.approx(1 / 4.0)  # at the halved rate
    clock.advance(0.5)
    assert q.tokens("t") == pytest.approx(2.0)
    processes[0] = 1  # it left: the whole quota again, refilling at the whole rate
    clock.advance(0.5)
    assert q.tokens("t") == pytest.approx(6.0)
    assert q.limits_of("t") == (8.0, 8)
    processes[0] = 0  # never below one share
    assert q.limits_of("t") == (8.0, 8)


def test_the_service_divides_by_the_stores_serving_processes_outside_ray(tmp_path):
    from service.core.settings import Deployment, Settings
    from service.core.tenancy import Tenancy
    from store import open_store

    settings = Settings(store=str(tmp_path), tenant_rate=10.0, tenant_burst=4)
    with open_store(tmp_path) as a, open_store(tmp_path) as b:
        tenancy = Tenancy(settings, b, threads=None)
        assert tenancy.quotas.limits_of("default") == (10.0, 4)  # b does not serve (yet)
        a.processes.join()
        b.processes.join()  # its first beat counts a's lease
        assert tenancy.quotas.limits_of("default") == (5.0, 2)
        # Under Ray the replicas divide (the leases count them too, but the range is the rule).
        ray = settings.replace(ray=True, deployment=Deployment(replicas=3))
        assert Tenancy(ray, b, threads=None).quotas.limits_of("default") == (10.0 / 3, 2)


def test_full_buckets_are_dropped():
    clock = FakeClock()
    q = quotas({f"t{i}": (100.0, 1) for i in range(600)}, clock=clock)
    for i in range(600):
        q.take(f"t{i}", 1)
        clock.advance(0.02)  # refills 2 tokens: every older bucket is full again
    assert len(q) < 300


@settings(max_examples=200, deadline=None)
@given(rate=st.floats(0.5, 50), burst=st.integers(1, 40),
       requests=st.lists(st.tuples(st.integers(1, 32), st.floats(0, 2)), min_size=1,
                         max_size=60))
def test_over_any_run_a_tenant_gets_at_most_burst_plus_rate_times_time(rate, burst, requests):
    """Every accepted image is paid for: accepted <= burst + rate * elapsed (+ the debt of the
    last request, which the rate pays back), and a refused request is accepted after waiting
    its Retry-After."""
    clock = FakeClock()
    q = quotas({"t": (rate, burst)}, clock=clock)
    start, accepted = clock.now, 0
    for n, gap in requests:
        clock.advance(gap)
        try:
            q.take("t", n)
        except RateLimited as refused:
            clock.advance(refused.retry_after_s + 1e-9)
            q.take("t", n)
        accepted += n
        assert accepted <= burst + rate * (clock.now - start) + max(0, n - burst) + 1e-6
