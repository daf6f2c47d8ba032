"""The demo model and its optimizer: a GPT-BigCode configuration scaled down from StarCoder (multi-query
attention, 12 heads, learned positions, tied embeddings), built new or loaded for continued training.

The training loop is in train.py.
"""

from __future__ import annotations

import torch

from common import EOT, log


def new_config(vocab: int, hf_tok, args):
    from transformers import GPTBigCodeConfig

    return GPTBigCodeConfig(
        vocab_size=vocab,
        n_positions=args.long_len,  # 512
        n_embd=args.n_embd,
        n_layer=args.n_layer,
        n_head=12,  # fixed: tp 1, 2, 3, 4, 6 divide 12, tp 5 does not
        n_inner=4 * args.n_embd,
        multi_query=True,  # StarCoder: one shared K/V head
        activation_function="gelu_pytorch_tanh",
        resid_pdrop=0.0,  # < 2 epochs of data: dropout only slows learning down
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=hf_tok.convert_tokens_to_ids(EOT),
        eos_token_id=hf_tok.convert_tokens_to_ids(EOT),
        tie_word_embeddings=True,
    )


def build_model(args, vocab: int, hf_tok):
    """--init-from's model, or a new one from the seeded torch RNG."""
    from transformers import GPTBigCodeForCausalLM

    if args.init_from:
        model = GPTBigCodeForCausalLM.from_pretrained(args.init_from, dtype=torch.float32)
        c = model.config
        assert (c.vocab_size, c.n_embd, c.n_layer, c.n_head) == (vocab, args.n_embd, args.n_layer, 12), c
    else:
        model = GPTBigCodeForCausalLM(new_config(vocab, hf_tok, args)).float()
    n_params = sum(p.numel() for p in model.parameters())  # tied lm_head counted once
    log(f"model: n_embd {args.n_embd}, n_layer {args.n_layer}, 12 heads (MQA), {n_params:,} parameters")
    return model, n_params


def new_optimizer(model, args) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.dim() >= 2]  # matrices + embeddings decay, biases/LN don't
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
