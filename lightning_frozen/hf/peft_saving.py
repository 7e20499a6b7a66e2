"""What the package uses of PEFT's saving, all in one place (written for PEFT 0.21): the keys
``get_peft_model_state_dict`` gives an adapter's tensors, what its ``AuxiliaryTrainingWrapper`` modules add
(``modules_to_save``, trainable tokens), and the prompt encoder classes of ``PEFT_TYPE_TO_TUNER_MAPPING``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn


def adapter_state_dict(peft_model: Any, state_dict: dict[str, Any], adapter_name: str) -> dict[str, Any]:
    """``get_peft_model_state_dict`` of ``peft_model`` over ``state_dict`` (its own names) for ``adapter_name``, the
    base's embedding layers left out: the values it picks, by PEFT's saved keys. Raises what PEFT raises."""
    from peft import get_peft_model_state_dict

    return get_peft_model_state_dict(
        peft_model, state_dict=state_dict, adapter_name=adapter_name, save_embedding_layers=False
    )


def auxiliary_state_dict(peft_model: Any, adapter_name: str, state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """What ``get_peft_model_state_dict`` adds for ``modules_to_save`` and other auxiliary wrappers, by PEFT key: its
    loop, which prompt learning cannot reach through it (it runs the prompt encoder first)."""
    from peft.utils.other import AuxiliaryTrainingWrapper

    found: dict[str, Any] = {}
    for name, module in peft_model.named_modules():
        if isinstance(module, AuxiliaryTrainingWrapper):
            local = {key[len(name) + 1 :]: value for key, value in state_dict.items() if key.startswith(f"{name}.")}
            found.update(
                {f"{name}.{key}": value for key, value in module.adapter_state_dict(adapter_name, local).items()}
            )
    return found


def prompt_encoder(config: Mapping[str, Any]) -> nn.Module:
    """A new prompt encoder of the class PEFT uses for ``config`` (an adapter config as a plain dict), with the layers
    PEFT's own saving runs (p-tuning's MLP/LSTM, prefix tuning's projection); its weights are PEFT's initial ones.

    Raises:
        KeyError: ``config["peft_type"]`` names no PEFT tuner.
    """
    from peft import PeftConfig
    from peft.mapping import PEFT_TYPE_TO_TUNER_MAPPING

    peft_type = config["peft_type"]
    encoder_class = PEFT_TYPE_TO_TUNER_MAPPING[peft_type]
    if peft_type == "PROMPT_TUNING":
        # an inference config skips the init from the base's vocabulary (the loaded weights replace it anyway)
        return encoder_class(PeftConfig.from_peft_type(**{**config, "inference_mode": True}), None)
    # a trainable config builds p-tuning's MLP/LSTM and prefix tuning's projection, which PEFT's own saving runs
    return encoder_class(PeftConfig.from_peft_type(**{**config, "inference_mode": False}))
