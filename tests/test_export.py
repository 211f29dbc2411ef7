"""Lossy export (issue 17): quantizers, packing, weight detection, the lossy .ckz convention,
compressed-tensors interop, bad inputs, sensitivity allocation. CPU, a few seconds."""
from __future__ import annotations

import functools
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import ckptzip
from ckptzip import lossy as ex
from ckptzip.lossy.alloc import allocate
from ckptzip.lossy.quant import pack_bits, unpack_bits

INT_SCHEMES = [f"int{b}-g{g}{s}" for b in range(2, 9) for g in (32, 128) for s in ("", "-sym")]


def _w(rows=48, cols=200, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.02
    w[:, 7] *= 10  # an outlier column, as real weights have
    return w


def _group_scale(e):
    q = e["q"]
    rows = q["shape"][0]
    s = e["scales"].float().reshape(rows, -1)
    return s.repeat_interleave(int(q["group"]), 1)[:, :q["shape"][-1]]


# -- quantizers ---------------------------------------------------------------------------
@pytest.mark.parametrize("scheme", INT_SCHEMES)
def test_int_rtn_error_bound(scheme):
    """Round-to-nearest from min/max: every element within half a quantization step."""
    w = _w()
    e = ex.quantize(w, scheme, search=False)
    deq = ex.dequantize(e, dtype=torch.float32)
    assert deq.shape == w.shape
    assert ((w - deq).abs() <= _group_scale(e) / 2 * (1 + 1e-6)).all()
    assert (e["zeros"] is None) == scheme.endswith("-sym")


@pytest.mark.parametrize("scheme", INT_SCHEMES)
def test_scale_search_never_worse_than_rtn(scheme):
    w = _w(seed=1)
    mse = [(ex.dequantize(ex.quantize(w, scheme, search=s), dtype=torch.float32).double() - w.double()).square().sum()
           for s in (False, True)]
    assert mse[1] <= mse[0] * (1 + 1e-5)  # the grid includes the ratio 1.0 (= min/max); float32 sums aside


def test_fp8_row_scale_error_bound():
    w = _w(rows=64, cols=96, seed=2)
    e = ex.quantize(w, "fp8")
    assert e["codes"].dtype == torch.uint8 and e["scales"].shape == (64,)
    deq = ex.dequantize(e, dtype=torch.float32)
    s = e["scales"].float()[:, None]
    assert (w.abs().amax(1) / e["scales"].float() <= 448).all()
    # e4m3: 3 mantissa bits -> relative rounding error <= 2**-4; subnormals: half the smallest step
    bound = torch.maximum(w.abs() * 2 ** -4, s * 2 ** -10) * (1 + 1e-6)
    assert ((w - deq).abs() <= bound).all()


@pytest.mark.parametrize("scheme", ["fp8", "int4-g32", "int6-g128-sym", "int3-g64"])
def test_dequantize_is_exact_float32_then_one_rounding(scheme):
    e = ex.quantize(_w(seed=3).to(torch.bfloat16), scheme)
    f32 = ex.dequantize(e, dtype=torch.float32)
    assert torch.equal(ex.dequantize(e, dtype=torch.bfloat16), f32.to(torch.bfloat16))
    assert torch.equal(ex.dequantize(e, dtype=torch.float16), f32.to(torch.float16))
    if torch.cuda.is_available():
        assert torch.equal(ex.dequantize(e, device="cuda").cpu(), ex.dequantize(e))


@pytest.mark.parametrize("bits", range(2, 9))
@pytest.mark.parametrize("n", [1, 8, 37, 1000])
def test_pack_roundtrip(bits, n):
    c = torch.randint(0, 1 << bits, (n,), dtype=torch.uint8)
    p = pack_bits(c, bits)
    assert p.numel() == (n + 7) // 8 * bits
    assert torch.equal(unpack_bits(p, bits, n), c)


def test_int4_packs_two_per_byte_low_nibble_first():
    p = pack_bits(torch.tensor([1, 2, 3, 4, 5, 6, 7, 8], dtype=torch.uint8), 4)
    assert p.tolist() == [0x21, 0x43, 0x65, 0x87]


def test_3d_tensor_and_short_rows():
    w = torch.randn(3, 5, 40)
    e = ex.quantize(w, "int4")  # rows of 40 < group 128: groups of 64
    assert e["q"]["group"] == 64
    assert ex.dequantize(e).shape == w.shape


# -- sources and detection ------------------------------------------------------------------
def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 10))


def _train_state(m):
    opt = torch.optim.AdamW(m.parameters())
    m(torch.randn(4, 32)).sum().backward()
    opt.step()
    sd = m.state_dict()
    return {"model": sd, "model_bf16": {k: v.to(torch.bfloat16) for k, v in sd.items()},
            "optimizer": opt.state_dict(), "step": 1, "rng": torch.get_rng_state()}


def test_report_names_dropped_lists_of_tensors(tmp_path):
    """A Lightning checkpoint keeps its optimizer states in a list of dicts: dropped like a dict, and
    named in the report."""
    m = _mlp()
    st = _train_state(m)
    src = {"state_dict": st["model"], "optimizer_states": [st["optimizer"]], "epoch": 3,
           "callbacks": {"ModelCheckpoint": {"best_model_score": torch.tensor(0.5)}}, "lr_schedulers": []}
    r = ex.export(src, tmp_path / "o.ckz", scheme="int8")
    assert r["model_key"] == "state_dict"
    assert r["dropped"].keys() == {"optimizer_states", "callbacks"}
    assert r["dropped"]["optimizer_states"] == "optimizer state"
    assert r["dropped"]["callbacks"].startswith("not the model weights")


def test_report_with_a_dotted_top_level_model_key():
    from ckptzip.lossy.sources import find_weights
    w = {"fc.weight": torch.randn(4, 4)}
    for kw in ({}, {"model_key": "model.ema"}):
        weights, notes = find_weights({"model.ema": w, "step": 1, "opt": {"exp_avg": torch.ones(2)}}, **kw)
        assert set(weights) == {"fc.weight"} and notes["dropped"] == {"opt": "optimizer state"}, kw
    weights, notes = find_weights({"model": {"ema": w, "other": {"x": torch.ones(2, 2)}}, "rng": torch.ones(3)},
                                  model_key="model.ema")  # (a dotted path: its root is "model")
    assert set(weights) == {"fc.weight"} and notes["dropped"] == {"rng": "not the model weights"}
    big = {"model": w, "perm": list(range(2_000_000))}  # (plain ints: no call per element)
    assert find_weights(big)[1]["dropped"] == {}


def test_detects_model_drops_optimizer_and_duplicate_copy(tmp_path):
    m = _mlp()
    state = _train_state(m)
    src = tmp_path / "s.ckz"
    ckptzip.save(state, src)
    r = ex.export(src, tmp_path / "o.ckz", scheme="int8")
    assert r["model_key"] == "model"
    assert r["dropped"]["optimizer"] == "optimizer state"
    assert "duplicate" in r["dropped"]["model_bf16"]
    assert r["dropped"]["rng"] == "not the model weights" and "step" not in r["dropped"]
    assert set(r["quantized"]) == {"0.weight", "3.weight"}
    assert {"0.bias", "2.weight", "2.bias", "3.bias"} <= set(r["kept"])
    out = ex.load_lossy(tmp_path / "o.ckz", dtype=torch.float32)
    for k in r["kept"]:  # kept = the fp32 master, exactly
        assert torch.equal(out[k], state["model"][k])
    assert (out["0.weight"] - state["model"]["0.weight"]).abs().max() < 0.01


@pytest.mark.parametrize("kind", ["flat", "lightning", "pt", "safetensors", "model_key"])
def test_sources(tmp_path, kind):
    sd = _mlp().state_dict()
    src: object
    kw = {}
    if kind == "flat":
        src = dict(sd)
    elif kind == "lightning":
        src = {"state_dict": sd, "optimizer_states": [{}], "epoch": 3}
    elif kind == "pt":
        src = tmp_path / "s.pt"
        torch.save({"model": sd, "optimizer": {"state": {}, "param_groups": []}}, src)
    elif kind == "safetensors":
        st = pytest.importorskip("safetensors.torch")
        src = tmp_path / "s.safetensors"
        st.save_file(dict(sd), src)
    else:
        src, kw = {"ema": sd, "online": {k: v + 1 for k, v in sd.items()}}, {"model_key": "online"}
    r = ex.export(src, tmp_path / "o.ckz", scheme="int4", **kw)
    assert set(r["quantized"]) == {"0.weight", "3.weight"}
    if kind == "model_key":
        assert torch.equal(ex.load_lossy(tmp_path / "o.ckz")["0.bias"], sd["0.bias"] + 1)


def test_keep_patterns_and_progress(tmp_path):
    calls = []
    r = ex.export(_mlp().state_dict(), tmp_path / "o.ckz", scheme="fp8", keep=["3.*"],
                  progress=lambda d, t: calls.append((d, t)))
    assert r["kept"]["3.weight"] == "keep pattern"
    assert calls[-1] == (1, 1)


# -- the lossy file ----------------------------------------------------------------------------
def test_lossy_file_convention_and_guards(tmp_path):
    src = tmp_path / "s.ckz"
    ckptzip.save(_train_state(_mlp()), src)
    dst = tmp_path / "o.ckz"
    ex.export(src, dst, scheme="int4-g32")
    with ckptzip.open(dst) as r:
        assert r.metadata["ckptzip.lossy"] == "1" and r.metadata["ckptzip.lossy.scheme"] == "int4-g32"
        assert ex.is_lossy(r)
    tree = ex.load_codes(dst)  # the raw tree (ckptzip.load dequantizes)
    assert tree["format"] == "ckptzip-lossy/1"
    t = tree["tensors"]["0.weight"]
    assert t["codes"].dtype == torch.uint8 and t["scales"].dtype == torch.bfloat16
    assert t["q"]["scheme"] == "int4-g32" and t["q"]["pack"] == "bits" and t["q"]["shape"] == [64, 32]
    assert t["codes"].numel() == 64 * 32 // 2
    assert ex.is_lossy(dst) and not ex.is_lossy(src)
    ex.ensure_lossless(src)
    with pytest.raises(ex.LossyCheckpointError, match="lossy"):
        ex.ensure_lossless(dst)
    codes = ex.load_codes(dst)["tensors"]["0.weight"]
    assert ex.unpack_codes(codes).shape == (64, 32)
    with pytest.raises(ex.ExportError, match="already a lossy export"):
        ex.export(dst, tmp_path / "again.ckz", scheme="int8")


def test_compressed_tensors_interop_bit_exact(tmp_path):
    pytest.importorskip("compressed_tensors")
    st = pytest.importorskip("safetensors.torch")
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import CompressedTensorsDequantizer
    torch.manual_seed(0)
    sd = {"a.weight": torch.randn(64, 128) * 0.02, "b.weight": torch.randn(32, 64) * 0.05,
          "b.bias": torch.randn(32), "odd.weight": torch.randn(8, 40)}
    for scheme in ("int4", "int4-g32-sym", "int8-g64", "int3-g32", "int6-g32-sym", "fp8"):
        ex.export(sd, tmp_path / "ct", scheme=scheme, format="compressed-tensors", force=True)
        ex.export(sd, tmp_path / "q.ckz", scheme=scheme, force=True)
        deq = CompressedTensorsDequantizer(str(tmp_path / "ct")).process(st.load_file(tmp_path / "ct" / "model.safetensors"))
        mine = ex.load_lossy(tmp_path / "q.ckz")
        assert ex.is_lossy(tmp_path / "ct")
        assert set(deq) == set(mine), scheme
        for k in mine:
            assert deq[k].dtype == mine[k].dtype and torch.equal(deq[k], mine[k]), (scheme, k)


# -- bad inputs --------------------------------------------------------------------------------
def test_bad_inputs(tmp_path):
    with pytest.raises(ex.NoFloatWeightsError, match=r"top-level keys: \['step', 'ids'\]"):
        ex.export({"step": 3, "ids": torch.arange(5)}, tmp_path / "o.ckz", scheme="int8")
    src = tmp_path / "s.ckz"
    ckptzip.save({"model": _mlp().state_dict()}, src)
    with pytest.raises(ex.DestinationError, match="is the source"):
        ex.export(src, src, scheme="int8")
    (tmp_path / "exists.ckz").write_bytes(b"x")
    with pytest.raises(ex.DestinationError, match="force"):
        ex.export(src, tmp_path / "exists.ckz", scheme="int8")
    ex.export(src, tmp_path / "exists.ckz", scheme="int8", force=True)
    sd = _mlp().state_dict()
    sd["3.weight"][1, 2] = float("nan")
    with pytest.raises(ex.NonFiniteWeightError, match="'3.weight' holds 1 NaN"):
        ex.export(sd, tmp_path / "n.ckz", scheme="int8")
    r = ex.export(sd, tmp_path / "n.ckz", scheme="int8", nonfinite="keep")
    assert "NaN" in r["kept"]["3.weight"]
    assert torch.equal(ex.load_lossy(tmp_path / "n.ckz")["3.weight"], sd["3.weight"], ) is False  # NaN != NaN
    assert ex.load_lossy(tmp_path / "n.ckz")["3.weight"].isnan().sum() == 1
    with pytest.raises(ex.SchemeError, match="float16"):
        ex.export({k: v.half() for k, v in _mlp().state_dict().items()}, tmp_path / "h.ckz", scheme="bf16")
    with pytest.raises(ex.SchemeError, match="unknown scheme"):
        ex.export(_mlp().state_dict(), tmp_path / "u.ckz", scheme="int9")
    with pytest.raises(ex.BudgetError, match="eval_fn"):
        ex.export(_mlp().state_dict(), tmp_path / "b.ckz", max_loss_increase=0.001)
    for e in (ex.NoFloatWeightsError, ex.DestinationError, ex.LossyCheckpointError):
        assert issubclass(e, ckptzip.CkptzipError)


# -- allocation ------------------------------------------------------------------------------
def test_allocate_knapsack_small():
    table = {"a": {"x": {"bits": 10, "damage": 5.0}, "y": {"bits": 20, "damage": 0.0}},
             "b": {"x": {"bits": 10, "damage": 1.0}, "y": {"bits": 20, "damage": 0.0}}}
    assert allocate(table, budget_bits=30) == {"a": "y", "b": "x"}
    assert allocate(table, budget_bits=40) == {"a": "y", "b": "y"}
    assert allocate(table, max_damage=1.0) == {"a": "y", "b": "x"}


def _trained(m, x, y, n_train: int, steps: int, g):
    """Train ``m`` with Adam on the first ``n_train`` rows (batches drawn from ``g``); returns its
    weights and an eval_fn: held-out cross-entropy on the remaining rows."""
    opt = torch.optim.Adam(m.parameters(), lr=3e-3)
    for _ in range(steps):
        idx = torch.randint(0, n_train, (128,), generator=g)
        loss = F.cross_entropy(m(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    xh, yh = x[n_train:], y[n_train:]

    def eval_fn(weights):
        with torch.no_grad():
            return float(F.cross_entropy(torch.func.functional_call(m, {k: v.float() for k, v in weights.items()}, (xh,)), yh))
    return {k: v.detach().clone() for k, v in m.state_dict().items()}, eval_fn


@functools.lru_cache(maxsize=1)
def _tiny_task():
    """A 3-layer MLP learning a fixed random teacher; held-out cross-entropy as eval_fn."""
    g = torch.Generator().manual_seed(0)
    teacher = torch.randn(16, 8, generator=g)
    x = torch.randn(3000, 16, generator=g)
    y = (x @ teacher + 0.3 * torch.randn(3000, 8, generator=g)).argmax(1)
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 8))
    return _trained(m, x, y, 2500, 200, g)


@functools.lru_cache(maxsize=1)
def _deep_task():
    """A 5-layer MLP (5 matrices) trained under one epoch on a nonlinear teacher (not overfit:
    quantization noise does not lower its held-out loss); held-out cross-entropy as eval_fn."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(22000, 16, generator=g)
    y = (torch.tanh(x @ torch.randn(16, 16, generator=g)) @ torch.randn(16, 8, generator=g)
         + 0.3 * torch.randn(22000, 8, generator=g)).argmax(1)
    torch.manual_seed(0)
    layers = [nn.Linear(16, 96), nn.ReLU()]
    for _ in range(3):
        layers += [nn.Linear(96, 96), nn.ReLU()]
    m = nn.Sequential(*layers, nn.Linear(96, 8))
    return _trained(m, x, y, 20000, 300, g)


DEEP_CANDS = ("int2-g32", "int3-g32", "int4-g32", "int5-g32", "int6-g32", "int8-g32")


@functools.lru_cache(maxsize=1)
def _deep_table():
    from ckptzip.lossy import alloc
    sd, eval_fn = _deep_task()
    return alloc.measure(sd, [k for k, v in sd.items() if v.ndim >= 2], DEEP_CANDS, eval_fn)[0]


def test_sensitivity_allocation_beats_uniform_at_equal_size(tmp_path):
    """At the stored size of uniform int3/int4/int5/int6 (same clipping search), the allocation's
    stored bpw stays <= the uniform one and its measured held-out loss is no worse."""
    sd, eval_fn = _deep_task()
    wins = 0
    for uni in ("int3-g32", "int4-g32", "int5-g32", "int6-g32"):
        u = ex.export(sd, tmp_path / f"u{uni}.ckz", scheme=uni, eval_fn=eval_fn)
        a = ex.export(sd, tmp_path / f"a{uni}.ckz", scheme="auto", bpw=u["bpw"], eval_fn=eval_fn,
                      candidates=DEEP_CANDS, sensitivity=_deep_table())
        assert a["bpw"] <= u["bpw"], (uni, a["bpw"], u["bpw"])
        assert a["loss"]["measured"] <= u["loss"]["measured"], (uni, a["loss"], u["loss"])
        assert a["loss"]["predicted"] is not None and a["correction"]["size"]["met"]
        wins += a["loss"]["measured"] < u["loss"]["measured"] - 1e-4
    assert wins >= 2  # never worse at the 4 sizes (int3: the guard may pick uniform), strictly better at 2+
    # loss budget: measured on the joint choice (not only predicted), and met
    b = ex.export(sd, tmp_path / "b.ckz", scheme="auto", max_loss_increase=0.005, eval_fn=eval_fn,
                  candidates=DEEP_CANDS, sensitivity=_deep_table())
    assert b["loss"]["measured"] - b["loss"]["base"] <= 0.005 * b["loss"]["base"]
    assert b["loss"]["met"] and 1 <= b["correction"]["loss"]["evals"] <= 8


def _interacting(n=6, seed=3):
    """Weights and an eval whose damages interact: loss = 1 + c * (sum_t relerr_t)^2, so the
    joint increase is up to n times the sum of the single-tensor increases c * relerr_t^2."""
    g = torch.Generator().manual_seed(seed)
    sd = {f"l{i}.weight": torch.randn(64 * (1 + i % 3), 128, generator=g) * 0.02 for i in range(n)}
    ref = {k: v.clone() for k, v in sd.items()}

    def eval_fn(w):
        s = sum(float((w[k].float() - ref[k]).norm() / ref[k].norm()) for k in ref)
        return 1.0 + 0.5 * s * s
    return sd, eval_fn


def test_loss_budget_correction_meets_measured_budget(tmp_path):
    sd, eval_fn = _interacting()
    cands = ("int2-g32", "int3-g32", "int4-g32", "int5-g32", "int6-g32", "int8-g32")
    for budget in (0.002, 0.0005):
        raw = ex.export(sd, tmp_path / "r.ckz", scheme="auto", max_loss_increase=budget, eval_fn=eval_fn,
                        candidates=cands, correct=False, force=True)
        assert raw["loss"]["predicted"] - 1.0 <= budget + 1e-12  # the additive prediction is met ...
        assert raw["loss"]["measured"] - 1.0 > budget             # ... the measured increase is not
        cor = ex.export(sd, tmp_path / "c.ckz", scheme="auto", max_loss_increase=budget, eval_fn=eval_fn,
                        candidates=cands, force=True)
        c = cor["correction"]["loss"]
        assert cor["loss"]["measured"] - 1.0 <= budget and cor["loss"]["met"] and c["met"]
        assert 2 <= c["evals"] <= 8
        assert cor["bpw_est"] > raw["bpw_est"]  # it backed off to safer schemes
        assert c["rounds"][0]["measured"] > budget  # round 0 is the uncorrected greedy choice
        # the reported figure is the loss of what was written
        assert abs(eval_fn(ex.load_lossy(tmp_path / "c.ckz")) - cor["loss"]["measured"]) < 1e-6


@pytest.mark.parametrize("mode", ["proxy", "eval"])
def test_size_target_is_never_exceeded(tmp_path, mode):
    sd, eval_fn = _interacting(n=5, seed=4)
    kw = {"eval_fn": eval_fn} if mode == "eval" else {}
    # the targets below are calibrated to the CPU's coding of these small tensors (a GPU's ANS
    # stores the smallest allocation at 2.97 bpw, where a 2.9 target is then refused, rightly)
    kw["device"] = "cpu"
    with pytest.raises(ex.BudgetError, match="smallest stored"):  # int2-g32 stores ~2.8 bpw here
        ex.export(sd, tmp_path / "low.ckz", scheme="auto", bpw=2.6, force=True, **kw)
    for i, target in enumerate((2.9, 3.3, 4.2, 4.9, 6.0, 7.95, 9.0)):
        r = ex.export(sd, tmp_path / f"s{i}.ckz", scheme="auto", bpw=target, force=True, **kw)
        assert r["bpw"] <= target, (target, r["bpw"], r["correction"])
        assert r["bpw"] >= target - 0.6, (target, r["bpw"])  # and spends most of it
    # the int8 size: the old allocation stopped far below it (negative/zero damages ended the walk)
    u = ex.export(sd, tmp_path / "u.ckz", scheme="int8-g128", **kw)
    a = ex.export(sd, tmp_path / "a.ckz", scheme="auto", bpw=u["bpw"], **kw)
    assert u["bpw"] - 0.25 <= a["bpw"] <= u["bpw"]


def test_effective_damage_ties_spend_the_budget():
    from ckptzip.lossy import alloc
    # b's measured damages are noise (<= 0): clamped at 0 the hull walk never upgraded it
    table = {"a": {"x": {"bits": 10, "damage": 5.0, "err": 0.3}, "y": {"bits": 20, "damage": 0.0, "err": 0.01}},
             "b": {"x": {"bits": 10, "damage": -1e-4, "err": 0.3}, "y": {"bits": 20, "damage": -2e-4, "err": 0.01}}}
    for model in ("fit", "measured"):
        assert alloc.allocate(alloc.effective(table, model), budget_bits=40) == {"a": "y", "b": "y"}
    # a jump off the hull that fits the leftover bits is taken
    t2 = {"a": {"x": {"bits": 10, "damage": 5.0}, "y": {"bits": 25, "damage": 1.0}, "z": {"bits": 40, "damage": 0.0}}}
    assert alloc.allocate(t2, budget_bits=26) == {"a": "y"}


def test_proxy_allocation_without_eval_fn(tmp_path):
    sd, _ = _tiny_task()
    r = ex.export(sd, tmp_path / "p.ckz", scheme="auto", bpw=4.0)
    assert r["mode"] == "proxy" and r["bpw_est"] <= 4.0 + 1e-9
    assert len(ex.load_lossy(tmp_path / "p.ckz")) == len(sd)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_dcp_source(tmp_path):
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    import ckptzip.dcp
    sd = _mlp().state_dict()
    dcp.save({"model": dict(sd)}, storage_writer=ckptzip.dcp.Writer(tmp_path / "dcp"))
    r = ex.export(tmp_path / "dcp", tmp_path / "o.ckz", scheme="int8")
    assert set(r["quantized"]) == {"0.weight", "3.weight"}
    assert os.path.exists(tmp_path / "o.ckz")
    # torch's own FileSystemWriter keeps its metadata as a pickle: refused, never run
    dcp.save({"model": dict(sd)}, checkpoint_id=str(tmp_path / "native"))
    with pytest.raises(ex.ExportError, match="pickle"):
        ex.export(tmp_path / "native", tmp_path / "o2.ckz", scheme="int8")


def test_torch_file_with_numpy_rng_state_is_read_without_pickle(tmp_path):
    import numpy as np
    sd = _mlp().state_dict()
    torch.save({"model": sd, "np_rng": np.random.get_state(), "step": 3}, tmp_path / "m.pt")
    r = ex.export(tmp_path / "m.pt", tmp_path / "o.ckz", scheme="int4")
    assert set(r["quantized"]) == {"0.weight", "3.weight"}


def test_explicit_scheme_mapping(tmp_path):
    r = ex.export(_mlp().state_dict(), tmp_path / "o.ckz", scheme={"0.weight": "int8", "3.weight": "int2-g32"})
    assert r["mode"] == "explicit" and r["quantized"]["3.weight"]["scheme"] == "int2-g32"
    with ckptzip.open(tmp_path / "o.ckz") as rd:
        assert rd.metadata["ckptzip.lossy.scheme"] == "explicit:int2-g32,int8-g128"
    with pytest.raises(ex.SchemeError, match="no entry"):
        ex.export(_mlp().state_dict(), tmp_path / "p.ckz", scheme={"0.weight": "int8"})


def test_safetensors_without_the_package(tmp_path, monkeypatch):
    """ckptzip's own safetensors writer and reader (ckptzip.torchfile: validated, no package
    needed) round-trip, and the safetensors package reads what they write."""
    from ckptzip.torchfile import read_safetensors, write_safetensors
    sd = {"a.weight": torch.randn(4, 6).bfloat16(), "b": torch.arange(5), "f8": torch.randn(3).to(torch.float8_e4m3fn)}
    write_safetensors(sd, str(tmp_path / "m.safetensors"), {"format": "pt"})
    back, meta = read_safetensors(str(tmp_path / "m.safetensors"))
    assert meta == {"format": "pt"}
    assert all(torch.equal(back[k].view(torch.uint8), sd[k].view(torch.uint8)) for k in sd)
    st = pytest.importorskip("safetensors.torch")
    assert all(torch.equal(v.view(torch.uint8), sd[k].view(torch.uint8)) for k, v in st.load_file(tmp_path / "m.safetensors").items())


def test_resume_paths_refuse_lossy_files(tmp_path):
    """The Lightning and DeepSpeed integrations refuse to resume from a lossy export."""
    pytest.importorskip("deepspeed")  # (CI installs it; a machine without it skips)
    from ckptzip.integrations.deepspeed import CkptzipCheckpointEngine
    from ckptzip.lossy import LossyCheckpointError
    p = tmp_path / "lossy.ckz"
    ex.export(_mlp().state_dict(), p, scheme="int8")
    with pytest.raises(LossyCheckpointError):
        CkptzipCheckpointEngine().load(str(p))
    pytest.importorskip("lightning")
    from ckptzip.lightning import CkptzipCheckpointIO
    with pytest.raises(LossyCheckpointError):
        CkptzipCheckpointIO().load_checkpoint(p)


def test_ckptzip_load_dequantizes_a_lossy_export(tmp_path):
    sd = _mlp().state_dict()
    p = tmp_path / "l.ckz"
    ex.export(sd, p, scheme="int8")
    got = ckptzip.load(p)
    want = ex.load_lossy(p)
    assert set(got) == set(want)
    for k in want:
        assert torch.equal(got[k], want[k])
    assert any(v.dtype == torch.bfloat16 for v in got.values())
    f32 = ckptzip.load(p, dtype=torch.float32)
    assert all(v.dtype != torch.bfloat16 for k, v in f32.items() if k in ex.load_codes(p)["tensors"])


def test_manager_and_incremental_save_refuse_lossy(tmp_path):
    from ckptzip.lossy import LossyCheckpointError
    m = ckptzip.CheckpointManager(tmp_path / "run")
    m.save(1, {"w": torch.randn(64, 64)})
    ex.export(m.path(1), tmp_path / "l.ckz", scheme="int8")
    import shutil
    shutil.copy(tmp_path / "l.ckz", m.path(1))  # a lossy file where a checkpoint was
    import json
    marker = json.loads(open(m._marker(1)).read())
    marker["bytes"] = (tmp_path / "l.ckz").stat().st_size
    open(m._marker(1), "w").write(json.dumps(marker))
    with pytest.raises(LossyCheckpointError):
        m.load(1)
    with pytest.raises(LossyCheckpointError):
        ckptzip.save({"w": torch.randn(64, 64)}, tmp_path / "x.ckz", base=tmp_path / "l.ckz")


def test_both_budgets_size_wins_and_loss_is_reported(tmp_path):
    sd, eval_fn = _interacting(n=5, seed=5)
    for target in (3.5, 5.0):
        r = ex.export(sd, tmp_path / "b.ckz", scheme="auto", bpw=target, max_loss_increase=0.001,
                      eval_fn=eval_fn, force=True)
        assert r["bpw"] <= target
        assert r["loss"]["met"] == (r["loss"]["measured"] - 1.0 <= 0.001)


# -- stalled correction: tensors whose single damage is ~0 but whose joint damage is large --------
_SYN_SCHEMES = {"int2": (2.5, 0.35), "int3": (3.5, 0.17), "int4": (4.5, 0.08), "int5": (5.5, 0.04),
                "int6": (6.5, 0.02), "int8": (8.5, 0.005), "bf16": (16.0, 0.002)}
_SYN_CULPRITS = ("t3", "t11")


def _stalled_case(n=16, numel=1_000_000):
    """A measured table + joint eval as in the H100 export run: every tensor's true damage is
    k_t * err^2 (jointly 1.3x the sum: interactions), but two tensors (t3, t11) measured ~0 or
    negative alone at int2..int4, while each costs +2e-3 (2x the 1e-3 budget) jointly at those
    schemes. Returns (raw table, joint_damage, the all-bf16 bits)."""
    ks = {f"t{i}": 1e-3 * (0.5 + 1.5 * ((7 * i) % n) / (n - 1)) for i in range(n)}
    noise = {"int2": -2e-5, "int3": 1e-6, "int4": -5e-6}
    table = {}
    for t, k in ks.items():
        table[t] = {}
        for s, (bpw, err) in _SYN_SCHEMES.items():
            d = k * err ** 2
            if t in _SYN_CULPRITS and s in noise:
                d = noise[s]
            table[t][s] = {"bits": bpw * numel, "err": err, "damage": d}

    def joint(choice):
        d = 1.3 * sum(ks[t] * _SYN_SCHEMES[s][1] ** 2 for t, s in choice.items())
        return d + sum(2e-3 for t in _SYN_CULPRITS if choice[t] in noise)
    return table, joint, n * 16.0 * numel


def test_clean_damages_monotone_and_floored():
    from ckptzip.lossy import alloc
    table, _, _ = _stalled_case()
    info = {}
    eff = alloc.effective(table, "measured", info)
    cl, cinfo = alloc.clean(table)
    assert info == cinfo and info["kappa"] > 0 and info["n_floored"] >= 6
    ks = sorted(1e-3 * (0.5 + 1.5 * ((7 * i) % 16) / 15) for i in range(16))
    assert ks[0] <= info["kappa"] <= ks[8]  # a low quantile of measured / proxy
    for n, opts in cl.items():
        order = sorted(opts, key=lambda s: opts[s]["err"])  # finest first
        ds = [opts[s]["damage"] for s in order]
        assert all(b >= a for a, b in zip(ds, ds[1:])), (n, ds)  # coarser: never less damage
        assert all(opts[s]["damage"] >= info["kappa"] * alloc.proxy(n, opts[s]) * (1 - 1e-12) for s in opts)
        assert all(opts[s]["damage_raw"] == table[n][s]["damage"] for s in opts)
        assert all(eff[n][s]["damage_measured"] == table[n][s]["damage"] for s in opts)
        assert all(eff[n][s]["damage_clean"] == opts[s]["damage"] for s in opts)
    # the culprits' int2 is no longer free: at least the floor, not the measured -2e-5
    for c in _SYN_CULPRITS:
        assert cl[c]["int2"]["damage"] >= info["kappa"] * 0.35 ** 2 > 0
    # entries already positive and monotone are kept as measured
    assert cl["t9"]["int2"]["damage"] == table["t9"]["int2"]["damage"]  # t9: the largest k_t


@pytest.mark.parametrize("model", ["measured", "fit"])
def test_stalled_correction_pins_culprits_and_meets_budget(model):
    from ckptzip.lossy import alloc
    table, joint, bf16_bits = _stalled_case()
    budget = 1e-3
    eff = alloc.effective(table, model)
    choice, info = alloc.correct_loss(eff, joint, budget, max_evals=16)
    bits = alloc.predicted(table, choice)[0]
    assert info["met"] and joint(choice) <= budget
    assert bits < 0.6 * bf16_bits, (bits / bf16_bits, info)  # most tensors stay quantized
    assert sum(s != "bf16" for s in choice.values()) >= 12
    assert set(info["pinned"]) == set(_SYN_CULPRITS)
    assert info["evals"] <= 16 and any(r["kind"] == "group" for r in info["rounds"])
    # the cleaned damages alone (no group testing) also meet it, but with far less of the budget used
    c0, i0 = alloc.correct_loss(eff, joint, budget, max_evals=16, stall_tau=float("inf"))
    assert i0["met"] and not i0["pinned"] and alloc.predicted(table, c0)[0] > bits
    # with 8 evals there are too few left for group testing after the stall: the scaling goes on
    c8, i8 = alloc.correct_loss(eff, joint, budget, max_evals=8)
    assert i8["met"] and i8["evals"] <= 8 and joint(c8) <= budget
    assert alloc.predicted(table, c8)[0] < 0.6 * bf16_bits


def test_no_group_test_when_damage_is_spread():
    """Joint damage 3x the sum of the single ones, no culprit: the scaling alone meets the budget,
    no stall, nothing pinned."""
    from ckptzip.lossy import alloc
    table, _, bf16_bits = _stalled_case()
    ks = {t: o["int2"]["damage"] / 0.35 ** 2 for t, o in table.items() if t not in _SYN_CULPRITS}
    table = {t: o for t, o in table.items() if t in ks}

    def joint(choice):
        return 3.0 * sum(ks[t] * _SYN_SCHEMES[s][1] ** 2 for t, s in choice.items())
    choice, info = alloc.correct_loss(alloc.effective(table, "measured"), joint, 1e-3, max_evals=16)
    assert info["met"] and not info["pinned"] and all(r["kind"] == "alloc" for r in info["rounds"])
    assert joint(choice) <= 1e-3 and alloc.predicted(table, choice)[0] < 0.4 * bf16_bits


def test_stalled_correction_without_fix_goes_to_bf16():
    """The failure this guards against: raw damages (clamped at 0) and no group testing (a stall
    never detected): the correction meets the budget only by moving nearly everything to bf16."""
    from ckptzip.lossy import alloc
    table, joint, bf16_bits = _stalled_case()
    raw = {n: {s: {**r, "damage": max(r["damage"], 0.0)} for s, r in o.items()} for n, o in table.items()}
    choice, info = alloc.correct_loss(raw, joint, 1e-3, max_evals=16, stall_tau=float("inf"))
    assert alloc.predicted(table, choice)[0] > 0.6 * bf16_bits or not info["met"]
