"""The hot-state URL forms: one node, a Redis Cluster, a master behind Sentinel."""

from __future__ import annotations

import pytest

from pdserve.common.errors import ConfigError
from pdserve.common.redis_url import RedisEndpoint, parse_endpoint
from pdserve.common.settings import CommonSettings
from pdserve.common.settings_parsers import REDIS_URL


def test_cluster_and_sentinel_urls_name_their_hosts_master_and_database() -> None:
    assert parse_endpoint("redis+cluster://a:7000,b:7001") == RedisEndpoint(
        "redis+cluster", (("a", 7000), ("b", 7001)))
    assert parse_endpoint("redis+sentinel://u:p%40ss@a:26379,[::1]:26380/mymaster/3"
                          "?replica_acks=1") == RedisEndpoint(
        "redis+sentinel", (("a", 26379), ("::1", 26380)), "u", "p@ss", "mymaster", 3, 1)
    assert parse_endpoint("redis+sentinel://a:1/m").db == 0


@pytest.mark.parametrize("url", [
    "redis+cluster://a", "redis+cluster://a:0", "redis+cluster://:1", "redis+cluster://a:1/2",
    "redis+cluster://a:1?replica_acks=1", "redis+sentinel://a:1", "redis+sentinel://a:1/m/x",
    "redis+sentinel://a:1/m/0/1", "redis+sentinel://a:1/m?replicas=1",
    "redis+sentinel://a:1/m?replica_acks=-1", "redis+sentinel:///m",
])
def test_a_malformed_url_is_refused_naming_the_setting(url: str) -> None:
    with pytest.raises(ConfigError, match="PDSERVE_REDIS_URL"):
        parse_endpoint(url)
    with pytest.raises(ValueError):
        REDIS_URL(url)


def test_the_setting_takes_every_form() -> None:
    for url in ("memory://", "redis://h:6379/0", "rediss://h:6380/1", "redis+cluster://a:1,b:2",
                "redis+sentinel://a:1,b:2/mymaster/0?replica_acks=1"):
        assert CommonSettings(redis_url=url).redis_url == url
    with pytest.raises(ValueError):
        REDIS_URL("redis+clusters://a:1")
