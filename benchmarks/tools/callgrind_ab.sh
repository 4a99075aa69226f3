#!/bin/bash
# callgrind_ab.sh LIB which iters p tag -> instructions (Ir) a call of the collected loop (callgrind_loop.py):
# the overhead bench's add_layer_norm case under callgrind (load-independent: the VM has no hardware
# counters). LIB: the fastformer library (FASTFORMER_EXT_LIBRARY); which: direct / ff / torch; tag: a label.
# The Python package is this checkout's (callgrind_loop.py puts it first on sys.path). Writes
# /tmp/cg.<which>.<p>.<tag> (callgrind_annotate reads it). ~3-4 minutes a run at iters 10.
export FASTFORMER_EXT_LIBRARY=$1
HERE=$(cd "$(dirname "$0")" && pwd)
valgrind --tool=callgrind --collect-atstart=no --toggle-collect=_operator_call --callgrind-out-file=/tmp/cg.$2.$4.$5 /work/main/.venv/bin/python "$HERE/callgrind_loop.py" $2 $3 $4 2>&1 | grep -E "Collected" | awk -v w=$2 -v n=$3 -v t=$5 -v p=$4 '{gsub(",","",$4); print t, w, "p="p, $4/(2*n*16), "Ir/call"}'
