#!/usr/bin/env bash
# Regenerates RELIABILITY.md in one run at one commit: the tests its rows
# cite (attacks, faults, routing, records, relays, HTTP and the API, and the
# unit tests of the limiters), every fuzz target, then the report rendered
# from tests/reliability.md.in with the figures the tests wrote.
#
#   bash scripts/reliability.sh                  fuzz targets 120 s each (~16 min in all, built)
#   FUZZ_SECONDS=600 bash scripts/reliability.sh longer fuzzing
#
# It fails, naming them, when a cited test failed or did not run or a figure
# is missing; RELIABILITY.md is written either way, marked where it is not
# whole. Run it as root on Debian/Ubuntu (like scripts/test.sh) with the
# default model fetched (`corolla fetch-model`): the rebalancing row uses it.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
source scripts/web-tools.sh
shared_build
"$CARGO_TARGET_DIR/debug/corolla" fetch-model >/dev/null

figures=tests/artifacts/reliability
# Figures of an earlier run must not stand in for this one's.
rm -rf "$figures"
mkdir -p "$figures"
failed=0

# The areas of the integration binary the rows cite, one test at a time
# where they measure speed (the figures are of an unloaded machine).
cargo test --locked -p corolla-tests --test integration -- \
    trust:: sources:: crowds:: routing:: protocol:: http:: api:: faults:: default_model::overlapping \
    --test-threads 1 2>&1 | tee "$figures/integration.log" || failed=1
# The limiters' and identity files' unit tests (every crate's, from the
# workspace build: one crate alone would build with other features).
cargo test --locked --workspace --lib -- quota:: identity:: relay_shares:: relay_reclaim:: fair_share:: handshake_shares:: address_limits:: api::admission:: record::tests peers:: api::error:: node::lookup::tests \
    2>&1 | tee "$figures/units.log" || failed=1
# Every decoder of untrusted bytes (needs a nightly toolchain; without one
# the fuzzing rows show as not measured).
bash scripts/fuzz.sh --seconds "${FUZZ_SECONDS:-120}" || failed=1

"$CARGO_TARGET_DIR/debug/corolla-bench" --reliability "$figures" --write RELIABILITY.md || failed=1
if [ "$failed" != 0 ]; then
    echo "RELIABILITY.md is not whole: see the messages above" >&2
    exit 1
fi
echo "RELIABILITY.md regenerated"
