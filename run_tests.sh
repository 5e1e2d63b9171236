#!/usr/bin/env bash
# Test: set up what is missing (test tools included), then run pytest with any arguments.
# Test files run in parallel worker processes (pytest-xdist), each file whole in one worker so that
# a module's shared runs are made once: twice as many workers as cores, at most 8, since most of a
# test's time is spent in the processes it starts, waiting on them or on each other. Give `-n N`
# (`-n 0`: none) or `-p no:xdist` to choose otherwise; TEST_WORKERS=N sets the default.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$ROOT/scripts/setup.sh"
setup_python "$ROOT" "$ROOT/requirements.txt" "$ROOT/requirements-dev.txt"
cd "$ROOT"
# The suite starts about 1,500 Python processes from this clone (launchers, workers, test processes).
# With PYTHONDONTWRITEBYTECODE set (container images often set it), each one compiles the project's
# modules again, and every test process rewrites every test file: about 0.1 s of CPU per launcher or
# worker and 5 s per test process. The bytecode goes to this clone's __pycache__ (git ignores it).
unset PYTHONDONTWRITEBYTECODE
parallel=(-n "${TEST_WORKERS:-$(cores=$(nproc); echo $((cores * 2 > 8 ? 8 : cores * 2)))}" --dist loadfile)
for arg in "$@"; do
  case "$arg" in
    -n | -n* | --numprocesses | --numprocesses=* | no:xdist | -pno:xdist) parallel=() ;;
  esac
done
exec "$PYTHON" -m pytest ${parallel[@]+"${parallel[@]}"} "$@"
