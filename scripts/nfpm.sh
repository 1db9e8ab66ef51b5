#!/bin/sh
# Builds nfpm VERSION into DEST (a file path) unless it is there: `go install` into a
# directory beside DEST, then a rename, under an flock on DEST.lock, so that an
# interrupted build leaves nothing that looks complete and two makes at once (make
# testbed, and make deb run by a packaging test) build it once.
#   scripts/nfpm.sh VERSION DEST
set -eu
version=$1 dest=$2
dir=$(dirname "$dest")
mkdir -p "$dir"
exec 9>"$dest.lock"
flock 9
[ -x "$dest" ] && exit 0
echo "nfpm: building nfpm $version into $dir"
start=$(date +%s)
rm -rf "$dir"/.tmp.*  # left by an interrupted build (no other build runs: we hold the lock)
tmp=$(mktemp -d "$dir/.tmp.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
GOBIN=$tmp go install "github.com/goreleaser/nfpm/v2/cmd/nfpm@$version"
mv "$tmp/nfpm" "$dest"
echo "nfpm: built in $(( $(date +%s) - start ))s: $dest"
