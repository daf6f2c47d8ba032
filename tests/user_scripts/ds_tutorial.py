"""DeepSpeed's inference tutorial with `deepspeed` swapped for autotp, run as its users run it: torchrun, the
engine assigned back to `pipe.model`, unseeded sampling. Each rank writes its text to OUT/rank{RANK}.json.

    torchrun --nproc-per-node 2 ds_tutorial.py MODEL_DIR OUT
"""

import json
import os
import sys
from pathlib import Path

import torch
from transformers import pipeline

import autotp

model, out = sys.argv[1], Path(sys.argv[2])
world_size = int(os.getenv("WORLD_SIZE", "1"))
pipe = pipeline("text-generation", model=model, device="cpu")
pipe.model = autotp.init_inference(pipe.model, tensor_parallel={"tp_size": world_size}, dtype=torch.float,
                                   replace_with_kernel_inject=True)
text = pipe("def print_hello_world():", do_sample=True, max_new_tokens=24)[0]["generated_text"]
(out / f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(text))
