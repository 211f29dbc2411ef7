"""The tree of a structure saved again (``tree.encode_reusing``): the same tree, storages and
manifest JSON as the full encoder makes, whatever changed between the saves."""
import collections

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptzip
from ckptzip import tree
from ckptzip.errors import UnsupportedObjectError
from ckptzip.format import dump_json
from conftest import assert_same, nested

_BASE = torch.arange(64, dtype=torch.float32)
#: tensors a tree may hold: some share a storage, one is a view, one a parameter
POOL = [
    lambda: _BASE, lambda: _BASE[8:24].view(4, 4), lambda: _BASE.view(8, 8).t(),
    lambda: torch.zeros(3, dtype=torch.bfloat16), lambda: torch.ones(2, 2, requires_grad=True),
    lambda: torch.nn.Parameter(torch.ones(5)), lambda: torch.empty(0), lambda: torch.tensor(3, dtype=torch.int64),
]

leaves = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True),
    st.text(max_size=8) | st.sampled_from([tree._HOLE, '"' + tree._HOLE, tree._HOLE + "x"]),
    st.sampled_from(range(len(POOL))).map(lambda i: ("tensor", i)),
)
trees = nested(leaves, max_leaves=20)


def build(t, tensors: dict, change: int = 0):
    """The object of tree ``t``: ("tensor", i) leaves become POOL[i]'s tensor (one per i), and
    with ``change`` every scalar becomes another value of its type (a new step, a new rate)."""
    if type(t) is tuple and len(t) == 2 and t[0] == "tensor" and type(t[1]) is int:
        if t[1] not in tensors:
            tensors[t[1]] = POOL[t[1]]()
        return tensors[t[1]]
    if type(t) in (list, tuple):
        return type(t)(build(x, tensors, change) for x in t)
    if type(t) in (dict, collections.OrderedDict):
        return type(t)((k, build(v, tensors, change)) for k, v in t.items())
    if not change or t is None:
        return t
    if type(t) is bool:
        return not t
    if type(t) is int:
        return t + change
    if type(t) is float:
        return -t if t == 0 else t * 1.5
    return t + "!" * change


def check_same(obj) -> None:
    """encode_reusing's tree, storages and JSON equal the full encoder's."""
    root, storages, reused = tree.encode_reusing(obj)
    enc = tree.Encoder()
    want = enc.encode(obj)
    assert root == want
    assert [(s.data.data_ptr(), s.data.numel(), s.elem, s.device, s.float_width) for s in storages] == \
        [(s.data.data_ptr(), s.data.numel(), s.elem, s.device, s.float_width) for s in enc.storages]
    assert tree.root_json(root, reused) == dump_json(want)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(t=trees)
def test_reused_tree_equals_the_encoders(t):
    tensors: dict = {}
    for change in (0, 0, 1, 1, 0, 2):  # first seen, seen again, new scalars, the same again, ...
        check_same({"x": build(t, tensors, change)})


def test_a_new_structure_is_encoded_afresh():
    a = {"w": torch.zeros(4), "step": 1}
    check_same(a)
    check_same(a)
    check_same({"w": torch.zeros(4, 1), "step": 1})  # another shape
    w = torch.zeros(4)
    check_same({"w": w, "v": w})  # shared storage
    check_same({"w": w, "v": torch.zeros(4)})  # the same layout, storages no longer shared
    check_same({"w": torch.zeros(4), "step": 1.0})  # a scalar of another type


def test_a_reused_tree_is_never_modified():
    """A save being written keeps its tree while the next save of the structure is planned."""
    w = torch.ones(3)
    tree.encode_reusing({"w": w, "step": 1, "lr": 0.5})
    first, _, r1 = tree.encode_reusing({"w": w, "step": 1, "lr": 0.5})
    text = tree.root_json(first, r1)
    second, _, r2 = tree.encode_reusing({"w": w, "step": 2, "lr": 0.25})
    assert second is not first and second["v"][0] is first["v"][0]  # (tensor nodes shared)
    assert first == tree.Encoder().encode({"w": w, "step": 1, "lr": 0.5})
    assert tree.root_json(first, r1) == text != tree.root_json(second, r2)


@pytest.mark.parametrize("obj", [
    {"n": 2**64}, {"a": torch.zeros(2, dtype=torch.complex64).conj()}, {1.5: torch.zeros(1)},
    {"s": torch.Size([2])}, collections.defaultdict(list, a=[1]), {"t": (True, b"x")},
])
def test_shapes_left_to_the_encoder(obj):
    assert tree._walk_object(obj) is None
    root, _, reused = tree.encode_reusing(obj, allow_pickle=True)
    assert reused is None and root == tree.Encoder(allow_pickle=True).encode(obj)


def test_a_cycle_is_refused_not_walked_forever():
    loop: list = []
    loop.append(loop)
    with pytest.raises(UnsupportedObjectError, match="deeper"):
        tree.encode_reusing({"x": loop})


def test_async_saves_of_one_structure_hold_each_saves_values(tmp_path):
    w = torch.randn(100, 10)
    for step in range(4):
        w.add_(1.0)
        obj = {"model": {"w": w}, "step": step, "lr": 0.1 / (step + 1), "tag": f"s{step}"}
        ckptzip.async_save(obj, tmp_path / f"{step}.ckz", fsync=False).wait()
        assert_same(ckptzip.load(tmp_path / f"{step}.ckz"), obj)


def test_an_object_changed_while_encoded_is_not_kept(monkeypatch):
    """The first save of a structure keeps its tree only if the object is the same after the
    encoder ran (another thread may set a step counter meanwhile)."""
    obj = {"w": torch.ones(2), "step": 1, "tag": "changing"}
    real = tree.Encoder.encode

    def encode_then_change(self, o, depth=0):
        out = real(self, o, depth)
        if not depth:
            obj["step"] += 1
        return out
    monkeypatch.setattr(tree.Encoder, "encode", encode_then_change)
    root, _, reused = tree.encode_reusing(obj)
    assert reused is None and root["v"][1] == {"t": "int", "v": "1"}
    monkeypatch.undo()
    check_same(obj)  # (step 2: encoded afresh, not the tree that says 1)
    check_same(obj)
