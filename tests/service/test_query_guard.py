"""A NUL character in a query string is a 400 naming the parameter, on every database."""

from __future__ import annotations

import pytest

from tests.conftest import ApiClient


@pytest.mark.parametrize(
    "path",
    ["/v1/files?purpose=%00", "/v1/fine_tuning/jobs?after=ftjob-%00&limit=2", "/v1/files?x%00y=1"],
)
def test_a_nul_in_the_query_is_400_naming_the_parameter(api: ApiClient, path: str) -> None:
    """PostgreSQL's text cannot hold NUL: without the guard `?purpose=%00` was a 500 there."""
    r = api.get(path)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_query" and "NUL" in err["message"]
    assert err["param"] in {"purpose", "after", "x\\0y"}
    assert api.get("/v1/files?purpose=fine-tune").status_code == 200  # the guard lets plain ones by
