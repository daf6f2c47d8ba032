"""The tiny models the quantization tests run: StarCoder's multi-query and multi-head layouts, Llama, GPT-2, with
MLP and hidden widths that groups of GROUP divide (every quantization group whole on every rank at tp 2)."""

from transformers import AutoConfig

GROUP = 32
COMMON = dict(vocab_size=101, bos_token_id=None, eos_token_id=None, pad_token_id=None)
MODELS = {
    "bigcode_mqa": ("gpt_bigcode", dict(n_embd=128, n_head=4, n_inner=384, multi_query=True, n_layer=2,
                                        n_positions=64)),
    "bigcode_mha": ("gpt_bigcode", dict(n_embd=128, n_head=4, n_inner=384, multi_query=False, n_layer=2,
                                        n_positions=64)),
    "llama": ("llama", dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, intermediate_size=384,
                            num_hidden_layers=2, max_position_embeddings=64, tie_word_embeddings=False)),
    "gpt2": ("gpt2", dict(n_embd=128, n_head=4, n_inner=384, n_layer=2, n_positions=64)),
}


def config(name: str):
    model_type, overrides = MODELS[name]
    return AutoConfig.for_model(model_type, **(COMMON | overrides))
