#!/usr/bin/env bash
# Every GPU check in one command. It lives in benchmarks/gpu/ with fetch_gpu_wheels.sh; this is
# the path the docs and the device tool's command give:
#   bash benchmarks/gpu_check.sh [OUTDIR]
exec bash "$(dirname "${BASH_SOURCE[0]}")/gpu/gpu_check.sh" "$@"
