#!/usr/bin/env bash
# Prepares what the lent GPU machine's checks (load/device/run.sh) carry, on this machine, from the repo root:
#   .whl/             the wheels its image lacks (CPython 3.12, x86-64), at the versions ./dev installed here
#   .devcarry/model/  SmolLM2's tokenizer and chat template (`kvgate model export`), not its 100 MB GGUF
# Both are ignored by git (.git/info/exclude). Then: device run `bash load/device/run.sh`, carry .whl and
# .devcarry (about 21 MiB of the 64 MiB a call may carry). load/device/README.md says why each is needed.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${KVGATE_VENV:-.venv}
PY="$VENV/bin/python"
[ -x "$PY" ] || { echo "run ./dev setup first (needs $PY)" >&2; exit 1; }
mkdir -p .git/info
for p in /.whl/ /.devcarry/; do grep -qxF "$p" .git/info/exclude 2>/dev/null || echo "$p" >> .git/info/exclude; done
# The image has Python 3.12 with grpcio, protobuf, tokenizers, jinja2, numpy, uvloop, aiohttp, pyyaml,
# prometheus-client, transformers and nvidia-ml-py (the device README's package list); grpcio and protobuf
# travel anyway so that Envoy's generated stubs (xds-protos) meet the versions they were built for.
NAMES=(xds-protos grpcio grpcio-health-checking protobuf orjson blake3 msgspec pyzmq gguf cryptography cffi
  pycparser etcd3aio opentelemetry-api opentelemetry-sdk opentelemetry-proto opentelemetry-semantic-conventions
  opentelemetry-exporter-otlp-proto-grpc opentelemetry-exporter-otlp-proto-common
  opentelemetry-exporter-otlp-common googleapis-common-protos importlib-metadata)
# Each at the version installed here; one this venv does not have (some releases need it, some not) is left out.
pins=$("$PY" - "${NAMES[@]}" <<'PYEOF'
import importlib.metadata as m, sys
have = {(d.metadata["Name"] or "").lower().replace("_", "-"): d.version for d in m.distributions()}
print(" ".join(f"{n}=={have[n]}" for n in sys.argv[1:] if n in have))
PYEOF
)
rm -rf .whl && mkdir .whl
# shellcheck disable=SC2086
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d .whl $pins
rm -rf .devcarry/model && mkdir -p .devcarry
model=$("$PY" -c 'from load.bench import smollm2_dir; print(smollm2_dir(None))')
cp -r "$model" .devcarry/model
du -sh .whl .devcarry
