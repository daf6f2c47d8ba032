"""Dequantize a GGUF model into a float32 safetensors checkpoint with its tokenizer (transformers' GGUF
reader: it needs the `gguf` and `accelerate` packages, which autotp does not, so tests/real_model.py runs
this with a folder holding them on PYTHONPATH).

    python convert_gguf.py GGUF_DIR GGUF_FILE OUT_DIR
"""

import functools
import sys

import gguf
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

# transformers reads the file's fields three times (tokenizer, config, tensors) and builds llama's tensor-name map
# again for each of its ~400 modules: one reader and one map serve them all (22 -> 8 s of a core)
gguf.GGUFReader = functools.lru_cache(maxsize=None)(gguf.GGUFReader)
gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map)

source, gguf_file, out = sys.argv[1:4]
torch.set_num_threads(1)
tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=gguf_file)
# dequantize=True drops the GGUF quantizer after loading, so that save_pretrained writes plain tensors
model = AutoModelForCausalLM.from_pretrained(source, gguf_file=gguf_file, dtype=torch.float32,
                                             quantization_config=GgufConfig(dequantize=True))
model.save_pretrained(out)
tokenizer.save_pretrained(out)
