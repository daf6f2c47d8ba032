"""One rank of benchmarks/compare.py, run under torchrun in the system's own venv.

Loads a checkpoint with one system, runs the correctness probe (prefill logits, greedy generate) and the
timed prefill/decode loop, and writes $BENCH_OUT/rank{RANK}.json; rank 0 also writes the logits and tokens
to $BENCH_OUT/output.pt for compare.py to hold against the single-process reference. A failed load is a
result, not a crash: its error text goes into the JSON.

    torchrun --nproc-per-node N benchmarks/compare_worker.py SYSTEM CHECKPOINT_DIR DTYPE RUNS NEW_TOKENS

Imports only torch, transformers and the system under test, so it runs in the DeepSpeed and HF-TP venvs too.
"""

import json
import os
import statistics
import sys
import time
import traceback

import torch
import torch.distributed as dist

# An explicit plan for Hugging Face TP on GPT-BigCode: its style vocabulary has no fused-QKV style that
# knows GPT-BigCode's [Q | K | V] (multi-query) or (heads, 3, head_dim) (multi-head) layouts, and its
# attention forward reads the global `num_heads`/`embed_dim`, so attention stays replicated. The MLP pair
# is the textbook colwise -> rowwise split; the tied wte/lm_head stays replicated (sharding one of a tied
# pair is not expressible either).
HF_TP_PLAN = {"transformer.h.*.mlp.c_fc": "colwise", "transformer.h.*.mlp.c_proj": "rowwise"}


def vm_hwm_mib() -> float:
    """Peak RSS since start or since the last reset_peak() (VmHWM, in KiB)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM")) / 1024


def reset_peak() -> None:
    """Linux: writing 5 to clear_refs resets VmHWM to the current RSS, so the next phase has its own peak."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def local_bytes(model) -> int:
    """Bytes of the parameters this rank holds; a DTensor (HF TP) counts its local shard only."""
    total = 0
    for p in model.parameters():
        t = p.to_local() if hasattr(p, "to_local") else p
        total += t.numel() * t.element_size()
    return total


def load(system: str, path: str, dtype: torch.dtype, world: int):
    from transformers import AutoModelForCausalLM

    if system == "hf":
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    if system == "autotp":
        import autotp

        return autotp.from_pretrained(path, dtype=dtype)
    if system == "deepspeed":
        import deepspeed

        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        return deepspeed.init_inference(model, tensor_parallel={"tp_size": world}, dtype=dtype).module
    if system == "hf-tp-auto":
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, tp_plan="auto")
    if system == "hf-tp-plan":
        from transformers.distributed import DistributedConfig

        return AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, distributed_config=DistributedConfig(tp_plan=HF_TP_PLAN, tp_size=world))
    raise SystemExit(f"unknown system {system}")


def timed_run(model, prompt: torch.Tensor, new_tokens: int, world: int) -> tuple[float, float, list[int]]:
    """One prefill then `new_tokens - 1` single-token decode steps on the KV cache, greedy.

    Returns (prefill ms, decode ms/token, tokens). The barrier lines the ranks up so that rank 0's clock
    covers the same work as everyone's; inside a step the collectives keep them in lock step.
    """
    if world > 1:
        dist.barrier()
    start = time.perf_counter()
    out = model(prompt, use_cache=True)
    prefilled = time.perf_counter()
    token = out.logits[:, -1:].argmax(-1)
    tokens = [token.item()]
    for _ in range(new_tokens - 1):
        out = model(token, past_key_values=out.past_key_values, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        tokens.append(token.item())
    done = time.perf_counter()
    return (prefilled - start) * 1e3, (done - prefilled) * 1e3 / (new_tokens - 1), tokens


def measure(system: str, path: str, dtype: torch.dtype, world: int, runs: int, new_tokens: int, report: dict,
            out_dir: str) -> None:
    """Load, probe and time, filling `report` as it goes so that a failure keeps what came before it."""
    start = time.perf_counter()
    model = load(system, path, dtype, world).eval()
    report["load_s"] = round(time.perf_counter() - start, 2)
    report["peak_rss_load_mib"] = round(vm_hwm_mib(), 1)
    report["param_mib"] = round(local_bytes(model) / 2**20, 1)
    reset_peak()

    vocab = model.config.vocab_size
    prompt = (torch.arange(32).unsqueeze(0) * 37 + 11) % min(vocab, 1000)  # 32 fixed ids, valid in any vocab
    eos = model.config.eos_token_id
    with torch.no_grad():
        logits = model(prompt).logits[0].float()
        greedy = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                                do_sample=False, pad_token_id=eos if eos is not None else 0)
        timed_run(model, prompt, new_tokens, world)  # warm-up: first-call allocations, lazy inits
        timings = [timed_run(model, prompt, new_tokens, world) for _ in range(runs)]
    report["peak_rss_generate_mib"] = round(vm_hwm_mib(), 1)
    report["prefill_ms"] = round(statistics.median(t[0] for t in timings), 2)
    report["decode_ms_per_token"] = round(statistics.median(t[1] for t in timings), 2)
    report["decode_runs_ms"] = [round(t[1], 2) for t in timings]
    new = greedy[0, prompt.shape[1]:].tolist()
    report["timed_tokens_match_generate"] = timings[-1][2] == new
    if int(os.environ.get("RANK", 0)) == 0:
        torch.save({"logits": logits, "tokens": new}, os.path.join(out_dir, "output.pt"))


def main() -> None:
    system, path, dtype_name, runs, new_tokens = sys.argv[1:6]
    runs, new_tokens = int(runs), int(new_tokens)
    dtype = getattr(torch, dtype_name)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    out_dir = os.environ["BENCH_OUT"]
    # Process-group set-up is outside the load clock for every system. DeepSpeed wraps the group in its
    # own backend (which loads its shared-memory all-reduce op, compiled on first use), so it starts it.
    if system == "deepspeed":
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")
    elif world > 1:
        dist.init_process_group("gloo")
    # Imports are outside the load clock too; their RSS is the idle baseline.
    from transformers import AutoModelForCausalLM  # noqa: F401
    if system == "autotp":
        import autotp  # noqa: F401

    report = {"rank": rank, "threads": torch.get_num_threads(), "idle_rss_mib": round(vm_hwm_mib(), 1)}
    try:
        measure(system, path, dtype, world, runs, new_tokens, report, out_dir)
    except Exception as e:  # noqa: BLE001 - the error text is the result (with whatever was measured before it)
        report["error"] = f"{type(e).__name__}: {e}"
        report["traceback_tail"] = traceback.format_exc().splitlines()[-8:]
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    if "error" in report:
        return  # a peer may be stuck in a collective: no barrier, torchrun tears the group down
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
