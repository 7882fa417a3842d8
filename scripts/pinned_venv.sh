#!/usr/bin/env bash
# A venv of pinned packages, made once per set of pins in the user's cache (as pip's and Go's
# caches are) and linked into the checkout: a fresh clone on a machine that has made it
# links it instead of installing again. A change of pins (or Python) makes a new one.
#   scripts/pinned_venv.sh .cache/torch-venv torch==2.15.0 transformers==5.12.1 ...
set -euo pipefail
link=$1; shift
py=${PY:-python3.11}
key=$(echo "$* $($py --version 2>&1)" | sha256sum | cut -c1-16)
shared=${XDG_CACHE_HOME:-$HOME/.cache}/posttrain/venvs/$(basename "$link")-$key
if [ "$(cat "$shared/.installed" 2>/dev/null)" != "$*" ]; then
  set -x
  rm -rf "$shared"
  "$py" -m venv "$shared"
  "$shared/bin/pip" install -q "$@"
  echo "$*" > "$shared/.installed"
  set +x
fi
mkdir -p "$(dirname "$link")"
if [ "$(readlink "$link" 2>/dev/null)" != "$shared" ]; then
  rm -rf "$link"
  ln -s "$shared" "$link"
fi
echo "$link -> $shared: up to date"
