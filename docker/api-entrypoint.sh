#!/bin/sh
# API container start: migrations (alembic upgrade head, idempotent), the LORAQ_API_KEY for the
# default tenant, then `loraq api` (uvicorn with the connection limits of service/api_server.py;
# LORAQ_API_WORKERS processes, proxies in LORAQ_FORWARDED_ALLOW_IPS believed) in the foreground as
# PID 1's replacement so signals reach it.
# Run one API replica per database while migrating; more replicas may start once it is healthy.
set -eu

python - <<'PY'
from service.settings import get_settings
from service.up import prepare_database_and_key

key, generated = prepare_database_and_key(get_settings())
if generated:
    # Without LORAQ_API_KEY every start mints a new key; compose.yaml requires the variable.
    print(f"LORAQ_API_KEY unset: generated an API key for tenant default: {key}", flush=True)
print("database migrated; API key ready", flush=True)
PY

exec loraq api
