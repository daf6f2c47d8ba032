"""The seed report's flow under DeepSpeed 0.11.1 (run by repro.py inside its own venv, under torchrun):
HF load -> deepspeed.init_inference(model, mp_size=N) -> generate. Writes $OUT/rank{RANK}.json.

Three stand-ins let 0.11.1 run on today's CPU torch; none touches AutoTP's sharding:
- torch >= 2.4 renamed two private names its elastic agent imports (inference never uses that code);
- its CPU accelerator imports intel_extension_for_pytorch and oneccl_bindings_for_pytorch at import time
  (AutoTP uses neither): empty modules stand in during `import deepspeed` and are removed afterwards;
- the accelerator's communication backend is set to gloo (dist_backend='gloo' alone does not do it).
"""

import json
import os
import sys
import traceback
import types

import torch
import torch.distributed.elastic.agent.server.api as agent_api
import torch.distributed.elastic.utils.distributed as elastic_dist

if not hasattr(agent_api, "log"):
    agent_api.log = agent_api.logger
if not hasattr(agent_api, "_get_socket_with_port"):
    agent_api._get_socket_with_port = elastic_dist.get_socket_with_port

STUBS = ("intel_extension_for_pytorch", "oneccl_bindings_for_pytorch")
sys.modules.update({name: types.ModuleType(name) for name in STUBS})
os.environ.setdefault("DS_ACCELERATOR", "cpu")
import deepspeed  # noqa: E402
from deepspeed.accelerator import get_accelerator  # noqa: E402

for name in STUBS:
    del sys.modules[name]
get_accelerator()._communication_backend_name = "gloo"

from transformers import AutoModelForCausalLM  # noqa: E402

model_dir, new_tokens = sys.argv[1], int(sys.argv[2])
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
prompt = torch.tensor([[3, 17, 42, 8, 99, 51, 23]])
report = {"rank": rank, "world_size": world, "deepspeed": deepspeed.__version__}
try:
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    engine = deepspeed.init_inference(model, mp_size=world, dtype=torch.float32, replace_with_kernel_inject=False)
    out = engine.module.generate(prompt, max_new_tokens=new_tokens, do_sample=False)
    report["output_ids"] = out.tolist()
except Exception as e:  # noqa: BLE001 - the error is the result
    report["error"] = f"{type(e).__name__}: {e}"
    report["traceback_tail"] = traceback.format_exc().splitlines()[-6:]
with open(os.path.join(os.environ["OUT"], f"rank{rank}.json"), "w") as f:
    json.dump(report, f)
