"""Property tests of the pure codecs (hypothesis): whatever the bytes, a parser either returns a
typed result or raises a domain error (a 4xx); never anything else."""
from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from accounts.errors import AccountsError
from heads.errors import HeadsError
from service.codecs.common import parse_top_k
from service.codecs.native import parse_bot_ids, parse_multipart
from service.codecs.oip_tensors import parse_infer_request
from service.codecs.tfserving import parse_predict_request
from service.core.errors import ServiceError, error_status
from store.errors import StoreError

FAST = settings(max_examples=300, deadline=None,
                suppress_health_check=[HealthCheck.too_slow])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=True)
    | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.sampled_from(["name", "datatype", "shape", "data", "parameters",
                                       "inputs", "outputs", "instances", "b64", "id",
                                       "binary_data_size", "classification", "signature_name",
                                       "image_bytes"]), children, max_size=4),
    max_leaves=30)


def client_error(exc: BaseException) -> bool:
    return isinstance(exc, ServiceError | HeadsError | AccountsError | StoreError) and 400 <= error_status(exc)[0] < 500


@FAST
@given(body=st.binary(max_size=600), header=st.none() | st.text(max_size=8))
def test_oip_parser_on_arbitrary_bytes(body, header):
    try:
        parse_infer_request(body, header)
    except Exception as exc:  # noqa: BLE001 - the property: only client errors
        assert client_error(exc), repr(exc)


@FAST
@given(obj=json_values)
def test_oip_parser_on_arbitrary_json(obj):
    try:
        parse_infer_request(json.dumps(obj).encode(), None)
    except Exception as exc:  # noqa: BLE001
        assert client_error(exc), repr(exc)


@FAST
@given(obj=st.dictionaries(st.sampled_from(["instances", "inputs", "signature_name"]),
                           json_values, max_size=3))
def test_tfserving_parser_on_arbitrary_json(obj):
    try:
        parse_predict_request(obj)
    except Exception as exc:  # noqa: BLE001
        assert client_error(exc), repr(exc)


@FAST
@given(body=st.binary(max_size=400), boundary=st.text(max_size=12))
def test_multipart_parser_on_arbitrary_bytes(body, boundary):
    try:
        parse_multipart(f"multipart/form-data; boundary={boundary}", body)
    except Exception as exc:  # noqa: BLE001
        assert client_error(exc), repr(exc)


@FAST
@given(raw=st.text(max_size=200))
def test_query_parsers_on_arbitrary_text(raw):
    for parse in (lambda: parse_top_k({"top_k": raw}, 5), lambda: parse_bot_ids(raw)):
        try:
            parse()
        except Exception as exc:  # noqa: BLE001
            assert client_error(exc), repr(exc)
