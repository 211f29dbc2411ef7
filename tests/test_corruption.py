"""Corruption matrix: truncation at every structural boundary, bit flips everywhere, lying sizes
and offsets, decompression bombs. Every case raises a named CkptzipError: never a crash, a hang,
a silently wrong tensor or an oversized allocation."""
import os
import struct

import numpy as np
import pytest
import torch
import zstandard

import ckptzip
import ckptzip.cli
from ckptzip import format as fmt
from conftest import read_parts, same_bits, write_parts


@pytest.fixture(scope="module")
def sample(tmp_path_factory):
    d = tmp_path_factory.mktemp("c")
    p = d / "ok.ckz"
    torch.manual_seed(0)
    obj = {"w": torch.randn(3000), "i": torch.arange(500), "h": torch.randn(700).half(), "s": "text"}
    ckptzip.save(obj, p, chunk_size=1024, device="cpu")  # the format under test, same on every machine
    return p, obj


def load_all(p):
    return ckptzip.load(p)


def expect(p, err=ckptzip.CorruptFileError):
    with pytest.raises(err):
        load_all(p)


def boundaries(p):
    data, doc, rows = read_parts(p)
    size = os.path.getsize(p)
    b = {0, 1, fmt.HEADER_SIZE - 1, fmt.HEADER_SIZE, len(data), len(data) + 4, size - fmt.FOOTER_SIZE,
         size - fmt.FOOTER_SIZE + 8, size - 1}
    for r in rows:
        b.update({int(r["offset"]), int(r["offset"]) + int(r["stored"]) // 2})
    return sorted(x for x in b if 0 <= x < size)


def test_truncation_everywhere(sample, tmp_path):
    p, _ = sample
    raw = open(p, "rb").read()
    for cut in boundaries(p):
        q = tmp_path / f"t{cut}.ckz"
        q.write_bytes(raw[:cut])
        expect(q)  # TruncatedFileError or CorruptFileError (both CorruptFileError)


def test_bit_flips_header_manifest_chunks_footer(sample, tmp_path):
    p, obj = sample
    raw = bytearray(open(p, "rb").read())
    data, doc, rows = read_parts(p)
    spots = list(range(0, fmt.HEADER_SIZE, 3))
    spots += list(range(len(data), len(raw), max(1, (len(raw) - len(data)) // 40)))
    spots += [int(r["offset"]) + int(r["stored"]) // 2 for r in rows]
    for pos in spots:
        for bit in (0, 7):
            bad = bytearray(raw)
            bad[pos] ^= 1 << bit
            q = tmp_path / "f.ckz"
            q.write_bytes(bytes(bad))
            try:
                back = load_all(q)
            except ckptzip.CkptzipError:
                continue
            # a flip may only go unnoticed where it cannot change data (e.g. JSON padding)
            for k in ("w", "i", "h"):
                assert same_bits(back[k], obj[k]), f"silent corruption at byte {pos}"


def test_chunk_checksum_error(sample, tmp_path):
    p, _ = sample
    raw = bytearray(open(p, "rb").read())
    _, _, rows = read_parts(p)
    raw[int(rows[0]["offset"])] ^= 0xFF
    q = tmp_path / "c.ckz"
    q.write_bytes(bytes(raw))
    expect(q, ckptzip.ChecksumError)
    assert ckptzip.cli.main(["verify", str(q), "-q"]) == 1


def test_manifest_checksum_error(sample, tmp_path):
    p, _ = sample
    raw = bytearray(open(p, "rb").read())
    data, _, _ = read_parts(p)
    raw[len(data) + 10] ^= 1
    q = tmp_path / "m.ckz"
    q.write_bytes(bytes(raw))
    expect(q, ckptzip.ChecksumError)


LIES = {
    "offset past data": lambda d, r: r.__setitem__("offset", r["offset"] + 10**6),
    "offset overflow": lambda d, r: r.__setitem__("offset", np.uint64(2**64 - 5)),
    "offset into header": lambda d, r: r.__setitem__("offset", 3),
    "stored zero": lambda d, r: r.__setitem__("stored", 0),
    "stored huge": lambda d, r: r.__setitem__("stored", 2**32 - 1),
    "raw huge": lambda d, r: r.__setitem__("raw", 2**32 - 1),
    "raw zero": lambda d, r: r.__setitem__("raw", 0),
    "raw doubled": lambda d, r: r.__setitem__("raw", r["raw"] * 2),
    "flags": lambda d, r: r.__setitem__("flags", 9),
    "nbytes lies": lambda d, r: d["storages"][0].__setitem__("nbytes", 10**12),
    "nbytes negative": lambda d, r: d["storages"][0].__setitem__("nbytes", -1),
    "rows past table": lambda d, r: d["storages"][0].__setitem__("rows", [0, 10**9]),
    "rows shared": lambda d, r: d["storages"][1].__setitem__("rows", d["storages"][0]["rows"]),
    "n_chunks lies": lambda d, r: d.__setitem__("n_chunks", d["n_chunks"] + 1),
    "shape lies": lambda d, r: d["root"]["v"][0].__setitem__("shape", [10**9]),
    "shape negative": lambda d, r: d["root"]["v"][0].__setitem__("shape", [-3]),
    "stride lies": lambda d, r: d["root"]["v"][0].__setitem__("stride", [10**6]),
    "offset view lies": lambda d, r: d["root"]["v"][0].__setitem__("offset", 2**62),
    "storage index": lambda d, r: d["root"]["v"][0].__setitem__("s", 99),
    "unknown dtype": lambda d, r: d["root"]["v"][0].__setitem__("dtype", "float1024"),
    "unknown node": lambda d, r: d["root"]["v"].__setitem__(0, {"t": "bogus"}),
    "bad int": lambda d, r: d["root"]["v"].__setitem__(0, {"t": "int", "v": "12x"}),
    "bad float": lambda d, r: d["root"]["v"].__setitem__(0, {"t": "float", "v": "zz"}),
    "dict mismatch": lambda d, r: d["root"]["k"].append("extra"),
    "no root": lambda d, r: d.pop("root"),
    "byteplane width": lambda d, r: d["storages"][0]["transforms"][0].__setitem__("width", 3),
    "byteplane block": lambda d, r: d["storages"][0]["transforms"][0].__setitem__("block", 2**40),
}


@pytest.mark.parametrize("name", sorted(LIES))
def test_lying_manifest(sample, tmp_path, name):
    p, _ = sample
    data, doc, rows = read_parts(p)
    LIES[name](doc, rows[:1] if name not in ("raw doubled",) else rows)
    if name in ("offset past data", "offset overflow", "offset into header", "stored zero",
                "stored huge", "raw huge", "raw zero", "flags"):
        LIES[name](doc, rows[0:1])
    q = tmp_path / "lie.ckz"
    write_parts(q, data, doc, rows)
    with pytest.raises((ckptzip.CorruptFileError, ckptzip.UnknownCodecError)):
        load_all(q)


def test_deep_nesting_manifest(sample, tmp_path):
    p, _ = sample
    data, doc, rows = read_parts(p)
    manifest = b'{"format":"ckz","version":[1,0],"n_chunks":0,"storages":[],"root":' + b"[" * 100000 + b"]" * 100000 + b"}"
    body = struct.pack("<I", len(manifest)) + manifest
    body += b" " * ((-len(body)) % 8)
    q = tmp_path / "deep.ckz"
    q.write_bytes(data + body + fmt.pack_footer(len(data), body))
    expect(q)


def test_footer_lies(sample, tmp_path):
    p, _ = sample
    raw = open(p, "rb").read()
    size = len(raw)
    for off, length in [(0, 10), (size, 10), (16, 2**40), (2**63, 8), (16, size)]:
        q = tmp_path / "foot.ckz"
        q.write_bytes(raw[:-fmt.FOOTER_SIZE] + struct.pack("<QQQ8s", off, length, 0, fmt.FOOTER_MAGIC))
        expect(q)


def test_decompression_bomb(tmp_path):
    """A chunk whose zstd frame expands far beyond its declared raw size is refused without
    allocating the expansion."""
    p = tmp_path / "b.ckz"
    # (device="cpu": one chunk on every machine; a GPU's zstd cuts smaller chunks)
    ckptzip.save({"x": torch.randint(0, 255, (65536,), dtype=torch.uint8)}, p, codec="zstd", transform=None,
                 device="cpu")
    data, doc, rows = read_parts(p)
    bomb = zstandard.ZstdCompressor(level=19, write_content_size=False).compress(b"\0" * (64 << 20))
    assert len(bomb) < 65536
    off = int(rows[0]["offset"])
    data = data[:off] + bomb
    rows[0]["stored"] = len(bomb)
    rows[0]["xxh3"] = fmt.checksum(bomb)
    rows[0]["flags"] = 0
    q = tmp_path / "bomb.ckz"
    write_parts(q, data, doc, rows)
    with pytest.raises(ckptzip.CodecError):
        load_all(q)
    # same with the content size declared in the frame
    bomb2 = zstandard.ZstdCompressor(level=19).compress(b"\0" * (64 << 20))
    data = data[:off] + bomb2
    rows[0]["stored"] = len(bomb2)
    rows[0]["xxh3"] = fmt.checksum(bomb2)
    write_parts(q, data, doc, rows)
    with pytest.raises(ckptzip.CodecError):
        load_all(q)


def test_garbage_stream_with_valid_checksum(tmp_path):
    p = tmp_path / "g.ckz"
    ckptzip.save({"x": torch.randn(1000)}, p, codec="zstd", transform=None)
    data, doc, rows = read_parts(p)
    off, n = int(rows[0]["offset"]), int(rows[0]["stored"])
    junk = bytes((i * 37) & 0xFF for i in range(n))
    data = data[:off] + junk + data[off + n:]
    rows[0]["xxh3"] = fmt.checksum(junk)
    rows[0]["flags"] = 0
    write_parts(p, data, doc, rows)
    with pytest.raises(ckptzip.CodecError):
        load_all(p)


def test_not_a_ckz(tmp_path):
    q = tmp_path / "x.ckz"
    q.write_bytes(b"PK\x03\x04" + b"\0" * 100)
    expect(q)
    q.write_bytes(b"")
    expect(q, ckptzip.TruncatedFileError)


# -- fuzzing: random damage anywhere may only end in a named error or in the right data --------
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_FUZZ_OBJ = {"w": torch.linspace(-3, 3, 2000), "h": torch.arange(300, dtype=torch.int16), "s": "x",
             "n": [1, 2.5, None, b"\x00"]}


@pytest.fixture(scope="module")
def fuzz_base(tmp_path_factory):
    p = tmp_path_factory.mktemp("fz") / "base.ckz"
    ckptzip.save(_FUZZ_OBJ, p, chunk_size=512, device="cpu")
    return p.read_bytes()


def _check_fuzzed(tmp_path_factory, data: bytes, strict: bool = True) -> None:
    """Load damaged bytes: a named error, or (``strict``: the damage missed everything that
    matters) the original data. Without ``strict`` (a rewritten manifest with valid checksums,
    i.e. a different but well-formed file) any loaded object is fine."""
    q = tmp_path_factory.mktemp("fz") / "f.ckz"
    q.write_bytes(data)
    try:
        back = ckptzip.load(q)
    except ckptzip.CkptzipError:
        return
    if strict:
        assert same_bits(back["w"], _FUZZ_OBJ["w"]) and same_bits(back["h"], _FUZZ_OBJ["h"])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 255)), min_size=1, max_size=8),
       cut=st.one_of(st.none(), st.floats(0, 1)))
def test_fuzz_random_byte_damage(tmp_path_factory, fuzz_base, edits, cut):
    data = bytearray(fuzz_base)
    for where, value in edits:
        data[int(where * len(data))] = value
    if cut is not None:
        data = data[: int(cut * len(data))]
    _check_fuzzed(tmp_path_factory, bytes(data))


json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False, allow_infinity=False),
              st.text(max_size=8)),
    lambda ch: st.one_of(st.lists(ch, max_size=4), st.dictionaries(st.text(max_size=6), ch, max_size=4)),
    max_leaves=20)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=st.sampled_from(["root", "storages", "n_chunks", "version", "meta", "format"]), value=json_values)
def test_fuzz_manifest_fields(tmp_path_factory, fuzz_base, key, value):
    """Any JSON in any manifest field, with valid checksums: a named error or the right data."""
    q = tmp_path_factory.mktemp("fz") / "m.ckz"
    q.write_bytes(fuzz_base)
    data, doc, rows = read_parts(q)
    doc[key] = value
    write_parts(q, data, doc, rows)
    _check_fuzzed(tmp_path_factory, q.read_bytes(), strict=False)


@pytest.fixture(scope="module")
def deep_seeds(tmp_path_factory):
    """Files whose manifests use every kind of record a CPU save writes: byteplane chains with
    several chunks, ``derived`` (a bfloat16 copy of a float32 master), ``expref`` and
    ``expgrid`` (AdamW's moments), a numpy array, scalars and bytes; and an incremental file
    (a base record with located storages) beside its base."""
    d = tmp_path_factory.mktemp("deep")
    g = torch.Generator().manual_seed(5)
    m = torch.nn.Linear(256, 256)
    opt = torch.optim.AdamW(m.parameters())
    for _ in range(3):
        opt.zero_grad()
        m(torch.randn(8, 256, generator=g)).pow(2).sum().backward()
        opt.step()
    w = torch.randn(40_000, generator=g) * 0.02  # (its bf16 copy over the packing size: derived)
    ckptzip.save({"model": m.state_dict(), "optimizer": opt.state_dict(), "w": w, "w_bf16": w.bfloat16(),
                  "np": np.arange(12, dtype=np.float32).reshape(3, 4), "meta": {"lr": 0.1, "b": b"\x00", "t": (1, 2)}},
                 d / "state.ckz", device="cpu", chunk_size=8192)
    ckptzip.save({"a": w, "b": torch.randn(30_000, generator=g)}, d / "base.ckz", device="cpu")
    ckptzip.save({"a": w + 1e-6 * torch.randn(40_000, generator=g), "b": torch.randn(30_000, generator=g)},
                 d / "incr.ckz", device="cpu", base=d / "base.ckz")
    ids = {t.get("id") for f in ("state.ckz", "incr.ckz") for s in read_parts(d / f)[1]["storages"]
           for t in s.get("transforms", [])}
    assert {"byteplane", "derived", "expref", "expgrid"} <= ids and read_parts(d / "incr.ckz")[1]["bases"]
    assert any("in" in s for s in read_parts(d / "state.ckz")[1]["storages"])  # (packed storages, 1.5)
    return d


def _json_places(node, out, depth=0):
    """Every (container, key or index) in a JSON document, depth first."""
    if depth > 16:
        return
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for k, v in items:
        out.append((node, k))
        _json_places(v, out, depth + 1)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(which=st.sampled_from(["state.ckz", "incr.ckz"]), where=st.floats(0, 1, exclude_max=True),
       edit=st.sampled_from(["set", "delete", "add"]), value=json_values)
def test_fuzz_any_manifest_place(deep_seeds, which, where, edit, value):
    """Any value at any place of the manifest (storage records, transform parameters, reference
    records, base records and their located storages, the object tree), deleted, or a known
    field name added where it does not belong, with valid checksums: opening, reading keys and
    tensors, loading and verifying give a named error or a well-formed object."""
    data, doc, rows = read_parts(deep_seeds / which)
    places: list = []
    _json_places(doc, places)
    node, key = places[int(where * len(places))]
    if edit == "set":
        node[key] = value
    elif edit == "delete":
        del node[key]
    elif isinstance(node, dict):  # a field name the reader knows, at a place it was not written
        node[("ref", "rows", "width", "members", "offset", "s", "dtype", "storages", "in")[int(where * 9)]] = value
    q = deep_seeds / "fuzzed.ckz"
    write_parts(q, data, doc, rows)
    for step in (lambda r: [r.get_tensor(k) for k in r.keys()[:4]], lambda r: r.load(), lambda r: r.verify()):
        try:
            with ckptzip.open(q) as r:
                step(r)
        except ckptzip.CkptzipError:
            pass


@pytest.mark.parametrize("where", [0, "mid", -1])
def test_parallel_read_parts_check_every_chunk(tmp_path, where):
    """Batches of 8 MiB and more are read and checksummed in parallel parts: a damaged chunk in
    any part (first, middle, last) is still a ChecksumError, and an intact file loads bit-exact."""
    g = torch.Generator().manual_seed(3)
    state = {"a": torch.randn(3 << 20, generator=g), "b": torch.randn(2 << 20, generator=g).to(torch.bfloat16)}
    p = tmp_path / "big.ckz"
    ckptzip.save(state, p, codec="zstd", chunk_size=1 << 20)
    out = ckptzip.load(p)
    assert all(same_bits(out[k], state[k]) for k in state)
    _, _, rows = read_parts(p)
    assert len(rows) > 8
    k = {0: 0, "mid": len(rows) // 2, -1: len(rows) - 1}[where]
    raw = bytearray(p.read_bytes())
    raw[int(rows[k]["offset"]) + int(rows[k]["stored"]) // 2] ^= 0x01
    q = tmp_path / "c.ckz"
    q.write_bytes(bytes(raw))
    expect(q, ckptzip.ChecksumError)


def test_reader_leaves_long_chunks_to_the_gpu_only_when_asked(tmp_path):
    """``read_stored(gpu_hash=True)`` (GPU loads with the kernels ready) leaves chunks of more
    than 240 bytes at 8-byte aligned offsets unverified and returns their indices; short ones
    are still verified here; without it every chunk is verified."""
    import numpy as np
    import ckptzip
    from conftest import read_parts, write_parts
    from ckptzip.io.reader import read_stored
    p = tmp_path / "a.ckz"
    ckptzip.save({"w": torch.randn(100_000), "s": torch.tensor(1.0)}, p, codec="zstd", chunk_size=64 << 10)
    data, doc, rows = read_parts(p)
    long_ = np.nonzero(rows["stored"] > 240)[0]
    short = np.nonzero(rows["stored"] <= 240)[0]
    assert len(long_) and len(short)
    k = int(long_[0])
    off = int(rows["offset"][k]) + 5
    bad = data[:off] + bytes([data[off] ^ 1]) + data[off + 1:]
    q = tmp_path / "b.ckz"
    write_parts(q, bad, doc, rows)
    fd = os.open(q, os.O_RDONLY)
    try:
        buf, offs, later = read_stored(fd, rows, gpu_hash=True)
        assert k in later.tolist() and not set(short.tolist()) & set(later.tolist())
        assert all(offs[i] % 8 == 0 for i in later.tolist())
        with pytest.raises(ckptzip.ChecksumError):
            read_stored(fd, rows)
        s = int(short[0])
        rows2 = rows.copy()
        rows2["xxh3"][s] ^= 1
        with pytest.raises(ckptzip.ChecksumError):
            read_stored(fd, rows2, gpu_hash=True)
    finally:
        os.close(fd)
