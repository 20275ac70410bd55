"""The prefix cache on disk (prefix_store.py): snapshots survive a restart, restore byte for byte what a
cold prefill computes, and a truncated, corrupt or foreign file is skipped with one warning, never
changing an output."""

from __future__ import annotations

import threading

import pytest
import torch

from exactspec.prefix_store import MAGIC, DiskPrefixStore
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
    (folder / "foreign.kv").write_bytes(data.replace(b'"key": "kv1|', b'"key": "kv0|', 1))
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
