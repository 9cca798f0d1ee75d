#!/usr/bin/env bash
# The wheels speculators 0.9.0 needs on the GPU machine (Python 3.12) that its image lacks, into
# DIR (default .devcarry/peerwhl, ~7 MB): carry DIR with a call and install it there with
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /root/site DIR/*.whl
# (the image has torch, transformers, pyarrow, pandas, fsspec, xxhash, aiohttp, rich and click).
set -euo pipefail
DIR=${1:-.devcarry/peerwhl}
mkdir -p "$DIR"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 -d "$DIR" \
  speculators==0.9.0 hs-connectors==0.9.0 datasets dill multiprocess loguru pydantic pydantic-core \
  pydantic-settings python-dotenv annotated-types typing-inspection openai jiter distro sniffio httpx httpx2 httpcore2 truststore idna typer shellingham annotated-doc \
  httpcore anyio h11
ls "$DIR" | wc -l
du -sh "$DIR"
