"""Settings, rule by rule: each limit at its boundary (the limit accepted, one step past it
refused with the exact message a user reads), the type checks, the environment parser per field
type, and what the flags and `multihead serve --help` say."""
from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import re

import pytest

from service.core.settings import InvalidSettings, Settings, _help


def refused(**overrides) -> str:
    with pytest.raises(InvalidSettings) as info:
        Settings(**overrides)
    return str(info.value)


def from_env(**env: str) -> Settings:
    return Settings.from_env_and_args(None, environ={f"MULTIHEAD_{k.upper()}": v
                                                     for k, v in env.items()})


def env_refused(**env: str) -> str:
    with pytest.raises(InvalidSettings) as info:
        from_env(**env)
    return str(info.value)


# -- limits ---------------------------------------------------------------------------------------

# (fields at the limit: accepted), (the same fields one step past it), the message.
BOUNDARIES = [
    ({"port": 0}, {"port": -1}, "port must be >= 0, got -1"),
    ({"port": 65535}, {"port": 65536}, "port must be <= 65535, got 65536"),
    ({"max_batch_size": 1}, {"max_batch_size": 0}, "max_batch_size must be >= 1, got 0"),
    ({"max_wait_ms": 0.0}, {"max_wait_ms": -0.5}, "max_wait_ms must be >= 0, got -0.5"),
    ({"max_queue_rows": 1, "max_images_per_request": 1},
     {"max_queue_rows": 0, "max_images_per_request": 1}, "max_queue_rows must be >= 1, got 0"),
    ({"request_timeout_s": 0.001}, {"request_timeout_s": 0.0},
     "request_timeout_s must be > 0, got 0.0"),
    ({"request_timeout_s": 0.001}, {"request_timeout_s": -1.0},
     "request_timeout_s must be > 0, got -1.0"),
    ({"max_body_bytes": 1}, {"max_body_bytes": 0}, "max_body_bytes must be >= 1, got 0"),
    ({"max_ws_message_bytes": 1}, {"max_ws_message_bytes": 0},
     "max_ws_message_bytes must be >= 1, got 0"),
    ({"max_body_bytes": 8, "max_ws_message_bytes": 1, "max_inflight_bytes": 8},
     {"max_body_bytes": 8, "max_ws_message_bytes": 1, "max_inflight_bytes": 7},
     "max_body_bytes (8) must be <= max_inflight_bytes (7)"),
    ({"max_body_bytes": 1, "max_ws_message_bytes": 8, "max_inflight_bytes": 8},
     {"max_body_bytes": 1, "max_ws_message_bytes": 9, "max_inflight_bytes": 8},
     "max_ws_message_bytes (9) must be <= max_inflight_bytes (8)"),
    ({"max_image_pixels": 1}, {"max_image_pixels": 0}, "max_image_pixels must be >= 1, got 0"),
    ({"max_images_per_request": 1}, {"max_images_per_request": 0},
     "max_images_per_request must be >= 1, got 0"),
    ({"max_queue_rows": 8, "max_images_per_request": 8},
     {"max_queue_rows": 7, "max_images_per_request": 8},
     "max_queue_rows (7) must be >= max_images_per_request (8)"),
    ({"top_k_default": 1}, {"top_k_default": 0}, "top_k_default must be >= 1, got 0"),
    ({"feature_cache_size": 0}, {"feature_cache_size": -1},
     "feature_cache_size must be >= 0, got -1"),
    ({"heads_memory_mb": 1}, {"heads_memory_mb": 0}, "heads_memory_mb must be >= 1, got 0"),
    ({"preprocess_threads": 1}, {"preprocess_threads": 0},
     "preprocess_threads must be >= 1, got 0"),
    ({"metrics_top_bots": 0}, {"metrics_top_bots": -1}, "metrics_top_bots must be >= 0, got -1"),
]


@pytest.mark.parametrize("at_limit, past_limit, message", BOUNDARIES,
                         ids=[m.split(" ")[0] for _, _, m in BOUNDARIES])
def test_each_limit_accepts_its_boundary_and_refuses_one_step_past_it(at_limit, past_limit,
                                                                      message):
    s = Settings(**at_limit)
    assert {k: getattr(s, k) for k in at_limit} == at_limit
    assert refused(**past_limit) == message


@pytest.mark.parametrize("name, message", [
    ("max_wait_ms", "max_wait_ms must be >= 0, got nan"),
    ("request_timeout_s", "request_timeout_s must be > 0, got nan"),
])
def test_nan_is_refused_where_a_number_has_a_lower_bound(name, message):
    assert env_refused(**{name: "nan"}) == message


# -- types ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, message", [
    ({"port": True}, "port must be int, got True"),
    ({"port": 8080.0}, "port must be int, got 8080.0"),
    ({"max_wait_ms": True}, "max_wait_ms must be float, got True"),
    ({"max_wait_ms": "5"}, "max_wait_ms must be float, got '5'"),
    ({"host": None}, "host must be str, got None"),
    ({"trunk_checkpoint": 5}, "trunk_checkpoint must be str, got 5"),
    ({"admin_token": 123}, "admin_token must be str, got ***"),  # never the value itself
    ({"warmup": 1}, "warmup must be bool, got 1"),
])
def test_a_value_of_the_wrong_type_is_refused_naming_the_field_and_type(overrides, message):
    assert refused(**overrides) == message


def test_an_int_is_a_valid_float_and_none_is_valid_where_a_field_is_optional():
    s = Settings(max_wait_ms=5, request_timeout_s=2, trunk_checkpoint=None, admin_token=None)
    assert (s.max_wait_ms, s.request_timeout_s) == (5, 2)
    assert s.trunk_checkpoint is None and s.admin_token is None


# -- names, devices, tokens, choices ----------------------------------------------------------------


@pytest.mark.parametrize("overrides, message", [
    ({"host": ""}, "host must not be empty"),
    ({"store": ""}, "store must not be empty"),
    ({"trunk_checkpoint": ""}, "trunk_checkpoint must not be empty (leave it unset for the "
                               "default)"),
    ({"batch_policy": "per_bot"}, "batch_policy must be one of mixed, per_group, got 'per_bot'"),
    ({"precision": "fp64"}, "precision must be one of fp32, bf16, fp16, auto, got 'fp64'"),
    ({"runtime": "onnx"}, "runtime must be one of tf, openvino, auto, got 'onnx'"),
])
def test_empty_names_and_unknown_choices_are_refused(overrides, message):
    assert refused(**overrides) == message


def test_a_trunk_checkpoint_and_every_choice_are_accepted():
    assert Settings(trunk_checkpoint="/ckpt/x.ckpt").trunk_checkpoint == "/ckpt/x.ckpt"
    for policy in ("mixed", "per_group"):
        assert Settings(batch_policy=policy).batch_policy == policy
    for precision in ("fp32", "bf16", "fp16", "auto"):
        assert Settings(precision=precision).precision == precision
    for runtime in ("tf", "openvino", "auto"):
        assert Settings(runtime=runtime).runtime == runtime


@pytest.mark.parametrize("device", ["auto", "cpu", "gpu", "gpu:0", "gpu:12"])
def test_valid_devices(device):
    assert Settings(device=device).device == device


@pytest.mark.parametrize("device", [
    "", "tpu", "GPU", "cpu:0", "gpu:", "gpu:x", "gpu:-1", "gpu:0:1", "gpu:1.5",
    "gpu:\u00b2",  # '²': str.isdigit() says yes, int() says no
    "gpu:\u0661",  # Arabic-Indic one: a digit, but not an ASCII one
])
def test_invalid_devices_are_refused_naming_the_forms_allowed(device):
    assert refused(device=device) == f"device must be auto, cpu, gpu or gpu:N, got {device!r}"


@pytest.mark.parametrize("token", ["", "two words", "tab\tinside", "newline\n", " "])
def test_an_empty_or_spaced_admin_token_is_refused_without_echoing_it(token):
    assert refused(admin_token=token) == "admin_token must be non-empty and contain no whitespace"


def test_public_dict_redacts_only_a_set_admin_token():
    s = Settings(admin_token="s3cret-token", port=9000)
    public = s.public_dict()
    assert public["admin_token"] == "***" and public["port"] == 9000
    assert s.admin_token == "s3cret-token"  # the settings themselves keep it
    assert Settings().public_dict()["admin_token"] is None
    assert Settings().public_dict() == dataclasses.asdict(Settings())


# -- the environment ------------------------------------------------------------------------------


@pytest.mark.parametrize("text, want", [
    ("1", True), ("true", True), (" Yes ", True), ("ON", True),
    ("0", False), ("false", False), ("No", False), (" off ", False),
])
def test_boolean_variables_accept_the_usual_words_in_any_case(text, want):
    assert from_env(warmup=text).warmup is want
    assert from_env(graph_cache=text).graph_cache is want


@pytest.mark.parametrize("env, message", [
    ({"warmup": "perhaps"},
     "MULTIHEAD_WARMUP='perhaps': expected one of 1/0, true/false, yes/no, on/off"),
    ({"warmup": ""}, "MULTIHEAD_WARMUP='': expected one of 1/0, true/false, yes/no, on/off"),
    ({"max_batch_size": "8.5"}, "MULTIHEAD_MAX_BATCH_SIZE='8.5': expected an integer"),
    ({"port": ""}, "MULTIHEAD_PORT='': expected an integer"),  # only optional fields go unset
    ({"max_wait_ms": "fast"}, "MULTIHEAD_MAX_WAIT_MS='fast': expected a number"),
    ({"max_wait_ms": ""}, "MULTIHEAD_MAX_WAIT_MS='': expected a number"),
    ({"port": "70000"}, "port must be <= 65535, got 70000"),
])
def test_unparsable_variables_are_refused_naming_the_variable_and_the_type(env, message):
    assert env_refused(**env) == message


def test_variables_are_parsed_to_their_fields_type_around_whitespace():
    s = from_env(max_batch_size=" 8 ", max_wait_ms=" 3 ", request_timeout_s="2.5",
                 store="/data/store")
    assert s.max_batch_size == 8 and type(s.max_batch_size) is int
    assert s.max_wait_ms == 3.0 and type(s.max_wait_ms) is float
    assert s.request_timeout_s == 2.5
    assert s.store == "/data/store"


@pytest.mark.parametrize("text", ["", "   "])
def test_a_blank_optional_variable_means_unset(text):
    s = from_env(trunk_checkpoint=text, admin_token=text)
    assert s.trunk_checkpoint is None and s.admin_token is None and not s.admin_enabled


def test_only_unknown_multihead_variables_are_warned_about(caplog):
    env = {"MULTIHEAD_MAX_BATCH": "4", "MULTIHEAD_PORT": "9000", "PORT": "1",
           "XMULTIHEAD_HOST": "x"}
    with caplog.at_level(logging.WARNING, logger="service.core.settings"):
        s = Settings.from_env_and_args(None, environ=env)
    assert s.port == 9000
    assert [r.getMessage() for r in caplog.records] == [
        "ignoring unknown environment variable MULTIHEAD_MAX_BATCH"]


# -- flags ----------------------------------------------------------------------------------------


def parser(cls=Settings) -> argparse.ArgumentParser:
    # Wide enough that each flag's help is one line: "  --flag METAVAR   help ...".
    wide = functools.partial(argparse.HelpFormatter, width=100_000, max_help_position=100)
    p = argparse.ArgumentParser(prog="multihead serve", formatter_class=wide)
    cls.add_arguments(p)
    return p


def help_lines(cls=Settings) -> dict[str, str]:
    """`--flag` -> its line of `--help`."""
    return {line.split()[0].rstrip(","): line for line in parser(cls).format_help().splitlines()
            if line.startswith("  --")}


def test_flags_override_the_environment_and_absent_flags_do_not():
    args = parser().parse_args(["--port", "9000", "--max-wait-ms", "2.5", "--no-warmup",
                                "--batch-policy", "per_group", "--host", "0.0.0.0"])
    env = {"MULTIHEAD_PORT": "1234", "MULTIHEAD_MAX_BATCH_SIZE": "8", "MULTIHEAD_WARMUP": "on"}
    s = Settings.from_env_and_args(args, environ=env)
    assert (s.port, s.max_wait_ms, s.warmup, s.batch_policy, s.host) == (
        9000, 2.5, False, "per_group", "0.0.0.0")
    assert type(s.port) is int and type(s.max_wait_ms) is float
    assert s.max_batch_size == 8  # from the environment: no flag given
    assert parser().parse_args(["--warmup"]).warmup is True


def test_a_namespace_need_not_carry_every_field():
    s = Settings.from_env_and_args(argparse.Namespace(port=9000, store=None),
                                   environ={"MULTIHEAD_STORE": "/data"})
    assert (s.port, s.store, s.max_batch_size) == (9000, "/data", Settings().max_batch_size)


def test_a_flag_outside_its_choices_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        parser().parse_args(["--batch-policy", "per_bot"])
    assert info.value.code == 2
    assert "invalid choice: 'per_bot'" in capsys.readouterr().err


def test_help_describes_the_group_and_every_flag_with_its_env_var_and_default():
    text = parser().format_help()
    assert "serve settings:\n  each flag can also be set by its MULTIHEAD_* variable; flags win" \
        in text
    lines = help_lines()
    for f in dataclasses.fields(Settings):
        line = lines["--" + f.name.replace("_", "-")]
        assert " ".join(f.metadata["help"].split()) in line, f.name
        assert f"(env {Settings.env_var(f.name)}; default: " in line, f.name


@pytest.mark.parametrize("flag, shown", [
    ("--host HOST", "address to listen on (env MULTIHEAD_HOST; default: 127.0.0.1)"),
    ("--port N", "(env MULTIHEAD_PORT; default: 8080)"),
    ("--max-wait-ms X", "(env MULTIHEAD_MAX_WAIT_MS; default: 5.0)"),
    ("--trunk-checkpoint TRUNK_CHECKPOINT", "(env MULTIHEAD_TRUNK_CHECKPOINT; default: unset)"),
    ("--admin-token ADMIN_TOKEN", "(env MULTIHEAD_ADMIN_TOKEN; default: unset)"),
    ("--max-body-bytes N", "(env MULTIHEAD_MAX_BODY_BYTES; default: 20971520 = 20 MiB)"),
    ("--max-inflight-bytes N", "(env MULTIHEAD_MAX_INFLIGHT_BYTES; default: 268435456 = 256 MiB)"),
    ("--batch-policy {mixed,per_group}", "(env MULTIHEAD_BATCH_POLICY; default: mixed)"),
    ("--warmup, --no-warmup", "(env MULTIHEAD_WARMUP; default: True)"),
])
def test_help_shows_each_flags_value_form_and_default(flag, shown):
    line = help_lines()[flag.split()[0].rstrip(",")]
    assert line.startswith(f"  {flag} ") and line.endswith(shown)


def test_fields_of_a_subclass_get_flags_and_variables_like_the_others():
    # A help text with '%' (argparse expands %-formats in help), a field without a help text,
    # and a real type instead of a string annotation (no `from __future__ import annotations`).
    extended = dataclasses.make_dataclass(
        "Extended",
        [("share", "float", dataclasses.field(default=0.5, metadata=_help("50% = half"))),
         ("retries", int, dataclasses.field(default=3))],
        bases=(Settings,), frozen=True)
    lines = help_lines(extended)
    assert lines["--share"].endswith("50% = half (env MULTIHEAD_SHARE; default: 0.5)")
    assert re.fullmatch(r"  --retries N +\(env MULTIHEAD_RETRIES; default: 3\)", lines["--retries"])
    s = extended.from_env_and_args(parser(extended).parse_args(["--share", "0.25"]),
                                   environ={"MULTIHEAD_RETRIES": " 4 "})
    assert (s.share, s.retries) == (0.25, 4)
    with pytest.raises(InvalidSettings) as info:
        extended(retries="4")
    assert str(info.value) == "retries must be int, got '4'"


# -- gRPC, pinned bots, Ray Serve -----------------------------------------------------------------

MORE_BOUNDARIES = [
    ({"grpc_port": 0}, {"grpc_port": -1}, "grpc_port must be >= 0, got -1"),
    ({"grpc_port": 65535}, {"grpc_port": 65536}, "grpc_port must be <= 65535, got 65536"),
    ({"port": 8080, "grpc_port": 8081}, {"port": 8080, "grpc_port": 8080},
     "grpc_port must differ from port (8080)"),
    ({"port": 0, "grpc_port": 0}, {"port": 1, "grpc_port": 1},  # 0 and 0: two free ports
     "grpc_port must differ from port (1)"),
    ({"preload": 0}, {"preload": -1}, "preload must be >= 0, got -1"),
    ({"replicas": 1}, {"replicas": 0}, "replicas must be >= 1, got 0"),
    ({"ingress_replicas": 1}, {"ingress_replicas": 0}, "ingress_replicas must be >= 1, got 0"),
    ({"min_replicas": 0}, {"min_replicas": -1}, "min_replicas must be >= 0, got -1"),
    # max_replicas: at least min_replicas when set, else replicas; at least 1 either way
    ({"replicas": 3, "max_replicas": 3}, {"replicas": 3, "max_replicas": 2},
     "max_replicas must be >= 3, got 2"),
    ({"replicas": 5, "min_replicas": 2, "max_replicas": 2},
     {"replicas": 5, "min_replicas": 2, "max_replicas": 1}, "max_replicas must be >= 2, got 1"),
    ({"min_replicas": 0, "max_replicas": 1}, {"min_replicas": 0, "max_replicas": 0},
     "max_replicas must be >= 1, got 0"),
    ({"target_ongoing_requests": 0.5}, {"target_ongoing_requests": 0.0},
     "target_ongoing_requests must be > 0, got 0.0"),
    ({"max_ongoing_requests": 1}, {"max_ongoing_requests": 0},
     "max_ongoing_requests must be >= 1, got 0"),
    ({"replica_cpus": 0.0}, {"replica_cpus": -0.5}, "replica_cpus must be >= 0, got -0.5"),
    ({"replica_gpus": 0.0}, {"replica_gpus": -0.5}, "replica_gpus must be >= 0, got -0.5"),
]


@pytest.mark.parametrize("at_limit, past_limit, message", MORE_BOUNDARIES,
                         ids=[m.split(" ")[0] + f"-{i}" for i, (_, _, m) in
                              enumerate(MORE_BOUNDARIES)])
def test_grpc_and_ray_limits_accept_their_boundary_and_refuse_one_step_past_it(
        at_limit, past_limit, message):
    s = Settings(**at_limit)
    assert {k: getattr(s, k) for k in at_limit} == at_limit
    assert refused(**past_limit) == message


def test_grpc_and_autoscaling_are_off_unless_set():
    s = Settings()
    assert (s.grpc_port, s.min_replicas, s.max_replicas, s.ray_address, s.ray) == (
        None, None, None, None, False)


@pytest.mark.parametrize("pin, bots", [
    (None, ()), ("", ()), ("acme", ("acme",)), ("a, b,,a , c", ("a", "b", "c")),
    (" , ", ()),
])
def test_pinned_bots_are_the_listed_ids_in_order_without_duplicates(pin, bots):
    assert Settings(pin=pin).pinned_bots == bots


def test_a_pinned_bot_id_must_be_a_valid_bot_id():
    assert refused(pin="acme,../etc") == (
        "pin: invalid bot id '../etc': use 1-64 characters from A-Z a-z 0-9 . _ -, starting "
        "with a letter or digit")


def test_from_mapping_parses_text_like_the_environment_and_refuses_unknown_names():
    s = Settings.from_mapping({"port": "9000", "warmup": "off", "max_wait_ms": "2.5",
                               "replicas": 3, "trunk_checkpoint": None},
                              environ={"MULTIHEAD_MAX_BATCH_SIZE": "8", "MULTIHEAD_PORT": "1"})
    assert (s.port, s.warmup, s.max_wait_ms, s.replicas, s.trunk_checkpoint) == (
        9000, False, 2.5, 3, None)
    assert s.max_batch_size == 8  # the environment still applies where the mapping is silent
    with pytest.raises(InvalidSettings) as info:
        Settings.from_mapping({"port": "x"}, environ={})
    assert str(info.value) == "port='x': expected an integer"
    with pytest.raises(InvalidSettings) as info:
        Settings.from_mapping({"nope": 1, "bogus": 2, "port": 1}, environ={})
    assert str(info.value) == "unknown setting(s): bogus, nope"
