#!/usr/bin/env bash
# Build the byte-level smoke data (data/smoke/train.bin, val.bin) from the embedded corpus (corpus/*.txt.gz),
# offline. Idempotent: when the inputs have not changed since the last build it says so and does nothing.
# The split: documents are the blank-line-separated blocks of the files, cleaned (NFC, controls, whitespace)
# and deduplicated; about 5% of them, chosen by a hash of their text, form val (configs/data/smoke.yaml).
#
#   scripts/prepare_smoke_data.sh [section.key=value ...]     e.g. data.dir=/tmp/smoke
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=.venv/bin/python
[ -x "$PYTHON" ] || PYTHON=python3
exec "$PYTHON" -m corpus all configs/smoke-cpu.yaml "$@"
