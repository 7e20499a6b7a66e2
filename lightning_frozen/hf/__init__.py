"""The Hugging Face seam: everything that reaches into transformers' or PEFT's internals lives in this subpackage.

Written for transformers 5.x (5.25 tested) and PEFT 0.21 (0.21.2 tested). Modules outside it import neither package
(except under ``TYPE_CHECKING``) and read none of the private names below (tests/test_hf_seams.py checks both).

- ``transformers_loading``: ``from_pretrained`` under ZeRO-3 in ``configure_model``:
  :func:`~.transformers_loading.zero3_loading` keeps an ``HfDeepSpeedConfig`` alive for its duration only
  (``integrations.deepspeed._hf_deepspeed_config_weak_ref`` restored on exit) and replaces
  ``modeling_utils.load_state_dict`` and ``_load_state_dict_into_zero3_model`` where their signatures are those of
  5.x; with other versions transformers' own ZeRO-3 loader runs. Also the key
  renamings of ``core_model_loading`` (``WeightRenaming``, ``WeightConverter``, ``rename_source_key``), and the
  private markers ``modeling_utils._is_ds_init_called`` and a tensor's ``_is_hf_initialized``.
- ``peft_adapters``: :func:`~.peft_adapters.around_adapter_creation` wraps ``PeftModel.__init__`` and
  ``BaseTuner.inject_adapter`` class-wide for its duration only; finding ``PeftModel`` and ``ModulesToSaveWrapper``
  instances; each adapter's params in ``BaseTunerLayer``s; LoRA's forward on blocks of rows from ``base_layer``,
  ``lora_A``, ``lora_B``, ``lora_dropout``, ``scaling`` and the input cast of ``lora.layer.Linear`` and
  its ``Conv1d/2d/3d``.
- ``reference``: where each frozen base came from (PEFT's ``base_model_name_or_path``, ``config.name_or_path``) and the
  PEFT model inside a module.
- ``row_guard``: a forward pre-hook on PEFT's LoRA layers that refuses a training forward of several adapters outside
  ``adapter_rows`` / ``shared_rows``.
- ``checkpointing``: transformers' ``_gradient_checkpointing_func`` on each checkpointing module, wrapped while
  ``adapter_rows`` is open so that a block recomputed in backward gets its rows' adapters again.
- ``generation``: the outermost models inside a module that ``generate`` (``GenerationMixin`` instances), whose
  ``generate`` a run wraps to gather the base once per call.
- ``merging``: for ``export_merged``, a folder's model built on the meta device, the adapters injected with
  ``get_peft_model`` / ``add_adapter`` (``low_cpu_mem_usage``), PEFT's own ``merge`` and
  ``unload_and_optionally_merge_module`` of one tuner layer, ``BaseTuner._check_merge_allowed``, and the folder's keys
  through ``conversion_mapping.get_model_conversion_mapping``.
- ``peft_saving``: ``get_peft_model_state_dict``, ``AuxiliaryTrainingWrapper.adapter_state_dict`` and the prompt
  encoders of ``PEFT_TYPE_TO_TUNER_MAPPING`` (built from ``PeftConfig.from_peft_type``).
"""
