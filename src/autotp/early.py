"""What every command (plan, generate, serve) refuses from its flags and the model's config.json alone, before torch
is imported and before any rank starts: a pipeline the model's decoder layers cannot make (`--pp` past the layers,
`--pp-layers` that do not give each of the `--pp` stages a layer or do not sum to the model's layers; with `--pp`
left out there is one stage, so `--pp-layers` must give it every layer, as at any `--pp`).

The rule's owner is parallel/stages.Stages.split, which the ranks ask again where they split the model: this module
asks it sooner, from the layer count config.json states, so that a refusal is early and never different. A hub id
is fetched by the ranks, so its config is checked there (`check_stages`, with the count of the loaded config).
No torch: stages.py is integer arithmetic and model_dir.py reads JSON.
"""

from __future__ import annotations

from autotp.model_dir import config_fields, local_dir
from autotp.parallel.stages import Stages

# config.json's names for the number of decoder layers, as Hugging Face's configs map them onto num_hidden_layers
# (attribute_map): GPT-2, GPT-BigCode, BLOOM, CodeGen, GPT-J write n_layer; MPT n_layers; older Falcon num_layers
LAYER_FIELDS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers")


def layer_count(fields: dict) -> int | None:
    """The decoder layers config.json's fields state, or None where none of LAYER_FIELDS holds a count."""
    for name in LAYER_FIELDS:
        value = fields.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def check_stages(pp: int, pp_layers: tuple[int, ...] | None, num_layers: int | None) -> None:
    """Raise Stages.split's AutotpError where `--pp pp --pp-layers pp_layers` cannot split num_layers layers (with
    neither flag there is nothing to split; an unknown count is left to the ranks)."""
    if num_layers is not None and (pp > 1 or pp_layers is not None):
        Stages.split(pp, 1, num_layers, pp_layers)


def check_model(model: str, pp: int, pp_layers: tuple[int, ...] | None) -> None:
    """check_stages for `--model model` where it is a local directory, from its config.json alone."""
    if pp == 1 and pp_layers is None:
        return
    directory = local_dir(model, "--model")
    if directory is not None:
        check_stages(pp, pp_layers, layer_count(config_fields(directory)))
