#!/usr/bin/env bash
# Build the stand-in for the vLLM engine image and publish it where the project's Dockerfile takes its
# base from: a local registry, so that it is pinned by tag AND digest exactly like the real image.
#
#   docker/standin/build.sh            prints the pin, `<registry>/vllm-standin:<tag>@sha256:...`
#
# Steps (each skipped when its result exists): debootstrap a Debian rootfs with Python, `docker import`
# it, build docker/standin/Dockerfile on it (CPU torch, vLLM without its dependencies), start a registry
# on localhost (Debian's docker-registry) and push. Only Debian's repositories and PyPI are reached.
#
# Environment: DOCKER (a client with BuildKit: Debian's /usr/bin/docker where the default client lacks
# buildx), STANDIN_CACHE (rootfs, wheels, registry storage; ~/.cache/eagle3build-standin),
# STANDIN_REGISTRY (localhost:5000), STANDIN_SUITE (bookworm), STANDIN_MIRROR, VLLM_VERSION (0.25.0),
# TORCH_REQ (torch==2.13.0: pip takes a local CPU wheel where pip's find-links offer one),
# PIP_CERT_FILE (a CA bundle handed to pip as a build secret; default: $PIP_CERT, else the system's bundle).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
DOCKER="${DOCKER:-docker}"
cache="${STANDIN_CACHE:-$HOME/.cache/eagle3build-standin}"
registry="${STANDIN_REGISTRY:-localhost:5000}"
suite="${STANDIN_SUITE:-bookworm}"
mirror="${STANDIN_MIRROR:-http://deb.debian.org/debian}"
vllm_version="${VLLM_VERSION:-0.25.0}"
torch_req="${TORCH_REQ:-torch==2.13.0}"
rootfs_image="eagle3build-standin-rootfs:$suite"
repo="$registry/vllm-standin"
tag="v$vllm_version"
log() { echo "standin: $*" >&2; }

mkdir -p "$cache/context/wheels"
cert="${PIP_CERT_FILE:-${PIP_CERT:-}}"
[ -n "$cert" ] || [ ! -s /etc/ssl/certs/ca-certificates.crt ] || cert=/etc/ssl/certs/ca-certificates.crt

# 1. The Debian rootfs, imported as an image (no registry has to serve a base image).
if ! "$DOCKER" image inspect "$rootfs_image" >/dev/null 2>&1; then
    if [ ! -s "$cache/rootfs-$suite.tar" ]; then
        log "debootstrap $suite (python3, venv) from $mirror"
        root="$(mktemp -d "$cache/rootfs.XXXXXX")"
        debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
            "$suite" "$root" "$mirror" >&2
        # Keep the host's apt settings for mirrors that serve a frozen snapshot (Release files past
        # their Valid-Until), so that apt-get inside the image works against the same mirror.
        cp /etc/apt/apt.conf.d/99artifact-registry "$root/etc/apt/apt.conf.d/" 2>/dev/null || true
        rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
        tar -C "$root" --numeric-owner -cf "$cache/rootfs-$suite.tar.tmp" .
        mv "$cache/rootfs-$suite.tar.tmp" "$cache/rootfs-$suite.tar"
        rm -rf "$root"
    fi
    log "docker import -> $rootfs_image"
    "$DOCKER" import --change 'CMD ["bash"]' "$cache/rootfs-$suite.tar" "$rootfs_image" >/dev/null
fi

# 2. The wheels: a CPU torch and vLLM (downloaded once; the build bind-mounts them).
wheels="$cache/context/wheels"
ls "$wheels"/torch-*.whl >/dev/null 2>&1 || python3 -m pip download --no-deps -d "$wheels" "$torch_req" >&2
ls "$wheels"/torch-*.whl | grep -q '+cpu' || log "warning: the torch wheel is not a +cpu build: $(ls "$wheels"/torch-*.whl)"
ls "$wheels"/vllm-"$vllm_version"-*.whl >/dev/null 2>&1 \
    || python3 -m pip download --no-deps -d "$wheels" "vllm==$vllm_version" >&2
cp "$here/Dockerfile" "$cache/context/Dockerfile"

# 3. The stand-in image: host networking for pip, the CA bundle as a secret (never in a layer).
secret=()
[ -n "$cert" ] && [ -s "$cert" ] && secret=(--secret "id=pip_cert,src=$cert")
log "docker build -> $repo:$tag"
DOCKER_BUILDKIT=1 "$DOCKER" build --network host "${secret[@]}" --build-arg "ROOTFS=$rootfs_image" \
    -t "$repo:$tag" "$cache/context" >&2

# 4. A registry on localhost: a digest exists only for an image a registry holds.
if ! curl -fsS "http://$registry/v2/" >/dev/null 2>&1; then
    mkdir -p "$cache/registry"
    cat > "$cache/registry.yml" <<YML
version: 0.1
storage:
  filesystem:
    rootdirectory: $cache/registry
  delete:
    enabled: true
http:
  addr: $registry
YML
    log "starting docker-registry on $registry"
    nohup docker-registry serve "$cache/registry.yml" > "$cache/registry.log" 2>&1 &
    for _ in $(seq 50); do curl -fsS "http://$registry/v2/" >/dev/null 2>&1 && break; sleep 0.2; done
fi
"$DOCKER" push "$repo:$tag" >&2
digest="$("$DOCKER" image inspect --format '{{range .RepoDigests}}{{println .}}{{end}}' "$repo:$tag" \
    | sed -n "s|^$repo@||p" | head -n1)"
[ -n "$digest" ] || { log "no digest for $repo:$tag after the push"; exit 1; }
echo "$repo:$tag@$digest"
