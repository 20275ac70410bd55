"""The prefix cache on disk (prefix_store.py): snapshots survive a restart, restore byte for byte what a
cold prefill computes, and a truncated, corrupt or foreign file is skipped with one warning, never
changing an output."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import stat
import threading

import pytest
import torch

from exactspec.errors import ExactSpecError
from exactspec.prefix_store import MAGIC, SECRET, DiskPrefixStore
from exactspec.speculative.prefix_cache import PrefixCache
from exactspec.speculative.sampling import SamplingParams
from exactspec.stats import Stats

from .conftest import need

SYSTEM = ("You are a coding agent. Tools: read_file(path) returns a file's text; write_file(path, text) replaces it; "
          "run(cmd) runs a shell command and returns its output; search(query) greps the repository. Answer with "
          "one JSON tool call per step, or a one-line summary when the task is done. ") * 6
GREEDY = SamplingParams(temperature=0)


@pytest.fixture
def engine(embedded_llamacpp):
    need("llama_cpp")
    yield embedded_llamacpp
    embedded_llamacpp.set_prefix_cache(None)


def step(engine, user: str) -> tuple[list[int], Stats]:
    stats = Stats()
    ids = engine.encode([{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}])
    return list(engine.stream_ids(ids, GREEDY, 12, 4, 0, stats)), stats


def restart(engine, folder) -> PrefixCache:
    """A new process's prefix cache: memory empty, the same folder on disk."""
    engine.set_prefix_cache(64, folder, 64)
    return engine.prefix_cache


def kv_after(engine, ids: list[int]) -> bytes:
    """The target's KV bytes for `ids` as the prefix cache leaves them (restored + prefilled)."""
    lm = engine.target
    engine.prefix_cache.prefill(lm, ids)
    return bytes(lm.snapshot_prefix(len(ids))[0].buf)


def test_a_restart_finds_the_prompt_on_disk_and_restores_a_cold_prefills_bytes(engine, tmp_path):
    engine.set_prefix_cache(None)
    plain, cold = step(engine, "List the files.")
    assert cold.cached_tokens == 0
    cache = restart(engine, tmp_path)
    first, _ = step(engine, "List the files.")
    cache.spill.flush()
    assert first == plain and cache.spill.writes >= 1
    cache = restart(engine, tmp_path)  # restarted: nothing in memory
    assert len(cache) == 0
    again, stats = step(engine, "Read README.md.")  # the same system prompt, another question
    assert cache.restored == 1 and stats.cached_tokens > len(engine.encode([{"role": "system", "content": SYSTEM}])) // 2
    engine.set_prefix_cache(None)
    reference, _ = step(engine, "Read README.md.")
    assert again == reference
    # byte for byte: the restored prefix + the rest prefilled == a cold prefill of the same prompt
    ids = engine.encode([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Run the tests."}])[:-1]
    engine.target.reset()
    engine.target.prefill(torch.tensor([ids]))
    cold_bytes = bytes(engine.target.snapshot_prefix(len(ids))[0].buf)
    restart(engine, tmp_path)
    assert kv_after(engine, ids) == cold_bytes and engine.prefix_cache.restored == 1


def test_a_bad_file_is_skipped_with_one_warning_and_changes_nothing(engine, tmp_path, capsys):
    engine.set_prefix_cache(None)
    reference, _ = step(engine, "Summarise the repository.")
    cache = restart(engine, tmp_path)
    step(engine, "Summarise the repository.")
    cache.spill.flush()
    [good] = list(cache.spill.folder.glob("*.kv"))
    data = good.read_bytes()
    folder = cache.spill.folder
    (folder / "truncated.kv").write_bytes(data[: len(data) // 2])
    flipped = bytearray(data)
    flipped[-100] ^= 0xFF
    (folder / "corrupt.kv").write_bytes(bytes(flipped))
    (folder / "garbage.kv").write_bytes(b"not a kv file at all")
    (folder / "foreign.kv").write_bytes(data.replace(b'"key": "kv2|', b'"key": "kv0|', 1))
    good.unlink()
    capsys.readouterr()
    for _ in range(2):  # the second restart warns again (a new process), each file once per process
        restart(engine, tmp_path)
        out, stats = step(engine, "Summarise the repository.")
        assert out == reference and stats.cached_tokens == 0 and engine.prefix_cache.restored == 0
        warnings = [line for line in capsys.readouterr().err.splitlines() if "prefix cache on disk: skipped" in line]
        assert sorted(w.split("/")[-1].split(":")[0] for w in warnings) == ["corrupt.kv", "foreign.kv", "garbage.kv",
                                                                              "truncated.kv"], warnings
        engine.prefix_cache.spill.flush()
        for written in set(folder.glob("*.kv")) - {folder / f"{bad}.kv" for bad in ("truncated", "corrupt", "garbage",
                                                                                      "foreign")}:
            written.unlink()  # this step's own snapshot: the next start must meet only the bad files


def test_two_stores_sharing_a_folder_write_whole_files_within_the_budget(tmp_path):
    """Two servers' stores writing at once into one folder: every file there reads back whole (header,
    size, checksum), and the folder stays within the budget (least recently used removed first)."""
    stores = [DiskPrefixStore(tmp_path, "test-key", budget_mb=1) for _ in range(2)]
    payload = {n: bytes([n % 251]) * 100_000 for n in range(30)}

    def write(store, ns):
        for n in ns:
            store.keep([n, n + 1000, 7], lambda n=n: payload[n])
        store.flush()

    threads = [threading.Thread(target=write, args=(s, range(i, 30, 2))) for i, s in enumerate(stores)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    files = list(stores[0].folder.glob("*.kv"))
    assert files and sum(f.stat().st_size for f in files) <= 2**20
    reader = DiskPrefixStore(tmp_path, "test-key", budget_mb=1)
    assert reader.skipped == 0 and len(reader.index) == len(files)
    for ids in reader.index.values():
        held, data = reader.load(ids)
        assert held == ids and data == payload[ids[0]]
    assert not list(stores[0].folder.glob("*.tmp*"))
    assert all(f.read_bytes().startswith(MAGIC) for f in files)


def test_a_longer_sequence_supersedes_its_prefix_on_disk(tmp_path):
    store = DiskPrefixStore(tmp_path, "k", budget_mb=8)
    store.keep([1, 2, 3], lambda: b"a")
    store.keep([1, 2, 3, 4, 5], lambda: b"b")
    store.keep([1, 2], lambda: b"c")  # covered by the longer one: not written
    store.flush()
    assert list(DiskPrefixStore(tmp_path, "k", budget_mb=8).index.values()) == [[1, 2, 3, 4, 5]]
    assert store.longest([1, 2, 3, 9]) == 3 and store.load([1, 2, 3, 9]) == ([1, 2, 3, 4, 5], b"b")
    assert DiskPrefixStore(tmp_path, "other key", budget_mb=8).longest([1, 2, 3]) == 0  # another folder


def test_a_replaced_cache_ends_its_writer_after_writing_what_it_kept(tmp_path):
    store = DiskPrefixStore(tmp_path, "k", budget_mb=8)
    store.keep([1, 2, 3], lambda: b"kept")
    store.close()
    assert not store._writer.is_alive()
    assert DiskPrefixStore(tmp_path, "k", budget_mb=8).load([1, 2, 3]) == ([1, 2, 3], b"kept")


def test_the_cli_default_disk_budget_is_the_librarys():
    from exactspec import cli_common, prefix_store

    assert cli_common.PREFIX_DISK_MB == prefix_store.PREFIX_DISK_MB  # two names: --help imports no torch


def written(tmp_path, ids=(1, 2, 3), payload=b"payload") -> DiskPrefixStore:
    store = DiskPrefixStore(tmp_path, "k", budget_mb=8)
    store.keep(list(ids), lambda: payload)
    store.flush()
    return store


def test_a_forged_or_swapped_snapshot_is_never_restored(tmp_path):
    """The MAC is keyed by the folder's secret: a file re-signed with another key (someone without the
    secret), or a snapshot's payload swapped under another prompt's header, is skipped."""
    store = written(tmp_path)
    [path] = store.folder.glob("*.kv")
    other = written(tmp_path / "elsewhere", (1, 2, 3), b"forged!")  # another folder: another secret
    [forged] = other.folder.glob("*.kv")
    path.write_bytes(forged.read_bytes())
    fresh = DiskPrefixStore(tmp_path, "k", budget_mb=8)
    assert fresh.load([1, 2, 3, 4]) is None and fresh.skipped == 1
    # the right secret, but the header of prompt [1, 2, 3] over the payload of another: the MAC says no
    secret = (tmp_path / SECRET).read_bytes()
    header = {"key": "k", "ids": [1, 2, 3], "size": 7}
    mac = hmac.new(secret, json.dumps(header, sort_keys=True).encode(), hashlib.sha256)
    mac.update(b"other X")
    body = json.dumps({**header, "mac": mac.hexdigest()}).encode()
    path.write_bytes(MAGIC + len(body).to_bytes(8, "little") + body + b"payload")
    assert DiskPrefixStore(tmp_path, "k", budget_mb=8).load([1, 2, 3, 4]) is None


def test_the_folder_and_files_are_private(tmp_path):
    store = written(tmp_path / "cache")
    [path] = store.folder.glob("*.kv")
    assert stat.S_IMODE(os.stat(tmp_path / "cache").st_mode) == 0o700
    assert stat.S_IMODE(os.stat(store.folder).st_mode) == 0o700
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE((tmp_path / "cache" / SECRET).stat().st_mode) == 0o600


def test_a_fifo_or_a_link_named_kv_is_skipped_not_waited_on(tmp_path):
    store = written(tmp_path)
    [path] = store.folder.glob("*.kv")
    os.mkfifo(store.folder / "fifo.kv")
    os.symlink(path, store.folder / "link.kv")
    result = {}
    reader = threading.Thread(target=lambda: result.update(store=DiskPrefixStore(tmp_path, "k", budget_mb=8)))
    reader.start()
    reader.join(timeout=10)
    assert not reader.is_alive(), "a FIFO blocked the folder's read"
    fresh = result["store"]
    assert fresh.skipped == 2 and list(fresh.index.values()) == [[1, 2, 3]]
    assert fresh.load([1, 2, 3, 9]) == ([1, 2, 3], b"payload")


def test_a_failed_write_leaves_no_temporary_file(tmp_path, monkeypatch):
    store = DiskPrefixStore(tmp_path, "k", budget_mb=8)

    class Full:  # a file on a full disk: the bytes do not fit
        def __init__(self, fd, mode):
            self.fd = fd

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            os.close(self.fd)

        def write(self, data):
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fdopen", Full)
    store.keep([5, 6], lambda: b"x" * 1000)
    store.flush()
    monkeypatch.undo()
    assert store.failed_writes == 1 and not list(store.folder.iterdir())


def test_a_folder_that_cannot_be_made_is_a_one_line_error(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ExactSpecError, match="cannot make the prefix cache folder"):
        DiskPrefixStore(tmp_path / "file" / "sub", "k", budget_mb=8)


def test_a_snapshot_the_engine_refuses_is_dropped_and_prefilled(engine, tmp_path, capsys):
    """A snapshot llama.cpp will not restore (one written by a context of other rows): the request is
    prefilled as if it were absent, the entry and its file are dropped, one warning is printed, and the
    next request does not meet it again."""
    engine.set_prefix_cache(None)
    reference, _ = step(engine, "Summarise the repository.")
    cache = restart(engine, tmp_path)
    step(engine, "Summarise the repository.")
    cache.spill.flush()
    before = list(cache.spill.folder.glob("*.kv"))
    assert before
    spill = restart(engine, tmp_path).spill
    forget, gone = spill.forget, []

    def forgets(ids):
        forget(ids)
        gone.append(not any(path.exists() for path in before))

    def refuses(seq, state, length):  # what llama_state_seq_set_data's refusal raises (adapter._set_state)
        raise ExactSpecError("llama.cpp could not restore a sequence's cache (context full?)")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine.target, "_restore", refuses)
        patch.setattr(spill, "forget", forgets)
        out, stats = step(engine, "Summarise the repository.")
    assert out == reference and stats.cached_tokens == 0
    assert "could not be restored" in capsys.readouterr().err
    engine.prefix_cache.spill.flush()
    assert gone == [True]  # the refused file was removed at once
    out, stats = step(engine, "Summarise the repository.")
    assert out == reference
