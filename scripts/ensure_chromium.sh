#!/usr/bin/env bash
# Installs Debian's `chromium` when it is missing: tests/server/test_docs_offline.py drives it headless
# to see that /docs and /redoc render offline, and skips only where it is truly absent. Called by
# `make test`; a no-op where chromium is already installed. fonts-liberation: readable screenshots.
set -euo pipefail

if command -v chromium >/dev/null 2>&1; then
    exit 0
fi
bash "$(dirname "$0")/apt_install.sh" ensure_chromium "the offline docs test skips" chromium fonts-liberation
