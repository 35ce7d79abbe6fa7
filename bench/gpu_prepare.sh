#!/usr/bin/env bash
# Prepare what a lent GPU machine lacks, into .gpu/ (git-ignored), for bench/gpu_check.sh:
#  - wheels for the GPU image's Python 3.12 of the packages the engine imports that the image
#    does not hold (xgrammar and pydantic, with their needs; versions as installed in .venv);
#  - the test model's config and tokenizer (the 538 MB weights do not travel: the throughput
#    step times random weights).
# Then, from the device tool: run(command="bash bench/gpu_check.sh", carry=[".gpu"]).
#
#   bash bench/gpu_prepare.sh        # here, after `make install model`
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
DEST=.gpu
rm -rf "$DEST" && mkdir -p "$DEST/wheels" "$DEST/smollm2-135m"
version() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
for pkg in xgrammar apache-tvm-ffi pydantic pydantic-core annotated-types typing-inspection typing-extensions; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$DEST/wheels" "$pkg==$(version "$pkg")"
done
for f in models/smollm2-135m/*; do
  [[ $f == *.safetensors ]] || cp "$f" "$DEST/smollm2-135m/"
done
du -sh "$DEST"
