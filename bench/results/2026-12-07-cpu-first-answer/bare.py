import time, sys
from mlx_lm import load, generate
import mlx.core as mx
path = sys.argv[1]
model, tok = load(path)
prompt = tok.apply_chat_template([{"role":"user","content":"What is the capital of France?"}], add_generation_prompt=True) if tok.chat_template else tok.encode("What is the capital of France?")
for i in range(2):
    t = time.perf_counter(); out = generate(model, tok, prompt, max_tokens=30, verbose=False); print("bare mlx-lm 30 tokens s", round(time.perf_counter()-t, 2))
