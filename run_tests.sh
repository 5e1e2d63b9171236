#!/usr/bin/env bash
# Test: set up what is missing (test tools included), then run pytest with any arguments.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$ROOT/scripts/setup.sh"
setup_python "$ROOT" "$ROOT/requirements.txt" "$ROOT/requirements-dev.txt"
cd "$ROOT"
exec "$PYTHON" -m pytest "$@"
