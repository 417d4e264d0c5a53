#!/usr/bin/env bash
# Namespace hosts on this machine (root): separate network, /dev/shm and hostname each, on a private bridge.
#   scripts/hosts.sh up N [TAG]          -> prints TAG; hosts stay until `down TAG`
#   scripts/hosts.sh run TAG HOST -- CMD -> CMD inside host HOST (GLOO_SOCKET_IFNAME, MASTER_ADDR set)
#   scripts/hosts.sh link TAG HOST down  -> takes HOST off the network (up: back)
#   scripts/hosts.sh down TAG            -> kills every process of the hosts, deletes the namespaces
#   scripts/hosts.sh each N -- CMD       -> N hosts, CMD in each (HOST_INDEX set), torn down after
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] && PYTHON=.venv/bin/python
exec env PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$PYTHON" -m mtdeepep.utils.hosts "$@"
