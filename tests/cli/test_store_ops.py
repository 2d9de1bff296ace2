"""`multihead store copy|backup|restore|check` end to end: a store copied directory ->
PostgreSQL -> directory answers every key and bot exactly as the source does on a real server
(the session's real trunk); a backup taken while another process registers restores to a sound
store; a kill -9 of copy, backup and restore leaves the destination unchanged or detectably
incomplete, and --resume finishes it."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from cli.main import main
from service.transports.http.app import create_app
from store import HeadStore, open_store
from store.ops.copy import STALL_ENV
from tests.backbone.helpers import encode, pattern
from tests.store.test_ops import build, heads_of, rows_of
from tests.support.servers import ThreadedServer, make_settings

pytestmark = pytest.mark.timeout(300)

REPO = Path(__file__).resolve().parents[2]
OPERATOR_TOKEN = "operator-s3cret-token"
BOTS = ("a1", "a2", "g1", "d1", "gone", "nope")


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


async def _answers(url, tokens: dict[str, str], image: bytes, manage: str) -> dict:
    """Every answer of the server that may depend on the store: the audit log and the keys
    (read first: refusals below add audit records), then each bot through each key (none, an
    unknown one, every key of the store, the revoked one included), then a rollback."""
    out = {}
    operator = {"Authorization": f"Bearer {OPERATOR_TOKEN}"}
    async with aiohttp.ClientSession() as s:
        for path in ("/audit?limit=1000", "/keys", "/tenants", "/bots"):
            async with s.get(f"{url}{path}", headers=operator) as r:
                out[path] = (r.status, await r.json())
        callers = {"none": None, "unknown": "mhk_000000000000_nope", **tokens}
        for name, token in callers.items():
            headers = {"Authorization": f"Bearer {token}"} if token else {}
            async with s.get(f"{url}/bots", headers=headers) as r:
                out[(name, "bots")] = (r.status, await r.json())
            for bot in BOTS:
                async with s.post(f"{url}/classify/{bot}?top_k=5", data=image,
                                  headers={**headers, "Content-Type": "image/png"}) as r:
                    out[(name, bot)] = (r.status, await r.json())
        async with s.post(f"{url}/bots/a1/rollback?to=2",
                          headers={"Authorization": f"Bearer {manage}"}) as r:
            out["rollback"] = (r.status, await r.json())
        async with s.post(f"{url}/classify/a1", data=image,
                          headers={"Authorization": f"Bearer {manage}",
                                   "Content-Type": "image/png"}) as r:
            out["after rollback"] = (r.status, await r.json())
        async with s.get(f"{url}/audit?limit=1", headers=operator) as r:
            (last,) = (await r.json())["records"]
            out["audited"] = {k: last[k] for k in ("actor", "action", "tenant", "bot_id",
                                                  "version", "detail")}
    return out


def _serve(trunk, location, tmp_path, tokens, image, manage: str) -> dict:
    """The answers (`_answers`) of a real server on the store at `location`."""
    store = HeadStore(location)
    settings = make_settings(tmp_path, store=str(location), auth="keys",
                             admin_token=OPERATOR_TOKEN)
    server = ThreadedServer(create_app(settings, trunk=trunk, store=store))
    try:
        return asyncio.run(_answers(server.url, tokens, image, manage))
    finally:
        server.close()
        store.close()


@pytest.mark.postgresql
def test_a_store_copied_to_postgresql_and_back_answers_every_key_and_bot_alike(
        trunk, tmp_path, pg_url, capsys):
    source = tmp_path / "source"
    tokens = build(source)
    with open_store(source) as s:
        (manage,) = [tokens[k.id] for k in s.keys("acme") if k.scope == "manage"]
        names = {k.id: f"{k.tenant}-{k.scope}{'-revoked' if k.revoked else ''}"
                 for k in s.keys()}
    back = tmp_path / "back"
    code, out, _ = run(capsys, "store", "copy", source, pg_url)
    assert code == 0 and out.startswith("copied 4 bots (6 versions, 1 candidates)"), out
    code, out, _ = run(capsys, "store", "copy", pg_url, back)
    assert code == 0 and "6 API keys" in out, out
    image = encode(pattern(7, size=(320, 240)), "PNG")
    expected = _serve(trunk, source, tmp_path, tokens, image, manage)
    status = {(names.get(k[0], k[0]), k[1]): v[0] for k, v in expected.items()
              if isinstance(k, tuple)}
    assert status[("acme-infer", "a1")] == status[("globex-infer", "g1")] == 200
    assert status[("acme-infer", "g1")] == status[("globex-infer", "a1")] == 404
    assert status[("globex-manage-revoked", "g1")] == status[("none", "g1")] == 401
    assert status[("acme-metrics", "a1")] == 403
    assert expected["rollback"][0] == 200 and expected["audited"]["action"] == "rollback"
    assert len(expected["/audit?limit=1000"][1]["records"]) > 10
    for name, location in (("postgresql", pg_url), ("back", back)):
        assert _serve(trunk, location, tmp_path, tokens, image, manage) == expected, name



def _killed_after(n: int, *argv) -> None:
    """`multihead *argv` in a process of its own, killed (SIGKILL) once it has written its
    n-th bot (the test seam `STALL_ENV` holds it there)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), STALL_ENV: str(n)}
    proc = subprocess.Popen([sys.executable, "-m", "cli", *map(str, argv)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if line.startswith(f"stalled after {n} bots"):
            break
    proc.send_signal(signal.SIGKILL)
    out, _ = proc.communicate()
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, out, "".join(seen[-20:]))


@pytest.mark.subprocess
def test_a_copy_killed_midway_is_incomplete_until_resumed(tmp_path, capsys):
    # A directory destination: its version folders are written before the commit that a kill
    # never reaches (a PostgreSQL writer killed midway is rolled back by the server:
    # tests/store/test_writers.py; the resume there: tests/store/test_ops.py).
    source, location = tmp_path / "source", tmp_path / "copy"
    build(source)
    _killed_after(2, "store", "copy", source, location)
    code, out, _ = run(capsys, "store", "check", "--store", location)
    assert code == 1 and "problem: incomplete: a copy or restore from directory:" in out, out
    with open_store(location) as s:  # never half a bot; no key works before the end
        assert len(s.list()) == 2 and s.keys() == []
        for info in s.list():
            assert s.get(info.bot_id).version == info.version
    code, _, err = run(capsys, "store", "copy", source, location)
    assert code == 2 and "finish it with --resume" in err, err
    code, out, _ = run(capsys, "store", "copy", source, location, "--resume")
    assert code == 0 and "(2 kept from the interrupted copy, 0 dropped)" in out, out
    assert rows_of(location) == rows_of(source) and heads_of(location) == heads_of(source)
    assert run(capsys, "store", "check", "--store", location)[0] == 0
    # The killed copy's snapshot links in the source: orphans, removed by --fix.
    code, out, _ = run(capsys, "store", "check", "--store", source, "--fix")
    assert code == 0 and "orphan (removed): .ops-snapshot-" in out, out
    assert not list(source.glob(".ops-snapshot-*"))


@pytest.mark.subprocess
def test_a_backup_killed_midway_leaves_the_file_as_it_was(tmp_path, capsys):
    source, archive = tmp_path / "source", tmp_path / "store.tar"
    build(source)
    archive.write_bytes(b"yesterday's backup")
    _killed_after(2, "store", "backup", "--store", source, archive)
    assert archive.read_bytes() == b"yesterday's backup"
    code, _, err = run(capsys, "store", "restore", archive, "--store", tmp_path / "restored")
    assert code == 2 and "not a readable backup archive" in err and err.count("\n") == 1, err
    assert not (tmp_path / "restored").exists()


@pytest.mark.subprocess
def test_a_restore_killed_midway_is_incomplete_until_resumed(tmp_path, capsys):
    source, archive, restored = tmp_path / "source", tmp_path / "store.tar", tmp_path / "r"
    build(source)
    code, out, _ = run(capsys, "store", "backup", "--store", source, archive)
    assert code == 0 and out.startswith("backed up 4 bots (6 versions)"), out
    _killed_after(3, "store", "restore", archive, "--store", restored)
    code, out, _ = run(capsys, "store", "check", "--store", restored)
    assert code == 1 and "incomplete: a copy or restore from backup:" in out, out
    code, out, _ = run(capsys, "store", "restore", archive, "--store", restored, "--resume")
    assert code == 0 and "(3 kept" in out, out
    assert rows_of(restored) == rows_of(source) and heads_of(restored) == heads_of(source)
    assert run(capsys, "store", "check", "--store", restored)[0] == 0


WRITER = """
import sys
from heads.errors import UnknownBot
from store import HeadStore
from tests.support.builders import random_head

store = HeadStore(sys.argv[1])
for i in range(1, 100000):
    store.register(f"w{i % 7}", *random_head(2 + i % 3, seed=i))
    if i % 4 == 0:
        try:
            store.remove(f"w{(i * 3) % 7}")
        except UnknownBot:
            pass
    print(i, flush=True)
"""


@pytest.mark.subprocess
def test_a_backup_taken_while_another_process_registers_restores_sound(tmp_path, capsys):
    source = tmp_path / "source"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(source)], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        for line in writer.stdout:
            if int(line) >= 10:
                break
        archives = []
        for i in range(3):
            archives.append(tmp_path / f"b{i}.tar")
            code, out, _ = run(capsys, "store", "backup", "--store", source, archives[-1])
            assert code == 0, out
            time.sleep(0.2)
        for _ in range(3):  # the writer went on meanwhile
            writer.stdout.readline()
    finally:
        writer.kill()
        writer.wait()
    for i, archive in enumerate(archives):
        restored = tmp_path / f"r{i}"
        code, out, _ = run(capsys, "store", "restore", archive, "--store", restored)
        assert code == 0, out
        code, out, _ = run(capsys, "store", "check", "--store", restored)
        assert code == 0 and "sound; 0 orphans" in out, out
        with open_store(restored) as s:
            listed = s.list()
            assert listed
            for info in listed:
                for version in info.versions:
                    assert s.get(info.bot_id).version == info.version
                    assert version <= info.version or info.candidate is not None


def test_progress_goes_to_a_terminal_only_and_the_help_says_what_is_copied(
        tmp_path, capsys, monkeypatch):
    build(tmp_path / "source")
    code, out, err = run(capsys, "store", "copy", tmp_path / "source", tmp_path / "a")
    assert code == 0 and "bots:" not in err and out.startswith("copied 4 bots")
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    code, out, err = run(capsys, "store", "copy", tmp_path / "source", tmp_path / "b")
    assert code == 0 and err.endswith("\rcopying bots: 4/4\n"), err
    assert "bots:" not in out
    with pytest.raises(SystemExit):
        main(["store", "copy", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--resume" in text and "one consistent snapshot" in text
