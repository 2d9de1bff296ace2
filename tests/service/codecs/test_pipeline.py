"""`service.codecs.pipeline`: the steps every transport runs around a codec call, their order,
and what metrics count, on a recording stand-in for the `Service` (the transports' end-to-end
tests run it on real servers: test_same_answers, test_auth, test_grpc, test_logs, ...)."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from service.codecs import pipeline
from service.codecs.pipeline import Incoming
from service.core.admission import ByteBudget
from service.core.auth import INFER
from service.core.errors import Overloaded, Unauthorized, error_status


@dataclass
class Settings:
    access_log: bool = False


@dataclass
class Metrics:
    seen: list[tuple[str, int, bool]] = field(default_factory=list)  # (route, status, timed)

    def observe_request(self, route: str, status: int, elapsed_s: float | None) -> None:
        self.seen.append((route, status, elapsed_s is not None))


class Tenancy:
    """No tenant has a default deadline."""

    def deadline_ms(self, tenant: str) -> None:
        return None


@dataclass
class Service:
    """What the pipeline reads of a `Service`; `caller` records its calls."""

    steps: list[str]
    refuse: bool = False
    settings: Settings = field(default_factory=Settings)
    metrics: Metrics = field(default_factory=Metrics)
    inflight: ByteBudget = field(default_factory=lambda: ByteBudget(100))
    tracing: None = None
    tenancy: Tenancy = field(default_factory=Tenancy)

    def caller(self, authorization, access, *, route_key=None):
        self.steps.append(f"caller {authorization} {access} {route_key}")
        if self.refuse:
            raise Unauthorized("no credential")
        return "the caller"


class Outcome:
    """An outcome that renders an answer as (status, body) and records what it was asked."""

    def __init__(self, cancelled_status: int = pipeline.CLIENT_CLOSED) -> None:
        self.cancelled_status = cancelled_status
        self.done_with: list[tuple[object, str, str | None]] = []

    def error(self, exc):
        return error_status(exc)[0], type(exc).__name__

    def status(self, answer) -> int:
        return answer[0]

    def cancelled(self, req) -> int:
        return self.cancelled_status

    async def done(self, answer, req, timing):
        self.done_with.append((answer, req.request_id, timing))
        return answer


def incoming(**changes) -> Incoming:
    values = dict(protocol="http", method="POST", route="classify", path="/classify/acme",
                  headers={"authorization": "Bearer k", "x-request-id": "req-1",
                           "x-multihead-route-key": "user-7"},
                  span_name="POST /classify/{bot_id}", params={"bot_id": "acme"})
    values.update(changes)
    return Incoming(**values)


async def test_the_steps_run_in_order_and_the_answer_names_its_request():
    steps: list[str] = []
    service, outcome = Service(steps), Outcome()

    def admit(held):
        steps.append("admit")
        held.take(40)

    async def step(caller, held):
        steps.append(f"step {caller} {service.inflight.used_bytes}")
        return 200, "ok"

    answer = await pipeline.run(service, incoming(), step, outcome, access=INFER, admit=admit)
    assert answer == (200, "ok")
    assert steps == ["caller Bearer k infer user-7", "admit", "step the caller 40"]
    assert service.inflight.used_bytes == 0  # given back once answered
    assert service.metrics.seen == [("classify", 200, True)]
    [(_, request_id, timing)] = outcome.done_with
    assert request_id == "req-1" and timing.startswith("app;dur=")


@pytest.mark.parametrize("refuse_caller", [True, False])
async def test_a_refused_caller_is_answered_before_admission_and_a_refusal_before_the_step(
        refuse_caller):
    steps: list[str] = []
    service = Service(steps, refuse=refuse_caller)

    def admit(held):
        steps.append("admit")
        raise Overloaded(1.0)

    async def step(caller, held):
        steps.append("step")
        return 200, "ok"

    answer = await pipeline.run(service, incoming(), step, Outcome(), access=INFER, admit=admit)
    if refuse_caller:
        assert answer == (401, "Unauthorized") and "admit" not in steps
    else:
        assert answer == (503, "Overloaded") and steps[-1] == "admit"
    assert service.metrics.seen == [("classify", answer[0], True)]


async def test_without_an_access_rule_there_is_no_caller():
    steps: list[str] = []
    service = Service(steps)

    async def step(caller, held):
        steps.append(f"step {caller}")
        return 404, "no route"

    await pipeline.run(service, incoming(route=pipeline.UNMATCHED, params={}), step, Outcome())
    assert steps == ["step None"]
    assert service.metrics.seen == [(pipeline.UNMATCHED, 404, True)]


async def test_a_streams_upgrade_and_its_cancellation_are_counted_not_timed():
    service = Service([])

    async def upgrade(caller, held):
        return pipeline.SWITCHING_PROTOCOLS, "socket"

    await pipeline.run(service, incoming(stream=True), upgrade, Outcome(), access=INFER)
    assert service.metrics.seen[-1] == ("classify", 101, False)


@pytest.mark.parametrize("stream, cancelled_status, timed", [
    (False, pipeline.CLIENT_CLOSED, True), (True, pipeline.CLIENT_CLOSED, False),
    (False, 504, True)])
async def test_a_cancelled_request_counts_the_outcomes_status_and_gives_its_bytes_back(
        stream, cancelled_status, timed):
    service = Service([])
    entered = asyncio.Event()

    async def waits(caller, held):
        held.take(30)
        entered.set()
        await asyncio.Event().wait()

    task = asyncio.ensure_future(pipeline.run(service, incoming(stream=stream), waits,
                                              Outcome(cancelled_status), access=INFER))
    await entered.wait()
    assert service.inflight.used_bytes == 30
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert service.metrics.seen == [("classify", cancelled_status, timed)]
    assert service.inflight.used_bytes == 0
