"""The model families, one file each, named after config.json's `model_type`.

This folder is the registry (engine/registry.py): a module here with a `Model` class and
a `ModelArgs` is a family, found with no edit anywhere else; `MODEL_REMAPPING` in the
registry maps names that share a file."""
