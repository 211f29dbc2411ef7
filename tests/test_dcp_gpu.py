"""ckptzip.dcp on a GPU: two ranks share the one GPU (gloo for DCP's collectives), each compresses
its own CUDA shards with nvCOMP; the checkpoint loads bit-exact on 2 ranks, in 1 process, and
after consolidation. Skipped without CUDA and nvCOMP (marked ``gpu``)."""
import os
import socket
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

import ckptzip
import ckptzip.dcp  # noqa: F401

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore::UserWarning")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _full():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(1 << 20, 4, generator=g) * 0.02
    return {"w": w, "w_bf16": w.to(torch.bfloat16), "v": (w * 1e-3) ** 2,
            "special": torch.tensor([float("nan"), -0.0, float("inf"), 1e-45] * 4)}


def _local(full, rank, world):
    return {k: t.chunk(world, 0)[rank].contiguous().cuda() for k, t in full.items()}


def _state(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    mesh = init_device_mesh("cuda", (world,))
    full = _full()
    loc = _local(full, rank, world)
    return {"t": {k: DTensor.from_local(loc[k], mesh, [Shard(0)], shape=full[k].shape, stride=full[k].stride())
                  for k in full}, "step": 7}


def _bits(t):
    t = t.detach().reshape(-1).contiguous().cpu()
    return t.view(torch.uint8)


def _rank_main(rank, world, port, path, phase):
    warnings.simplefilter("ignore")
    torch.cuda.set_device(0)  # both ranks share the one GPU
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        st = _state(rank, world)
        if phase == "save":
            dcp.save(st, storage_writer=ckptzip.dcp.Writer(path))
        elif phase == "async":
            # the stall is the GPU compression; training may change the shards at once
            fut = dcp.async_save(st, storage_writer=ckptzip.dcp.Writer(path))
            for v in st["t"].values():
                v.to_local().add_(1.0)
            fut.result()
        else:
            tgt = _state(rank, world)
            for v in tgt["t"].values():
                v.to_local().zero_()
            tgt["step"] = 0
            dcp.load(tgt, storage_reader=ckptzip.dcp.Reader(path))
            for k, v in st["t"].items():
                assert torch.equal(_bits(v.to_local()), _bits(tgt["t"][k].to_local())), k
            assert tgt["step"] == 7
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_two_ranks_share_one_gpu_and_compress_their_shards(tmp_path):
    path = str(tmp_path / "ck")
    mp.spawn(_rank_main, args=(2, _free_port(), path, "save"), nprocs=2, join=True)
    files = sorted(f for f in os.listdir(path) if f.endswith(".ckz"))
    assert len(files) == 2
    for f in files:  # each rank compressed on the GPU (an nvCOMP codec is recorded)
        with ckptzip.open(os.path.join(path, f)) as r:
            codecs = {s["codec"]["id"] for s in r.storages if s["nbytes"] > (1 << 20)}
            assert codecs & {"ans", "zstd", "bitcomp", "gdeflate"}, codecs
            assert any(s["device"].startswith("cuda") for s in r.storages)
    mp.spawn(_rank_main, args=(2, _free_port(), path, "load"), nprocs=2, join=True)
    # one process, no process group: the full tensors
    full = _full()
    got = {"t": {k: torch.zeros_like(v).cuda() for k, v in full.items()}, "step": 0}
    dcp.load(got, storage_reader=ckptzip.dcp.Reader(path))
    for k, v in full.items():
        assert torch.equal(_bits(v), _bits(got["t"][k])), k
    out = tmp_path / "one.ckz"
    ckptzip.dcp.consolidate(path, out)
    one = ckptzip.load(out, map_location="cpu")
    for k, v in full.items():
        assert torch.equal(_bits(v), _bits(one["t"][k])), k
    assert one["step"] == 7


def test_async_save_two_ranks_on_one_gpu(tmp_path):
    """dcp.async_save through Writer.stage with CUDA shards: the shards change right after the
    call returns; the checkpoint holds them as they were at the call, compressed on the GPU."""
    path = str(tmp_path / "ck")
    mp.spawn(_rank_main, args=(2, _free_port(), path, "async"), nprocs=2, join=True)
    for f in sorted(f for f in os.listdir(path) if f.endswith("_0.ckz")):
        with ckptzip.open(os.path.join(path, f)) as r:
            assert any(s["device"].startswith("cuda") for s in r.storages)
    full = _full()
    got = {"t": {k: torch.zeros_like(v) for k, v in full.items()}, "step": 0}
    dcp.load(got, storage_reader=ckptzip.dcp.Reader(path))
    for k, v in full.items():
        assert torch.equal(_bits(v), _bits(got["t"][k])), k
