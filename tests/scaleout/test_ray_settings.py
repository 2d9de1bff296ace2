"""The Ray Serve deployment settings and the options Ray gets from them, and the
transport-neutral body reader. (Each deployment setting's bounds and messages are in
tests/service/core/test_settings.py, generated from the field metadata.)"""
from __future__ import annotations

import pytest

from service.core import admission
from service.core.admission import ByteBudget, Reservation
from service.core.errors import BadRequest, Overloaded, PayloadTooLarge
from service.core.setting_fields import InvalidSettings
from service.core.settings import Deployment, Settings


def test_fixed_replicas_and_per_replica_resources():
    from service.transports.ray.serve import deployment_options

    options = deployment_options(Settings(ray=True, deployment=Deployment(
        replicas=3, replica_cpus=2.0, replica_gpus=0.5, max_ongoing_requests=40)))
    assert options["num_replicas"] == 3 and "autoscaling_config" not in options
    assert options["ray_actor_options"] == {"num_cpus": 2.0, "num_gpus": 0.5}
    assert options["max_ongoing_requests"] == 40
    assert "num_gpus" not in deployment_options(Settings())["ray_actor_options"]


def test_max_replicas_turns_autoscaling_on_from_replicas_or_min_replicas():
    from service.transports.ray.serve import deployment_options

    auto = deployment_options(Settings(deployment=Deployment(
        replicas=2, max_replicas=5, target_ongoing_requests=8)))
    assert "num_replicas" not in auto
    assert auto["autoscaling_config"] == {"min_replicas": 2, "max_replicas": 5,
                                          "target_ongoing_requests": 8.0}
    scaled = deployment_options(Settings(deployment=Deployment(min_replicas=0, max_replicas=2)))
    assert scaled["autoscaling_config"]["min_replicas"] == 0


@pytest.mark.parametrize("changes,message", [
    (dict(replicas=0), "replicas must be >= 1"),
    (dict(ingress_replicas=0), "ingress_replicas must be >= 1"),
    (dict(min_replicas=-1, max_replicas=1), "min_replicas must be >= 0"),
    (dict(replicas=3, max_replicas=2), "max_replicas must be >= 3"),
    (dict(min_replicas=0, max_replicas=0), "max_replicas must be >= 1"),
    (dict(target_ongoing_requests=0), "target_ongoing_requests must be > 0"),
    (dict(max_ongoing_requests=0), "max_ongoing_requests must be >= 1"),
    (dict(replica_cpus=-0.5), "replica_cpus must be >= 0"),
    (dict(replica_gpus=-1.0), "replica_gpus must be >= 0"),
])
def test_invalid_ray_settings_are_refused_naming_the_field(changes, message):
    with pytest.raises(InvalidSettings, match=message):
        Deployment(**changes)


def test_local_paths_become_absolute_for_replicas_and_urls_stay(tmp_path, monkeypatch):
    from service.transports.ray.serve import _absolute

    monkeypatch.chdir(tmp_path)
    local = _absolute(Settings(store="st", trunk_checkpoint="t/ckpt",
                               deployment=Deployment(replicas=2)))
    assert local.store == str(tmp_path / "st")
    assert local.trunk_checkpoint == str(tmp_path / "t" / "ckpt")
    assert local.deployment == Deployment(replicas=2)  # the deployment travels along
    url = "postgresql://u@h:5432/db"
    assert _absolute(Settings(store=url, trunk_checkpoint="/abs/ckpt")).store == url


def test_settings_from_a_ray_config_mapping_parse_text_and_refuse_unknown_names():
    settings = Settings.from_mapping({"replicas": "2", "ray": "yes", "replica_cpus": 0.5},
                                     environ={"MULTIHEAD_MAX_BATCH_SIZE": "4"})
    assert (settings.deployment.replicas, settings.ray, settings.deployment.replica_cpus) == (
        2, True, 0.5)
    assert settings.max_batch_size == 4  # the environment still counts, under the args
    with pytest.raises(InvalidSettings, match="unknown setting"):
        Settings.from_mapping({"replica": 2}, environ={})
    with pytest.raises(InvalidSettings, match="replicas='two'"):
        Settings.from_mapping({"replicas": "two"}, environ={})


async def _chunks(*parts: bytes):
    for part in parts:
        yield part


async def test_a_declared_length_fills_one_buffer_and_must_match():
    with Reservation(ByteBudget(100)) as held:
        admission.admit(6, 10, held)
        assert held.bytes == 6
        assert await admission.read_body(_chunks(b"abc", b"def"), 6, 10, held) == b"abcdef"
        with pytest.raises(BadRequest, match="body of 3 bytes, its Content-Length says 6"):
            await admission.read_body(_chunks(b"abc"), 6, 10, held)
        with pytest.raises(BadRequest, match="longer than its Content-Length of 4"):
            await admission.read_body(_chunks(b"abc", b"def"), 4, 10, held)


async def test_admission_refuses_over_the_limit_and_over_the_budget_before_reading():
    budget = ByteBudget(10)
    with Reservation(budget) as held:
        with pytest.raises(PayloadTooLarge):
            admission.admit(11, 10, held)
        admission.admit(8, 10, held)
        with Reservation(budget) as other:
            with pytest.raises(Overloaded):
                admission.admit(3, 10, other)
    assert budget.used_bytes == 0


async def test_a_chunked_body_is_counted_as_it_streams_and_cut_at_the_limit():
    budget = ByteBudget(100)
    with Reservation(budget) as held:
        assert await admission.read_body(_chunks(b"ab", b"cd"), None, 10, held) == b"abcd"
        assert held.bytes == 4
    with Reservation(budget) as held:
        with pytest.raises(PayloadTooLarge):
            await admission.read_body(_chunks(b"x" * 6, b"y" * 6), None, 10, held)
    assert budget.used_bytes == 0
