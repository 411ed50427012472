#!/usr/bin/env bash
# The base image where no container registry is reachable: Debian bookworm (minbase, with CA
# certificates) from the Debian mirror, imported as a local image. Every pdserve image derives from
# it (BASE_IMAGE build argument); where a registry is reachable use debian:bookworm-slim instead.
#
#   scripts/build_base_image.sh [IMAGE]       (default local/debian:bookworm; needs root,
#                                              mmdebstrap and a Docker engine)
# Environment: PDSERVE_DEBIAN_MIRROR (default http://deb.debian.org/debian).
set -euo pipefail
image="${1:-local/debian:bookworm}"
mirror="${PDSERVE_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
security="${mirror%/debian}/debian-security"
if docker image inspect "$image" >/dev/null 2>&1; then
  echo "$image exists"
  exit 0
fi
command -v mmdebstrap >/dev/null || { echo "mmdebstrap is missing (apt-get install mmdebstrap)" >&2; exit 1; }
mmdebstrap --quiet --variant=minbase --include=ca-certificates bookworm - \
  "deb $mirror bookworm main" "deb $mirror bookworm-updates main" \
  "deb $security bookworm-security main" | docker import - "$image" >/dev/null
echo "$image built"
