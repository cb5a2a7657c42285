#!/usr/bin/env bash
# The lent GPU machine's checks, run there from the repo root (load/device/README.md): NVML through the
# agent's power source (issue 20), the ext_proc alone at 1..8 workers and the decision latency on a quiet
# 16-core machine (issue 27). Carried: .whl and .devcarry (load/device/prepare.sh makes both here).
# Rehearsal here, seconds long: QUICK=1 PY=<a Python 3.12 with the image's packages> bash load/device/run.sh
set -uo pipefail
PY=${PY:-python3}
SITE=${SITE:-/tmp/site}
OUT=${OUT:-/tmp/devout}
mkdir -p "$OUT"
rm -rf "$SITE" /tmp/sx
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" $(ls .whl/*.whl | grep -v xds_protos) || exit 1
# xds-protos ships an older copy of opentelemetry/proto: opentelemetry-proto's files win, as ./dev arranges.
"$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/sx .whl/xds_protos-*.whl || exit 1
cp -rn /tmp/sx/. "$SITE"/
export PYTHONPATH="$SITE:$PWD" PYTHONUNBUFFERED=1 KVGATE_CACHE=/tmp/kvc-dev
M=.devcarry/model
if [ -n "${QUICK:-}" ]; then
  NV="--idle-s 1 --load-s 1 --cool-s 1"; AL="--quick --workers 1,2"; AL2="--quick --workers 2"; DE="--quick"
else
  NV="--idle-s 8 --load-s 20 --cool-s 6"
  AL="--workers 1,2,4,8 --clients 8 --concurrency 128 --rounds 2"
  AL2="--workers 4,8 --clients 8 --concurrency 128 --rounds 1 --no-siblings"
  DE="--gc deferred"
fi
{ date -u; nproc; lscpu | grep -E "Model name|^CPU\(s\)|Thread|Socket|MHz"; nvidia-smi -L; "$PY" --version; } > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
echo "== nvml_live"; timeout 80 "$PY" -m load.bench.nvml_live --out "$OUT/nvml-live-h200.json" $NV 2>&1 | tail -6
echo "== extproc_alone"; timeout 220 "$PY" -m load.bench.extproc_alone $AL --model-dir $M --out "$OUT/extproc-alone-h200.json" > "$OUT/alone.log" 2>&1; echo "rc=$?"; tail -12 "$OUT/alone.log"
echo "== extproc_alone, sharing nothing"; timeout 80 "$PY" -m load.bench.extproc_alone $AL2 --model-dir $M --out "$OUT/extproc-alone-nosiblings-h200.json" 2>&1 | tail -4
echo "== decision"; timeout 170 "$PY" -m load.bench.decision $DE --model-dir $M --out "$OUT/decision-h200.json" > "$OUT/decision.log" 2>&1; echo "rc=$?"; tail -25 "$OUT/decision.log"
