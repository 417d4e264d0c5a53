#!/usr/bin/env bash
# The main job: set-up (scripts/env.sh), then the intranode benchmark at 2 and 4 CPU ranks with its plot.
# Extra arguments go to bench/intranode.py (e.g. --num-ranks 4).
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
python bench/intranode.py --plot "$@"
