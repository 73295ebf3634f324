#!/usr/bin/env bash
# One device run (the GPU-exactness issue): the suite on MLX's CUDA backend with JUnit XML, its
# report as device_<device>.json, then the first GPU figures (bench/batch.py, and bench/bitwise.py
# where time is left), all under $OUT, within ~9 minutes.
#
# Here, once:  bash bench/device_run.sh prepare   # wheels into .device/ (git-ignored), in two
#                                                 # parts: MLX's CUDA build is ~75 MB even xz -9'd
# On the lent machine, two calls of the device tool back to back (it stays warm ~30 s between;
# a call carries at most 64 MiB with the working tree, ~17 MB):
#   run 1: bash bench/device_run.sh stash   # carry [".device/mlx_cuda.tar.xz.00"]: kept in /tmp
#   run 2: bash bench/device_run.sh run     # carry [".device/mlx_cuda.tar.xz.01", ".device/wheels"]
# Rehearsal on the CPU (same files, device "cpu"; a subset keeps it short):
#   DEVICE=cpu OUT=/tmp/device_out TESTS=tests/test_options.py bash bench/device_run.sh run
set -uo pipefail
cd "$(dirname "$0")/.."
STEP=${1:-run}
DEVICE=${DEVICE:-gpu}
OUT=${OUT:-$PWD/device_out}
TESTS=${TESTS:-tests/}
SUITE_SECONDS=${SUITE_SECONDS:-420}
PARTS=/tmp/tinydraft-device
MLX=0.32.4

prepare() {  # needs the package registries; writes .device/part1.tar, .device/part2.tar
    grep -qx '/.device/' .git/info/exclude 2>/dev/null || echo '/.device/' >> .git/info/exclude
    rm -rf .device /tmp/device-wheels && mkdir -p .device /tmp/device-wheels/x
    local pip=(.venv/bin/python -m pip download -q --no-deps --only-binary=:all:
               --python-version 3.12 --implementation cp -d /tmp/device-wheels
               --platform manylinux_2_35_x86_64 --platform manylinux_2_28_x86_64
               --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
    "${pip[@]}" "mlx==$MLX" "mlx-cuda-13==$MLX" "mlx-lm==0.32.2" fastapi starlette uvicorn \
        pydantic pydantic-core annotated-types typing-inspection anthropic openai jiter distro \
        sniffio docstring-parser h11 prometheus-client || return 1
    # MLX's CUDA build without its C++ headers (not needed to run), as an xz'd tree
    (cd /tmp/device-wheels/x && unzip -q ../mlx_cuda_13-*.whl && rm -rf mlx/include &&
     tar cf - . | xz -9 -T0 > /tmp/device-wheels/mlx_cuda.tar.xz) || return 1
    rm /tmp/device-wheels/mlx_cuda_13-*.whl
    split -n 2 -d /tmp/device-wheels/mlx_cuda.tar.xz .device/mlx_cuda.tar.xz.
    mkdir -p .device/wheels && mv /tmp/device-wheels/*.whl .device/wheels/
    du -sh .device/*
}

stash() {  # run 1 on the machine: keep the first part
    mkdir -p "$PARTS" && cp .device/mlx_cuda.tar.xz.00 "$PARTS/" && ls -la "$PARTS"
}

install() {  # run 2: assemble, install into /tmp/site (the machine's python3 has torch)
    cp .device/mlx_cuda.tar.xz.01 "$PARTS/" 2>/dev/null
    mkdir -p /tmp/site
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
        .device/wheels/*.whl || return 1
    cat "$PARTS"/mlx_cuda.tar.xz.* | xz -d | tar xf - -C /tmp/site || return 1
    export PYTHONPATH=/tmp/site:$PWD
}

run() {
    mkdir -p "$OUT"
    local py=python3
    if [ "$DEVICE" = gpu ]; then
        install || { echo "install failed" | tee "$OUT/install.log"; return 1; }
        nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
    else
        py=.venv/bin/python
        export PYTHONPATH=$PWD
    fi
    export TINYDRAFT_TEST_DEVICE=$DEVICE HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
    $py - > "$OUT/versions.json" <<'EOF'
import json, platform, sys
import mlx.core as mx, mlx_lm, transformers
print(json.dumps({"python": sys.version.split()[0], "platform": platform.platform(),
                  "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__,
                  "transformers": transformers.__version__,
                  "default_device": str(mx.default_device())}))
EOF
    timeout "$SUITE_SECONDS" $py -m pytest -q -p no:cacheprovider -o junit_logging=all \
        --junitxml="$OUT/junit.xml" $TESTS > "$OUT/pytest.log" 2>&1
    $py -m bench.device_report "$OUT/junit.xml" --device "$DEVICE" \
        --versions "$OUT/versions.json" --out "$OUT/device_$DEVICE.json"
    # the first figures, in the time left (bench/batch.py writes results/batch.json)
    timeout 90 $py -m bench.batch > "$OUT/batch.log" 2>&1 && cp results/batch.json "$OUT/"
    # the bit-for-bit mode's cost on this device, where time is left (results/bitwise.json)
    if [ "$SECONDS" -lt 500 ]; then
        timeout 60 $py -m bench.bitwise --prompts 3 --max-tokens 64 > "$OUT/bitwise.log" 2>&1 \
            && cp results/bitwise.json results/bitwise.png "$OUT/"
    fi
    ls -la "$OUT"
}

"$STEP"
