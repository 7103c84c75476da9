#!/usr/bin/env bash
# Installs Debian's `postgresql` package when its server binaries are missing: the registry tests
# start a throw-away PostgreSQL cluster (initdb + pg_ctl on a loopback port) and skip only when the
# binaries are truly absent. Called by `make test`; a no-op where PostgreSQL is already installed.
set -euo pipefail

if command -v initdb >/dev/null 2>&1 || compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null; then
    exit 0
fi
bash "$(dirname "$0")/apt_install.sh" ensure_postgres "the PostgreSQL registry tests skip" postgresql
