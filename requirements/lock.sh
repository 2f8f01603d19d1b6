#!/usr/bin/env bash
# Re-resolve requirements/dev.lock: every package the README's test command installs (the
# runtime dependencies and the "dev" extra: pytest, notebook and browser tooling), pinned for
# Python 3.10 and newer on any platform, with environment markers where versions differ.
# torch and its CUDA libraries are left out: the README pins the CPU build of torch first.
# Needs uv (`pip install uv`). After running it: the whole suite, then commit.
set -euo pipefail
cd "$(dirname "$0")/.."
compile() {
    uv pip compile pyproject.toml requirements/dev.in --extra dev --universal \
        --python-version 3.10 --no-header "$@"
}
# Everything torch pulls in only for CUDA, found by a first pass.
skip=(--no-emit-package torch)
for name in $(compile --no-annotate --quiet | sed -nE 's/^((nvidia|cuda)-[a-z0-9-]+)==.*/\1/p' | sort -u); do
    skip+=(--no-emit-package "$name")
done
{
    echo "# The test environment's pins (pip constraints): bash requirements/lock.sh regenerates"
    echo "# this file from pyproject.toml and requirements/dev.in. Do not edit by hand."
    compile --quiet "${skip[@]}"
} > requirements/dev.lock
echo "wrote requirements/dev.lock ($(grep -c '==' requirements/dev.lock) pins)"
