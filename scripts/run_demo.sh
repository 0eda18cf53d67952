#!/usr/bin/env bash
# `make demo`: the whole pipeline on the embedded default recipe, publishing to a local Hub.
#
# The real Hub is out of reach here, so the demo starts tests/support/local_hub.py (the Hub stand-in the
# publish tests use, speaking the Hub's HTTP protocol) with a throw-away token, points the Hub client
# at it, runs `mxspec run`, and stops it. The published repo stays in runs/demo-hub/.
#
# The gate is the demo's result, not its failure: when it does not pass (the 135M reference target
# loses acceptance under MXFP4, see README), `mxspec run` publishes nothing and exits 1, as it would
# in CI; the demo then shows what publishing would upload (`mxspec publish --dry-run`) and exits 0.
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=.venv/bin
RECIPE=recipes/reference-cpu.toml
mkdir -p runs
token="demo-$(od -An -N12 -tx1 /dev/urandom | tr -d ' \n')"
LOCAL_HUB_TOKEN="$token" "$BIN/python" -m tests.support.local_hub --root runs/demo-hub >runs/demo-hub.url 2>runs/demo-hub.log &
hub=$!
trap 'kill "$hub" 2>/dev/null || true' EXIT
for _ in $(seq 100); do grep -q "listening" runs/demo-hub.url 2>/dev/null && break; sleep 0.1; done
url=$(sed -n 's/^local hub listening on //p' runs/demo-hub.url)
[ -n "$url" ] || { echo "error: the local Hub did not start (see runs/demo-hub.log)" >&2; exit 3; }
echo "local Hub at $url (repos in runs/demo-hub/)"
export HF_ENDPOINT="$url" HF_TOKEN="$token" HF_HUB_DISABLE_XET=1
"$BIN/mxspec" run "$RECIPE" --out runs/demo
status=$?
echo
echo "report: runs/demo/validate/report.md; gate: runs/demo/gate/summary.md"
if [ "$status" -eq 0 ]; then
  echo "published to the local Hub; card: runs/demo/publish/README.md"
elif [ "$status" -eq 1 ] && [ -f runs/demo/gate/verdict.json ]; then
  echo "the gate did not pass, so nothing was published (exit 1 in CI). What publishing would upload:"
  "$BIN/mxspec" publish "$RECIPE=runs/demo" --dry-run --force
  status=0
fi
echo "demo: ${SECONDS} s after install (the limit is 25 min from a fresh clone, install included)"
exit "$status"
