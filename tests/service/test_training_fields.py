"""Every field of the training configuration type, walked from the type itself (nothing listed
here by hand): the API refuses a value out of range with a 400 naming the field, accepts a valid
one and shows it on the job; the YAML of `loraq train` refuses and accepts the same values; and the
value reaches the engine's config, the same whether it came through a job or a YAML file.

The values come from the type's JSON schema (the OpenAPI's): a field's bounds give a valid value
other than the default and an invalid one; a field's `examples` give the valid value where no
generic one fits (a module name).

A tagged union (`method`: supervised or dpo) is not a leaf with bounds: its request shape is OpenAI's
`method` object, and a dpo job needs a preference file, so tests/service/test_api_dpo.py walks it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from service import jobs
from service.db.session import session_scope
from service.settings import get_settings
from tests.conftest import DATASET, ApiClient
from worker.engine.config_file import load_config_file
from worker.engine.training_config import Hyperparameters, Placement, TrainingConfig
from worker.engine.types import ConfigError, TrainConfig

Path_ = tuple[str, ...]


def _leaves(
    schema: dict[str, Any], defs: dict[str, Any], prefix: Path_ = ()
) -> list[tuple[Path_, dict[str, Any]]]:
    found: list[tuple[Path_, dict[str, Any]]] = []
    for name, prop in schema["properties"].items():
        if "discriminator" in prop:  # a tagged union (method): see the module's docstring
            continue
        ref = prop.get("$ref")
        if ref is not None:
            found += _leaves(defs[ref.split("/")[-1]], defs, (*prefix, name))
        else:
            found.append(((*prefix, name), prop))
    return found


def leaves(model: type[Any]) -> list[tuple[Path_, dict[str, Any]]]:
    schema = model.model_json_schema()
    return _leaves(schema, schema.get("$defs", {}))


TRAINING = {path: prop for path, prop in leaves(TrainingConfig)}
PLACEMENT = {path: prop for path, prop in leaves(Placement)}


def _branch(prop: dict[str, Any]) -> dict[str, Any]:
    """The schema of the field's values, without the null / "auto" / "all-linear" alternatives."""
    for branch in prop.get("anyOf", [prop]):
        if branch.get("type") != "null" and "const" not in branch:
            return dict(branch)
    raise AssertionError(f"no value schema in {prop}")


def good_value(prop: dict[str, Any]) -> Any:
    """A valid value other than the default."""
    if "examples" in prop:
        return prop["examples"][0]
    b, default = _branch(prop), prop.get("default")
    if "enum" in b:
        return next(v for v in b["enum"] if v != default)
    kind = b.get("type")
    if kind == "boolean":
        return not default
    if kind in ("integer", "number"):
        if "maximum" in b:
            return b["maximum"]
        lo = b.get("minimum", b.get("exclusiveMinimum", 0))
        return (lo + b["exclusiveMaximum"]) / 2 if "exclusiveMaximum" in b else lo + 1
    if kind == "string":
        return "a" * max(1, b.get("minLength", 1))
    if kind == "array":
        return [good_value(b["items"])] * max(1, b.get("minItems", 1))
    raise AssertionError(f"no valid value known for {prop}")


def bad_value(prop: dict[str, Any]) -> Any:
    """A value out of the field's range, or of the wrong type where it has no range."""
    b = _branch(prop)
    if b.get("type") in ("integer", "number"):
        if "maximum" in b:
            return b["maximum"] * 2 + 1
        if "exclusiveMaximum" in b:
            return b["exclusiveMaximum"]
        if "minimum" in b:
            return b["minimum"] - 1
    if b.get("type") == "array" and "maxItems" in b:
        return [good_value(b["items"])] * (b["maxItems"] + 1)
    if b.get("type") == "string" and "maxLength" in b:
        return "a" * (b["maxLength"] + 1)
    return {"not": "a value"}


def api_path(path: Path_) -> Path_:
    """Where the request (and the job) carries a field: OpenAI's hyperparameters are nested."""
    return ("hyperparameters", *path) if path[0] in Hyperparameters.model_fields else path


def nested(path: Path_, value: Any) -> dict[str, Any]:
    for key in reversed(path):
        value = {key: value}
    return value


def dig(data: dict[str, Any], path: Path_) -> Any:
    for key in path:
        data = data[key]
    return data


@pytest.fixture
def unserved_ok(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    # a queue or GPU count no test worker serves is a valid value: the job waits for one
    monkeypatch.setenv("LORAQ_ACCEPT_UNSERVED_JOBS", "1")
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()  # the next test reads its own environment


def post_job(api: ApiClient, file_id: str, path: Path_, value: Any) -> Any:
    body = {"model": "tiny-llama", "training_file": file_id, **nested(api_path(path), value)}
    return api.post("/v1/fine_tuning/jobs", json=body)


def assert_api_validates(api: ApiClient, file_id: str, path: Path_, prop: dict[str, Any]) -> dict[str, Any]:
    bad = post_job(api, file_id, path, bad_value(prop))
    assert bad.status_code == 400, bad.text
    assert bad.json()["error"]["param"] == ".".join(api_path(path)), bad.json()
    good = post_job(api, file_id, path, good_value(prop))
    assert good.status_code == 200, good.text
    job: dict[str, Any] = good.json()
    assert dig(job, api_path(path)) == good_value(prop)  # the job shows it where the request put it
    assert api.get(f"/v1/fine_tuning/jobs/{job['id']}").json() == job
    return job


def yaml_config(tmp_path: Path, fields: dict[str, Any]) -> TrainConfig:
    path = tmp_path / f"cfg-{len(list(tmp_path.iterdir()))}.yaml"
    path.write_text(
        yaml.safe_dump({"model": "tiny-llama", "train_file": "t.jsonl", "output_dir": "out", **fields})
    )
    return load_config_file(path, default_model_store=tmp_path / "models")


def test_every_field_is_walked() -> None:
    # the walk reaches nested fields (lora.r) and every field of the type, hyperparameters included
    assert ("lora", "r") in TRAINING and ("n_epochs",) in TRAINING and ("packing",) in TRAINING
    flat = {p[0] for p in TRAINING}
    unions = {
        name
        for name, prop in TrainingConfig.model_json_schema()["properties"].items()
        if "discriminator" in prop
    }
    assert unions == {"method"}  # a new union field needs its own walk, as method has in test_api_dpo
    assert flat == set(TrainingConfig.model_fields) - unions


@pytest.mark.parametrize("path", list(TRAINING), ids=".".join)
def test_training_field_api_yaml_and_engine(
    api: ApiClient, tmp_path: Path, unserved_ok: None, path: Path_
) -> None:
    from worker.runner import build_train_config

    prop = TRAINING[path]
    file_id = api.upload(DATASET)
    job = assert_api_validates(api, file_id, path, prop)

    with pytest.raises(ConfigError) as err:
        yaml_config(tmp_path, nested(path, bad_value(prop)))
    assert err.value.param == ".".join(path)
    from_yaml = yaml_config(tmp_path, nested(path, good_value(prop))).to_dict()
    default = yaml_config(tmp_path, {}).to_dict()
    # `auto` lists what the run plans from its data; a local run's unset n_epochs is 1, a job's
    # "auto", so only the tested field's own place in it is compared
    changed = {k for k in from_yaml if from_yaml[k] != default[k]} - {"auto"}
    assert changed, f"{'.'.join(path)} changed nothing in the engine's config"
    planned_name = {"learning_rate_multiplier": "learning_rate"}.get(path[0], path[0])

    with session_scope() as session:
        claim = jobs.claim(session, job_id=job["id"], worker_id="test-worker")
    assert claim is not None
    from_job = build_train_config(claim, get_settings(), tmp_path / "job").to_dict()
    assert {k: from_job[k] for k in changed} == {k: from_yaml[k] for k in changed}
    assert (planned_name in from_job["auto"]) == (planned_name in from_yaml["auto"])


@pytest.mark.parametrize("path", list(PLACEMENT), ids=".".join)
def test_placement_field_api(api: ApiClient, unserved_ok: None, path: Path_) -> None:
    job = assert_api_validates(api, api.upload(DATASET), path, PLACEMENT[path])
    with session_scope() as session:
        assert (
            jobs.get_job(session, tenant_id=api.tenant_id, job_id=job["id"]).__dict__[path[0]] == job[path[0]]
        )


def test_eval_prompts_are_at_most_16(api: ApiClient) -> None:
    # The walk above takes the limit from the schema; the product promises 16 (the README and the
    # New-job page say so), so the number is written here, not read from the constant.
    body = {"model": "tiny-llama", "training_file": api.upload(DATASET)}
    ok = api.post("/v1/fine_tuning/jobs", json={**body, "eval_prompts": [f"q{i}?" for i in range(16)]})
    assert ok.status_code == 200, ok.text
    assert len(ok.json()["eval_prompts"]) == 16
    over = api.post("/v1/fine_tuning/jobs", json={**body, "eval_prompts": [f"q{i}?" for i in range(17)]})
    assert over.status_code == 400, over.text
    assert over.json()["error"]["param"] == "eval_prompts"
