"""How many tokens (prompt + completion) one sequence may hold: the context rule `autotp generate` and `autotp serve`
share, read from the flag, the config and the tokenizer. No torch."""

from __future__ import annotations

from autotp.errors import AutotpError

# Config fields that bound the positions a model runs: learned position embeddings (GPT-2's n_positions, OPT's
# max_position_embeddings), the length rotary models were trained to (Llama's max_position_embeddings), MPT's
# ALiBi table (max_seq_len), n_ctx of old GPT-2 and CodeGen configs, seq_length of ChatGLM-style ones. BLOOM's
# config has none: its ALiBi biases are built for any length.
POSITION_LIMITS = ("n_positions", "max_position_embeddings", "n_ctx", "seq_length", "max_seq_len")
FROM_FLAG = "--max-model-len"
FROM_TOKENIZER = "the tokenizer's model_max_length"
TOKENIZER_UNSET = int(1e30)  # transformers' VERY_LARGE_INTEGER: the model_max_length of a tokenizer that sets none


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def context_limit(config, tokenizer=None, max_model_len: int | None = None) -> tuple[int | None, str]:
    """How many tokens (prompt + completion) one sequence may hold, and where that number comes from.

    The first that applies:
    1. `max_model_len` (the --max-model-len flag), which may not exceed the config's position limit
       (an AutotpError names both numbers); it may exceed the tokenizer's model_max_length (advice);
    2. the config's position limit: the first of POSITION_LIMITS it sets to a positive int;
    3. the tokenizer's model_max_length, when it is real (below transformers' 1e30 placeholder);
    4. none: (None, why), e.g. BLOOM without a tokenizer that sets model_max_length.
    Returns (limit, source): source is FROM_FLAG, "the config's <field>" or FROM_TOKENIZER; with no limit,
    the reason there is none (`context_line` words both for users).
    """
    field = next((f for f in POSITION_LIMITS if _whole(getattr(config, f, None))), None)
    if max_model_len is not None:
        if not _whole(max_model_len):
            raise AutotpError(f"--max-model-len must be a positive int, got {max_model_len!r}")
        if field is not None and max_model_len > getattr(config, field):
            raise AutotpError(f"--max-model-len {max_model_len} exceeds the model's context of "
                              f"{getattr(config, field)} positions (the config's {field})")
        return max_model_len, FROM_FLAG
    if field is not None:
        return getattr(config, field), f"the config's {field}"
    told = getattr(tokenizer, "model_max_length", None)
    if _whole(told) and told < TOKENIZER_UNSET:
        return told, FROM_TOKENIZER
    why = "there is no tokenizer" if tokenizer is None else "its tokenizer sets no model_max_length"
    return None, f"{config.model_type} has no position limit in its config ({', '.join(POSITION_LIMITS)}) and {why}"


def context_line(limit: int | None, source: str) -> str:
    """The line rank 0 prints when the limit is not the config's own (the tokenizer's, or none)."""
    if limit is None:
        return f"autotp: no context limit: {source}; {FROM_FLAG} sets one"
    return f"autotp: context {limit} tokens ({source})"
