"""DeepSpeed's seed scripts with `import deepspeed` swapped for autotp: init_inference + pipeline."""

import pytest
import torch
from checkpoints import word_tokenizer
from tasks import seed_flow
from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

PROMPT = "w3 w17 w42 w8"


@pytest.fixture(scope="module")
def model_and_tokenizer(tmp_path_factory, checkpoint):
    model_dir, _ = checkpoint("mqa12")
    tok_dir = word_tokenizer(tmp_path_factory.mktemp("tok"))
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    pipe = pipeline("text-generation", model=model, tokenizer=AutoTokenizer.from_pretrained(tok_dir), device="cpu")
    expected = pipe(PROMPT, do_sample=False, max_new_tokens=24)[0]["generated_text"]
    return model_dir, tok_dir, expected


@pytest.mark.parametrize("tp, tp_kwargs", [
    (4, {"mp_size": 4}),                                      # init_inference(model, mp_size=world_size)
    (2, {"tensor_parallel": {"enabled": True, "tp_size": 2}}),  # the second report's call shape
])
def test_seed_flow_matches_the_unsharded_pipeline(pools, model_and_tokenizer, tp, tp_kwargs):
    model_dir, tok_dir, expected = model_and_tokenizer
    results = pools(tp).run(seed_flow, model_dir, tok_dir, PROMPT, tp_kwargs)
    assert expected.count("w") == 4 + 24  # the pipeline glues prompt and completion: count words by prefix
    for r in results:
        assert r["text"] == expected
    sizes = [r["info"].param_bytes for r in results]
    assert max(sizes) / min(sizes) < 1.05, f"lopsided partition {sizes}"


def test_init_inference_rejects_unknown_arguments(model_and_tokenizer):
    import autotp

    model = AutoModelForCausalLM.from_pretrained(model_and_tokenizer[0])
    with pytest.raises(autotp.AutotpError, match="unknown arguments: mp_sise"):
        autotp.init_inference(model, mp_sise=2)
    engine = autotp.init_inference(model, replace_with_kernel_inject=False, dtype=torch.float32)
    assert engine.module is model and model.autotp.tp == 1
