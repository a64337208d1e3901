#!/usr/bin/env bash
# Download flash-attn-4 and its CuTe DSL stack as wheels for the GPU machine (Python 3.12,
# manylinux x86-64, CUDA 13; it has no internet) into .whl/fa4/ (git-ignored: /.whl/ in .gitignore).
# Run here, on a machine with pip and internet; then install there with install_flash_attn4.sh.
#
# The nvidia-cutlass-dsl-libs-cu13 wheel (~92 MB) is over one device call's 64 MiB carry, so it is
# split in two halves (split -b 46000000) and the wheels are grouped by the call that carries them:
#   .whl/fa4/small   every other wheel + SHA256SUMS   (call 1, with part1)
#   .whl/fa4/part1   first half of libs-cu13          (call 1)
#   .whl/fa4/part2   second half + SHA256SUMS          (call 2)
# Already on the GPU machine (not carried): torch, einops, cuda-bindings, cuda-pathfinder, protobuf,
# typing-extensions (the device documentation's package list).
# JAX (transformer_engine/jax/flash_backend.py) calls the same flash-attn-4 through the machine's own jax
# 0.11.2 (jax.experimental.buffer_callback, in jax since 0.7) and torch: no wheel beyond these.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"

DEST=.whl/fa4
SPLIT_BYTES=46000000
CARRY_LIMIT=$((64 * 1024 * 1024))
WHEELS=(
  flash-attn-4==4.0.0b36
  nvidia-cutlass-dsl==4.8.1
  nvidia-cutlass-dsl-libs-base==4.8.1
  nvidia-cutlass-dsl-libs-core==4.8.1
  quack-kernels==0.6.5
  apache-tvm-ffi==0.1.15.post2
  torch-c-dlpack-ext==0.1.5
)
BIG=nvidia-cutlass-dsl-libs-cu13==4.8.1
PIP_FLAGS=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
           --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)

rm -rf "$DEST"
mkdir -p "$DEST/small" "$DEST/part1" "$DEST/part2" "$DEST/download"
python3 -m pip download -q "${PIP_FLAGS[@]}" -d "$DEST/small" "${WHEELS[@]}"
python3 -m pip download -q "${PIP_FLAGS[@]}" -d "$DEST/download" "$BIG"

big=$(ls "$DEST"/download/*.whl)
name=$(basename "$big")
[ "$(ls "$DEST"/small/*.whl | wc -l)" -eq "${#WHEELS[@]}" ] || { echo "expected ${#WHEELS[@]} small wheels"; exit 1; }

# Checksums of every wheel as installed there (the big one whole, after reassembly).
(cd "$DEST/small" && sha256sum -- *.whl) > "$DEST/SHA256SUMS"
(cd "$DEST/download" && sha256sum -- "$name") >> "$DEST/SHA256SUMS"
cp "$DEST/SHA256SUMS" "$DEST/small/"
cp "$DEST/SHA256SUMS" "$DEST/part2/"
echo "$name" > "$DEST/part2/BIG_WHEEL"

split -b "$SPLIT_BYTES" -d -a 2 "$big" "$DEST/part1/$name.part"
parts=$(ls "$DEST"/part1/"$name".part* | wc -l)
[ "$parts" -eq 2 ] || { echo "expected 2 parts of $name, got $parts"; exit 1; }
mv "$DEST/part1/$name.part01" "$DEST/part2/"
rm -r "$DEST/download"

echo "Requirements of the downloaded wheels (extras omitted):"
for w in "$DEST"/small/*.whl; do
  printf '  %s: ' "$(basename "$w")"
  unzip -p "$w" '*.dist-info/METADATA' | grep '^Requires-Dist' | grep -v 'extra ==' | cut -d' ' -f2- | paste -sd ';' -
done

tree_bytes=$(git ls-files -z | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
call1=$(( $(du -cb "$DEST/small" "$DEST/part1" | tail -1 | cut -f1) + tree_bytes ))
call2=$(( $(du -cb "$DEST/part2" | tail -1 | cut -f1) + tree_bytes ))
ls -l "$DEST"/small "$DEST"/part1 "$DEST"/part2
echo "call 1 carries .whl/fa4/small + .whl/fa4/part1: $call1 bytes with the tree (limit $CARRY_LIMIT)"
echo "call 2 carries .whl/fa4/part2:                  $call2 bytes with the tree (limit $CARRY_LIMIT)"
[ "$call1" -lt "$CARRY_LIMIT" ] && [ "$call2" -lt "$CARRY_LIMIT" ] || { echo "over the carry limit"; exit 1; }
