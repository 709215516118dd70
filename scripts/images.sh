#!/usr/bin/env bash
# Build the operator and trainer images without Docker: buildah (chroot isolation, no daemon) on
# locally assembled stand-in bases, with Python packages from a wheelhouse that pip prepares on
# the host. The image builds themselves need no network. docs/install.md says how the stand-in
# base differs from python:3.12-slim; docs/benchmarks/images.md#2026-11-23-images-and-real-node has the
# measured times and sizes.
#
#   scripts/images.sh tools                 install buildah, podman, runc, mmdebstrap (root) or say which
#   scripts/images.sh base                  the stand-in base image (cached tarball)
#   scripts/images.sh operator              megatron-operator:dev  (wheelhouse of the operator extra)
#   scripts/images.sh trainer               megatron-trainer:dev   (wheelhouse of the trainer extra, torch),
#                                           then check-trainer: --help and preprocess as uid 1000
#
# Caches live outside the repository, keyed by version: $CACHE/images/base-<suite>-py<version>-<key>.tar
# and $CACHE/wheelhouse/<extra>-py<version>-<key>/ (key: a hash of what feeds them).
set -euo pipefail
cd "$(dirname "$0")/.."

CACHE=${MEGATRON_OPERATOR_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/megatron-operator}
SUITE=bookworm                       # python:3.12-slim's Debian release
TAG=${IMAGE_TAG:-dev}
BASE_RECIPE=2                        # bump when cmd_base changes what goes into the base
TOOLS_PACKAGES="buildah podman runc mmdebstrap"
# Runtime libraries of CPython's extension modules, and what python:3.12-slim also carries.
BASE_PACKAGES="ca-certificates,netbase,tzdata,libssl3,libffi8,libsqlite3-0,libbz2-1.0,liblzma5,zlib1g,libexpat1,libuuid1,libncursesw6,libreadline8,libnsl2,libtirpc3,libcrypt1"

log() { echo "[images] $*" >&2; }
die() { echo "images: $*" >&2; exit 1; }

key_of() { cat "$@" | sha256sum | cut -c1-12; }

cmd_tools() {
  local missing=()
  for tool in $TOOLS_PACKAGES; do command -v "$tool" >/dev/null || missing+=("$tool"); done
  [ ${#missing[@]} = 0 ] && { log "tools: $TOOLS_PACKAGES present"; return; }
  if [ "$(id -u)" != 0 ]; then
    die "missing ${missing[*]}; install the Debian packages as root:
  apt-get install --no-install-recommends $TOOLS_PACKAGES
then run the command again."
  fi
  command -v apt-get >/dev/null || die "missing ${missing[*]} and no apt-get here; install the packages $TOOLS_PACKAGES with your distribution's package manager"
  log "tools: installing $TOOLS_PACKAGES (apt-get)"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $TOOLS_PACKAGES >/dev/null
}

# The CPython that find-python.sh resolves (the same 3.12 CI and the virtualenvs use).
host_python() { scripts/find-python.sh; }
python_version() { "$1" -c 'import platform; print(platform.python_version())'; }

# Stand-in for python:3.12-slim: Debian $SUITE minbase (mmdebstrap) + this machine's CPython 3.12
# copied to /usr/local (Debian has no python3.12 package). Prints the image name.
cmd_base() {
  local py prefix version key tarball image root
  py=$(host_python); version=$(python_version "$py")
  prefix=$("$py" -c 'import sys; print(sys.base_prefix)')
  [[ $version == 3.12.* ]] || die "the stand-in base needs CPython 3.12, found $version at $py"
  key=$(key_of <(echo "$BASE_RECIPE $SUITE $BASE_PACKAGES $version") "$prefix/bin/python${version%.*}")
  tarball=$CACHE/images/base-$SUITE-py$version-$key.tar
  image=localhost/megatron-operator-base/python:$version-slim-$SUITE-standin
  if [ ! -f "$tarball" ]; then
    log "base: mmdebstrap $SUITE minbase + CPython $version from $prefix"
    mkdir -p "$CACHE/images"
    root=$(mktemp -d "$CACHE/images/rootfs.XXXXXX")
    trap 'rm -rf "$root"' RETURN
    # The path excludes are debian:bookworm-slim's (no man pages, docs or translations).
    mmdebstrap --quiet --variant=minbase --include="$BASE_PACKAGES" \
      --dpkgopt='path-exclude=/usr/share/man/*' --dpkgopt='path-exclude=/usr/share/info/*' \
      --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
      --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/groff/*' \
      --dpkgopt='path-exclude=/usr/share/lintian/*' \
      --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*' \
      "$SUITE" "$root/rootfs" >&2
    # The interpreter, its standard library and headers; no tests, no IDLE/tkinter, nothing from
    # the host's site-packages. pip comes from the interpreter's own bundled wheel (ensurepip).
    local minor=${version%.*}
    tar -C "$prefix" -c \
      --exclude="lib/python$minor/test" --exclude="lib/python$minor/idlelib" \
      --exclude="lib/python$minor/tkinter" --exclude="lib/python$minor/turtledemo" \
      --exclude="lib/python$minor/site-packages/*" --exclude='__pycache__' \
      --exclude="lib/python$minor/config-$minor-*/*.a" --exclude='bin/pip*' --exclude='bin/idle*' \
      bin include lib | tar -C "$root/rootfs/usr/local" -x
    # Scripts keep the host prefix in their #! line; point them at /usr/local.
    grep -lr "^#!$prefix" "$root/rootfs/usr/local/bin" | xargs -r sed -i "1s|^#!$prefix/bin/|#!/usr/local/bin/|"
    # Without debug symbols, as in python:3.12-slim.
    find "$root/rootfs/usr/local" -name '*.so*' -type f -exec strip --strip-unneeded {} +
    strip --strip-unneeded "$root/rootfs/usr/local/bin/python$minor"
    chroot "$root/rootfs" /sbin/ldconfig
    chroot "$root/rootfs" /usr/local/bin/python3 -m ensurepip --default-pip >/dev/null
    find "$root/rootfs/usr/local" -name __pycache__ -prune -exec rm -rf {} +
    chroot "$root/rootfs" /usr/local/bin/python3 -c 'import ssl, sqlite3, ctypes, lzma, bz2, zlib, uuid, readline' \
      || die "the stand-in base's CPython cannot load its extension modules"
    tar -C "$root/rootfs" --numeric-owner -cf "$tarball.part" . && mv "$tarball.part" "$tarball"
    find "$CACHE/images" -maxdepth 1 -name "base-$SUITE-py*.tar" ! -path "$tarball" -delete   # superseded keys
  fi
  if ! podman image exists "$image" || [ "$(podman image inspect -f '{{index .Labels "key"}}' "$image" 2>/dev/null)" != "$key" ]; then
    log "base: importing $tarball as $image"
    podman import --quiet \
      --change 'ENV PATH=/usr/local/bin:/usr/local/sbin:/usr/sbin:/usr/bin:/sbin:/bin' \
      --change 'ENV LANG=C.UTF-8' --change "ENV PYTHON_VERSION=$version" \
      --change "LABEL key=$key" --change 'CMD ["python3"]' \
      "$tarball" "$image" >/dev/null
  fi
  echo "$image"
}

# pip wheel of an extra's dependencies (and the build backend) into a cache keyed by the inputs.
# Prints the directory.
# The trainer's pins are its own (constraints-trainer.txt: multi-storage-client's boto3 needs
# python-dateutil<3, the operator's kubernetes client >=3; the trainer image has no Kubernetes client).
wheelhouse() {
  local extra=$1 py version key dir constraints=constraints.txt
  [ "$extra" = trainer ] && constraints=constraints-trainer.txt
  py=$(host_python); version=$(python_version "$py")
  key=$(key_of "$constraints" pyproject.toml <(echo "$extra $version"))
  dir=$CACHE/wheelhouse/$extra-py$version-$key
  if [ ! -f "$dir/.complete" ]; then
    log "wheelhouse: pip wheel '.[$extra]' ($constraints) into $dir"
    rm -rf "$dir" && mkdir -p "$dir"
    "$py" -m pip wheel --quiet --disable-pip-version-check --wheel-dir "$dir" \
      --constraint "$constraints" ".[$extra]" 'setuptools>=68' wheel >&2
    rm -f "$dir"/megatron_operator-*.whl   # the project itself is built inside the image
    touch "$dir/.complete"
    find "$CACHE/wheelhouse" -mindepth 1 -maxdepth 1 -name "$extra-py*" ! -path "$dir" -exec rm -rf {} +   # superseded keys
  fi
  echo "$dir"
}

# buildah bud of one Dockerfile on the stand-in base, pip offline from the wheelhouse.
build() {
  local name=$1 dockerfile=$2 base_arg=$3 extra=$4 base wheels start since previous
  base=$(cmd_base); wheels=$(wheelhouse "$extra")
  log "build: $name:$TAG from $dockerfile (base $base, wheelhouse $wheels)"
  start=$SECONDS since=$(date +%s)
  previous=$(podman image inspect -f '{{.Id}}' "localhost/$name:$TAG" 2>/dev/null || true)
  buildah bud --quiet --isolation chroot --layers \
    --build-arg "$base_arg=$base" --build-arg WHEELHOUSE=/wheelhouse \
    --volume "$wheels:/wheelhouse:ro" \
    -f "$dockerfile" -t "localhost/$name:$TAG" . >&2
  log "build: localhost/$name:$TAG in $((SECONDS - start)) s, $(podman image inspect -f '{{.Size}}' "localhost/$name:$TAG") bytes"
  drop_superseded "$previous" "localhost/$name:$TAG" "$since"
}

# A rebuild that moved the tag leaves the old image behind, and with it the build stage's layer-cache
# images, which no tagged image holds (a multi-stage build): ~170 MB of disk a rebuild, and CI rebuilds on
# every run (171 images, 5.1 GB seen, then a full disk). So once the tag has moved, the untagged images made
# before this build from our stand-in base (its `key` label) go; this build's own cache stays, and so
# does anyone else's image. One still in use (a running container) stays too.
drop_superseded() { # drop_superseded OLD_ID TAG BUILD_START_EPOCH
  local old=$1 tag=$2 since=$3 key
  [ -n "$old" ] && [ "$old" != "$(podman image inspect -f '{{.Id}}' "$tag")" ] || return 0
  key=$(podman image inspect -f '{{index .Labels "key"}}' "$tag")
  [ -n "$key" ] || return 0
  podman image prune --force --filter "label=key=$key" --filter "until=$since" >/dev/null \
    || log "build: could not remove the images $tag superseded (podman image prune)"
}

# podman as a kubelet would run the image: runc (crun refuses this machine's hybrid cgroup v1),
# explicit limits (the sandbox refuses to raise RLIMIT_NPROC), no passwd entry added, no network.
run_image() { # run_image UID IMAGE ARGS...
  local uid=$1; shift
  podman --runtime runc run --rm --read-only --user "$uid" --passwd=false --network none \
    --ulimit nproc=4096:4096 --ulimit nofile=20000:20000 --tmpfs /tmp:rw,size=256m,mode=1777 "$@"
}

# The trainer image as uid 1000: its CLI, and `preprocess` of a small JSONL corpus with a tokenizer
# trained in the container, read back with the trainer's own IndexedDataset reader.
check_trainer() {
  local image=localhost/megatron-trainer:$TAG
  run_image 1000 --entrypoint python "$image" -m megatron_trainer --help >/dev/null \
    || die "python -m megatron_trainer --help failed in $image"
  run_image 1000 --entrypoint python "$image" -c '
import json, os, subprocess, sys
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from megatron_trainer.indexed import read_indexed_dataset
texts = [f"document {i}: the quick brown fox jumps over the lazy dog" for i in range(50)]
tok = Tokenizer(models.BPE(unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<|endoftext|>"]))
os.makedirs("/tmp/tok"); os.makedirs("/tmp/out")
tok.save("/tmp/tok/tokenizer.json")
with open("/tmp/docs.jsonl", "w") as f:
    f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
subprocess.run([sys.executable, "-m", "megatron_trainer", "preprocess", "--input", "/tmp/docs.jsonl",
                "--output-prefix", "/tmp/out/corpus", "--tokenizer-model", "/tmp/tok", "--append-eod"], check=True)
view = read_indexed_dataset("/tmp/out/corpus_text_document")
assert len(view.sequence_lengths) == len(texts), len(view.sequence_lengths)
eod = tok.token_to_id("<|endoftext|>")
assert all(int(view.sequence(i)[-1]) == eod for i in range(len(texts)))
print(f"preprocess as uid {os.getuid()}: {len(texts)} documents, {int(view.sequence_lengths.sum())} tokens")
' || die "preprocess failed in $image"
  # multi-storage-client with boto3 (object-storage checkpoints and exports): a client built the
  # trainer's way; with no network, the store is unreachable and the error classified as retriable.
  run_image 1000 --entrypoint python "$image" -c '
import os
with open("/tmp/credentials", "w") as f:
    f.write("[default]\naws_access_key_id = a\naws_secret_access_key = b\n")
os.environ.update(AWS_SHARED_CREDENTIALS_FILE="/tmp/credentials", AWS_CONFIG_FILE="/tmp/none", AWS_MAX_ATTEMPTS="1")
import boto3, multistorageclient
from megatron_trainer.objstore import MscStore, ObjectStoreError, configure
store = MscStore(configure("s3://ckpt-bucket/run", "http://127.0.0.1:9", "us-east-1"))
try:
    store.ensure_root()
except ObjectStoreError as e:
    assert e.retriable, e
    print(f"multi-storage-client {multistorageclient.__version__}, boto3 {boto3.__version__}: {str(e)[:90]}")
else:
    raise SystemExit("an unreachable store answered")
' || die "the object-store client failed in $image"
}

case ${1:-} in
  tools) cmd_tools ;;
  base) cmd_tools; cmd_base ;;
  wheelhouse) wheelhouse "${2:?extra}" ;;
  operator) cmd_tools; build megatron-operator Dockerfile.operator PYTHON_IMAGE operator ;;
  trainer) cmd_tools; build megatron-trainer Dockerfile.trainer BASE_IMAGE trainer; check_trainer ;;
  check-trainer) check_trainer ;;
  *) die "usage: scripts/images.sh tools | base | wheelhouse EXTRA | operator | trainer | check-trainer" ;;
esac
