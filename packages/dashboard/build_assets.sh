#!/usr/bin/env bash
# Refreshes the committed copy of the charting library after a change of
# frontend/package-lock.json: installs exactly the locked uPlot (npm checks the lockfile's
# integrity hash) and copies its minified build, CSS and licence into static/vendor.
# Commit the result; tests/packaging/test_vendored_uplot.py checks it against the lockfile.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
cd "$here/frontend"
npm ci --ignore-scripts --no-audit --no-fund --silent
dest="$here/src/nanotron_dashboard/static/vendor"
mkdir -p "$dest"
cp node_modules/uplot/dist/uPlot.iife.min.js node_modules/uplot/dist/uPlot.min.css "$dest/"
cp node_modules/uplot/LICENSE "$dest/uPlot.LICENSE"
rm -rf node_modules
echo "uPlot copied to $dest: commit it"
