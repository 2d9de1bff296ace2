"""`store.open_store`: which backend a location names, and what it refuses (no server needed)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from store import HeadStore, InvalidStoreLocation, StoreUnavailable, open_store
from store.backend import parse_location, redact_url
from store.errors import StoreError

REPO = Path(__file__).resolve().parents[2]
# Nothing listens on port 1: connecting is refused at once.
DEAD_URL = "postgresql://someone:s3cret@127.0.0.1:1/heads"


@pytest.mark.parametrize("location, scheme", [
    ("s3://bucket/heads", "s3"),
    ("file:///srv/heads", "file"),
    ("https://example.org/heads", "https"),
    ("mysql://user@db/heads", "mysql"),
    ("sqlite:///srv/registry.sqlite", "sqlite"),
    ("S3://Bucket/heads", "s3"),
    ("redis:/0", "redis"),
])
@pytest.mark.parametrize("opener", [open_store, HeadStore], ids=["open_store", "HeadStore"])
def test_an_unknown_scheme_is_refused_and_nothing_is_created(tmp_path, monkeypatch, opener,
                                                             location, scheme):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InvalidStoreLocation) as exc:
        opener(location)
    message = str(exc.value)
    assert f"'{scheme}://'" in message, message  # names the scheme...
    assert "postgresql://" in message and "postgres://" in message and "directory" in message
    assert isinstance(exc.value, StoreError)  # the CLI prints it as one line, exit 2
    assert list(tmp_path.iterdir()) == []  # ...and no folder named 's3:' or the like


@pytest.mark.parametrize("location", ["postgresql:/db", "postgres:db", "PostgreSQL:host/db",
                                      "postgresql:/"])
def test_a_postgresql_url_without_slashes_is_refused(tmp_path, monkeypatch, location):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InvalidStoreLocation, match="malformed PostgreSQL store URL"):
        open_store(location)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("location", ["", "   ", None, 42])
def test_an_empty_or_non_path_location_is_refused(location):
    with pytest.raises(InvalidStoreLocation):
        open_store(location)


def test_paths_open_a_directory_store_and_create_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for location in ["store", "./with:colon", Path("as-path"), str(tmp_path / "abs"),
                     "data:v1", "C:/windows-ish"]:
        with open_store(location) as s:
            assert (s.kind, s.root, s.heads_dir) == ("sqlite", Path(location),
                                                      Path(location) / "heads")
            assert s.list() == [] and not s.exists("acme")
            assert repr(s) == f"HeadStore({str(Path(location))!r})"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("url", ["postgresql://u@h:5432/db", "postgres://u@h/db",
                                 "POSTGRESQL://u@h/db", "postgresql:///db?host=/run/pg"])
def test_postgresql_urls_name_the_postgresql_backend(url):
    kind, where = parse_location(url)
    assert kind == "postgresql" and where.lower() == url.lower()
    assert where.startswith(("postgresql://", "postgres://"))  # libpq wants lower case


def test_opening_a_postgresql_store_connects_lazily_and_hides_the_password(caplog):
    with open_store(DEAD_URL, heads_memory_mb=1, pinned=["acme"]) as s:  # no server: fine
        assert (s.kind, s.root, s.heads_dir, s.pinned) == ("postgresql", None, None,
                                                           frozenset({"acme"}))
        assert repr(s) == "HeadStore('postgresql://someone:***@127.0.0.1:1/heads')"
        with pytest.raises(StoreUnavailable) as exc:
            s.list()
        assert "unreachable" in str(exc.value) and "s3cret" not in str(exc.value)
        assert not s.exists("acme")  # an unreachable store on start-up: nothing known yet
    assert "s3cret" not in caplog.text


@pytest.mark.parametrize("url, shown", [
    ("postgresql://[::1/db", "<unparseable URL>"),  # urlsplit refuses it: nothing of it shown
    # The last @ ends the user info; the first : in it starts the password.
    ("postgresql://me@corp:p@ss:w@h/db", "postgresql://me@corp:***@h/db"),
    ("postgresql://u:a:b@h/db", "postgresql://u:***@h/db"),
    ("postgresql://h/db?PassWord=a=b&sslmode=require", "postgresql://h/db?password=***&sslmode=require"),
    ("postgresql://h/db?passwordx=1", "postgresql://h/db?passwordx=1"),
    ("postgresql://h/db", "postgresql://h/db"),
    ("postgresql://u:pw@h:1/db?sslmode=require&password=x",
     "postgresql://u:***@h:1/db?sslmode=require&password=***"),
    ("postgresql://u@h/db", "postgresql://u@h/db"),
])
def test_redact_url(url, shown):
    assert redact_url(url) == shown


def test_psycopg_is_imported_only_when_a_postgresql_store_is_opened(tmp_path):
    code = (f"import sys, store\n"
            f"store.open_store({str(tmp_path / 's')!r}).list()\n"
            f"before = 'psycopg' in sys.modules\n"
            f"store.open_store({DEAD_URL!r}).close()\n"
            f"print(before, 'psycopg' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.split() == ["False", "True"], out.stderr[-2000:]


@pytest.mark.parametrize("location, message", [
    (42, "a store location is a directory path or a postgresql:// URL, not int"),
    ("  ", "the store location is empty"),
    ("postgres:db", "malformed PostgreSQL store URL 'postgres:db': write "
                    "postgresql://user@host:port/dbname"),
    ("postgresql:/x", "malformed PostgreSQL store URL 'postgresql:/x': write "
                      "postgresql://user@host:port/dbname"),
    ("s3://b/h", "unsupported store scheme 's3://' in 's3://b/h': a store is a directory path "
                 "(SQLite registry and head files) or a postgresql:// or postgres:// URL "
                 "(PostgreSQL)"),
])
def test_parse_location_refusals_word_for_word(location, message):
    with pytest.raises(InvalidStoreLocation) as exc:
        parse_location(location)
    assert str(exc.value) == message
