"""What every step of the demo pipeline shares: the special tokens, the padding label and a timestamped log.

StarCoder's special tokens come first, in StarCoder's order, so they get the same ids (0..4) as in
bigcode/starcoder.  Nothing here imports torch or tokenizers.
"""

from __future__ import annotations

import time

EOT, FIM_PREFIX, FIM_MIDDLE, FIM_SUFFIX, FIM_PAD = (
    "<|endoftext|>",
    "<fim_prefix>",
    "<fim_middle>",
    "<fim_suffix>",
    "<fim_pad>",
)
SPECIAL_TOKENS = [EOT, FIM_PREFIX, FIM_MIDDLE, FIM_SUFFIX, FIM_PAD]
IGNORE = -100  # label value that F.cross_entropy skips (padding)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)
