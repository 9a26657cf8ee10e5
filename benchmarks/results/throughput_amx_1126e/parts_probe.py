import sys, time, functools, collections
import torch
from torch import nn
sys.path.insert(0, "/work/main")
import sbloader, sbloader.epoch as E, sbloader.codec as C, sbloader.stats as S, sbloader._checks as K, sbloader.ffcv as F
from benchmarks.core.config import measurement
from benchmarks.core.data import train_set
from benchmarks.core.sources import Sources
from benchmarks.core.throughput import raw_epoch
acc = collections.Counter(); cnt = collections.Counter()
def wrap(owner, name, label):
    f = getattr(owner, name)
    @functools.wraps(f)
    def g(*a, **k):
        t = time.perf_counter_ns()
        try: return f(*a, **k)
        finally: acc[label] += time.perf_counter_ns() - t; cnt[label] += 1
    setattr(owner, name, g)
kind, strategy = sys.argv[1], sys.argv[2]
for owner, name in [(E.EpochIterator, "__next__"), (E.EpochIterator, "_load"), (E.EpochIterator, "_take"), (E.EpochIterator, "_build"), (E.EpochIterator, "_next_ready"), (E.EpochIterator, "_source_step")]:
    wrap(owner, name, name)
cfg, m = measurement(False)
x, y = train_set(cfg)
src = Sources(x, y, cfg.device, kind == "ffcv", 1)
bs = cfg.batch_size if strategy == "traditional" else cfg.pool_batch_size
source = src.make(kind, bs, 0)
model = nn.Sequential(nn.Flatten(), nn.Linear(cfg.image_size**2, 10))
loader = sbloader.SelectiveLoader(source, model, policy=m.policy(strategy), batch_size=cfg.batch_size)
# wrap codec methods on instance
for name in ["columns", "build"]:
    wrap(loader._codec, name, "codec." + name)
wrap(loader._fetch if hasattr(loader, "_fetch") else loader, "__class__", "x") if False else None
for i, _ in enumerate(loader):
    if i >= 8: break
for rep in range(3):
    acc.clear(); cnt.clear()
    raw = raw_epoch(source)
    t0 = time.perf_counter()
    n = 0
    for b in loader: n += 1
    el = time.perf_counter() - t0
    print(f"raw per batch {bs/raw*1e6:.0f}us loader per batch {el/n*1e6:.0f}us ({n} batches)")
print({k: round(v / max(cnt[k],1) / 1000, 1) for k, v in acc.items()}, dict(cnt))
src.close()
