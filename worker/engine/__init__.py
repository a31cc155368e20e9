"""Loraq's training engine: pure PyTorch LoRA fine-tuning (no celery/sqlalchemy/fastapi).

Importing this package does not import torch; the heavy modules are imported where used
(`worker.engine.recipe`, `worker.engine.models`, ...), so `worker.engine.catalog` and
`worker.engine.types` stay cheap for the API process.
"""
