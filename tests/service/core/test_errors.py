"""The one table from errors to answers: HTTP status, code and headers, gRPC status, what the
client may read, and the per-waiter copies of one exception."""
from __future__ import annotations

import copy
import pickle

import pytest

from backbone.errors import CheckpointError, ImageTooLarge, InvalidImage
from heads.errors import (
    HeadLoadError,
    InvalidBotId,
    InvalidHead,
    InvalidLabel,
    InvalidTrainingData,
    TrunkMismatch,
    UnknownBot,
)
from service.core import errors as e
from store.errors import StoreUnavailable, UnknownVersion


@pytest.mark.parametrize("exc, status, code, grpc_code", [
    (e.BadRequest("x"), 400, "bad_request", "INVALID_ARGUMENT"),
    (e.Unauthorized("x"), 401, "unauthorized", "UNAUTHENTICATED"),
    (e.Forbidden("x"), 403, "forbidden", "PERMISSION_DENIED"),
    (e.NotFound("x"), 404, "not_found", "UNIMPLEMENTED"),
    (e.PayloadTooLarge("x"), 413, "payload_too_large", "RESOURCE_EXHAUSTED"),
    (e.UnsupportedMediaType("x"), 415, "unsupported_media_type", "INVALID_ARGUMENT"),
    (e.Overloaded(2.0), 503, "overloaded", "RESOURCE_EXHAUSTED"),
    (e.ShuttingDown("x"), 503, "shutting_down", "UNAVAILABLE"),
    (e.ReplicaLost("x"), 503, "replica_lost", "UNAVAILABLE"),
    (e.NotReady("x"), 503, "not_ready", "UNAVAILABLE"),
    (e.HeadUnavailable("x"), 500, "head_unavailable", "INTERNAL"),
    (e.DeadlineExceeded("x"), 504, "deadline_exceeded", "DEADLINE_EXCEEDED"),
    (e.BatchError("x"), 500, "internal", "INTERNAL"),
    (InvalidImage("x"), 400, "invalid_image", "INVALID_ARGUMENT"),
    (ImageTooLarge("x"), 413, "image_too_large", "INVALID_ARGUMENT"),
    (CheckpointError("x"), 500, "trunk_unavailable", "INTERNAL"),
    (UnknownBot("x"), 404, "unknown_bot", "NOT_FOUND"),
    (UnknownVersion("x"), 404, "unknown_version", "NOT_FOUND"),
    (InvalidBotId("x"), 400, "invalid_bot_id", "INVALID_ARGUMENT"),
    (InvalidHead("x"), 422, "invalid_head", "INVALID_ARGUMENT"),
    (HeadLoadError("x"), 422, "invalid_head", "INVALID_ARGUMENT"),
    (InvalidLabel("x"), 400, "invalid_label", "INVALID_ARGUMENT"),
    (StoreUnavailable("x"), 503, "store_unavailable", "UNAVAILABLE"),
    (TrunkMismatch("x"), 422, "trunk_mismatch", "INVALID_ARGUMENT"),
    (InvalidTrainingData("x"), 400, "invalid_training_data", "INVALID_ARGUMENT"),
    (RuntimeError("/secret/path"), 500, "internal", "INTERNAL"),
    (e.ServiceError("x"), 500, "internal", "INTERNAL"),
], ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else None)
def test_every_error_has_its_http_status_code_and_grpc_status(exc, status, code, grpc_code):
    assert e.error_status(exc)[:2] == (status, code)
    assert e.grpc_status(exc) == (grpc_code, code)
    assert e.error_body(exc)["code"] == code


def test_a_subclass_maps_like_its_nearest_listed_base():
    class Special(e.BadRequest):
        pass

    class SpecialBot(UnknownBot):
        pass

    assert e.error_status(Special("x"))[:2] == (400, "bad_request")
    assert e.grpc_status(SpecialBot("x")) == ("NOT_FOUND", "unknown_bot")


@pytest.mark.parametrize("exc, headers", [
    (e.Overloaded(retry_after_s=2.2), {"Retry-After": "3"}),
    (e.Overloaded(retry_after_s=0.2), {"Retry-After": "1"}),
    (e.Overloaded(retry_after_s=4.0), {"Retry-After": "4"}),
    (e.NotReady("loading"), {"Retry-After": "5"}),
    (e.Unauthorized("no token"), {"WWW-Authenticate": 'Bearer realm="multihead"'}),
    (e.Forbidden("admin off"), {}),
    (e.ShuttingDown("bye"), {}),
    (RuntimeError("x"), {}),
])
def test_headers_of_errors(exc, headers):
    assert e.error_status(exc)[2] == headers


@pytest.mark.parametrize("exc", [e.ReplicaLost("replica died"),
                                 StoreUnavailable("the registry database is unreachable")],
                         ids=["replica-lost", "store-unavailable"])
def test_a_lost_replica_or_store_is_retried_after_a_second(exc):
    assert e.error_status(exc)[2] == {"Retry-After": "1"}


def test_an_overloaded_error_without_an_estimate_is_retried_after_a_second():
    class QueueFull(e.Overloaded):
        def __init__(self, message: str) -> None:  # skips Overloaded's: no retry_after_s
            e.ServiceError.__init__(self, message)

    exc = QueueFull("queue full")
    assert not hasattr(exc, "retry_after_s")
    assert e.error_status(exc) == (503, "overloaded", {"Retry-After": "1"})


@pytest.mark.parametrize("clone", [copy.copy, lambda x: pickle.loads(pickle.dumps(x))],
                         ids=["copy", "pickle"])
def test_a_copied_overloaded_error_keeps_its_estimate_and_message(clone):
    for exc in (e.Overloaded(2.5), e.Overloaded(7, "queue full")):
        got = clone(exc)
        assert type(got) is e.Overloaded and got is not exc
        assert (got.retry_after_s, str(got)) == (exc.retry_after_s, str(exc))


def _raised(exc: BaseException) -> BaseException:
    try:
        try:
            raise KeyError("the cause")
        except KeyError as cause:
            raise exc from cause
    except BaseException as caught:  # noqa: BLE001 - returned to the test
        return caught


def test_each_waiter_gets_its_own_copy_with_the_original_traceback_and_cause():
    original = _raised(e.Overloaded(3.0))
    clone = e.copy_for_waiter(original)
    assert type(clone) is e.Overloaded and clone is not original
    assert (clone.retry_after_s, str(clone)) == (3.0, str(original))
    assert clone.__traceback__ is original.__traceback__
    assert clone.__cause__ is original.__cause__ and isinstance(clone.__cause__, KeyError)


class _Fussy(Exception):
    """An exception whose constructor `copy.copy` cannot call again."""

    def __init__(self, a: str, b: str) -> None:
        super().__init__(f"{a} {b}")


def test_an_exception_that_cannot_be_copied_is_wrapped_with_it_as_the_cause():
    original = _raised(_Fussy("cannot", "copy"))
    with pytest.raises(TypeError):
        copy.copy(original)
    clone = e.copy_for_waiter(original)
    assert type(clone) is e.BatchError and str(clone) == "internal server error"
    assert clone.__cause__ is original
    assert clone.__traceback__ is original.__traceback__


def test_known_errors_show_their_message_and_unknown_ones_never_leak():
    assert e.error_body(e.BadRequest("top_k must be >= 1, got 'abc'")) == {
        "error": "top_k must be >= 1, got 'abc'", "code": "bad_request"}
    assert e.error_body(e.ShuttingDown()) == {"error": "ShuttingDown", "code": "shutting_down"}
    leak = RuntimeError("/srv/secret.ckpt: InceptionV4/Conv2d_1a_3x3 failed")
    assert e.error_body(leak) == {"error": e.INTERNAL_MESSAGE, "code": "internal"}
    assert e.INTERNAL_MESSAGE == "internal server error"


def test_overloaded_message_names_the_estimate():
    assert str(e.Overloaded(retry_after_s=2.25)) == "server overloaded, retry after 2.2 s"
    assert str(e.Overloaded()) == "server overloaded, retry after 1.0 s"
    assert e.Overloaded().retry_after_s == 1.0
    assert str(e.Overloaded(3, "queue full")) == "queue full"


@pytest.mark.parametrize("seconds, header", [(0.0, "1"), (1.0, "1"), (1.01, "2"), (59.5, "60")])
def test_retry_after_header_is_whole_seconds_rounded_up(seconds, header):
    assert e.retry_after_header(seconds) == header
