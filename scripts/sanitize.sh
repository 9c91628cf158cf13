#!/usr/bin/env bash
# Builds torch_p2p._C with AddressSanitizer + UndefinedBehaviorSanitizer in a throwaway copy of
# the working tree (the normal in-place build is left alone) and runs the CPU test suite with it.
#
#   scripts/sanitize.sh                 # tests/ without the slow marker
#   scripts/sanitize.sh tests/test_fuzz.py -k connect
#
# Python itself is not instrumented, so libasan is preloaded. Leak detection is off (the
# interpreter leaks by design) and so is alloc/dealloc-mismatch checking (torch and pybind11
# mix allocators legitimately). Every sanitizer report, of the test process or of any Peer
# child, is written to $WORK/reports/ and makes the script fail, even if pytest passed.
#
# Environment: MAX_JOBS (default 2), TORCH_P2P_SANITIZE_DIR (default: a new temp dir; kept
# afterwards for the build and the reports), KEEP=1 keeps a temp dir too.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
WORK=${TORCH_P2P_SANITIZE_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/torch_p2p_sanitize.XXXXXX")}
mkdir -p "$WORK/reports"
rm -f "$WORK"/reports/*
start=$(date +%s)

echo "== copying the working tree to $WORK"
cd "$ROOT"
git ls-files -z --cached --others --exclude-standard |
  tar --null --ignore-failed-read -T - -cf - 2>/dev/null | tar -xf - -C "$WORK"

echo "== building with -fsanitize=address,undefined"
cd "$WORK"
rm -f torch_p2p/_C*.so
TORCH_P2P_SANITIZE=1 MAX_JOBS=${MAX_JOBS:-2} python setup.py build_ext --inplace > "$WORK/build.log" 2>&1 ||
  { tail -40 "$WORK/build.log"; echo "sanitized build failed"; exit 2; }
built=$(date +%s)
echo "   built in $((built - start)) s"

LIBASAN=$(gcc -print-file-name=libasan.so)
[ -f "$LIBASAN" ] || { echo "libasan.so not found (gcc -print-file-name=libasan.so gave $LIBASAN)"; exit 2; }
ldd torch_p2p/_C*.so > "$WORK/ldd.txt" || true
grep -q libasan "$WORK/ldd.txt" || { echo "the extension is not linked with ASan"; exit 2; }

# libstdc++ too: the python binary does not link it, and ASan's __cxa_throw interceptor must
# find the real one when it starts ("CHECK failed: real___cxa_throw != 0" otherwise).
LIBSTDCXX=$(gcc -print-file-name=libstdc++.so.6)
export LD_PRELOAD="$LIBASAN $LIBSTDCXX"
export ASAN_OPTIONS=detect_leaks=0:alloc_dealloc_mismatch=0:log_path=$WORK/reports/asan:${ASAN_OPTIONS:-}
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1:log_path=$WORK/reports/ubsan:${UBSAN_OPTIONS:-}
export TORCH_P2P_SANITIZED=1

echo "== running the tests (LD_PRELOAD=$LD_PRELOAD)"
if [ $# -eq 0 ]; then set -- tests -m "not slow and not cuda"; fi
set +e
python -m pytest -q -p no:cacheprovider "$@"
status=$?
set -e
end=$(date +%s)

shopt -s nullglob
reports=("$WORK"/reports/*)
echo "== build $((built - start)) s, tests $((end - built)) s, total $((end - start)) s"
if [ ${#reports[@]} -gt 0 ]; then
  echo "== ${#reports[@]} sanitizer report(s):"
  for r in "${reports[@]}"; do echo "--- $r"; head -60 "$r"; done
  exit 1
fi
echo "== no sanitizer reports; pytest exit status $status"
[ -z "${TORCH_P2P_SANITIZE_DIR:-}" ] && [ -z "${KEEP:-}" ] && [ $status -eq 0 ] && rm -rf "$WORK"
exit $status
