#!/bin/sh
# API container start: migrations (alembic upgrade head, idempotent), the LORAQ_API_KEY for the
# default tenant, then uvicorn in the foreground as PID 1's replacement so signals reach it.
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

exec uvicorn service.app:create_app --factory \
  --host "${LORAQ_HOST:-0.0.0.0}" --port "${LORAQ_PORT:-8000}" --workers "${LORAQ_API_WORKERS:-1}" \
  --proxy-headers --forwarded-allow-ips "${LORAQ_FORWARDED_ALLOW_IPS:-127.0.0.1}" \
  --no-access-log --timeout-graceful-shutdown 10
