"""A user script that makes its own process group first, then loads through autotp (a directory or a hub id)
and samples without a seed. Each rank writes its tokens to OUT/rank{RANK}.json.

    torchrun --nproc-per-node 2 own_group.py MODEL OUT
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import autotp

dist.init_process_group("gloo")
model = autotp.from_pretrained(sys.argv[1])
ids = torch.tensor([[1, 2, 3, 4]])
tokens = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, max_new_tokens=16)
Path(sys.argv[2], f"rank{dist.get_rank()}.json").write_text(json.dumps(tokens.tolist()))
dist.destroy_process_group()
