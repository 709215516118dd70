#!/usr/bin/env bash
# Build the local test control plane from Go modules (Go module proxy only, no git, no Docker):
# etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kubectl, kwok, kwokctl, jobset, kueue,
# helm; on request promtool, versitygw (the S3 server of the object-storage tests), kubelet and coredns
# (the real node).
# Binaries land in $CACHE/bin/<component>-<version>/ and are skipped when already built.
# Prints how long each step took. `build.sh helm` (or any subset of: etcd kubernetes kwok jobset kueue
# helm promtool versitygw) builds only those components: the unit tests need helm, promtool and versitygw.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=versions.env
source "$here/versions.env"

CACHE=${MEGATRON_OPERATOR_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/megatron-operator}
GO=${GO:-go}
command -v "$GO" >/dev/null || { echo "build.sh: Go is required (go 1.26+); not found on PATH" >&2; exit 1; }
GOVER=$($GO env GOVERSION)
export GOTOOLCHAIN=local          # never download another toolchain: fail loudly instead
export GOFLAGS=-mod=mod
export CGO_ENABLED=0
export GOCACHE=$CACHE/$GOVER/go-build GOMODCACHE=$CACHE/gomod
export GOPROXY=${GOPROXY_OVERRIDE:-https://proxy.golang.org}   # proxy only: never fall back to git
SRC=$CACHE/$GOVER/src
mkdir -p "$GOCACHE" "$GOMODCACHE" "$SRC"

step() { # step NAME DESTDIR BINARIES... -- COMMAND...
  local name=$1 dest=$2; shift 2
  local bins=()
  while [ "$1" != "--" ]; do bins+=("$1"); shift; done; shift
  local missing=0
  for b in "${bins[@]}"; do [ -x "$dest/$b" ] || missing=1; done
  if [ $missing = 0 ]; then echo "[build] $name: cached in $dest"; return; fi
  local t0=$SECONDS
  echo "[build] $name: building into $dest"
  mkdir -p "$dest.tmp"
  "$@"
  rm -rf "$dest"; mv "$dest.tmp" "$dest"
  echo "[build] $name: done in $((SECONDS - t0)) s"
}

wrapper() { # wrapper DIR MODULE@VERSION...: a throw-away main module that requires the tools
  local d=$SRC/$1; shift
  mkdir -p "$d"; cd "$d"
  if [ ! -f .resolved ]; then   # marker: a failed `go get` must not leave a half-resolved go.mod behind
    printf 'module local/%s\n\ngo 1.26\n' "$(basename "$d" | tr -c 'a-z0-9\n' _)" > go.mod; rm -f go.sum
    if [ -f go.sum.seed ]; then cp go.sum.seed go.sum; fi   # a main module's go.sum to start from
    $GO get -tool "$@"
    touch .resolved
  fi
}

build_etcd() {
  # etcd's server go.mod has replace directives, so `go install pkg@v` refuses it: use a wrapper module.
  wrapper "etcd-$ETCD_VERSION" "go.etcd.io/etcd/server/v3@v$ETCD_VERSION"
  $GO build -trimpath -ldflags='-s -w' -o "$BIN_DIR.tmp/etcd" go.etcd.io/etcd/server/v3
}

# A main module that requires k8s.io/kubernetes at $KUBE_VERSION and the given commands as tools.
kube_module() { # kube_module DIR CMD...
  local d=$SRC/$1; shift; mkdir -p "$d"; cd "$d"
  local minor=${KUBE_VERSION#1.} cmd tools=()
  if [ ! -f .resolved ]; then
    printf 'module local/k8sbuild\n\ngo 1.26\n' > go.mod; rm -f go.sum
    local up; up=$($GO mod download -json "k8s.io/kubernetes@v$KUBE_VERSION" | python3 -c 'import json,sys;print(json.load(sys.stdin)["GoMod"])')
    grep '^godebug' "$up" >> go.mod || true
    # k8s.io/kubernetes requires its staging modules at v0.0.0 through replace directives that
    # consumers ignore: map each one to its published v0.<minor>.<patch>.
    for m in $(sed -n 's#^[[:space:]]*\(k8s\.io/[^ ]*\) => \./staging/src/.*#\1#p' "$up"); do
      $GO mod edit -replace="$m=$m@v0.$minor"
    done
    for cmd in "$@"; do tools+=("k8s.io/kubernetes/cmd/$cmd@v$KUBE_VERSION"); done
    $GO get -tool "${tools[@]}"
    touch .resolved
  fi
}

kube_build() { # kube_build CMD...: the commands, with the version stamped as upstream does
  local minor=${KUBE_VERSION#1.} p='-X k8s.io/component-base/version' c='-X k8s.io/client-go/pkg/version' kv cmd pkgs=()
  local flags="-s -w"
  for kv in "gitVersion=v$KUBE_VERSION" "gitMajor=1" "gitMinor=${minor%%.*}" "gitTreeState=clean" "buildDate=1970-01-01T00:00:00Z"; do
    flags="$flags $p.$kv $c.$kv"
  done
  for cmd in "$@"; do pkgs+=("k8s.io/kubernetes/cmd/$cmd"); done
  $GO build -trimpath -ldflags "$flags" -o "$BIN_DIR.tmp/" "${pkgs[@]}"
}

build_kube() {
  kube_module "kubernetes-$KUBE_VERSION" kube-apiserver kube-controller-manager kube-scheduler kubectl
  kube_build kube-apiserver kube-controller-manager kube-scheduler kubectl
}

# The real node (e2e/cluster/node.py): the kubelet from the same Kubernetes modules. Built only on request.
build_kubelet() {
  kube_module "kubelet-$KUBE_VERSION" kubelet
  kube_build kubelet
}

build_install() { # go install MODULE/PKG@VERSION... into $BIN_DIR.tmp
  GOBIN=$BIN_DIR.tmp $GO install -trimpath -ldflags="${LDFLAGS:--s -w}" "$@"
}

# `go install m@v` also reads the module's version list (deprecation check), and this proxy answers
# 403 for the lists of jobset and helm: build those from a wrapper module with `go get -tool` instead.
build_jobset() {
  wrapper "jobset-$JOBSET_VERSION" "sigs.k8s.io/jobset@v$JOBSET_VERSION"
  $GO build -trimpath -ldflags="-s -w -X sigs.k8s.io/jobset/pkg/version.GitVersion=v$JOBSET_VERSION" \
    -o "$BIN_DIR.tmp/jobset" sigs.k8s.io/jobset
}

# Kueue's list is refused too (`go list -m -versions sigs.k8s.io/kueue`: 403): same route as JobSet.
build_kueue() {
  # Kueue >= 0.19 requires sigs.k8s.io/scheduler-library v0.1.0-alpha1, which the checksum database
  # does not know (lookup: 404). Its hash is in Kueue's own go.sum, which the checksum database
  # authenticates with Kueue's module: the throw-away module starts from that go.sum.
  local d=$SRC/kueue-$KUEUE_VERSION
  if [ ! -f "$d/.resolved" ]; then
    $GO mod download "sigs.k8s.io/kueue@v$KUEUE_VERSION"
    mkdir -p "$d"
    cp "$GOMODCACHE/sigs.k8s.io/kueue@v$KUEUE_VERSION/go.sum" "$d/go.sum.seed"
  fi
  wrapper "kueue-$KUEUE_VERSION" "sigs.k8s.io/kueue/cmd/kueue@v$KUEUE_VERSION"
  $GO build -trimpath -ldflags="-s -w -X sigs.k8s.io/kueue/pkg/version.GitVersion=v$KUEUE_VERSION" \
    -o "$BIN_DIR.tmp/kueue" sigs.k8s.io/kueue/cmd/kueue
}

build_helm() {
  local major=${HELM_VERSION%%.*}
  wrapper "helm-$HELM_VERSION" "helm.sh/helm/v$major/cmd/helm@v$HELM_VERSION"
  $GO build -trimpath -ldflags="-s -w -X helm.sh/helm/v$major/internal/version.version=v$HELM_VERSION" \
    -o "$BIN_DIR.tmp/helm" "helm.sh/helm/v$major/cmd/helm"
}

build_promtool() {
  # remove_all_sd: no service-discovery plugins (`promtool test rules` needs none; the proxy refuses
  # the pseudo-version of github.com/hashicorp/nomad/api that the Nomad plugin pins).
  GOFLAGS="$GOFLAGS -tags=remove_all_sd" wrapper "promtool-$PROMETHEUS_MODULE_VERSION" \
    "github.com/prometheus/prometheus/cmd/promtool@v$PROMETHEUS_MODULE_VERSION"
  $GO build -tags=remove_all_sd -trimpath -ldflags="-s -w" -o "$BIN_DIR.tmp/promtool" \
    github.com/prometheus/prometheus/cmd/promtool
}

# Argo CD (e2e/test_argocd.py): the one multicall binary of github.com/argoproj/argo-cd/v3/cmd,
# which picks argocd-application-controller / argocd-repo-server / the argocd CLI by argv[0];
# the two servers are links to it. Its go.mod has replace directives (k8s.io staging modules at
# the version Argo CD tested, protobuf, yaml) that a consumer ignores: the throw-away module
# repeats them, and starts from Argo CD's go.sum as Kueue's does.
build_argocd() {
  local d=$SRC/argocd-$ARGOCD_VERSION mod=github.com/argoproj/argo-cd/v3 up
  mkdir -p "$d"; cd "$d"
  if [ ! -f .resolved ]; then   # as wrapper(), with Argo CD's replace block and go.sum
    up=$($GO mod download -json "$mod@v$ARGOCD_VERSION" | python3 -c 'import json,sys;print(json.load(sys.stdin)["Dir"])')
    printf 'module local/argocd\n\ngo 1.26\n\n' > go.mod
    sed -n '/^replace (/,/^)/p' "$up/go.mod" >> go.mod
    cp "$up/go.sum" go.sum
    $GO get -tool "$mod/cmd@v$ARGOCD_VERSION"
    touch .resolved
  fi
  $GO build -trimpath -ldflags="-s -w -X $mod/common.version=$ARGOCD_VERSION -X $mod/common.gitTag=v$ARGOCD_VERSION -X $mod/common.gitTreeState=clean -X $mod/common.buildDate=1970-01-01T00:00:00Z" \
    -o "$BIN_DIR.tmp/argocd" "$mod/cmd"
  ln -s argocd "$BIN_DIR.tmp/argocd-application-controller"
  ln -s argocd "$BIN_DIR.tmp/argocd-repo-server"
}

# Cluster DNS for the real node's pods (node.py): e2e/cluster/coredns/main.go, which imports the plugins it
# serves with (kubernetes, cache, bind, health, ready, errors, log) from CoreDNS's module, built as a throw-away
# main module like the others. Built only on request, as the kubelet is.
build_coredns() {
  local d=$SRC/coredns-$COREDNS_VERSION
  mkdir -p "$d"; cp "$here/coredns/main.go" "$d/main.go"; cd "$d"
  if [ ! -f .resolved ]; then
    printf 'module local/coredns\n\ngo 1.26\n' > go.mod; rm -f go.sum
    $GO get "github.com/coredns/coredns@v$COREDNS_VERSION"
    $GO mod tidy
    touch .resolved
  fi
  $GO build -trimpath -ldflags="-s -w -X github.com/coredns/coredns/coremain.GitCommit=v$COREDNS_VERSION" \
    -o "$BIN_DIR.tmp/coredns" .
}

build_versitygw() {
  # The S3 server of the object-storage checkpoint tests (no replace directives in its go.mod, but the
  # wrapper route keeps the proxy's version list out of it, as for jobset).
  wrapper "versitygw-$VERSITYGW_VERSION" "github.com/versity/versitygw/cmd/versitygw@v$VERSITYGW_VERSION"
  $GO build -trimpath -ldflags="-s -w" -o "$BIN_DIR.tmp/versitygw" github.com/versity/versitygw/cmd/versitygw
}

total0=$SECONDS
echo "[build] cache: $CACHE ($GOVER)"
wanted=${*:-etcd kubernetes kwok jobset kueue helm}
[ "${BUILD_HELM:-1}" = 1 ] || wanted=${wanted//helm/}   # BUILD_HELM=0 skips helm (needed by e2e/test_helm.py)
for c in $wanted; do
  case $c in
    etcd)       BIN_DIR=$CACHE/bin/etcd-$ETCD_VERSION;       step etcd "$BIN_DIR" etcd -- build_etcd ;;
    kubernetes) BIN_DIR=$CACHE/bin/kubernetes-$KUBE_VERSION; step kubernetes "$BIN_DIR" kube-apiserver kube-controller-manager kube-scheduler kubectl -- build_kube ;;
    kwok)       BIN_DIR=$CACHE/bin/kwok-$KWOK_VERSION;       step kwok "$BIN_DIR" kwok kwokctl -- build_install "sigs.k8s.io/kwok/cmd/kwok@v$KWOK_VERSION" "sigs.k8s.io/kwok/cmd/kwokctl@v$KWOK_VERSION" ;;
    jobset)     BIN_DIR=$CACHE/bin/jobset-$JOBSET_VERSION;   step jobset "$BIN_DIR" jobset -- build_jobset ;;
    kueue)      BIN_DIR=$CACHE/bin/kueue-$KUEUE_VERSION;     step kueue "$BIN_DIR" kueue -- build_kueue ;;
    helm)       BIN_DIR=$CACHE/bin/helm-$HELM_VERSION;       step helm "$BIN_DIR" helm -- build_helm ;;
    promtool)   BIN_DIR=$CACHE/bin/promtool-$PROMETHEUS_MODULE_VERSION; step promtool "$BIN_DIR" promtool -- build_promtool ;;
    versitygw)  BIN_DIR=$CACHE/bin/versitygw-$VERSITYGW_VERSION; step versitygw "$BIN_DIR" versitygw -- build_versitygw ;;
    kubelet)    BIN_DIR=$CACHE/bin/kubelet-$KUBE_VERSION;    step kubelet "$BIN_DIR" kubelet -- build_kubelet ;;
    coredns)    # keyed by main.go too (the plugins it imports): node.py's coredns_binary() computes the same name
                BIN_DIR=$CACHE/bin/coredns-$COREDNS_VERSION-$(sha256sum "$here/coredns/main.go" | cut -c1-12)
                step coredns "$BIN_DIR" coredns -- build_coredns ;;
    argocd)     BIN_DIR=$CACHE/bin/argocd-$ARGOCD_VERSION;   step argocd "$BIN_DIR" argocd argocd-application-controller argocd-repo-server -- build_argocd ;;
    *) echo "build.sh: unknown component '$c' (etcd kubernetes kwok jobset kueue helm promtool versitygw kubelet coredns argocd)" >&2; exit 2 ;;
  esac
done
echo "[build] $(echo $wanted) ready in $((SECONDS - total0)) s"
