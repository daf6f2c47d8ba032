"""`autotp serve` on a CPU that says it multiplies bfloat16 natively (startup/weight_form.native_bf16 patched), as
an AMX or AVX512_BF16 machine would: what serve holds a float32 checkpoint in there."""

import sys

from autotp.serve.startup import weight_form

weight_form.native_bf16 = lambda: "AMX"

from autotp.cli import main  # noqa: E402 - after the patch, as a user's wrapper would import it

sys.exit(main())
