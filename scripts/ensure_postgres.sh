#!/usr/bin/env bash
# Installs Debian's `postgresql` package when its server binaries are missing: the registry tests
# start a throw-away PostgreSQL cluster (initdb + pg_ctl on a loopback port) and skip only when the
# binaries are truly absent. Called by `make test`; a no-op where PostgreSQL is already installed.
set -euo pipefail

if command -v initdb >/dev/null 2>&1 || compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null; then
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "ensure_postgres: no apt-get here; install PostgreSQL yourself or the PostgreSQL registry tests skip" >&2
    exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi
$SUDO apt-get update -qq
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends postgresql
