"""Settings: defaults, MULTIHEAD_* environment, CLI flags over env, validation messages."""
from __future__ import annotations

import argparse
import dataclasses

import pytest

from service.core.settings import Settings


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="multihead serve")
    Settings.add_arguments(p)
    return p


def test_defaults_are_valid_and_safe():
    s = Settings.from_env_and_args(None, environ={})
    assert s == Settings()
    assert (s.host, s.port, s.max_batch_size, s.max_wait_ms) == ("127.0.0.1", 8080, 16, 5.0)
    assert s.max_body_bytes == 20 * 1024 * 1024
    assert s.admin_token is None and not s.admin_enabled
    assert s.batch_policy == "mixed" and s.warmup is True


def test_environment_variables_are_parsed_to_each_fields_type():
    env = {
        "MULTIHEAD_MAX_BATCH_SIZE": "8",
        "MULTIHEAD_MAX_WAIT_MS": "2.5",
        "MULTIHEAD_ADMIN_TOKEN": "s3cret-token",
        "MULTIHEAD_WARMUP": "off",
        "MULTIHEAD_TRUNK_CHECKPOINT": "/ckpt/inception_v4.ckpt",
        "MULTIHEAD_BATCH_POLICY": "per_group",
        "MULTIHEAD_HOST": "0.0.0.0",
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


def test_empty_optional_variable_means_unset():
    s = Settings.from_env_and_args(None, environ={"MULTIHEAD_ADMIN_TOKEN": ""})
    assert s.admin_token is None


def test_cli_flags_override_environment_and_absent_flags_do_not():
    env = {"MULTIHEAD_MAX_BATCH_SIZE": "8", "MULTIHEAD_PORT": "9000", "MULTIHEAD_WARMUP": "1"}
    args = parser().parse_args(["--max-batch-size", "32", "--no-warmup", "--store", "/data"])
    s = Settings.from_env_and_args(args, environ=env)
    assert s.max_batch_size == 32  # flag beats env
    assert s.port == 9000  # env kept where no flag was given
    assert s.warmup is False
    assert s.store == "/data"
    assert s.max_wait_ms == 5.0  # default where neither is given


@pytest.mark.parametrize(
    "env, message",
    [
        ({"MULTIHEAD_MAX_BATCH_SIZE": "0"}, "max_batch_size must be >= 1, got 0"),
        ({"MULTIHEAD_MAX_BATCH_SIZE": "many"},
         "MULTIHEAD_MAX_BATCH_SIZE='many': expected an integer"),
        ({"MULTIHEAD_MAX_WAIT_MS": "-1"}, "max_wait_ms must be >= 0, got -1.0"),
        ({"MULTIHEAD_WARMUP": "perhaps"}, "MULTIHEAD_WARMUP='perhaps'"),
        ({"MULTIHEAD_PORT": "70000"}, "port must be <= 65535, got 70000"),
        ({"MULTIHEAD_BATCH_POLICY": "per_bot"}, "batch_policy must be one of mixed, per_group"),
        ({"MULTIHEAD_DEVICE": "tpu"}, "device must be"),
        ({"MULTIHEAD_REQUEST_TIMEOUT_S": "0"}, "request_timeout_s must be > 0"),
        ({"MULTIHEAD_MAX_QUEUE_ROWS": "16"},
         "max_queue_rows (16) must be >= max_images_per_request (32)"),
    ],
)
def test_invalid_values_raise_naming_the_field_and_value(env, message):
    with pytest.raises(ValueError) as info:
        Settings.from_env_and_args(None, environ=env)
    assert message in str(info.value)


def test_direct_construction_validates_too():
    with pytest.raises(ValueError, match="max_batch_size must be >= 1, got 0"):
        Settings(max_batch_size=0)
    with pytest.raises(ValueError, match="max_batch_size must be int"):
        Settings(max_batch_size="16")
    with pytest.raises(ValueError, match="must be >= 1"):
        Settings().replace(preprocess_threads=0)


def test_admin_token_is_never_shown():
    s = Settings(admin_token="s3cret-token")
    assert "s3cret" not in repr(s)
    assert s.public_dict()["admin_token"] == "***"
    with pytest.raises(ValueError) as info:
        Settings.from_env_and_args(None, environ={"MULTIHEAD_ADMIN_TOKEN": "has space"})
    assert "has space" not in str(info.value)


def test_settings_are_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        Settings().port = 1  # type: ignore[misc]


def test_help_documents_every_field_with_its_env_var():
    text = parser().format_help()
    for f in dataclasses.fields(Settings):
        assert "--" + f.name.replace("_", "-") in text, f.name
        assert Settings.env_var(f.name) in " ".join(text.split()), f.name
