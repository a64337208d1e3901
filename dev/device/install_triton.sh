#!/usr/bin/env bash
# Put another Triton release on the GPU machine, beside the image's own, from parts carried over
# several device calls (a Triton wheel is larger than one call's carry limit).
#
# Here, once: bash dev/device/install_triton.sh pack 3.9.0
#   downloads the cp312 wheel, unpacks it, drops what the GPU runs do not use (the CUPTI static
#   libraries for the profiler and the Blackwell tool binaries), packs the rest with xz and splits it
#   into .whl/triton/p1 .. p3 (each under the carry limit with the tree beside it), with SHA256SUMS.
# There, in consecutive calls while the machine stays warm (it keeps /tmp for about 30 s after a call):
#   call 1 (carry .whl/triton/p1): bash dev/device/install_triton.sh stage
#   call 2 (carry .whl/triton/p2): bash dev/device/install_triton.sh stage
#   call 3 (carry .whl/triton/p3): bash dev/device/install_triton.sh stage && bash dev/device/install_triton.sh install
# `install` reassembles, checks the checksum and unpacks into $TRITON_SITE (default /tmp/site_triton);
# then `source $TRITON_SITE/env.sh` (or `bash dev/device/install_triton.sh env` prints it) puts it first
# on PYTHONPATH, so that python3 imports that Triton instead of the image's.
set -u
SRC=.whl/triton
STAGE=${TRITON_STAGE:-/tmp/triton_parts}
SITE=${TRITON_SITE:-/tmp/site_triton}

pack() {
  local version=$1 tmp
  tmp=$(mktemp -d)
  PIP_CONFIG_FILE=/dev/null python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 -d "$tmp" "triton==$version" || return 1
  mkdir "$tmp/tree" && (cd "$tmp/tree" && unzip -q "$tmp"/triton-*.whl) || return 1
  rm -rf "$tmp"/tree/triton/backends/nvidia/lib/cupti* "$tmp"/tree/triton/backends/nvidia/bin/*-blackwell
  tar -C "$tmp/tree" -cf - . | xz -T2 -6 > "$tmp/triton.tar.xz" || return 1
  rm -rf "$SRC" && mkdir -p "$SRC"/p1 "$SRC"/p2 "$SRC"/p3
  (cd "$tmp" && split -n 3 -d triton.tar.xz triton.tar.xz.part && sha256sum triton.tar.xz > SHA256SUMS)
  mv "$tmp"/triton.tar.xz.part00 "$SRC"/p1/ && mv "$tmp"/triton.tar.xz.part01 "$SRC"/p2/
  mv "$tmp"/triton.tar.xz.part02 "$tmp"/SHA256SUMS "$SRC"/p3/
  echo "$version" > "$SRC"/p3/VERSION
  rm -rf "$tmp"; ls -l "$SRC"/p*
}

stage() {
  mkdir -p "$STAGE" && cp "$SRC"/p*/* "$STAGE"/ && echo "staged: $(ls "$STAGE" | tr '\n' ' ')"
}

install() {
  local n
  n=$(ls "$STAGE"/triton.tar.xz.part* 2>/dev/null | wc -l)
  [ "$n" -eq 3 ] || { echo "install: $n of 3 parts staged in $STAGE (a new machine starts bare: stage all three)"; return 2; }
  cat "$STAGE"/triton.tar.xz.part0[0-2] > "$STAGE/triton.tar.xz" && (cd "$STAGE" && sha256sum -c --quiet SHA256SUMS) \
    || { echo "install: checksum mismatch"; return 1; }
  rm -rf "$SITE" && mkdir -p "$SITE" && xz -dc "$STAGE/triton.tar.xz" | tar -C "$SITE" -xf - || return 1
  # Triton 3.9 looks for the Blackwell tools even when compiling for Hopper: the ones kept serve both.
  local b
  for b in ptxas cuobjdump nvdisasm; do
    [ -e "$SITE/triton/backends/nvidia/bin/$b-blackwell" ] || ln -s "$b" "$SITE/triton/backends/nvidia/bin/$b-blackwell"
  done
  echo "export PYTHONPATH=$SITE\${PYTHONPATH:+:\$PYTHONPATH}" > "$SITE/env.sh"
  # shellcheck disable=SC1091
  source "$SITE/env.sh"
  python3 -c "import triton; print('install: triton', triton.__version__, 'from', triton.__file__)"
}

case "${1:-env}" in
  pack) pack "${2:?pack needs a version, e.g. 3.9.0}" ;;
  stage) stage ;;
  install) install ;;
  env) [ -f "$SITE/env.sh" ] && cat "$SITE/env.sh" ;;
  *) echo "usage: $0 pack VERSION | stage | install | env"; exit 2 ;;
esac
