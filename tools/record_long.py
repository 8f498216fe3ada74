#!/usr/bin/env python3
"""A long HF Llama training run recorded with `_record_memory_history()`'s defaults (C++ and Python
frames in every stack): a real snapshot of about 0.6 M entries for decode-speed measurements
(docs/performance.md, "Pickles").

    python3 tools/record_long.py OUT_PREFIX [STEPS=400]

Writes OUT_PREFIX.pickle.gz (what `_dump_snapshot` wrote, gzip'd) and OUT_PREFIX.json (steps, entries,
the final `memory_stats()`). Needs torch (2.11 was used), transformers and a GPU. History starts after
the process's first CUDA allocation, as in most real recordings.
"""
import gzip, json, os, random, shutil, sys, time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

out = sys.argv[1]
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 400
torch.zeros(1, device="cuda")
torch.cuda.memory._record_memory_history()
cfg = LlamaConfig(vocab_size=16000, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=4096)
torch.manual_seed(0)
model = LlamaForCausalLM(cfg).cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
rng = random.Random(0)
t0 = time.time()
for step in range(steps):
    s = rng.choice([128, 256, 384, 512])
    x = torch.randint(0, 16000, (8, s), device="cuda")
    loss = model(input_ids=x, labels=x).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if time.time() - t0 > 200:
        break
torch.cuda.synchronize()
raw = out + ".pickle"
torch.cuda.memory._dump_snapshot(raw)
n = len(torch.cuda.memory._snapshot()["device_traces"][0])
with open(raw, "rb") as f, gzip.open(out + ".pickle.gz", "wb", compresslevel=6) as g:
    shutil.copyfileobj(f, g)
print(json.dumps({"steps": step + 1, "entries": n, "raw_bytes": os.path.getsize(raw), "torch": torch.__version__}))
os.remove(raw)
with open(out + ".json", "w") as f:
    json.dump({"steps": step + 1, "entries": n, "memory_stats": {k: int(v) for k, v in torch.cuda.memory_stats().items()}}, f)
