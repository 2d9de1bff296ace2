"""The one table from errors to HTTP: status, code, headers and what the client may read."""
from __future__ import annotations

import pytest

from backbone.errors import CheckpointError, ImageTooLarge, InvalidImage
from heads.errors import (
    HeadLoadError,
    InvalidBotId,
    InvalidHead,
    InvalidTrainingData,
    TrunkMismatch,
    UnknownBot,
    UnknownVersion,
)
from service.core import errors as e


@pytest.mark.parametrize("exc, status, code", [
    (e.BadRequest("x"), 400, "bad_request"),
    (e.Unauthorized("x"), 401, "unauthorized"),
    (e.Forbidden("x"), 403, "forbidden"),
    (e.NotFound("x"), 404, "not_found"),
    (e.PayloadTooLarge("x"), 413, "payload_too_large"),
    (e.UnsupportedMediaType("x"), 415, "unsupported_media_type"),
    (e.Overloaded(2.0), 503, "overloaded"),
    (e.ShuttingDown("x"), 503, "shutting_down"),
    (e.NotReady("x"), 503, "not_ready"),
    (e.HeadUnavailable("x"), 500, "head_unavailable"),
    (e.DeadlineExceeded("x"), 504, "deadline_exceeded"),
    (e.BatchError("x"), 500, "internal"),
    (InvalidImage("x"), 400, "invalid_image"),
    (ImageTooLarge("x"), 413, "image_too_large"),
    (CheckpointError("x"), 500, "trunk_unavailable"),
    (UnknownBot("x"), 404, "unknown_bot"),
    (UnknownVersion("x"), 404, "unknown_version"),
    (InvalidBotId("x"), 400, "invalid_bot_id"),
    (InvalidHead("x"), 422, "invalid_head"),
    (HeadLoadError("x"), 422, "invalid_head"),
    (TrunkMismatch("x"), 422, "trunk_mismatch"),
    (InvalidTrainingData("x"), 400, "invalid_training_data"),
    (RuntimeError("/secret/path"), 500, "internal"),
    (e.ServiceError("x"), 500, "internal"),
], ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else None)
def test_every_error_maps_to_its_status_and_code(exc, status, code):
    got_status, got_code, _ = e.error_status(exc)
    assert (got_status, got_code) == (status, code)
    assert e.error_body(exc)["code"] == code


def test_a_subclass_maps_like_its_nearest_listed_base():
    class Special(e.BadRequest):
        pass

    assert e.error_status(Special("x"))[:2] == (400, "bad_request")


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
