#!/usr/bin/env bash
# Run HERE (a Debian machine with a package registry): downloads the Debian packages the build
# needs and unpacks them into .deps/, which travels to a GPU machine that has no registry
# (see scripts/device_check.sh). .deps/ is git-ignored.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .deps && mkdir -p .deps/debs
(cd .deps/debs && apt-get download nlohmann-json3-dev libcli11-dev libyaml-cpp-dev libyaml-cpp0.7)
for d in .deps/debs/*.deb; do dpkg -x "$d" .deps; done
rm -rf .deps/debs
# The -dev package's libyaml-cpp.so is an absolute symlink; make it relative so it resolves there.
lib=.deps/usr/lib/x86_64-linux-gnu
ln -sf "$(basename "$(readlink -f $lib/libyaml-cpp.so.0.7 2>/dev/null || ls $lib/libyaml-cpp.so.0.7*)")" $lib/libyaml-cpp.so
echo "unpacked into .deps/"
