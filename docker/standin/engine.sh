#!/usr/bin/env bash
# A Docker engine on a machine without systemd (run as root): Debian's docker.io (the daemon and a client
# with BuildKit), debootstrap and docker-registry where missing, then dockerd started by hand when no
# engine answers. Prints the client to use: the default `docker` when it has buildx, else Debian's
# /usr/bin/docker (BuildKit through DOCKER_BUILDKIT=1).
set -euo pipefail
log() { echo "engine: $*" >&2; }

missing=()
command -v dockerd >/dev/null || missing+=(docker.io)
command -v debootstrap >/dev/null || missing+=(debootstrap)
command -v docker-registry >/dev/null || missing+=(docker-registry)
command -v curl >/dev/null || missing+=(curl)
if [ "${#missing[@]}" -gt 0 ]; then
    log "apt-get install ${missing[*]}"
    apt-get update -q >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >&2
fi

client=docker
docker buildx version >/dev/null 2>&1 || client=/usr/bin/docker
if ! timeout 20 "$client" info >/dev/null 2>&1; then
    log "starting dockerd (log: /var/log/dockerd.log)"
    nohup dockerd > /var/log/dockerd.log 2>&1 &
    for _ in $(seq 60); do timeout 5 "$client" info >/dev/null 2>&1 && break; sleep 0.5; done
    timeout 20 "$client" info >/dev/null 2>&1 || { log "dockerd did not start: see /var/log/dockerd.log"; exit 1; }
fi
echo "$client"
