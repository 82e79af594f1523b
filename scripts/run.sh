#!/usr/bin/env bash
# Start ACE on its embedded defaults: SQLite, a local Redis, a worker (its managed-server supervisor runs a real
# vLLM for the managed demo endpoint), beat and the web server on http://127.0.0.1:8000. Prints the admin
# credentials. Ctrl-C stops everything.
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ACE_HOME="${ACE_HOME:-$HOME/.cache/ace}"
export ACE_HOME

bash "$REPO_ROOT/scripts/setup.sh" run
cd "$REPO_ROOT"
"$ACE_HOME/venv/bin/python" -m speculation.offline.demo
exec "$ACE_HOME/venv/bin/python" -m ace.launcher
