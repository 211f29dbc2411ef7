"""Where end-to-end save/load time goes (cProfile), on an 85 M-parameter GPT + AdamW state."""
import cProfile, io, os, pstats, sys, time
import torch
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ckptzip
from gpt import train, checkpoint
from run_bench import drop_cache

m, o, _ = train(int(os.environ.get("STEPS", "30")))
state = checkpoint(m, o)
d = "/tmp/prof"; os.makedirs(d, exist_ok=True)
for rep in range(2):
    for name, fn in (("torch.save", lambda: torch.save(state, f"{d}/t.pt")),):
        torch.cuda.synchronize(); t = time.perf_counter(); fn()
        fd = os.open(f"{d}/t.pt", os.O_RDONLY); os.fsync(fd); os.close(fd)
        print(name, time.perf_counter() - t)
    pr = cProfile.Profile()
    torch.cuda.synchronize(); t = time.perf_counter()
    pr.enable(); ckptzip.save(state, f"{d}/c.ckz"); pr.disable()
    print("ckptzip.save", time.perf_counter() - t)
    if rep:
        s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(18); print(s.getvalue()[:5000])
    drop_cache(f"{d}/c.ckz"); drop_cache(f"{d}/t.pt")
    t = time.perf_counter(); torch.load(f"{d}/t.pt", map_location="cuda"); torch.cuda.synchronize(); print("torch.load", time.perf_counter() - t)
    pr = cProfile.Profile()
    t = time.perf_counter(); pr.enable(); ckptzip.load(f"{d}/c.ckz", map_location="cuda"); torch.cuda.synchronize(); pr.disable()
    print("ckptzip.load", time.perf_counter() - t)
    if rep:
        s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(15); print(s.getvalue()[:4000])
