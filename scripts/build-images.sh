#!/usr/bin/env bash
# Build tandem's images with BuildKit: router, operator and server-cpu from ./Dockerfile, tagged
# tandem/<target>:$TAG. It starts no Docker engine: where none answers it says so and exits 1.
#
#   TAG=0.1.0            the tag (default dev)
#   TARGETS="operator"   the targets (default: router operator server-cpu; the CUDA `server` target
#                        builds the same way on a machine that can pull its base)
#   PY_IMAGE=...         the Python base (default: the Dockerfile's). Where it is neither present nor
#                        pullable (no registry), a stand-in is made from Debian's packages: debootstrap
#                        (installed with apt if missing; needs root or sudo), then docker/base.Dockerfile.
#   CA_BUNDLE=ca.pem     a CA bundle pip must trust inside the build, behind a TLS-inspecting proxy
#                        (default: $PIP_CERT where set; CA_BUNDLE= for none). Layered onto the base.
#   DOCKER=docker        the client (default: the first that builds with BuildKit: one with the buildx
#                        plugin, or Debian's docker.io 20.10, whose own builder is BuildKit)
#   DEBIAN_MIRROR=...    for the stand-in (default http://deb.debian.org/debian)
set -euo pipefail
cd "$(dirname "$0")/.."

TAG=${TAG:-dev}
TARGETS=${TARGETS:-router operator server-cpu}
PY_IMAGE=${PY_IMAGE:-$(sed -n 's/^ARG PY_IMAGE=//p' Dockerfile)}
CA_BUNDLE=${CA_BUNDLE-${PIP_CERT:-}}
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
STANDIN=tandem/python-standin:3.11-bookworm
ROOTFS=tandem/debian-rootfs:bookworm

say() { printf 'build-images: %s\n' "$*" >&2; }
die() { say "$*"; exit 1; }
as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

pick_client() {
  local c major
  for c in ${DOCKER:-} docker /usr/bin/docker; do
    command -v "$c" >/dev/null 2>&1 || continue
    if "$c" buildx version >/dev/null 2>&1; then echo "$c buildx"; return; fi
    major=$("$c" --version 2>/dev/null | sed -n 's/^Docker version \([0-9]*\)\..*/\1/p')
    if [ -n "$major" ] && [ "$major" -lt 23 ]; then echo "$c"; return; fi
  done
  return 1
}

client=$(pick_client) || die "no docker client that builds with BuildKit: install Debian's docker.io (20.10) or the buildx plugin"
read -r D buildx <<<"$client"
"$D" info >/dev/null 2>&1 || die "no Docker engine answers ($D, ${DOCKER_HOST:-unix:///var/run/docker.sock}). Start one, e.g. as root: dockerd --iptables=false --bridge=none (Debian's docker.io)"

context=$(mktemp -d)  # the base targets' build context: nothing, or the CA bundle
rootfs=""             # debootstrap's folder while the stand-in is made (root's)
trap 'rm -rf "$context"; if [ -n "$rootfs" ]; then as_root rm -rf "$rootfs"; fi' EXIT

build() {  # docker build with BuildKit, on the host's network (a daemon may run without a bridge)
  if [ -n "${buildx:-}" ]; then "$D" buildx build --load --network host --progress plain "$@"
  else DOCKER_BUILDKIT=1 "$D" build --network host --progress plain "$@"; fi
}
has_image() { "$D" image inspect "$1" >/dev/null 2>&1; }
label() { "$D" image inspect -f "{{index .Config.Labels \"$2\"}}" "$1" 2>/dev/null || true; }

standin() {  # a stand-in for python:3.11-slim-bookworm from Debian's packages; reused while its recipe holds
  local recipe
  recipe=$(sha256sum docker/base.Dockerfile | cut -c1-16)
  if [ "$(label "$STANDIN" dev.tandem.recipe)" = "$recipe" ]; then return; fi
  if ! has_image "$ROOTFS"; then
    command -v debootstrap >/dev/null 2>&1 || { as_root apt-get update -qq
      as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap >/dev/null; }
    rootfs=$(mktemp -d)
    say "debootstrap bookworm from $DEBIAN_MIRROR"
    as_root debootstrap --variant=minbase bookworm "$rootfs" "$DEBIAN_MIRROR" >/dev/null
    # Left out: apt's downloaded packages and lists (every stage runs apt-get update first), manual
    # pages and translations.
    as_root tar -C "$rootfs" --exclude='./var/cache/apt/archives/*.deb' --exclude='./var/cache/apt/*.bin' \
      --exclude='./var/lib/apt/lists/*' --exclude='./usr/share/man/*' --exclude='./usr/share/info/*' \
      --exclude='./usr/share/locale/*' -c . | "$D" import - "$ROOTFS" >/dev/null
    as_root rm -rf "$rootfs" && rootfs=""
  fi
  build -f docker/base.Dockerfile --target standin --build-arg FROM_IMAGE="$ROOTFS" \
    --label dev.tandem.recipe="$recipe" -t "$STANDIN" "$context" >&2
}

base=$PY_IMAGE
if ! has_image "$PY_IMAGE" && ! "$D" pull -q "$PY_IMAGE" >/dev/null 2>&1; then
  say "$PY_IMAGE cannot be pulled: using a stand-in built from Debian's packages ($STANDIN)"
  standin
  base=$STANDIN
fi
if [ -n "$CA_BUNDLE" ]; then
  [ -f "$CA_BUNDLE" ] || die "CA_BUNDLE=$CA_BUNDLE: no such file"
  cp "$CA_BUNDLE" "$context/ca-bundle.crt"
  say "pip in the build trusts $CA_BUNDLE"
  build -f docker/base.Dockerfile --target trust --build-arg FROM_IMAGE="$base" -t tandem/python-base:trusted "$context" >&2
  base=tandem/python-base:trusted
fi

# torch's CPU wheel (not on PyPI): the machine's own, where pip finds one, goes into docker/wheels/.
args=(--build-arg "PY_IMAGE=$base")
torch=$(sed -n 's/.*torch==\([^ ]*+cpu\).*/\1/p' Dockerfile | head -n 1)
wheel="torch-$torch-cp311-cp311-manylinux_2_28_x86_64.whl"
if [ ! -f "docker/wheels/$wheel" ]; then
  for dir in ${PIP_FIND_LINKS:-} $(pip config get global.find-links 2>/dev/null || true); do
    if [ -f "$dir/$wheel" ]; then ln -f "$dir/$wheel" docker/wheels/ 2>/dev/null || cp "$dir/$wheel" docker/wheels/; break; fi
  done
fi
if [ -f "docker/wheels/$wheel" ]; then
  say "torch $torch from docker/wheels/$wheel"
  args+=(--build-arg TORCH_CPU_INDEX=https://pypi.org/simple)
fi

for target in $TARGETS; do
  start=$SECONDS
  say "building tandem/$target:$TAG"
  build --target "$target" -t "tandem/$target:$TAG" "${args[@]}" . >&2
  size=$("$D" image inspect -f '{{.Size}}' "tandem/$target:$TAG")
  say "tandem/$target:$TAG: $((size / 1000000)) MB, built in $((SECONDS - start)) s"
done
