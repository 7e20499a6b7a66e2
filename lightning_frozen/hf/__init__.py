"""The Hugging Face seam: everything that reaches into transformers' or PEFT's internals lives in this subpackage.

Written for transformers 5.x (5.25 tested) and PEFT 0.21 (0.21.2 tested). Modules outside it import neither package
(except under ``TYPE_CHECKING``) and read none of their private names (tests/test_hf_seams.py checks both). Each module
names what it uses in its docstring; docs/internals.md maps the modules and lists the private names by capability.
"""
