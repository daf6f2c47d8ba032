"""The flow of the report this project started from, with `deepspeed` swapped for autotp: load the HF model,
`init_inference(model, mp_size=N)`, greedy `generate` on the engine's module. Each rank writes its tokens to
OUT/rank{RANK}.json.

    torchrun --nproc-per-node 2 seed_report.py MODEL_DIR OUT
"""

import json
import os
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

import autotp

model_dir, out = sys.argv[1], Path(sys.argv[2])
world_size = int(os.environ["WORLD_SIZE"])
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
engine = autotp.init_inference(model, mp_size=world_size, dtype=torch.float32, replace_with_kernel_inject=False)
ids = torch.tensor([[3, 17, 42, 8, 99, 51, 23]])
tokens = engine.module.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False)
(out / f"rank{os.environ['RANK']}.json").write_text(json.dumps(tokens.tolist()))
