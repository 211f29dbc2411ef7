"""Hostile files (issue 12): the attacker controls every byte and recomputes every checksum
(chunk XXH3, manifest XXH3, footer). Every such file must end in a named CkptzipError before any
large allocation; legitimate files that used not to round-trip must."""
import io
import json
import os
import struct
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import numpy as np
import pytest
import torch
import zstandard

import ckptzip
from ckptzip import format as fmt
from ckptzip.codecs.base import get_codec
from conftest import assert_same, read_parts, same_bits, write_parts

SRC = os.path.join(os.path.dirname(__file__), "..", "src")


def write_raw(path, data: bytes, doc_json: bytes, rows):
    """Like write_parts, but with the document's JSON text given verbatim."""
    pad = (-(4 + len(doc_json))) % 8
    manifest = struct.pack("<I", len(doc_json)) + doc_json + b" " * pad + rows.astype(fmt.ROW).tobytes()
    with open(path, "wb") as f:
        f.write(data + manifest + fmt.pack_footer(len(data), manifest))


def one_chunk_file(tmp_path, codec="zstd"):
    p = tmp_path / "one.ckz"
    ckptzip.save({"x": torch.randint(0, 255, (65536,), dtype=torch.uint8)}, p, codec=codec,
                 transform=None, chunk_size=65536, device="cpu")
    data, doc, rows = read_parts(p)
    assert len(rows) == 1 and int(rows[0]["raw"]) == 65536
    return data, doc, rows


def replace_chunk(data, rows, k, blob):
    off = int(rows[k]["offset"])
    rows[k]["stored"] = len(blob)
    rows[k]["xxh3"] = fmt.checksum(blob)
    rows[k]["flags"] = 0
    return data[:off] + blob


def zeros_frame(nbytes: int, content_size: bool) -> bytes:
    """A zstd frame of ``nbytes`` zeros, made without holding them in memory."""
    c = zstandard.ZstdCompressor(level=3, write_content_size=content_size)
    co = c.compressobj(size=nbytes if content_size else -1)
    piece = b"\0" * (1 << 20)
    out = [co.compress(piece) for _ in range(nbytes >> 20)]
    out.append(co.flush())
    return b"".join(out)


# -- 3. decompression bombs --------------------------------------------------------------------
_RSS_PROBE = textwrap.dedent("""
    import resource, sys, time
    import ckptzip, torch
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = time.time()
    try:
        ckptzip.load(sys.argv[1])
        err = "none"
    except ckptzip.CodecError as e:
        err = "CodecError"
    except Exception as e:
        err = type(e).__name__
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(err, (after - before) * 1024, time.time() - t)
""")


@pytest.mark.parametrize("content_size", [True, False])
def test_zstd_bomb_claiming_a_gigabyte_stays_small(tmp_path, content_size):
    data, doc, rows = one_chunk_file(tmp_path)
    bomb = zeros_frame(1 << 30, content_size)
    assert len(bomb) < 64 * 1024
    q = tmp_path / "bomb.ckz"
    write_parts(q, replace_chunk(data, rows, 0, bomb), doc, rows)
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", _RSS_PROBE, str(q)], capture_output=True, text=True,
                         env=env, timeout=300)
    err, grown, secs = out.stdout.split()
    assert err == "CodecError", out.stderr
    assert int(grown) < 200 << 20, f"reader grew by {int(grown) >> 20} MiB for a 64 KiB chunk"
    assert float(secs) < 30


def test_deflate_bomb(tmp_path):
    data, doc, rows = one_chunk_file(tmp_path, codec="deflate")
    c = zlib_raw = __import__("zlib").compressobj(9, 8, -15)
    bomb = b"".join(c.compress(b"\0" * (1 << 20)) for _ in range(64)) + zlib_raw.flush()
    q = tmp_path / "dbomb.ckz"
    write_parts(q, replace_chunk(data, rows, 0, bomb), doc, rows)
    with pytest.raises(ckptzip.CodecError):
        ckptzip.load(q)


def test_zstd_frame_shorter_than_declared(tmp_path):
    data, doc, rows = one_chunk_file(tmp_path)
    short = zstandard.ZstdCompressor(write_content_size=False).compress(b"\1" * 1000)
    q = tmp_path / "short.ckz"
    write_parts(q, replace_chunk(data, rows, 0, short), doc, rows)
    with pytest.raises(ckptzip.CodecError):
        ckptzip.load(q)


# -- 4. fields that are used: validated once, right after parsing ----------------------------
@pytest.fixture
def small(tmp_path):
    p = tmp_path / "s.ckz"
    torch.manual_seed(0)
    obj = {"w": torch.randn(2048), "i": torch.arange(100), "n": 5}
    ckptzip.save(obj, p, codec="zstd", device="cpu")
    return p, obj


def forge(tmp_path, p, edit, name="f.ckz"):
    data, doc, rows = read_parts(p)
    edit(doc)
    q = tmp_path / name
    write_parts(q, data, doc, rows)
    return q


@pytest.mark.parametrize("device", ["meta", "xla", "cuda:x", "CPU", "cuda:99999", "", 5, None, ["cpu"]])
def test_storage_device_validated(tmp_path, small, device):
    q = forge(tmp_path, small[0], lambda d: d["storages"][0].__setitem__("device", device))
    with pytest.raises(ckptzip.CorruptFileError, match="device"):
        ckptzip.load(q)
    with pytest.raises(ckptzip.CorruptFileError):
        ckptzip.open(q)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU fallback")
def test_saved_cuda_device_loads_to_cpu(tmp_path, small):
    p, obj = small
    q = forge(tmp_path, p, lambda d: [s.__setitem__("device", "cuda:1") for s in d["storages"]])
    back = ckptzip.load(q)
    assert back["w"].device.type == "cpu" and same_bits(back["w"], obj["w"])


@pytest.mark.parametrize("codec", [{"id": "zstd", "level": "x"}, {"id": "zstd", "self": 1},
                                   {"id": "zstd", "level": 3}, {"id": "ans", "data_type": 5},
                                   {"id": "ans", "data_type": "|u1", "max_sub_chunk_count": 2},
                                   {"id": "bitcomp", "algorithm_type": True},
                                   {"id": "deflate", "__class__": "x"}])
def test_codec_params_validated(tmp_path, small, codec):
    q = forge(tmp_path, small[0], lambda d: d["storages"][0].__setitem__("codec", codec))
    with pytest.raises((ckptzip.UnknownCodecError, ckptzip.CorruptFileError)):
        ckptzip.load(q)


def test_get_codec_refuses_bad_params_before_constructing():
    for bad in ({"id": "zstd", "self": 1}, {"id": "zstd", "level": "x"}, {"id": "zstd", "level": 2.0},
                {"id": "raw", "level": 1}, {"id": "deflate", "level": True}):
        with pytest.raises(ckptzip.UnknownCodecError):
            get_codec(bad, "cpu")
    assert get_codec("zstd", "cpu", level=5).level == 5


@pytest.mark.parametrize("tf", [{"id": "byteplane", "width": 2.0, "block": 1024},
                                {"id": "byteplane", "width": 4, "block": 1024.0},
                                {"id": "byteplane", "width": 4, "block": True},
                                {"id": "byteplane", "width": "4", "block": 1024}])
def test_transform_param_types(tmp_path, small, tf):
    def edit(d):
        s = next(s for s in d["storages"] if s["transforms"])
        s["transforms"] = [tf]
    q = forge(tmp_path, small[0], edit)
    with pytest.raises(ckptzip.CorruptFileError):
        ckptzip.load(q)


@pytest.mark.parametrize("keys", [["w", "w", "n"], [{"t": "int", "v": "1"}, True, "n"],
                                  [{"t": "int", "v": "1"}, {"t": "float", "v": struct.pack("<d", 1.0).hex()}, "n"]])
def test_duplicate_dict_keys_in_tree(tmp_path, small, keys):
    q = forge(tmp_path, small[0], lambda d: d["root"].__setitem__("k", keys))
    with pytest.raises(ckptzip.CorruptFileError, match="duplicate"):
        ckptzip.load(q)
    with pytest.raises(ckptzip.CorruptFileError, match="duplicate"):
        ckptzip.open(q)  # the lazy reader agrees with the eager one: no silent first-wins


def test_duplicate_json_object_keys(tmp_path, small):
    data, doc, rows = read_parts(small[0])
    text = json.dumps(doc, separators=(",", ":"))
    assert text.endswith("}")
    evil = text[:-1] + ',"root":' + json.dumps(doc["root"]) + "}"  # "root" twice
    q = tmp_path / "dupjson.ckz"
    write_raw(q, data, evil.encode(), rows)
    with pytest.raises(ckptzip.CorruptFileError, match="duplicate"):
        ckptzip.load(q)
    write_raw(q, data, text.replace('"nbytes":', '"nbytes":NaN,"nbytes":', 1).encode(), rows)
    with pytest.raises(ckptzip.CorruptFileError):
        ckptzip.load(q)


@pytest.mark.parametrize("native_lib", [True, False])
def test_strict_json_finds_repeated_names_however_written(monkeypatch, native_lib):
    """strict_json refuses an object that repeats a member name (escaped or not, at any depth,
    beside strings full of colons and quotes) and parses everything else as json.loads does,
    with the C extension's count (plain dicts, then members written vs items kept) or without."""
    from ckptzip import native
    from ckptzip.validate import strict_json
    if not native_lib:
        monkeypatch.setattr(native, "lib", None)
    elif native.lib is None:
        pytest.skip("C extension not built")
    def err(msg):
        return ValueError(msg)
    bad = ['{"a":1,"a":2}', '{"a":1,"\\u0061":2}', '{"x":{"b":[{"c":1,"c":1}]}}', '[{"k":":","k":"\\""}]',
           '{"a":{"b":1},"b":{"b":1},"b":2}', '[' * 600 + '{"d":1,"d":1}' + ']' * 600]
    for text in bad:
        with pytest.raises(ValueError, match="duplicate JSON object key"):
            strict_json(text.encode(), err)
    good = ['{"a":"::","b":{"c":"\\":\\\\"}}', '{"a\\"":1,"a":2}', '[]', '3', '"x:y"', '{"\\u00e9":1,"\u00e9x":2}',
            '[' * 600 + '{"d":1,"e":1}' + ']' * 600]
    for text in good:
        assert strict_json(text.encode(), err) == json.loads(text)
    with pytest.raises(ValueError, match="NaN"):
        strict_json(b'{"a":NaN}', err)


def test_strict_json_matches_a_pairs_hook_on_random_documents():
    """Random documents, some with a member name repeated somewhere: strict_json refuses exactly
    those that a pairs hook finds repeating one, and returns json.loads' result otherwise."""
    import random
    from ckptzip.validate import strict_json
    rng = random.Random(0)
    names = ["a", "b", ":", '"', "\\", "a:b", "\u00e9", "c"]

    def value(depth):
        r = rng.random()
        if depth > 3 or r < 0.3:
            return rng.choice([1, -2.5, "s:\"", None, True, ""])
        if r < 0.6:
            return [value(depth + 1) for _ in range(rng.randint(0, 3))]
        return [(rng.choice(names), value(depth + 1)) for _ in range(rng.randint(0, 4))]

    def text(v):
        if isinstance(v, list) and v and isinstance(v[0], tuple):
            return "{" + ",".join(json.dumps(k) + ":" + text(x) for k, x in v) + "}"
        if isinstance(v, list) and not v and rng.random() < 0.5:
            return "{}"
        if isinstance(v, list):
            return "[" + ",".join(text(x) for x in v) + "]"
        return json.dumps(v)

    def has_dup(pairs):
        if len({k for k, _ in pairs}) < len(pairs):
            raise KeyError
        return dict(pairs)
    seen = {True: 0, False: 0}
    for _ in range(3000):
        t = text(value(0))
        try:
            want, dup = json.loads(t, object_pairs_hook=has_dup), False
        except KeyError:
            dup = True
        seen[dup] += 1
        if dup:
            with pytest.raises(ValueError, match="duplicate"):
                strict_json(t.encode(), ValueError)
        else:
            assert strict_json(t.encode(), ValueError) == want
    assert min(seen.values()) > 100


@pytest.mark.usefixtures("no_pack")
@pytest.mark.parametrize("field", ["width", "block"])
def test_each_storage_chain_is_checked_even_where_it_equals_an_earlier_one(tmp_path, field):
    """Storages share parsed chains when their configs are equal; 4.0 equals (and hashes as) 4 in
    Python but is no JSON integer, so a second storage that writes it is refused, not given the
    first one's parse."""
    p = tmp_path / "two.ckz"
    torch.manual_seed(0)
    ckptzip.save({"a": torch.randn(2048), "b": torch.randn(2048)}, p, codec="zstd", device="cpu")

    def edit(d):
        first, second = [s for s in d["storages"] if s["transforms"]][:2]
        assert first["transforms"] == second["transforms"]
        tf = dict(first["transforms"][0])
        tf[field] = float(tf[field])
        second["transforms"] = [tf]
    q = forge(tmp_path, p, edit)
    with pytest.raises(ckptzip.CorruptFileError):
        ckptzip.load(q)


@pytest.mark.usefixtures("no_pack")
def test_a_reference_transform_without_its_ref_is_parsed_on_its_own(tmp_path):
    """Chains with a reference transform share a parse keyed without their "ref"; a chain whose
    first transform has no "ref" at all must not take that key (it was given the earlier
    storage's reference and decoded with it): it is refused by its own parse."""
    p = tmp_path / "three.ckz"
    torch.manual_seed(0)
    ckptzip.save({k: torch.randn(2048) for k in "abc"}, p, codec="zstd", device="cpu")

    def edit(d):
        st = d["storages"]
        bp = st[0]["transforms"][-1]
        assert bp["id"] == "byteplane" and all(s["nbytes"] == st[0]["nbytes"] for s in st)
        st[0]["transforms"] = [{"id": "expref", "ref": {"storage": 2}}, bp]
        st[1]["transforms"] = [{"id": "expref"}, bp]
    q = forge(tmp_path, p, edit)
    with pytest.raises((ckptzip.UnknownCodecError, ckptzip.CorruptFileError), match="expref"):
        ckptzip.load(q)


def test_terabyte_declared_by_small_file(tmp_path):
    """A 1.7 MB file whose 65,536 rows of 16 MiB all point at one small zstd frame declares a
    1 TiB storage: ResourceLimitError (a CorruptFileError) before any allocation."""
    data, doc, rows = one_chunk_file(tmp_path)
    frame = zeros_frame(fmt.MAX_CHUNK, True)
    data = replace_chunk(data, rows, 0, frame)
    n = 1 << 16
    big = np.zeros(n, dtype=fmt.ROW)
    big["offset"], big["stored"], big["raw"] = rows[0]["offset"], len(frame), fmt.MAX_CHUNK
    big["xxh3"] = fmt.checksum(frame)
    doc["n_chunks"] = n
    doc["storages"][0].update(nbytes=n * fmt.MAX_CHUNK, rows=[0, n])
    doc["root"]["v"][0]["shape"] = [n * fmt.MAX_CHUNK]
    q = tmp_path / "tib.ckz"
    write_parts(q, data, doc, big)
    assert os.path.getsize(q) < 2 << 20
    t = time.time()
    with pytest.raises(ckptzip.ResourceLimitError, match="max_bytes"):
        ckptzip.load(q)
    with ckptzip.open(q) as r:
        assert r.keys() == ["x"]
        with pytest.raises(ckptzip.ResourceLimitError):
            r.get_tensor("x")
        with pytest.raises(ckptzip.ResourceLimitError):
            r.verify()
    assert time.time() - t < 10
    assert issubclass(ckptzip.ResourceLimitError, ckptzip.CorruptFileError)


def test_max_bytes_knob(tmp_path):
    p = tmp_path / "z.ckz"
    ckptzip.save({"z": torch.zeros(1 << 20)}, p, device="cpu")  # 4 MiB of zeros, a few KB on disk
    with pytest.raises(ckptzip.ResourceLimitError):
        ckptzip.load(p, max_bytes=1 << 20)
    assert ckptzip.load(p, max_bytes=4 << 20)["z"].shape == (1 << 20,)
    assert ckptzip.load(p)["z"].shape == (1 << 20,)  # default: max(1 GiB, 4096 x file size)
    with ckptzip.open(p) as r:
        assert r.max_bytes == max(1 << 30, 4096 * os.path.getsize(p))


# -- 5. special files ---------------------------------------------------------------------------
def _finishes(fn, seconds=20):
    box = {}

    def run():
        try:
            fn()
        except BaseException as e:  # noqa: BLE001
            box["e"] = e
    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(seconds)
    assert not th.is_alive(), "hung on a special file"
    return box.get("e")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_fifo_is_refused_not_hung(tmp_path):
    f = tmp_path / "fifo.ckz"
    os.mkfifo(f)
    for fn in (lambda: ckptzip.load(f), lambda: ckptzip.open(f).verify(), lambda: ckptzip.open(f)):
        assert isinstance(_finishes(fn), ckptzip.NotARegularFileError)


def test_directory_and_device_are_refused(tmp_path):
    for path in (tmp_path, "/dev/null"):
        if not os.path.exists(path):
            continue
        with pytest.raises(ckptzip.NotARegularFileError):
            ckptzip.load(path)
        with pytest.raises(ckptzip.NotARegularFileError):
            ckptzip.open(path)
    with pytest.raises(FileNotFoundError):
        ckptzip.load(tmp_path / "missing.ckz")


# -- 6. verify is linear ------------------------------------------------------------------------
def test_verify_many_small_storages(tmp_path):
    p = tmp_path / "many.ckz"
    n = 20000
    ckptzip.save({f"t{i}": torch.tensor([i]) for i in range(n)}, p, device="cpu")
    t = time.time()
    with ckptzip.open(p) as r:
        r.verify()
    took = time.time() - t
    assert took < 15, f"verify of {n} tiny storages took {took:.1f} s"


def test_verify_still_detects_damage_in_batches(tmp_path):
    p = tmp_path / "d.ckz"
    ckptzip.save({f"t{i}": torch.full((100,), i) for i in range(300)}, p, device="cpu", codec="zstd")
    data, doc, rows = read_parts(p)
    raw = bytearray(p.read_bytes())
    raw[int(rows[-1]["offset"])] ^= 0xFF
    p.write_bytes(bytes(raw))
    with pytest.raises(ckptzip.ChecksumError), ckptzip.open(p) as r:
        r.verify()


# -- 8. round trips -----------------------------------------------------------------------------
def test_zero_d_numpy_array(tmp_path):
    p = tmp_path / "a.ckz"
    obj = {"a": np.array(3.5), "b": np.array(7, dtype=np.int16), "c": np.zeros((0, 3))}
    ckptzip.save(obj, p)
    back = ckptzip.load(p)
    assert back["a"].shape == () and back["b"].shape == () and back["c"].shape == (0, 3)
    assert_same(obj, back)
    with ckptzip.open(p) as r:
        assert r.get_tensor("a").shape == ()


def test_lazy_keys_do_not_conflate(tmp_path):
    p = tmp_path / "k.ckz"
    t = [torch.full((3,), float(i)) for i in range(6)]
    obj = {1: t[0], "1": t[1], "a.b": t[2], "a": {"b": t[3], "c": t[4]}, "plain": t[5]}
    ckptzip.save(obj, p)
    with ckptzip.open(p) as r:
        keys = r.keys()
        assert len(keys) == len(set(keys)) == 6
        assert "plain" in keys and "a.c" in keys  # no collision: dotted keys as before
        assert torch.equal(r.get_tensor("[1]"), t[0])
        assert torch.equal(r.get_tensor('["1"]'), t[1])
        assert torch.equal(r.get_tensor('["a.b"]'), t[2])
        assert torch.equal(r.get_tensor('["a","b"]'), t[3])
        assert torch.equal(r.get_tensor('["a","c"]'), t[4])  # escaped form always works
        got = sorted(float(r.get_tensor(k)[0]) for k in keys)
        assert got == [float(i) for i in range(6)]
    assert_same(obj, ckptzip.load(p))


def test_escaped_key_cannot_shadow_a_dotted_key(tmp_path):
    p = tmp_path / "k2.ckz"
    t = [torch.full((2,), float(i)) for i in range(3)]
    obj = {"x": {"y": t[0]}, "x.y": t[1], '["x","y"]': t[2]}
    ckptzip.save(obj, p)
    with ckptzip.open(p) as r:
        keys = r.keys()
        assert len(set(keys)) == 3
        assert sorted(float(r.get_tensor(k)[0]) for k in keys) == [0.0, 1.0, 2.0]


def test_keys_without_the_escaped_map_are_the_same_keys():
    """tensor_keys(escaped=False) (saves: escaped keys made only where a dotted key collides)
    lists the same keys for the same nodes as the full call, collisions and shadowing included."""
    from ckptzip.tree import Encoder, tensor_keys
    t = [torch.full((2,), float(i)) for i in range(8)]
    for obj in ({1: t[0], "1": t[1], "a.b": t[2], "a": {"b": t[3], "c": t[4]}, "plain": t[5]},
                {"x": {"y": t[0]}, "x.y": t[1], '["x","y"]': t[2], "z": [t[3], {"w": t[4]}]},
                {"m": {f"l{i}": t[i] for i in range(8)}}):
        root = Encoder().encode(obj)
        keys, esc = tensor_keys(root)
        keys2, esc2 = tensor_keys(root, escaped=False)
        assert list(keys) == list(keys2) and all(keys[k] is keys2[k] for k in keys)
        assert esc2 == {} and len(esc) == len(keys)


def test_huge_ints_round_trip(tmp_path):
    p = tmp_path / "i.ckz"
    obj = {"big": 10 ** 5000 + 7, "neg": -(3 ** 40000), "key": {7 ** 9000: 1}, "small": -12}
    ckptzip.save(obj, p)
    back = ckptzip.load(p)
    assert back == obj and list(back["key"]) == list(obj["key"])
    assert sys.get_int_max_str_digits() in (0, 4300)  # the global limit is left alone


@pytest.mark.parametrize("v", ["1" * (1_000_002), "١٢", "1_000", " 5", "+5", "", "--1", "0x10"],
                         ids=["too-long", "arabic-digits", "underscore", "space", "plus", "empty", "minus2", "hex"])
def test_int_strings_bounded_and_strict(tmp_path, small, v):
    q = forge(tmp_path, small[0], lambda d: d["root"]["v"].__setitem__(2, {"t": "int", "v": v}))
    with pytest.raises(ckptzip.CorruptFileError):
        ckptzip.load(q)


# -- 13. map_location and file objects ----------------------------------------------------------
def test_map_location_torch_convention(tmp_path, small):
    p, obj = small
    seen = []

    def fn(storage, location):
        seen.append((type(storage), location))
        return storage

    back = ckptzip.load(p, map_location=fn)
    assert same_bits(back["w"], obj["w"]) and back["n"] == 5
    assert seen and all(t is torch.UntypedStorage and loc == "cpu" for t, loc in seen)
    back = ckptzip.load(p, map_location=lambda s, loc: None)  # None: default placement
    assert same_bits(back["i"], obj["i"])
    back = ckptzip.load(p, map_location=lambda loc: "cpu")  # legacy one-argument form
    assert same_bits(back["w"], obj["w"])
    with ckptzip.open(p, map_location=fn) as r:
        assert same_bits(r.get_tensor("w"), obj["w"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_map_location_cuda_without_cuda(small):
    p, _ = small
    for ml in ("cuda", torch.device("cuda:0"), {"cpu": "cuda"}, lambda loc: "cuda"):
        with pytest.raises(ckptzip.GPURequiredError, match="CUDA is not available"):
            ckptzip.load(p, map_location=ml)


def test_load_and_open_file_objects(tmp_path, small):
    p, obj = small
    bio = io.BytesIO(p.read_bytes())
    assert_same(obj, ckptzip.load(bio))
    assert not bio.closed
    with open(p, "rb") as f:
        with ckptzip.open(f) as r:
            assert same_bits(r.get_tensor("w"), obj["w"])
        assert not f.closed
        f.seek(0)
        assert_same(obj, ckptzip.load(f))


def test_bytesio_is_decoded_in_place_and_never_changed(tmp_path, monkeypatch):
    """A BytesIO is read from its own bytes: the decoder gets views of them (no copy), they are
    never written, and the reader keeps its snapshot when the caller writes to the BytesIO."""
    from ckptzip.engine import decode
    from ckptzip.storage import FileObjectSource
    g = torch.Generator().manual_seed(3)
    obj = {"w": torch.randn(300_000, generator=g), "h": torch.randn(70_000, generator=g).bfloat16(),
           "i": torch.arange(5000), "n": torch.randn(7, generator=g), "s": "x"}
    bio = io.BytesIO()
    ckptzip.save(obj, bio)
    bio.seek(0)
    before = bio.getvalue()
    base = FileObjectSource(bio).mem.data_ptr()
    seen = []
    real = decode.read_stored

    def spy(src, rows, **kw):
        host, soffs, later = real(src, rows, **kw)
        seen.append(base <= host.data_ptr() < base + len(before))
        return host, soffs, later
    monkeypatch.setattr(decode, "read_stored", spy)
    for _ in range(2):
        assert_same(obj, ckptzip.load(bio))
    assert seen and all(seen)
    assert bio.getvalue() == before
    # the decoding pieces verify the fused chunks, each chunk once, before decoding it (as
    # for files: see test_engine); read_stored leaves them to the pieces
    plans, deferred, checked = [], [], []
    real_plan, real_verify = decode._fused_plan, decode.verify
    monkeypatch.setattr(decode, "_fused_plan", lambda rows, grp, **kw: plans.append(real_plan(rows, grp, **kw)) or plans[-1])

    def spy2(src, rows, **kw):
        deferred.append(kw.get("defer"))
        return real(src, rows, **kw)

    def spy_verify(buf, offs, batch):
        checked.extend(batch["offset"].tolist())
        return real_verify(buf, offs, batch)
    monkeypatch.setattr(decode, "read_stored", spy2)
    monkeypatch.setattr(decode, "verify", spy_verify)
    from ckptzip import native
    if native.lib is None:  # (fused batches, and their checks, are the C extension's)
        assert_same(obj, ckptzip.load(io.BytesIO(before)))
        assert not any(pl is not None for pl in plans)
    else:
        c_hash = native.XXH3
        monkeypatch.setattr(native, "XXH3", False)  # (first the pieces' checksums in Python)
        assert_same(obj, ckptzip.load(io.BytesIO(before)))
        fused = [pl for pl in plans if pl is not None]
        assert fused and all(pl.verify for pl in fused) and len(deferred) == len(plans)
        assert all(d is not None for pl, d in zip(plans, deferred) if pl is not None)
        assert sorted(checked) == sorted(set(checked))  # (no chunk verified twice)
        assert len(checked) == sum(int(d.sum()) for d in deferred if d is not None)
        if c_hash:
            # with native.XXH3 each piece's planes_fused call verifies the chunks whose words
            # start in its range: together, every deferred chunk once
            monkeypatch.setattr(native, "XXH3", True)
            from conftest import FusedSpy
            counted = []

            def pf(*a):
                assert a[10] is not None
                counted.append(int(np.sum((a[4] < a[9]) & (a[4] + a[5] > a[8]))))  # (the chunks it reads)
            monkeypatch.setattr(native, "lib", FusedSpy(native.lib, pf))
            plans.clear(), deferred.clear(), checked.clear()
            assert_same(obj, ckptzip.load(io.BytesIO(before)))
            assert not checked and sum(counted) == sum(int(d.sum()) for d in deferred if d is not None) > 0
            monkeypatch.undo()  # (the copy-on-write, damage and warning checks below: as loaded normally)
    r = ckptzip.open(bio)
    bio.seek(0)
    bio.write(b"\0" * len(before))  # (copy-on-write: the reader's snapshot keeps the old bytes)
    assert same_bits(r.get_tensor("w"), obj["w"])
    r.close()
    # a file object that starts inside a larger buffer, and damage found by its checksum
    assert_same(obj, ckptzip.load(_at(b"junk" + before, 4)))
    (tmp_path / "a.ckz").write_bytes(before)
    _data, _doc, rows = read_parts(tmp_path / "a.ckz")
    k = int(np.argmax(rows["stored"]))
    off = int(rows[k]["offset"]) + 5
    bad = before[:off] + bytes([before[off] ^ 1]) + before[off + 1:]
    with pytest.raises(ckptzip.ChecksumError):
        ckptzip.load(io.BytesIO(bad))
    src = FileObjectSource(io.BytesIO(before))
    with pytest.raises(ckptzip.TruncatedFileError):
        src.view(len(before) - 3, 4)


    class Masked(io.BytesIO):  # a subclass that reads its own way: read through it, as before
        def readinto(self, b):
            n = super().readinto(b)
            memoryview(b)[:n] = bytes(x ^ 0x5A for x in memoryview(b)[:n])
            return n
    assert FileObjectSource(Masked(bytes(x ^ 0x5A for x in before))).mem is None
    assert_same(obj, ckptzip.load(Masked(bytes(x ^ 0x5A for x in before))))
    # no warning, and the process's warning filters untouched, with loads on several threads
    filters, interval = list(warnings.filters), sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # (threads switch often: a race on the filters would show)
    try:
        end = time.monotonic() + 0.5

        def opens() -> None:
            while time.monotonic() < end:
                FileObjectSource(io.BytesIO(before))
        ts = [threading.Thread(target=opens) for _ in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert warnings.filters == filters
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_same(obj, ckptzip.load(io.BytesIO(before)))


def _at(data: bytes, start: int) -> io.BytesIO:
    b = io.BytesIO(data)
    b.seek(start)
    return b


def test_open_for_write_file_object_not_closed():
    from ckptzip.storage import open_for_write
    bio = io.BytesIO()
    with open_for_write(bio) as f:
        f.write(b"abc")
        f.close()
    assert not bio.closed and bio.getvalue() == b"abc"


def test_save_to_file_object(tmp_path, small):
    _, obj = small
    bio = io.BytesIO()
    r = ckptzip.save(obj, bio)
    assert r["path"] == "<file object>"
    bio.seek(0)
    assert_same(obj, ckptzip.load(bio))


@pytest.mark.usefixtures("no_pack")
def test_storage_row_ranges_checked_as_a_whole(tmp_path):
    """The chunk-table checks made over all storages at once: two storages sharing a chunk row,
    in either file order and with empty ranges around, and chunks that do not add up to a
    storage's size, are CorruptFileError before anything is decoded."""
    p = tmp_path / "a.ckz"
    ckptzip.save({"a": torch.randn(5000), "b": torch.randn(3000), "c": torch.zeros(0), "d": torch.randn(2000)}, p)
    data, doc, rows = read_parts(p)
    st = doc["storages"]
    nonempty = [k for k, s in enumerate(st) if s["rows"][1]]
    assert len(nonempty) >= 3
    for i, j in ((nonempty[0], nonempty[1]), (nonempty[2], nonempty[0])):
        bad = json.loads(json.dumps(doc))
        bad["storages"][j]["rows"] = [st[i]["rows"][0], st[j]["rows"][1]]
        q = tmp_path / f"shared{i}{j}.ckz"
        write_parts(q, data, bad, rows)
        with pytest.raises(ckptzip.CorruptFileError, match="shares chunk rows"):
            ckptzip.load(q)
    bad = json.loads(json.dumps(doc))
    bad["storages"][nonempty[1]]["nbytes"] += 4
    q = tmp_path / "sizes.ckz"
    write_parts(q, data, bad, rows)
    with pytest.raises(ckptzip.CorruptFileError, match="do not add up"):
        ckptzip.load(q)
    ckptzip.load(p)  # the untouched file still loads
