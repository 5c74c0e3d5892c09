#!/usr/bin/env bash
# Re-creates console/static/vendor/ from pinned npm packages: the admin console's front-end
# dependencies, shipped inside the Python package so `make demo` needs no Node and no network.
# Needs node + npm and the npm registry; run it only to change a version, then commit the result.
#
#   d3-array + d3-geo   map projection (d3-geo's UMD build expects d3-array on the same `d3` global)
#   topojson-client     decodes the world outline
#   world-atlas         Natural Earth 1:110m land outline as TopoJSON (public domain data, ISC package)
#   uplot               time-series charts of the tenants page
set -euo pipefail
PKGS=(d3-array@3.2.5 d3-geo@3.1.2 topojson-client@3.1.0 world-atlas@2.0.2 uplot@1.6.32)
here="$(cd "$(dirname "$0")/.." && pwd)"
dest="$here/console/static/vendor"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
( cd "$tmp" && npm init -y >/dev/null && npm install --no-audit --no-fund --ignore-scripts --save-exact "${PKGS[@]}" >/dev/null )
nm="$tmp/node_modules"
rm -rf "$dest"
mkdir -p "$dest/licenses"
cp "$nm/d3-array/dist/d3-array.min.js" "$dest/"
cp "$nm/d3-geo/dist/d3-geo.min.js" "$dest/"
cp "$nm/topojson-client/dist/topojson-client.min.js" "$dest/"
cp "$nm/world-atlas/land-110m.json" "$dest/"
cp "$nm/uplot/dist/uPlot.iife.min.js" "$dest/"
cp "$nm/uplot/dist/uPlot.min.css" "$dest/"
for p in d3-array d3-geo topojson-client world-atlas uplot; do
  lic="$(ls "$nm/$p" | grep -i -m1 -E '^licen[cs]e' || true)"
  [ -n "$lic" ] || { echo "no licence file in $p" >&2; exit 1; }
  cp "$nm/$p/$lic" "$dest/licenses/$p-LICENSE"
done
{
  echo "# Vendored by scripts/vendor_console.sh; do not edit by hand."
  for p in d3-array d3-geo topojson-client world-atlas uplot; do
    v="$(node -p "require('$nm/$p/package.json').version")"
    l="$(node -p "require('$nm/$p/package.json').license")"
    echo "$p $v $l"
  done
} > "$dest/VERSIONS"
echo "vendored into $dest:"; cat "$dest/VERSIONS"
