#!/usr/bin/env bash
# System packages the tests and the demo use: Fashion-MNIST (Debian's dataset-fashion-mnist), the
# mosquitto broker, and chromium (the dashboard's headless browser test). Installs them with apt-get
# when running as root; otherwise says what to run.
set -euo pipefail
need=()
[ -d /usr/share/datasets/fashion-mnist ] || need+=(dataset-fashion-mnist)
command -v mosquitto >/dev/null 2>&1 || [ -x /usr/sbin/mosquitto ] || need+=(mosquitto)
command -v chromium >/dev/null 2>&1 || need+=(chromium)
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing ${need[*]} with apt-get"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
else
    echo "missing system packages: ${need[*]} — run: sudo apt-get install ${need[*]}" >&2
    echo "(tests that need them will fail with that message)" >&2
fi
