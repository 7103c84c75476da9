#!/usr/bin/env bash
# Installs Debian's `chromium` when it is missing: tests/server/test_docs_offline.py drives it headless
# to see that /docs and /redoc render offline, and skips only where it is truly absent. Called by
# `make test`; a no-op where chromium is already installed. fonts-liberation: readable screenshots.
set -euo pipefail

if command -v chromium >/dev/null 2>&1; then
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "ensure_chromium: no apt-get here; install chromium yourself or the offline docs test skips" >&2
    exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi
$SUDO apt-get update -qq
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium fonts-liberation
