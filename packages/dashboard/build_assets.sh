#!/usr/bin/env bash
# Installs the pinned charting library (package-lock.json) and copies it into the package's
# static folder, which is git-ignored: the server refuses to start without it.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
cd "$here/frontend"
npm ci --ignore-scripts --no-audit --no-fund --silent
dest="$here/src/nanotron_dashboard/static/vendor"
mkdir -p "$dest"
cp node_modules/uplot/dist/uPlot.iife.min.js node_modules/uplot/dist/uPlot.min.css "$dest/"
cp node_modules/uplot/LICENSE "$dest/uPlot.LICENSE" 2>/dev/null || true
echo "uPlot copied to $dest"
