"""Adapters between protrain and training frameworks; each module imports its framework on import.

``protrain_fx.integrations.transformers``: ``ProtrainCallback`` for Hugging Face's ``Trainer``.
"""
