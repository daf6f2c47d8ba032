"""Functions the rank pools run on every rank. Module-level so that spawned workers can unpickle them."""

from __future__ import annotations

import torch
import torch.distributed as dist

import autotp
from autotp.generate import generate


def held_bytes(model) -> int:
    """Bytes of the weights a rank's model really holds: its parameters, and quantized weights with their
    scales (the oracle for `model.autotp.param_bytes`, which is the layout's count)."""
    from autotp.quant.weights import QuantizedWeight

    quantized = sum(m.nbytes() for m in model.modules() if isinstance(m, QuantizedWeight))
    return quantized + sum(p.numel() * p.element_size() for p in model.parameters())


def sharded_outputs(model_dir: str, prompt: list[list[int]], new_tokens: int, seed: int) -> dict:
    """Load this rank's shard and run what the parity test compares against the unsharded model."""
    model = autotp.from_pretrained(model_dir)
    ids = torch.tensor(prompt)
    with torch.no_grad():
        logits = model(ids).logits
    greedy = generate(model, ids, max_new_tokens=new_tokens)
    sampled = generate(model, ids, max_new_tokens=16, do_sample=True, temperature=1.0, top_k=0, seed=seed)
    nucleus = generate(model, ids, max_new_tokens=16, do_sample=True, temperature=0.7, top_p=0.9, top_k=20, seed=seed)
    beams = generate(model, ids, max_new_tokens=12, num_beams=3)
    return {
        "info": model.autotp,
        "held_bytes": held_bytes(model),
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "logits": logits,
        "greedy": greedy.tolist(),
        "sampled": sampled.tolist(),
        "nucleus": nucleus.tolist(),
        "beams": beams.tolist(),
    }


def attention_attrs(model_dir: str) -> list[dict]:
    model = autotp.from_pretrained(model_dir)
    keys = ("embed_dim", "num_heads", "kv_heads", "kv_dim", "num_key_value_groups")
    return [{k: getattr(block.attn, k) for k in keys} for block in model.transformer.h]


def load_error(model_dir: str, **kwargs) -> None:
    autotp.from_pretrained(model_dir, **kwargs)


def seed_flow(model_dir: str, tokenizer_dir: str, prompt: str, tp_kwargs: dict) -> dict:
    """DeepSpeed's seed script with one import changed: HF load, init_inference, pipeline."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    engine = autotp.init_inference(model, dtype=torch.float32, **tp_kwargs)
    pipe = pipeline("text-generation", model=engine.module, tokenizer=tokenizer, device="cpu")
    text = pipe(prompt, do_sample=False, max_new_tokens=24)[0]["generated_text"]
    return {"text": text, "info": engine.module.autotp}


def die_while_generating(model_dir: str, victim: int, out: str, at_forward: int = 3) -> None:
    """Every rank generates with its shard of the model; the victim exits hard as its forward call `at_forward`
    begins (mid-generation). Each other rank writes OUT/rank{r}.json: how its generate ended, the autotp frames
    its exception passed through, and how many forwards it started."""
    import json
    import os
    import traceback

    model = autotp.from_pretrained(model_dir)
    rank, calls = dist.get_rank(), []

    def count(module, args, kwargs):
        calls.append(1)
        if rank == victim and len(calls) == at_forward:
            os._exit(3)

    model.register_forward_pre_hook(count, with_kwargs=True)
    try:
        generate(model, torch.tensor([[3, 17, 42, 8]]), max_new_tokens=16)
        outcome = {"ended": "completed", "frames": []}
    except Exception as e:  # noqa: BLE001 - what the surviving rank saw, for the test to read
        frames = [f"{os.path.basename(f.filename)}:{f.name}" for f in traceback.extract_tb(e.__traceback__)
                  if f"{os.sep}autotp{os.sep}" in f.filename]
        outcome = {"ended": f"raised {type(e).__name__}", "frames": frames}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(outcome | {"forwards": len(calls)}, f)


def report_failure(messages: list[str], rank0_late_s: float = 0.0, symptoms: list[bool] | None = None,
                   wait_s: float | None = None) -> list[str]:
    """`autotp.distributed.fail(messages[rank], symptom=symptoms[rank])` on every rank as the CLI calls it, rank 0
    `rank0_late_s` after the others: the lines this rank printed. wait_s: FAILURE_WAIT_S for this call (the
    rules are the same at any bound; a shorter one spends less of the suite's time waiting it out)."""
    import contextlib
    import io
    import time
    from unittest import mock

    from autotp import distributed

    if dist.get_rank() == 0:
        time.sleep(rank0_late_s)
    printed = io.StringIO()
    bound = mock.patch.object(distributed, "FAILURE_WAIT_S", wait_s or distributed.FAILURE_WAIT_S)
    with contextlib.redirect_stderr(printed), bound:
        symptom = bool(symptoms and symptoms[dist.get_rank()])
        assert distributed.fail(messages[dist.get_rank()], code=2, symptom=symptom) == 2
    return printed.getvalue().splitlines()


def compiled_layers(model_dir: str) -> dict:
    """The parallel layers trace with torch.compile(fullgraph=True): no graph break at a collective."""
    model = autotp.from_pretrained(model_dir)
    ids = torch.tensor([[3, 17, 42, 8]])
    out = {}
    with torch.no_grad():
        hidden = model.transformer.wte(ids)
        for name, module, x in [("wte", model.transformer.wte, ids),
                                ("mlp_proj", model.transformer.h[0].mlp.c_proj,
                                 torch.randn(1, 4, model.transformer.h[0].mlp.c_proj.in_features)),
                                ("lm_head", model.lm_head, hidden)]:
            compiled = torch.compile(module, backend="aot_eager", fullgraph=True)
            out[name] = torch.equal(compiled(x), module(x))
    return out


def fresh_random_state() -> None:
    """Each rank's own random seed, as a new process has (torch >= 2.13 seeds from the OS): the pool's ranks
    may share a state left by an earlier test's seeded generate, which would hide a seeding bug."""
    import random

    torch.manual_seed(random.SystemRandom().randrange(2**63))


def user_pipeline(model_dir: str, tp_kwargs: dict, prompt: str) -> str:
    """The DeepSpeed seed script with autotp in its place, unseeded sampling through the user's pipeline."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

    fresh_random_state()
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    engine = autotp.init_inference(model=model, dtype=torch.float32, **tp_kwargs)
    generator = pipeline("text-generation", model=engine.module, tokenizer=AutoTokenizer.from_pretrained(model_dir),
                         device="cpu")
    return generator(prompt, do_sample=True, max_new_tokens=24)[0]["generated_text"]


def user_generate(model_dir: str, how: str, seed: int | None = None, seed_per_rank: bool = False) -> list:
    """The user's own model.generate(do_sample=True) after from_pretrained or init_inference(tensor_parallel=...),
    unseeded, seeded alike (torch.manual_seed(seed) on every rank) or seeded per rank (seed + rank)."""
    from transformers import AutoModelForCausalLM

    fresh_random_state()
    if how == "from_pretrained":
        model = autotp.from_pretrained(model_dir)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        autotp.init_inference(model, tensor_parallel={"tp_size": dist.get_world_size()})
    if seed is not None:
        torch.manual_seed(seed + (dist.get_rank() if seed_per_rank else 0))
    ids = torch.tensor([[3, 17, 42, 8, 99, 51, 23]])
    with torch.no_grad():
        # min_new_tokens: an unseeded draw of EOS would end a rank's text early (all ranks alike, but shorter)
        return model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, top_k=0,
                              min_new_tokens=24, max_new_tokens=24, pad_token_id=0).tolist()


def quant_rank_outputs(model_dir: str, quantize: str, group_size: int) -> dict:
    """A rank of a quantized model: its quantized tensors, the prompt's logits, the greedy continuation."""
    model = autotp.from_pretrained(model_dir, quantize=quantize, group_size=group_size)
    ids = torch.tensor([[3, 17, 42, 8, 99, 51, 23]])
    with torch.no_grad():
        logits = model(ids).logits
    state = {k: v.clone() for k, v in model.state_dict().items() if k.endswith((".qweight", ".scales"))}
    return {"state": state, "logits": logits, "greedy": generate(model, ids, max_new_tokens=16).tolist(),
            "bytes": model.autotp.param_bytes, "held_bytes": held_bytes(model)}


def gptq_rank_outputs(model_dir: str, prompt: list[list[int]], new_tokens: int) -> dict:
    """A rank of a GPTQ checkpoint held in float32: the prompt's logits, the greedy continuation, what it read."""
    model = autotp.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.tensor(prompt)
    with torch.no_grad():
        logits = model(ids).logits
    return {"logits": logits, "greedy": generate(model, ids, max_new_tokens=new_tokens).tolist(),
            "bytes_read": model.autotp.bytes_read, "bytes": model.autotp.param_bytes, "held_bytes": held_bytes(model)}


def downloader_without_local_rank() -> bool:
    """Whether this rank would download a hub id for its node when the launcher set no LOCAL_RANK."""
    import os

    from autotp.hub import _downloads_for_this_node

    saved = os.environ.pop("LOCAL_RANK")
    try:
        return _downloads_for_this_node()
    finally:
        os.environ["LOCAL_RANK"] = saved


def greedy_ids(model_dir: str, prompts: list[list[int]], new_tokens: int, quantize: str | None = None,
               group_size: int = 128) -> list[list[int]]:
    """This rank's shard of model_dir (quantized as asked), and the greedy continuations of prompts of one length,
    decoded together as one batch."""
    model = autotp.from_pretrained(model_dir, quantize=quantize, group_size=group_size)
    x = torch.tensor(prompts)  # (rows, prompt_len): no padding
    return generate(model, x, max_new_tokens=new_tokens)[:, x.shape[1]:].tolist()
