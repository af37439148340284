#!/usr/bin/env bash
# Installs the Debian packages moefq needs, only those missing (needs root or sudo).
set -euo pipefail
# chromium: the headless browser the HTML report test loads report.html in. python3-dev, pybind11-dev:
# the Python package (python/); python3-pytest, python3-numpy, python3-torch: its tests.
pkgs=(cmake g++ make libgtest-dev nlohmann-json3-dev libyaml-cpp-dev libcli11-dev clang libclang-rt-14-dev chromium
      python3-dev pybind11-dev python3-pytest python3-numpy python3-torch)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
echo "moefq: installing ${missing[*]}" >&2
sudo=""
[ "$(id -u)" -ne 0 ] && sudo="sudo"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
