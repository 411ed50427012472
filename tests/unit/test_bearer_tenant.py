"""The HTTP side of the key machinery: an ``Authorization`` header's bearer key -> its tenant, with
the refusals the OpenAI API answers 401 with."""

from __future__ import annotations

import pytest

from pdserve.common.credentials import KeyTable, bearer_tenant
from pdserve.common.errors import UnauthenticatedError

KEYS = KeyTable({"key-a": "tenant-a", "key-b": "tenant-b"})


def test_a_known_bearer_key_names_its_tenant() -> None:
    assert bearer_tenant("Bearer key-b", KEYS) == "tenant-b"
    assert bearer_tenant("  bearer   key-a ", KEYS) == "tenant-a"


@pytest.mark.parametrize(("authorization", "message"), [
    ("", "Missing API key: send 'Authorization: Bearer <key>'"),
    ("Bearer", "Missing API key: send 'Authorization: Bearer <key>'"),
    ("key-a", "Missing API key: send 'Authorization: Bearer <key>'"),
    ("Bearer key-c", "Incorrect API key provided"),
    ("Basic key-a", "Incorrect API key provided"),
])
def test_refusals(authorization: str, message: str) -> None:
    with pytest.raises(UnauthenticatedError) as caught:
        bearer_tenant(authorization, KEYS)
    assert caught.value.message == message


def test_a_key_table_is_a_read_only_mapping_that_never_echoes_a_key() -> None:
    assert dict(KEYS.items()) == {"key-a": "tenant-a", "key-b": "tenant-b"} and len(KEYS) == 2
    assert KEYS.lookup("key-a") == "tenant-a" and KEYS.lookup("key-") is None
    with pytest.raises(KeyError) as caught:
        KEYS["secret-guess"]
    assert "secret-guess" not in str(caught.value)
