#!/usr/bin/env bash
# Install the Debian/Ubuntu packages Tarantella-NT needs, and only those that are missing.
#   libgloo-dev            the Gloo library tnt-comm-gloo binds (headers + shared library)
#   cmake g++ make         build the tnt-comm-gloo native extension
#   dpkg-dev               `apt-get source` unpacks Gloo's Debian source package for the
#                          wheel build (ci/build-wheels.sh, `make wheels`)
#   openssh-server/client  the ssh launcher and its multi-node test (network namespaces)
#   iproute2               `ip netns` for that test
#   numactl                `tnt run --pin-to-socket`
# MPI needs nothing here: the `mpich` wheel from PyPI brings its own.
set -euo pipefail

packages=(libgloo-dev cmake g++ make dpkg-dev openssh-server openssh-client iproute2 numactl)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0

echo "installing system packages: ${missing[*]}"
if [ "$(id -u)" -eq 0 ]; then
  apt=(apt-get)
elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
  apt=(sudo apt-get)
else
  echo "error: missing system packages: ${missing[*]}" >&2
  echo "       run: sudo apt-get install -y ${missing[*]}   (then repeat this command)" >&2
  exit 1
fi
export DEBIAN_FRONTEND=noninteractive
"${apt[@]}" update -qq
"${apt[@]}" install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
