#!/bin/sh
# Run a command with BUSY_LOOPS (default 2) busy-loop processes beside it, as on a machine whose cores
# other work keeps busy: `make test-under-load` runs the suite this way, which must still pass.
set -u
pids=""
i=0
while [ "$i" -lt "${BUSY_LOOPS:-2}" ]; do
    timeout 21600 python3 -c 'while 1: pass' &  # a bound for orphans only: the trap stops them when the command ends
    pids="$pids $!"
    i=$((i + 1))
done
trap 'kill $pids 2>/dev/null' EXIT INT TERM
"$@"
status=$?
exit $status
