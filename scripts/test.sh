#!/usr/bin/env bash
# Run the whole test suite after setting up what it needs (Debian packages, both virtual environments).
# Extra arguments go to pytest, e.g. scripts/test.sh -m "not vllm" or scripts/test.sh tests/fleet.
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ACE_HOME="${ACE_HOME:-$HOME/.cache/ace}"
export ACE_HOME

bash "$REPO_ROOT/scripts/setup.sh"
cd "$REPO_ROOT"
mkdir -p test-artifacts
exec "$ACE_HOME/venv/bin/python" -m pytest "$@"
