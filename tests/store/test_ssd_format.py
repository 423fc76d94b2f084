"""Issue #15, finding 5: the SSD file format is fully checked. The checksum covers the header as
well as the payload, every header field is checked against the file, and anything odd in the
directory is skipped and logged, never fatal (in-process; tests/store/test_tiers.py runs the
same through a store process)."""

from __future__ import annotations

import logging
import os
import struct
import zlib

import pytest

from mooncake_lite.common.hashing import prefix_hash
from mooncake_lite.store.ssd import FILE_HEADER, FILE_MAGIC, SsdTier

K = prefix_hash(list(range(4 * 8)), 4)   # 8 chained keys
DATA = bytes(range(256)) * 24            # 6144 bytes: 4 layers of 1536
# (field index in FILE_HEADER, offset of the field in the file, how to change it)
FIELDS = {
    "magic": (0, b"MCKX"),
    "version": (4, 99),
    "chain_pos": (6, 77),
    "num_layers": (8, 3),
    "key": (12, K[7]),
    "length": (28, len(DATA) - 8),
    "crc": (36, 12345),
}
OFFSETS = {"magic": "4s", "version": "H", "chain_pos": "H", "num_layers": "I", "key": "16s", "length": "Q", "crc": "I"}


async def written(tmp_path, keys=K[:3], **kw) -> SsdTier:
    ssd = SsdTier(tmp_path, capacity_bytes=1 << 20, fsync=False, **kw)
    ssd.scan()
    for i, key in enumerate(keys):
        assert ssd.enqueue(key, DATA, 4, chain_pos=i)
        await ssd._write_pending(key)
    return ssd


def tamper(path, field: str, value) -> None:
    offset, fmt = FIELDS[field][0], OFFSETS[field]
    raw = bytearray(path.read_bytes())
    struct.pack_into("<" + fmt, raw, offset, value)
    path.write_bytes(bytes(raw))


def v1_file(root, key: bytes, data: bytes, num_layers: int = 4, chain_pos: int = 0):
    """A block file in the old format (version 1: the CRC covers the payload only)."""
    path = root / key.hex()[:2] / f"{key.hex()}.blk"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(FILE_HEADER.pack(FILE_MAGIC, 1, chain_pos, num_layers, key, len(data), zlib.crc32(data)) + data)
    return path


def test_the_header_layout_the_tests_assume():
    assert FILE_HEADER.size == 40 and FILE_HEADER.format == "<4sHHI16sQI"


@pytest.mark.parametrize("field", sorted(FIELDS))
async def test_any_changed_header_field_is_never_served(tmp_path, field):
    dropped = []
    ssd = await written(tmp_path, on_dropped=dropped.append)
    path = ssd.path_of(K[1])
    tamper(path, field, FIELDS[field][1])
    if field == "length":   # keep the length consistent with the file: only the checksum can tell
        path.write_bytes(path.read_bytes()[:-8])
    assert await ssd.read(K[1]) is None
    assert ssd.num_corrupt == 1 and not path.exists() and K[1] not in ssd and dropped == [K[1]]
    for i in (0, 2):   # the others are untouched
        data, num_layers, pos = await ssd.read(K[i])
        assert bytes(data) == DATA and (num_layers, pos) == (4, i)


@pytest.mark.parametrize("problem", ["num_layers=0", "num_layers=5", "short", "long", "magic", "old-version",
                                     "wrong-key", "tiny"])
async def test_scan_checks_every_header_field_against_the_file(tmp_path, caplog, problem):
    ssd = await written(tmp_path)
    path = ssd.path_of(K[1])
    if problem == "num_layers=0":
        tamper(path, "num_layers", 0)
    elif problem == "num_layers=5":    # 6144 bytes do not split into 5 layers
        tamper(path, "num_layers", 5)
    elif problem == "short":
        path.write_bytes(path.read_bytes()[:-1])
    elif problem == "long":
        path.write_bytes(path.read_bytes() + b"\0")
    elif problem == "magic":
        tamper(path, "magic", b"XXXX")
    elif problem == "old-version":
        v1_file(tmp_path, K[1], DATA)
    elif problem == "wrong-key":
        tamper(path, "key", K[6])
    elif problem == "tiny":
        path.write_bytes(b"MCKS")
    caplog.set_level(logging.WARNING, "mooncake_lite.store.ssd")
    again = SsdTier(tmp_path, capacity_bytes=1 << 20)
    assert sorted(again.scan()) == sorted([K[0], K[2]])
    assert again.num_corrupt == 1 and not path.exists()
    assert path.name in caplog.text
    if problem == "old-version":
        assert "version 1" in caplog.text


async def test_old_format_files_are_not_served(tmp_path):
    ssd = await written(tmp_path, keys=K[:1])
    v1_file(tmp_path, K[1], DATA)
    again = SsdTier(tmp_path, capacity_bytes=1 << 20)
    assert again.scan() == [K[0]] and again.num_corrupt == 1
    assert await again.read(K[1]) is None
    data, _, _ = await again.read(K[0])
    assert bytes(data) == DATA and ssd.num_corrupt == 0


async def test_odd_directory_entries_are_skipped_and_logged(tmp_path, caplog):
    await written(tmp_path)
    h = K[5].hex()
    odd = [
        tmp_path / h[:2] / f"{h}.blk",          # a directory named like a block file
        tmp_path / K[6].hex()[:2] / "junk.tmp",  # a directory named like a temp file
        tmp_path / "zz",                        # a two-character directory that is not hex
        tmp_path / "lost+found",
        tmp_path / K[7].hex()[:2] / "nested" / "deeper",
    ]
    for d in odd:
        d.mkdir(parents=True, exist_ok=True)
    (tmp_path / "README").write_text("not a block")
    (tmp_path / "ab.blk").write_text("not in a shard")
    (tmp_path / K[0].hex()[:2] / "notes.txt").write_text("hello")
    (tmp_path / K[0].hex()[:2] / "not-hex.blk").write_bytes(b"x" * 100)
    for key in K[3:5]:
        (tmp_path / key.hex()[:2]).mkdir(exist_ok=True)
    os.symlink(tmp_path / "README", tmp_path / K[4].hex()[:2] / f"{K[4].hex()}.blk")   # a link to a file
    os.symlink("/nonexistent", tmp_path / K[3].hex()[:2] / f"{K[3].hex()}.blk")   # dangling link

    caplog.set_level(logging.INFO, "mooncake_lite.store.ssd")
    again = SsdTier(tmp_path, capacity_bytes=1 << 20)
    assert sorted(again.scan()) == sorted(K[:3])
    assert again.num_corrupt == 0           # nothing odd is a corrupt block
    for d in odd:
        assert d.exists()                   # skipped, not removed
    assert (tmp_path / "README").exists() and (tmp_path / K[0].hex()[:2] / "not-hex.blk").exists()
    for name in (f"{h}.blk", "junk.tmp", "zz", "lost+found", "README", "notes.txt", "not-hex.blk",
                 f"{K[3].hex()}.blk", f"{K[4].hex()}.blk"):
        assert name in caplog.text, name
    for i in range(3):
        data, _, _ = await again.read(K[i])
        assert bytes(data) == DATA


async def test_an_entry_replaced_while_running_is_a_miss_not_a_crash(tmp_path):
    ssd = await written(tmp_path)
    path = ssd.path_of(K[1])
    path.unlink()
    path.mkdir()                           # a directory where the block file was
    assert await ssd.read(K[1]) is None and K[1] not in ssd
    assert await ssd.remove(K[0]) and not ssd.path_of(K[0]).exists()
    data, _, _ = await ssd.read(K[2])
    assert bytes(data) == DATA
