"""Plans: for each model family, which module gets which parallel style (`plan.Plan`), and the registry.

One file per family (llama.py serves every Llama-layout family); `common.py` holds what several share;
`infer.py` reads a plan off an unknown family's module tree when nothing about it is ambiguous.
"""

from __future__ import annotations

import os

from autotp.errors import AutotpError
from autotp.plans.plan import Plan


def builtin_plans() -> dict:
    """model_type -> plan builder(config) for every family with a built-in plan."""
    from autotp.plans import bloom, codegen, falcon, gpt2, gpt_bigcode, gpt_neox, gptj, llama, mixtral, mpt, opt, phi3

    return {"gpt_bigcode": gpt_bigcode.plan, "gpt2": gpt2.plan, "gpt_neox": gpt_neox.plan, "gptj": gptj.plan,
            "falcon": falcon.plan, "opt": opt.plan, "phi3": phi3.plan, "bloom": bloom.plan, "mpt": mpt.plan,
            "codegen": codegen.plan} | {f: llama.plan for f in llama.FAMILIES} | {
                f: mixtral.plan for f in mixtral.FAMILIES}


def plan_for(config) -> Plan:
    """The built-in plan for `config.model_type`, else one inferred from the model's module tree.

    An inferred plan is used only when nothing about it is ambiguous; otherwise the error prints what was
    inferred and how to add a built-in plan.
    """
    from autotp.plans.infer import infer_plan

    builders = builtin_plans()
    family = getattr(config, "model_type", None)
    if family in builders:
        return builders[family](config)
    if os.environ.get("AUTOTP_INFERRED_PLANS") == "0":
        raise AutotpError(f"no built-in plan for {family!r} and AUTOTP_INFERRED_PLANS=0 refuses inferred ones; "
                          f"built-in: {', '.join(sorted(builders))}")
    return infer_plan(config, supported=sorted(builders))
