#!/usr/bin/env bash
# apt_install.sh WHO WHAT-SKIPS PACKAGE...: installs Debian packages for the test helpers (with sudo
# when not root, quietly, no recommends); where there is no apt-get, says what will skip and succeeds.
set -euo pipefail

who="$1" skips="$2"
shift 2
if ! command -v apt-get >/dev/null 2>&1; then
    echo "$who: no apt-get here; install $* yourself or $skips" >&2
    exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi
$SUDO apt-get update -qq
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@"
