"""`/v1/models`: the base models of the catalog and the tenant's succeeded fine-tunes.

Real bases (pretrained, local) come first, then the random-weight presets: those say so
(`random`, `use` "tests"/"benchmarks", and the `warning` a job or chat on them carries), and so
do fine-tunes of them. Every base says its kind, family, parameter count, context length and
whether it is `local`, and per precision the smallest common GPU its default job trains on
(`min_gpu_memory_gb`, `min_gpu`: service/gpu_fit.py); a fine-tune says its base's family, size and
context."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import APIRouter

from service import jobs
from service.auth import CurrentTenant
from service.db.session import SessionDep
from service.errors import NotFoundError
from service.gpu_fit import catalog_min_gpus
from service.schemas import DATABASE_UNAVAILABLE, ModelPublic, ModelsPublic, error_responses
from service.settings import get_settings
from worker.engine.catalog import BaseModelInfo, random_weights_warning
from worker.engine.catalog import list_models as catalog_models

router = APIRouter(
    prefix="/v1/models",
    tags=["models"],
    responses={**error_responses(400, 401, 404, 429), **DATABASE_UNAVAILABLE},
)

BASE_OWNER = "loraq"


def _shape(m: BaseModelInfo) -> dict[str, Any]:
    return {
        "kind": m.kind,
        "family": m.family,
        "parameters": m.parameters,
        "context_length": m.context_length,
    }


def _min_gpu(m: BaseModelInfo, store: Path) -> dict[str, Any]:
    """A base's smallest common GPU per precision (service/gpu_fit.py), flat and in full."""
    found = catalog_min_gpus(m.name, store)
    if found is None:
        return {}
    return {"min_gpu_memory_gb": {p: f["memory_gb"] for p, f in found.items()}, "min_gpu": found}


def all_models(session: SessionDep, tenant_id: str) -> list[ModelPublic]:
    settings = get_settings()
    catalog = catalog_models(settings.model_store)
    base = [
        ModelPublic(
            id=m.name,
            created=0,
            owned_by=BASE_OWNER,
            random=m.random,
            description=m.description,
            local=m.pulled,
            auto_pull=settings.auto_pull,
            use=m.use,
            upstream=m.upstream,
            warning=random_weights_warning(m.name),
            **_shape(m),
            **_min_gpu(m, settings.model_store),
        )
        for m in sorted(catalog, key=lambda m: m.random)  # stable: catalog order within each group
    ]
    random_bases = {m.name for m in catalog if m.random}
    uses = {m.name: m.use for m in catalog}
    shapes = {m.name: _shape(m) for m in catalog}
    tuned = [
        # "ft:<base>:<suffix>:<job id>": an adapter on random weights is random (and test-only) too
        ModelPublic(
            id=name,
            created=finished,
            owned_by=tenant_id,
            random=name.split(":")[1] in random_bases,
            use=uses.get(name.split(":")[1]),
            warning=random_weights_warning(name.split(":")[1]),
            **{k: v for k, v in shapes.get(name.split(":")[1], {}).items() if k != "kind"},
        )
        for name, finished in jobs.succeeded_models(session, tenant_id=tenant_id)
    ]
    return base + tuned


@router.get("", response_model=ModelsPublic)
def list_models(tenant: CurrentTenant, session: SessionDep) -> ModelsPublic:
    return ModelsPublic(data=all_models(session, tenant.id))


@router.get("/{model:path}", response_model=ModelPublic)
def retrieve_model(model: str, tenant: CurrentTenant, session: SessionDep) -> ModelPublic:
    for m in all_models(session, tenant.id):
        if m.id == model:
            return m
    raise NotFoundError(f"The model {model!r} does not exist", param="model", code="model_not_found")
