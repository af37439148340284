#!/usr/bin/env bash
# Run HERE (a Debian machine with a package registry): downloads the Debian packages the build
# needs and unpacks them into .deps/, which travels to a GPU machine that has no registry
# (see scripts/device_check.sh). .deps/ is git-ignored. pybind11-dev (headers and its CMake package,
# found through CMAKE_PREFIX_PATH) lets the build there make the Python package for its python3;
# pytest (pure Python, with what it needs) runs its tests when that python3 has no pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .deps && mkdir -p .deps/debs
(cd .deps/debs && apt-get download nlohmann-json3-dev libcli11-dev libyaml-cpp-dev libyaml-cpp0.7 pybind11-dev \
  python3-pytest python3-pluggy python3-iniconfig python3-packaging python3-attr)
for d in .deps/debs/*.deb; do dpkg -x "$d" .deps; done
rm -rf .deps/debs
# The -dev package's libyaml-cpp.so is an absolute symlink; make it relative so it resolves there.
lib=.deps/usr/lib/x86_64-linux-gnu
ln -sf "$(basename "$(readlink -f $lib/libyaml-cpp.so.0.7 2>/dev/null || ls $lib/libyaml-cpp.so.0.7*)")" $lib/libyaml-cpp.so
echo "unpacked into .deps/"
