#!/usr/bin/env bash
# `make test`'s runner: every test of the workspace, the #[ignore]d ones (root, etcd, namespace
# tools) included, then one summary line with the totals and the name of every test that did
# not run. A test that did not run is never counted as passed: besides the ones the harness
# reports as ignored, a test whose prerequisite is optional outside CI (the Docker engine) and
# missing records itself in $SPLIT_FELIX_NOT_RUN_FILE (integration::docker::not_run) and
# returns; the harness calls it passed, this script moves it to "not run".
set -uo pipefail
cd "$(dirname "$0")/.."
CARGO=${CARGO:-cargo}
log=$(mktemp)
not_run=$(mktemp)
trap 'rm -f "$log" "$not_run"' EXIT
export SPLIT_FELIX_NOT_RUN_FILE="$not_run"
"$CARGO" test --workspace --no-fail-fast "$@" -- --include-ignored 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
recorded=$(grep -c . "$not_run")
# "test result: ok. 12 passed; 0 failed; 1 ignored; 0 measured; 0 filtered out; …"
totals=$(awk -v r="$recorded" '/^test result:/ { p += $4; f += $6; i += $8 } END { printf "%d passed, %d failed, %d not run", p - r, f, i + r }' "$log")
echo "make test: $totals"
grep -E '^test .* \.\.\. ignored' "$log" | sed -E 's/^test (.*) \.\.\. ignored,? ?/  not run: \1: /'
sed -E 's/^/  not run: /' "$not_run"
if [ "$rc" -ne 0 ]; then
  grep -E '^test .* \.\.\. FAILED$' "$log" | sed -E 's/^test (.*) \.\.\. FAILED$/  failed: \1/'
fi
exit "$rc"
