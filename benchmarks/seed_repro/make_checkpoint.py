"""A tiny GPT-BigCode multi-query checkpoint (n_embd 384, 12 heads, 2 layers), saved by transformers 4.34
so both DeepSpeed 0.11.1's stack and today's load it; prints the single-process greedy output as JSON."""

import json
import sys

import torch
from transformers import GPTBigCodeConfig, GPTBigCodeForCausalLM

out, new_tokens = sys.argv[1], int(sys.argv[2])
torch.manual_seed(0)
config = GPTBigCodeConfig(n_embd=384, n_head=12, n_layer=2, n_inner=1536, n_positions=128, vocab_size=1000,
                          multi_query=True, bos_token_id=None, eos_token_id=None)
model = GPTBigCodeForCausalLM(config).eval()
with torch.no_grad():  # wide random weights so greedy output depends on every slice
    for p in model.parameters():
        p.normal_(0, 0.3) if p.dim() > 1 else p.normal_(0, 0.1)
model.save_pretrained(out, safe_serialization=True)
ids = model.generate(torch.tensor([[3, 17, 42, 8, 99, 51, 23]]), max_new_tokens=new_tokens, do_sample=False)
print(json.dumps({"output_ids": ids.tolist(), "transformers": __import__("transformers").__version__}))
