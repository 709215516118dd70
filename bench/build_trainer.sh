#!/usr/bin/env bash
# Build the benchmark peer, Kubeflow Trainer's controller manager, from the Go module proxy by exact
# version (never in CI: `make bench-peer` only). Binary and the module's CRDs + runtime manifests go
# to $CACHE/bin/kubeflow-trainer-<version>/ (outside the repo), skipped when already there.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
TRAINER_VERSION=${TRAINER_VERSION:-2.3.0}
CACHE=${MEGATRON_OPERATOR_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/megatron-operator}
GO=${GO:-go}
command -v "$GO" >/dev/null || { echo "build_trainer.sh: Go is required (go 1.26+); not found on PATH" >&2; exit 1; }
GOVER=$($GO env GOVERSION)
export GOTOOLCHAIN=local GOFLAGS=-mod=mod CGO_ENABLED=0
export GOCACHE=$CACHE/$GOVER/go-build GOMODCACHE=$CACHE/gomod
export GOPROXY=${GOPROXY_OVERRIDE:-https://proxy.golang.org}
dest=$CACHE/bin/kubeflow-trainer-$TRAINER_VERSION
if [ -x "$dest/trainer-controller-manager" ] && [ -d "$dest/manifests" ]; then
  echo "[bench] kubeflow trainer $TRAINER_VERSION: cached in $dest"; exit 0
fi
mod=github.com/kubeflow/trainer/v2
src=$CACHE/$GOVER/src/kubeflow-trainer-$TRAINER_VERSION
mkdir -p "$src" "$dest.tmp"; cd "$src"
t0=$SECONDS
if [ ! -f .resolved ]; then  # a throw-away main module that requires the controller manager
  printf 'module local/kubeflow_trainer\n\ngo 1.26\n' > go.mod; rm -f go.sum
  $GO get -tool "$mod/cmd/trainer-controller-manager@v$TRAINER_VERSION"
  touch .resolved
fi
nice -n 10 $GO build -trimpath -ldflags='-s -w' -o "$dest.tmp/trainer-controller-manager" "$mod/cmd/trainer-controller-manager"
# CRDs and the torch-distributed ClusterTrainingRuntime come from the same module zip.
moddir=$($GO list -m -f '{{.Dir}}' "$mod")
cp -r "$moddir/manifests" "$dest.tmp/manifests"; chmod -R u+w "$dest.tmp/manifests"
rm -rf "$dest"; mv "$dest.tmp" "$dest"
echo "[bench] kubeflow trainer $TRAINER_VERSION: built in $((SECONDS - t0)) s into $dest"
