"""Where load time goes on the benchmark state: raw sequential read vs parallel read vs
ckptzip.load (with read threads 1 and 4) vs torch.load, page cache dropped before each."""
import cProfile, io, os, pstats, sys, time
import torch
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ckptzip
from ckptzip import storage
from gpt import train, checkpoint
from run_bench import drop_cache

m, o, _ = train(int(os.environ.get("STEPS", "300")))
state = checkpoint(m, o)
d = "/tmp/profl"; os.makedirs(d, exist_ok=True)
with open(f"{d}/t.pt", "wb") as f:
    torch.save(state, f)
ckptzip.save(state, f"{d}/c.ckz")
for rep in range(2):
    for path in (f"{d}/t.pt", f"{d}/c.ckz"):
        drop_cache(path)
        t = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            while f.read(16 << 20):
                pass
        print("sequential read", os.path.basename(path), os.path.getsize(path), round(time.perf_counter() - t, 3))
    drop_cache(f"{d}/t.pt")
    t = time.perf_counter(); torch.load(f"{d}/t.pt", map_location="cuda"); torch.cuda.synchronize()
    print("torch.load", round(time.perf_counter() - t, 3))
    for threads in (1, 4, 8):
        storage._READ_THREADS = threads
        storage._READ_POOL = None
        drop_cache(f"{d}/c.ckz")
        pr = cProfile.Profile()
        t = time.perf_counter(); pr.enable(); ckptzip.load(f"{d}/c.ckz", map_location="cuda"); torch.cuda.synchronize(); pr.disable()
        print(f"ckptzip.load threads={threads}", round(time.perf_counter() - t, 3))
        if rep and threads == 4:
            s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(12); print(s.getvalue()[:3000])
