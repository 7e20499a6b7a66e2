"""transformers' and PEFT's names that the seam overrides, calls or reads, one row each (written for transformers 5.25
and PEFT 0.21.2), checked when a strategy is built (``dependencies.py``). The signatures are those the seam's own
modules check before they replace a function.
"""

from __future__ import annotations

from lightning_frozen.foreign_names import ForeignName
from lightning_frozen.hf.peft_adapters import INJECT_ADAPTER_PARAMS, PEFT_MODEL_INIT_PARAMS
from lightning_frozen.hf.transformers_loading import (
    GET_HF_QUANTIZER_PARAMS,
    GET_INIT_CONTEXT_PARAMS,
    LOAD_INTO_ZERO3_PARAMS,
    LOAD_STATE_DICT_PARAMS,
)

_MODELING = "transformers.modeling_utils"
_LOADING = "hf/transformers_loading.py"
_OWN_LOADER = (
    "`from_pretrained` under ZeRO-3 loads as transformers does: each rank reads every tensor whole (a slower load)"
)

TRANSFORMERS = (
    ForeignName(f"{_MODELING}:load_state_dict", _LOADING, LOAD_STATE_DICT_PARAMS, exact=True, fallback=_OWN_LOADER),
    ForeignName(
        f"{_MODELING}:_load_state_dict_into_zero3_model",
        _LOADING,
        LOAD_INTO_ZERO3_PARAMS,
        exact=True,
        fallback=_OWN_LOADER,
    ),
    ForeignName(
        f"{_MODELING}:PreTrainedModel.get_init_context",
        _LOADING,
        GET_INIT_CONTEXT_PARAMS,
        fallback="`from_pretrained` builds the model in the checkpoint's dtype, DeepSpeed then casts it (slower)",
    ),
    ForeignName(f"{_MODELING}:get_hf_quantizer", _LOADING, GET_HF_QUANTIZER_PARAMS, exact=True),
    ForeignName(
        f"{_MODELING}:safe_open",
        _LOADING,
        fallback="a truncated or corrupt safetensors shard fails with safetensors' error, which does not name the file",
    ),
    ForeignName(
        f"{_MODELING}:_is_ds_init_called",
        _LOADING,
        fallback="each weight `from_pretrained` builds is written whole and broadcast from rank 0 before the loader"
        " replaces it (a slower load)",
    ),
    ForeignName("transformers.integrations.deepspeed:_hf_deepspeed_config_weak_ref", _LOADING),
    # the marker of a loaded tensor, which transformers' initialisation skips
    ForeignName("transformers.initialization:uniform_", _LOADING, in_code=("_is_hf_initialized",)),
    ForeignName(
        "transformers.configuration_utils:PreTrainedConfig.__post_init__", _LOADING, in_code=("_name_or_path",)
    ),
    ForeignName(
        "transformers.core_model_loading:rename_source_key",
        _LOADING,
        ("source_key", "weight_renamings", "weight_converters", "base_model_prefix", "meta_state_dict"),
    ),
    ForeignName(
        "transformers.utils.quantization_config:BitsAndBytesConfig.__init__",
        _LOADING,
        in_code=(
            "bnb_4bit_quant_type",
            "bnb_4bit_use_double_quant",
            "bnb_4bit_compute_dtype",
            "llm_int8_skip_modules",
            "llm_int8_has_fp16_weight",
        ),
    ),
    ForeignName(
        f"{_MODELING}:PreTrainedModel._set_gradient_checkpointing",
        "hf/checkpointing.py",
        in_code=("_gradient_checkpointing_func",),
    ),
)

_TUNERS = "peft.tuners.tuners_utils"

PEFT = (
    ForeignName("peft.peft_model:PeftModel.__init__", "hf/peft_adapters.py", PEFT_MODEL_INIT_PARAMS),
    ForeignName(f"{_TUNERS}:BaseTuner.inject_adapter", "hf/peft_adapters.py", INJECT_ADAPTER_PARAMS),
    ForeignName(f"{_TUNERS}:BaseTunerLayer.adapter_layer_names", "hf/peft_adapters.py"),
    ForeignName(f"{_TUNERS}:BaseTunerLayer._cast_input_dtype", "hf/peft_adapters.py", ("self", "x", "dtype")),
    ForeignName("peft.tuners.lora.layer:_ConvNd", "hf/peft_adapters.py"),
    ForeignName(
        "peft.tuners.lora.layer:LoraLayer.__init__",
        "hf/peft_adapters.py",
        in_code=("base_layer", "lora_A", "lora_B", "lora_dropout", "scaling", "lora_embedding_A", "lora_variant"),
    ),
    ForeignName(
        f"{_TUNERS}:BaseTuner._check_merge_allowed",
        "hf/merging.py",
        ("self",),
        fallback="`export_merged` cannot ask PEFT whether it merges the adapter (a GPTQ base, replicated layers): the"
        " merge of such an adapter fails in PEFT's own layer merge instead",
    ),
    ForeignName(
        "peft.utils.other:prepare_model_for_kbit_training",
        _LOADING,
        in_code=("is_loaded_in_4bit", "is_loaded_in_8bit"),
        fallback="PEFT's `prepare_model_for_kbit_training` takes a base stored in int8 or nf4 for an unquantized one:"
        " it turns on neither gradient checkpointing nor input gradients (more activation memory)",
    ),
)
