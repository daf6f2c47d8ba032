"""Tiny byte-level BPE tokenizers with the special tokens of the three FIM families autotp formats (fim.py), and
one without FIM tokens, trained in a temp dir in a second. The real vocabularies' special tokens, in their order
(bigcode/starcoder, bigcode/starcoder2-15b, Qwen/Qwen2.5-Coder-1.5B tokenizer configs), so a sentinel's id is
wherever the family puts it; the ordinary vocabulary is only what CORPUS teaches."""

from __future__ import annotations

from pathlib import Path

STARCODER = ["<|endoftext|>", "<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>", "<filename>", "<gh_stars>",
             "<issue_start>", "<issue_comment>", "<issue_closed>", "<jupyter_start>", "<jupyter_text>",
             "<jupyter_code>", "<jupyter_output>", "<empty_output>", "<commit_before>", "<commit_msg>",
             "<commit_after>", "<reponame>"]
STARCODER2 = ["<|endoftext|>", "<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>", "<repo_name>",
              "<file_sep>", "<issue_start>", "<issue_comment>", "<issue_closed>", "<jupyter_start>", "<jupyter_text>",
              "<jupyter_code>", "<jupyter_output>", "<jupyter_script>", "<empty_output>"]
QWEN25_CODER = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
                "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>",
                "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"]
PLAIN = ["<|endoftext|>"]  # SmolLM2-like: no FIM tokens at all

FAMILIES = {"starcoder": STARCODER, "starcoder2": STARCODER2, "qwen2.5-coder": QWEN25_CODER, "plain": PLAIN}
CORPUS = ["def add(a, b):\n    return a + b\n",
          "class Book:\n    def __init__(self, title):\n        self.title = title\n",
          "from library import Library\n\nlibrary = Library()\n", "for i in range(10):\n    total += i\n"]
CORPUS *= 20


def tokenizer(family: str, directory: Path):
    """The family's tokenizer, saved to and loaded back from `directory` (as a server loads one)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    special = FAMILIES[family]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=special[0], additional_special_tokens=special[1:],
                            clean_up_tokenization_spaces=False).save_pretrained(directory)
    return AutoTokenizer.from_pretrained(directory)
