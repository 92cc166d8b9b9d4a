"""32 chat-like prompts (a shared 9-token head, then distinct), arriving while others decode,
with CUDA-sized segments (one big segment): admission+prefill wall and MLX's peak."""
import random, time, gc, sys
import mlx.core as mx
from engine import EngineRequest, SamplingParams, load_model
from engine.core import EngineCore, EngineConfig
from memory import MemoryGuard
from memory.probes.allocator import AllocatorProbe
loaded = load_model("tiny", load_format="dummy", dtype="float32")
core = EngineCore(loaded, MemoryGuard(AllocatorProbe(), enabled=False),
                  EngineConfig(prefill_step_size=512, max_concurrency=64, kv_segment_tokens=131072), lambda o: None)
rng = random.Random(0)
head = tuple(rng.randrange(0, 250) for _ in range(9))
def req(i):
    r = random.Random(1000 + i)
    return EngineRequest(f"r{i}", head + tuple(r.randrange(0, 250) for _ in range(200)), 64, SamplingParams(temperature=0.0))
core.submit_now(req(0))
while len(core.batch) < 1: core.step()
for _ in range(3): core.step()
gc.collect(); mx.reset_peak_memory(); base = mx.get_active_memory()
t = time.perf_counter()
for i in range(1, 33):
    core.submit_now(req(i)); core.step()  # one arrives per step, others decode
while len(core.batch) < 33: core.step()
wall = time.perf_counter() - t
seg = next(iter(core.store.segments.values()))
print(f"hits={core.prefix_cache.hits} wall_s={wall:.2f} peak_over_base_MB={(mx.get_peak_memory()-base)/1e6:.0f} segment_MB={seg.nbytes/1e6:.0f}")
