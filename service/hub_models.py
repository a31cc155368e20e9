"""What a submit asks of a Hugging Face Hub base that is not local yet (worker/engine/hub.py
talks to the Hub): that a worker will be able to pull and train it."""

from __future__ import annotations

from pathlib import Path

from service.errors import InvalidRequestError
from worker.engine.hub import HubAccess, HubError, check_hub_model
from worker.engine.types import ModelError


def check_hub_base(model: str, store: Path) -> None:
    """400 naming `model` and what to do when the Hub refuses it (gated, missing, no such
    revision, unreachable: the error's code says which) or it holds no safetensors or a family
    Loraq does not train. Its config.json lands in the store, so listings show its family and size."""
    try:
        check_hub_model(model, store, HubAccess.from_env())
    except HubError as e:
        raise InvalidRequestError(str(e), param="model", code=e.code) from e
    except ModelError as e:
        raise InvalidRequestError(str(e), param="model", code="unsupported_model") from e
