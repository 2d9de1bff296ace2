"""Settings: defaults, the `MULTIHEAD_*` environment, flags over the environment, the one
resolver the other commands share, what `multihead serve --help` says, redaction, and every
rule at its boundary (the limit accepted, one step past it refused with the exact message a user
reads). The bounds, choices and non-empty rules are generated from the fields' metadata, so a
new setting with a constraint cannot skip them; the rules between fields and the literal
messages are listed by hand."""
from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import math
import re

import pytest

from cli.options import store_dir, trunk_kwargs, trunk_prefix
from service.core.setting_fields import CONSTRAINTS, InvalidSettings
from service.core.settings import Deployment, Settings

DEPLOYMENT_FIELDS = {f.name for f in dataclasses.fields(Deployment)}


def build(**flat) -> Settings:
    """`Settings` constructed directly, from settings named as flags name them (a deployment
    setting goes to the `Deployment`)."""
    deployment = {name: flat.pop(name) for name in list(flat) if name in DEPLOYMENT_FIELDS}
    return Settings(**flat, deployment=Deployment(**deployment)) if deployment \
        else Settings(**flat)


def value(settings: Settings, name: str):
    return getattr(settings.deployment if name in DEPLOYMENT_FIELDS else settings, name)


def refused(**overrides) -> str:
    with pytest.raises(InvalidSettings) as info:
        build(**overrides)
    return str(info.value)


def from_env(**env: str) -> Settings:
    return Settings.from_env_and_args(None, environ={f"MULTIHEAD_{k.upper()}": v
                                                     for k, v in env.items()})


def env_refused(**env: str) -> str:
    with pytest.raises(InvalidSettings) as info:
        from_env(**env)
    return str(info.value)


# -- defaults -------------------------------------------------------------------------------------


def test_defaults_are_valid_and_safe():
    s = Settings.from_env_and_args(None, environ={})
    assert s == Settings()
    assert (s.host, s.port, s.max_batch_size, s.max_wait_ms) == ("127.0.0.1", 8080, 16, 5.0)
    assert s.max_body_bytes == 20 * 1024 * 1024
    assert s.admin_token is None and not s.admin_enabled
    assert s.batch_policy == "mixed" and s.warmup is True
    # The trunk: the fastest this machine has (OpenVINO on a CPU when installed; int8 where a
    # passing INT8 trunk exists, else bf16 where the CPU has it, else fp32).
    assert (s.runtime, s.precision) == ("auto", "auto")


def test_grpc_and_autoscaling_are_off_unless_set():
    s = Settings()
    assert (s.grpc_port, s.deployment.min_replicas, s.deployment.max_replicas,
            s.deployment.ray_address, s.ray) == (None, None, None, None, False)
    assert (s.deployment.replicas, s.deployment.fewest_replicas) == (1, 1)


def test_settings_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Settings().port = 1  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        Settings().deployment.replicas = 2  # type: ignore[misc]


def test_every_setting_has_one_name_flag_and_variable():
    names = [f.name for f in Settings.flat_fields()]
    assert len(names) == len(set(names))
    assert "deployment" not in names and {"ray", "replicas", "replica_gpus"} <= set(names)
    assert [f.name for f in dataclasses.fields(Deployment)] == \
        names[names.index("ray") + 1:names.index("ray") + 1 + len(DEPLOYMENT_FIELDS)]


# -- the environment ------------------------------------------------------------------------------


def test_environment_variables_are_parsed_to_each_fields_type():
    env = {
        "MULTIHEAD_MAX_BATCH_SIZE": "8",
        "MULTIHEAD_MAX_WAIT_MS": "2.5",
        "MULTIHEAD_ADMIN_TOKEN": "s3cret-token",
        "MULTIHEAD_WARMUP": "off",
        "MULTIHEAD_TRUNK_CHECKPOINT": "/ckpt/inception_v4.ckpt",
        "MULTIHEAD_BATCH_POLICY": "per_group",
        "MULTIHEAD_HOST": "0.0.0.0",
        "MULTIHEAD_REPLICAS": "3",
        "MULTIHEAD_REPLICA_GPUS": "0.5",
        "UNRELATED": "x",
    }
    s = Settings.from_env_and_args(None, environ=env)
    assert s.max_batch_size == 8 and isinstance(s.max_batch_size, int)
    assert s.max_wait_ms == 2.5
    assert s.admin_token == "s3cret-token" and s.admin_enabled
    assert s.warmup is False
    assert s.trunk_checkpoint == "/ckpt/inception_v4.ckpt"
    assert s.batch_policy == "per_group"
    assert s.host == "0.0.0.0"
    assert (s.deployment.replicas, s.deployment.replica_gpus) == (3, 0.5)


@pytest.mark.parametrize("text, want", [
    ("1", True), ("true", True), (" Yes ", True), ("ON", True),
    ("0", False), ("false", False), ("No", False), (" off ", False),
])
def test_boolean_variables_accept_the_usual_words_in_any_case(text, want):
    assert from_env(warmup=text).warmup is want
    assert from_env(graph_cache=text).graph_cache is want
    assert from_env(cancel_on_disconnect=text).cancel_on_disconnect is want


@pytest.mark.parametrize("env, message", [
    ({"warmup": "perhaps"},
     "MULTIHEAD_WARMUP='perhaps': expected one of 1/0, true/false, yes/no, on/off"),
    ({"warmup": ""}, "MULTIHEAD_WARMUP='': expected one of 1/0, true/false, yes/no, on/off"),
    ({"max_batch_size": "many"}, "MULTIHEAD_MAX_BATCH_SIZE='many': expected an integer"),
    ({"max_batch_size": "8.5"}, "MULTIHEAD_MAX_BATCH_SIZE='8.5': expected an integer"),
    ({"port": ""}, "MULTIHEAD_PORT='': expected an integer"),  # only optional fields go unset
    ({"max_wait_ms": "fast"}, "MULTIHEAD_MAX_WAIT_MS='fast': expected a number"),
    ({"max_wait_ms": ""}, "MULTIHEAD_MAX_WAIT_MS='': expected a number"),
    ({"replica_cpus": "two"}, "MULTIHEAD_REPLICA_CPUS='two': expected a number"),
])
def test_unparsable_variables_are_refused_naming_the_variable_and_the_type(env, message):
    assert env_refused(**env) == message


@pytest.mark.parametrize("env, message", [
    ({"max_batch_size": "0"}, "max_batch_size must be >= 1, got 0"),
    ({"max_wait_ms": "-1"}, "max_wait_ms must be >= 0, got -1.0"),
    ({"port": "70000"}, "port must be <= 65535, got 70000"),
    ({"batch_policy": "per_bot"}, "batch_policy must be one of mixed, per_group, got 'per_bot'"),
    ({"device": "tpu"}, "device must be auto, cpu, gpu or gpu:N, got 'tpu'"),
    ({"request_timeout_s": "0"}, "request_timeout_s must be > 0, got 0.0"),
    ({"max_queue_rows": "16"}, "max_queue_rows (16) must be >= max_images_per_request (32)"),
    ({"replicas": "0"}, "replicas must be >= 1, got 0"),
    ({"replicas": "3", "max_replicas": "2"}, "max_replicas must be >= 3, got 2"),
])
def test_invalid_variables_are_refused_naming_the_field_and_value(env, message):
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
    s = from_env(trunk_checkpoint=text, admin_token=text, max_replicas=text, ray_address=text)
    assert s.trunk_checkpoint is None and s.admin_token is None and not s.admin_enabled
    assert s.deployment.max_replicas is None and s.deployment.ray_address is None


def test_only_unknown_multihead_variables_are_warned_about(caplog):
    env = {"MULTIHEAD_MAX_BATCH": "4", "MULTIHEAD_PORT": "9000", "PORT": "1",
           "XMULTIHEAD_HOST": "x", "MULTIHEAD_REPLICAS": "2", "MULTIHEAD_DEPLOYMENT": "x"}
    with caplog.at_level(logging.WARNING, logger="service.core.settings"):
        s = Settings.from_env_and_args(None, environ=env)
    assert (s.port, s.deployment.replicas) == (9000, 2)
    assert [r.getMessage() for r in caplog.records] == [
        "ignoring unknown environment variable MULTIHEAD_MAX_BATCH",
        "ignoring unknown environment variable MULTIHEAD_DEPLOYMENT"]


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
                                "--batch-policy", "per_group", "--host", "0.0.0.0",
                                "--store", "/data", "--replicas", "4", "--ray"])
    env = {"MULTIHEAD_PORT": "1234", "MULTIHEAD_MAX_BATCH_SIZE": "8", "MULTIHEAD_WARMUP": "on",
           "MULTIHEAD_REPLICAS": "2", "MULTIHEAD_INGRESS_REPLICAS": "3"}
    s = Settings.from_env_and_args(args, environ=env)
    assert (s.port, s.max_wait_ms, s.warmup, s.batch_policy, s.host, s.store) == (
        9000, 2.5, False, "per_group", "0.0.0.0", "/data")
    assert type(s.port) is int and type(s.max_wait_ms) is float
    assert s.max_batch_size == 8  # from the environment: no flag given
    assert s.request_timeout_s == 30.0  # the default where neither is given
    assert (s.ray, s.deployment.replicas, s.deployment.ingress_replicas) == (True, 4, 3)
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


def test_help_describes_the_group_and_every_setting_with_its_env_var_and_default():
    text = parser().format_help()
    assert "serve settings:\n  each flag can also be set by its MULTIHEAD_* variable; flags win" \
        in text
    lines = help_lines()
    assert len(lines) == len(Settings.flat_fields())
    for f in Settings.flat_fields():
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
    ("--ray, --no-ray", "(env MULTIHEAD_RAY; default: False)"),
    ("--replicas N", "Ray Serve replicas (a fixed count; see --max-replicas) "
                     "(env MULTIHEAD_REPLICAS; default: 1)"),
    ("--max-replicas N", "(env MULTIHEAD_MAX_REPLICAS; default: unset)"),
    ("--replica-gpus X", "(env MULTIHEAD_REPLICA_GPUS; default: 0.0)"),
    ("--ray-address RAY_ADDRESS", "(env MULTIHEAD_RAY_ADDRESS; default: unset)"),
])
def test_help_shows_each_flags_value_form_and_default(flag, shown):
    line = help_lines()[flag.split()[0].rstrip(",")]
    assert line.startswith(f"  {flag} ") and line.endswith(shown)


def test_fields_of_a_subclass_get_flags_and_variables_like_the_others():
    # A help text with '%' (argparse expands %-formats in help), a field without a help text,
    # and a real type instead of a string annotation (no `from __future__ import annotations`).
    extended = dataclasses.make_dataclass(
        "Extended",
        [("share", "float", dataclasses.field(default=0.5, metadata={"help": "50% = half"})),
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
    assert "s3cret" not in repr(extended(admin_token="s3cret"))


# -- a mapping (a Ray Serve config's args) ------------------------------------------------------


def test_from_mapping_parses_text_like_the_environment_and_refuses_unknown_names():
    s = Settings.from_mapping({"port": "9000", "warmup": "off", "max_wait_ms": "2.5",
                               "replicas": 3, "trunk_checkpoint": None},
                              environ={"MULTIHEAD_MAX_BATCH_SIZE": "8", "MULTIHEAD_PORT": "1"})
    assert (s.port, s.warmup, s.max_wait_ms, s.deployment.replicas, s.trunk_checkpoint) == (
        9000, False, 2.5, 3, None)
    assert s.max_batch_size == 8  # the environment still applies where the mapping is silent
    with pytest.raises(InvalidSettings) as info:
        Settings.from_mapping({"port": "x"}, environ={})
    assert str(info.value) == "port='x': expected an integer"
    with pytest.raises(InvalidSettings) as info:
        Settings.from_mapping({"nope": 1, "bogus": 2, "port": 1}, environ={})
    assert str(info.value) == "unknown setting(s): bogus, nope"
    with pytest.raises(InvalidSettings) as info:
        Settings.from_mapping({"deployment": Deployment()}, environ={})
    assert str(info.value) == "unknown setting(s): deployment"  # a group is not a setting


# -- the one resolver: flag, else environment, else default ---------------------------------------


def test_resolve_takes_the_flag_else_the_variable_else_the_default():
    env = {"MULTIHEAD_STORE": "/env/store", "MULTIHEAD_MAX_REPLICAS": "4"}
    assert Settings.resolve("store", "/flag/store", env) == "/flag/store"
    assert Settings.resolve("store", None, env) == "/env/store"
    assert Settings.resolve("store", None, {}) == "checkpoints"
    assert Settings.resolve("max_replicas", None, env) == 4
    assert Settings.resolve("max_replicas", None, {}) is None
    with pytest.raises(InvalidSettings) as info:
        Settings.resolve("precision", None, {"MULTIHEAD_PRECISION": "fp64"})
    assert str(info.value) == "precision must be one of fp32, bf16, fp16, int8, auto, got 'fp64'"
    with pytest.raises(InvalidSettings) as info:
        Settings.resolve("port", "9000", {})
    assert str(info.value) == "port must be int, got '9000'"
    with pytest.raises(KeyError):
        Settings.resolve("deployment")


def test_the_other_commands_resolve_store_trunk_and_features_as_serve_does():
    flags = argparse.Namespace(store="/flag", trunk_checkpoint="/t/ckpt", precision="fp32",
                               runtime=None)
    env = {"MULTIHEAD_STORE": "/env", "MULTIHEAD_RUNTIME": "openvino",
           "MULTIHEAD_TRUNK_CHECKPOINT": "/env/ckpt"}
    assert store_dir(flags, env) == "/flag"
    assert store_dir(argparse.Namespace(), env) == "/env"
    assert store_dir(argparse.Namespace(), {}) == "checkpoints"
    assert trunk_prefix(flags, env) == "/t/ckpt"
    assert trunk_prefix(argparse.Namespace(), env) == "/env/ckpt"
    assert trunk_prefix(argparse.Namespace(store="/s"), {"MULTIHEAD_TRUNK_CHECKPOINT": " "}) \
        .startswith("/s/trunk/")  # a blank variable is unset: the store's own trunk
    assert trunk_kwargs(flags, env) == {"precision": "fp32", "runtime": "openvino"}
    assert trunk_kwargs(argparse.Namespace(), {}) == {"precision": "auto", "runtime": "auto"}
    with pytest.raises(InvalidSettings) as info:
        trunk_kwargs(argparse.Namespace(), {"MULTIHEAD_RUNTIME": "onnx"})
    assert str(info.value) == "runtime must be one of tf, openvino, auto, got 'onnx'"
    with pytest.raises(InvalidSettings) as info:
        store_dir(argparse.Namespace(), {"MULTIHEAD_STORE": ""})
    assert str(info.value) == "store must not be empty"


# -- redaction ------------------------------------------------------------------------------------


def test_the_admin_token_is_never_shown():
    s = Settings(admin_token="s3cret-token", port=9000)
    assert "s3cret" not in repr(s) and "admin_token=***" in repr(s)
    public = s.public_dict()
    assert public["admin_token"] == "***" and public["port"] == 9000
    assert s.admin_token == "s3cret-token"  # the settings themselves keep it
    assert "has space" not in env_refused(admin_token="has space")
    assert refused(admin_token=123) == "admin_token must be str, got ***"


def test_a_store_url_is_shown_without_its_password():
    s = Settings(store="postgresql://me:pa55@db:5432/heads?password=pa55&sslmode=require")
    assert "pa55" not in repr(s) and "pa55" not in str(s.public_dict())
    assert s.public_dict()["store"] == \
        "postgresql://me:***@db:5432/heads?password=***&sslmode=require"
    assert s.store.count("pa55") == 2  # the settings themselves keep it


def test_public_dict_redacts_only_a_set_secret_or_a_password():
    assert Settings().public_dict()["admin_token"] is None
    assert Settings().public_dict() == dataclasses.asdict(Settings())
    plain = build(store="/data/store", ray_address="ray://head:10001", replicas=2)
    assert plain.public_dict() == dataclasses.asdict(plain)
    assert plain.public_dict()["deployment"]["replicas"] == 2


# -- types ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, message", [
    ({"port": True}, "port must be int, got True"),
    ({"port": 8080.0}, "port must be int, got 8080.0"),
    ({"max_batch_size": "16"}, "max_batch_size must be int, got '16'"),
    ({"max_wait_ms": True}, "max_wait_ms must be float, got True"),
    ({"max_wait_ms": "5"}, "max_wait_ms must be float, got '5'"),
    ({"host": None}, "host must be str, got None"),
    ({"trunk_checkpoint": 5}, "trunk_checkpoint must be str, got 5"),
    ({"admin_token": 123}, "admin_token must be str, got ***"),  # never the value itself
    ({"warmup": 1}, "warmup must be bool, got 1"),
    ({"replicas": 2.0}, "replicas must be int, got 2.0"),
    ({"ray_address": 1}, "ray_address must be str, got 1"),
])
def test_a_value_of_the_wrong_type_is_refused_naming_the_field_and_type(overrides, message):
    assert refused(**overrides) == message


def test_the_deployment_must_be_a_deployment():
    with pytest.raises(InvalidSettings) as info:
        Settings(deployment={"replicas": 2})
    assert str(info.value) == "deployment must be Deployment, got {'replicas': 2}"


def test_an_int_is_a_valid_float_and_none_is_valid_where_a_field_is_optional():
    s = build(max_wait_ms=5, request_timeout_s=2, trunk_checkpoint=None, admin_token=None,
              replica_cpus=2, min_replicas=None)
    assert (s.max_wait_ms, s.request_timeout_s, s.deployment.replica_cpus) == (5, 2, 2)
    assert s.trunk_checkpoint is None and s.admin_token is None


def test_replace_validates_again():
    with pytest.raises(InvalidSettings, match="preprocess_threads must be >= 1, got 0"):
        Settings().replace(preprocess_threads=0)
    assert Settings().replace(store="/x").store == "/x"


# -- every rule at its boundary: generated from the fields' metadata ------------------------------

# Other settings a value at its limit needs, for the rules between fields to hold.
COMPANIONS = {"max_queue_rows": {"max_images_per_request": 1}}
OPERATORS = {"at_least": ">=", "above": ">", "at_most": "<="}
# Constraint kinds this file generates cases for; "check" (a rule of its own) is listed in
# CHECKED and tested by hand below.
GENERATED = {*OPERATORS, "choices", "non_empty"}
CHECKED = {"device", "admin_token", "pin"}


def _constrained(*kinds: str):
    return [pytest.param(f, kind, id=f"{f.name}-{kind}")
            for f in Settings.flat_fields() for kind in kinds if kind in f.metadata]


def _is_float(f: dataclasses.Field) -> bool:
    return f.type.startswith("float")


def test_every_kind_of_constraint_is_tested_here():
    assert set(CONSTRAINTS) == GENERATED | {"check"}
    assert {f.name for f in Settings.flat_fields() if "check" in f.metadata} == CHECKED
    assert len(_constrained(*OPERATORS)) >= 25  # the generator found the bounds


@pytest.mark.parametrize("f, kind", _constrained(*OPERATORS))
def test_every_bound_accepts_its_limit_and_refuses_one_step_past_it(f, kind):
    bound = f.metadata[kind]
    outward = -math.inf if kind in ("at_least", "above") else math.inf
    if _is_float(f):
        limit, past = float(bound), math.nextafter(bound, outward)
        if kind == "above":
            limit, past = math.nextafter(bound, -outward), float(bound)
    else:
        limit, past = bound, bound + (1 if outward > 0 else -1)
        if kind == "above":
            limit, past = bound + 1, bound
    accepted = build(**{f.name: limit, **COMPANIONS.get(f.name, {})})
    assert value(accepted, f.name) == limit
    assert refused(**{f.name: past}) == f"{f.name} must be {OPERATORS[kind]} {bound}, got {past}"


@pytest.mark.parametrize("f, kind", [p for p in _constrained("at_least", "above")
                                     if _is_float(p.values[0])])
def test_nan_is_refused_where_a_number_has_a_lower_bound(f, kind):
    bound = f.metadata[kind]
    assert refused(**{f.name: math.nan}) == \
        f"{f.name} must be {OPERATORS[kind]} {bound}, got nan"
    assert env_refused(**{f.name: "nan"}) == f"{f.name} must be {OPERATORS[kind]} {bound}, got nan"


@pytest.mark.parametrize("f, kind", _constrained("choices"))
def test_every_choice_is_accepted_and_another_name_refused(f, kind):
    for choice in f.metadata[kind]:
        assert value(build(**{f.name: choice}), f.name) == choice
    assert refused(**{f.name: "other"}) == \
        f"{f.name} must be one of {', '.join(f.metadata[kind])}, got 'other'"


@pytest.mark.parametrize("f, kind", _constrained("non_empty"))
def test_a_name_must_not_be_empty(f, kind):
    hint = " (leave it unset for the default)" if f.type.endswith("| None") else ""
    assert refused(**{f.name: ""}) == f"{f.name} must not be empty{hint}"
    assert value(build(**{f.name: "x"}), f.name) == "x"


# -- every rule at its boundary: the literal messages, and the rules between fields ---------------

# (settings at the limit: accepted), (the same settings one step past it), the message.
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


@pytest.mark.parametrize("at_limit, past_limit, message", BOUNDARIES,
                         ids=[m.split(" ")[0] + f"-{i}" for i, (_, _, m) in
                              enumerate(BOUNDARIES)])
def test_each_limit_accepts_its_boundary_and_refuses_one_step_past_it(at_limit, past_limit,
                                                                      message):
    s = build(**at_limit)
    assert {k: value(s, k) for k in at_limit} == at_limit
    assert refused(**past_limit) == message


@pytest.mark.parametrize("name, message", [
    ("max_wait_ms", "max_wait_ms must be >= 0, got nan"),
    ("request_timeout_s", "request_timeout_s must be > 0, got nan"),
])
def test_nan_is_refused_from_the_environment(name, message):
    assert env_refused(**{name: "nan"}) == message


# -- names, devices, tokens, choices, pinned bots ---------------------------------------------------


@pytest.mark.parametrize("overrides, message", [
    ({"host": ""}, "host must not be empty"),
    ({"store": ""}, "store must not be empty"),
    ({"trunk_checkpoint": ""}, "trunk_checkpoint must not be empty (leave it unset for the "
                               "default)"),
    ({"batch_policy": "per_bot"}, "batch_policy must be one of mixed, per_group, got 'per_bot'"),
    ({"precision": "fp64"}, "precision must be one of fp32, bf16, fp16, int8, auto, got 'fp64'"),
    ({"runtime": "onnx"}, "runtime must be one of tf, openvino, auto, got 'onnx'"),
])
def test_empty_names_and_unknown_choices_are_refused(overrides, message):
    assert refused(**overrides) == message


def test_a_trunk_checkpoint_and_every_choice_are_accepted():
    assert Settings(trunk_checkpoint="/ckpt/x.ckpt").trunk_checkpoint == "/ckpt/x.ckpt"
    for policy in ("mixed", "per_group"):
        assert Settings(batch_policy=policy).batch_policy == policy
    for precision in ("fp32", "bf16", "fp16", "int8", "auto"):
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


def test_a_valid_admin_token_is_accepted():
    assert Settings(admin_token="s3cret-token").admin_token == "s3cret-token"


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


# -- fair sharing: the serve defaults of every tenant --------------------------------------------

TENANT_DEFAULTS = {"tenant_weight": (0.0, 1000.0, False), "tenant_rate": (0.0, 1e6, False),
                   "tenant_burst": (1, 1_000_000, True), "tenant_max_queued": (1, 1_000_000, True)}


@pytest.mark.parametrize("name", sorted(TENANT_DEFAULTS))
def test_fuzzed_tenant_defaults_are_refused_in_one_line_naming_the_setting(name):
    from hypothesis import given, settings
    from hypothesis import strategies as st

    low, high, integer = TENANT_DEFAULTS[name]
    texts = st.one_of(st.floats(allow_nan=True, allow_infinity=True).map(repr),
                      st.integers(-10**9, 10**9).map(str), st.text(max_size=12),
                      st.sampled_from(["nan", "inf", "-inf", "1e309", "0", "-1", "1.5", "2"]))

    @settings(max_examples=150, deadline=None)
    @given(text=texts)
    def check(text):
        variable = f"MULTIHEAD_{name.upper()}"
        try:
            value = getattr(Settings.from_env_and_args(None, {variable: text}), name)
        except InvalidSettings as exc:
            message = str(exc)
            assert "\n" not in message and (name in message or variable in message), message
            return
        if value is None:  # an empty variable leaves an optional setting unset
            assert name != "tenant_weight" and not text.strip(), text
            return
        assert (low < value <= high) if not integer else (low <= value <= high), value
        assert math.isfinite(value) and (not integer or isinstance(value, int))

    check()


def test_the_scheduler_is_fair_by_default_and_fifo_on_request():
    assert Settings().scheduler == "fair"
    assert Settings.from_env_and_args(None, {"MULTIHEAD_SCHEDULER": "fifo"}).scheduler == "fifo"
    with pytest.raises(InvalidSettings, match="scheduler must be one of fair, fifo"):
        Settings(scheduler="wfq")


def test_quotas_are_divided_between_ray_replicas_never_beyond_the_rate():
    assert Settings().quota_divisor == 1
    assert Settings(ray=True, deployment=Deployment(replicas=3)).quota_divisor == 3
    assert Settings(ray=True, deployment=Deployment(min_replicas=1, max_replicas=4)
                    ).quota_divisor == 4
    assert Settings(deployment=Deployment(replicas=3)).quota_divisor == 1  # not under Ray
