"""Bare mlx-lm's own generation on the converted model, the first answer's prompt, twice."""

import sys
import time

from mlx_lm import generate, load

model, tokenizer = load(sys.argv[1])
messages = [{"role": "user", "content": "What is the capital of France?"}]
if tokenizer.chat_template:
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
else:
    prompt = tokenizer.encode(messages[0]["content"])
for _ in range(2):
    started = time.perf_counter()
    generate(model, tokenizer, prompt, max_tokens=30, verbose=False)
    print("bare mlx-lm 30 tokens s", round(time.perf_counter() - started, 2))
