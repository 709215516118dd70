#!/usr/bin/env python3
"""A real node beside the kwok GPU nodes: the kubelet (built from the same Kubernetes modules,
`build.sh kubelet`) on containerd (Debian's package) and runc, with a CNI bridge.

    node.py up      start containerd and the kubelet, load the images, wait for the node to be Ready
    node.py down    stop the pods, the kubelet and containerd; unmount and remove what up made

Needs root (containerd, runc, mounts), the Debian packages `containerd containernetworking-plugins
iptables`, and the local cluster (`cluster.py up`). Everything lives in $MEGATRON_OPERATOR_RUN/node.

- kwok fakes only nodes annotated kwok.x-k8s.io/node=fake (cluster.py), so this node and its pods
  belong to the kubelet alone. The node is tainted `megatron-operator.io/real-node=true:NoSchedule`:
  only pods that tolerate it land here, and GPU pods keep going to the kwok nodes.
- Images come without a registry: `ctr images import` of the operator image (`make images`) and of
  a pause image built from pause/main.go (registry.k8s.io cannot be reached).
- Pods reach the API server at the address the `kubernetes` Endpoints advertise (this host's IP,
  which the serving certificate names). kwokctl binds the API server to 127.0.0.1, so a forwarder
  listens on that address. There is no kube-proxy: the ClusterIP 10.0.0.1 is not in the
  certificate, so pods set KUBERNETES_SERVICE_HOST/PORT to the advertised address (chart extraEnv).
- The kubelet's own API listens on 127.0.0.1 with anonymous access: test only.
- Cluster DNS is CoreDNS (`build.sh coredns`, e2e/cluster/coredns/main.go) with its kubernetes plugin, as
  on a real cluster: the Service `kube-system/kube-dns` has a ClusterIP, the kubelet writes it into every
  pod's resolv.conf (clusterDNS, clusterDomain cluster.local), and CoreDNS answers Service and headless-
  service names (a JobSet's pods: `<pod>.<jobset>.<namespace>.svc.cluster.local`) from the API server's
  EndpointSlices, with its own ServiceAccount and the usual `system:coredns` rights. The one departure:
  without kube-proxy nothing routes a ClusterIP, so CoreDNS runs on this host and listens on the Service's
  ClusterIP itself, added to this host's loopback device (pods reach it through their gateway, this host).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import cluster  # noqa: E402  (e2e/cluster/cluster.py: paths, binaries, helpers)

NODE_NAME = "real-node-0"
TAINT_KEY = "megatron-operator.io/real-node"
PAUSE_IMAGE = "localhost/megatron-operator-e2e/pause:1"
POD_SUBNET = "10.89.0.0/24"
BRIDGE = "mo-node0"
CNI_BIN = Path("/usr/lib/cni")
PACKAGES = "containerd containernetworking-plugins iptables"
READY_TIMEOUT_S = 120
DNS_LABEL = "lo:mo-dns"
CLUSTER_DOMAIN = "cluster.local"
#: The last octet of kube-dns's ClusterIP in the cluster's Service range (kubeadm's choice: .10).
DNS_HOST_OCTET = 10


def node_dir() -> Path:
    return cluster.run_dir() / "node"


def sock() -> Path:
    return node_dir() / "containerd" / "containerd.sock"


def log(msg: str) -> None:
    print(f"[node] {msg}", file=sys.stderr, flush=True)


def kubelet_binary() -> Path:
    return cluster.cache_dir() / "bin" / f"kubelet-{cluster.versions()['KUBE_VERSION']}" / "kubelet"


def coredns_binary() -> Path:
    """build.sh's path: keyed by the version and by main.go, whose imports are the plugins."""
    import hashlib

    key = hashlib.sha256((HERE / "coredns" / "main.go").read_bytes()).hexdigest()[:12]
    return cluster.cache_dir() / "bin" / f"coredns-{cluster.versions()['COREDNS_VERSION']}-{key}" / "coredns"


def ctr(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    proc = subprocess.run(["ctr", "--address", str(sock()), "--namespace", "k8s.io", *args],
                          capture_output=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        raise cluster.ClusterError(f"ctr {' '.join(args)} failed: {proc.stderr.decode(errors='replace')}")
    return proc


def check_prerequisites() -> None:
    if os.geteuid() != 0:
        raise cluster.ClusterError("the real node needs root (containerd, runc, mounts, a bridge)")
    def absent() -> list[str]:
        out = [t for t in ("containerd", "ctr", "runc", "containerd-shim-runc-v2", "iptables") if not shutil.which(t)]
        return out + ([] if (CNI_BIN / "bridge").exists() else [str(CNI_BIN / "bridge")])

    if absent() and shutil.which("apt-get"):
        log(f"installing {PACKAGES} (apt-get)")
        cluster.run(["apt-get", "update", "-qq"], timeout=300)
        cluster.run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES.split()], timeout=600,
                    env=dict(os.environ, DEBIAN_FRONTEND="noninteractive"))
    if missing := absent():
        raise cluster.ClusterError(f"missing {', '.join(missing)}: apt-get install --no-install-recommends {PACKAGES}")
    if not os.access(kubelet_binary(), os.X_OK):
        raise cluster.ClusterError(f"{kubelet_binary()} missing: run `e2e/cluster/build.sh kubelet`")
    if not os.access(coredns_binary(), os.X_OK):
        raise cluster.ClusterError(f"{coredns_binary()} missing: run `e2e/cluster/build.sh coredns`")


def start(name: str, argv: list[str]) -> int:
    logf = open(node_dir() / f"{name}.log", "a")
    proc = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
    return proc.pid


def write_containerd_config(d: Path) -> Path:
    cri = 'plugins."io.containerd.grpc.v1.cri"'
    text = f"""version = 2
root = "{d / 'root'}"
state = "{d / 'state'}"
[grpc]
  address = "{sock()}"
[plugins."io.containerd.internal.v1.opt"]
  path = "{d / 'opt'}"
[{cri}]
  # The sandbox refuses to lower oom_score_adj (the kubelet asks -998 for pod sandboxes; runc init
  # fails with "failed to update /proc/self/oom_score_adj: Permission denied"): keep scores >= ours.
  restrict_oom_score_adj = true
  sandbox_image = "{PAUSE_IMAGE}"
  [{cri}.containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [{cri}.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [{cri}.containerd.runtimes.runc.options]
        SystemdCgroup = false
  [{cri}.cni]
    bin_dir = "{CNI_BIN}"
    conf_dir = "{node_dir() / 'cni'}"
"""
    path = d / "config.toml"
    path.write_text(text)
    return path


def write_cni_config() -> None:
    conf = {"cniVersion": "0.4.0", "name": "mo-node", "plugins": [
        {"type": "bridge", "bridge": BRIDGE, "isGateway": True, "ipMasq": True,
         "ipam": {"type": "host-local", "ranges": [[{"subnet": POD_SUBNET}]], "routes": [{"dst": "0.0.0.0/0"}],
                  "dataDir": str(node_dir() / "cni-ipam")}},
        {"type": "portmap", "capabilities": {"portMappings": True}}]}
    (node_dir() / "cni").mkdir(parents=True, exist_ok=True)
    (node_dir() / "cni" / "10-mo-node.conflist").write_text(json.dumps(conf, indent=1))


def _image_id(image: str) -> str:
    """The podman image ID `image` names now, or "" if there is none."""
    return subprocess.run(["podman", "image", "inspect", "-f", "{{.Id}}", image], capture_output=True, text=True,
                          check=False).stdout.strip()


def build_pause_image(archive: Path) -> None:
    """A scratch image holding pause/main.go's static binary, as an OCI archive."""
    binary = node_dir() / "pause"
    env = dict(os.environ, CGO_ENABLED="0", GOTOOLCHAIN="local",
               GOCACHE=str(cluster.cache_dir() / "go-build-pause"), GOFLAGS="-mod=mod")
    subprocess.run(["go", "build", "-trimpath", "-ldflags=-s -w", "-o", str(binary), "."], cwd=HERE / "pause",
                   env=env, check=True, capture_output=True, timeout=300)
    previous = _image_id(PAUSE_IMAGE)
    ctr_id = subprocess.run(["buildah", "from", "scratch"], check=True, capture_output=True, text=True).stdout.strip()
    try:
        subprocess.run(["buildah", "copy", ctr_id, str(binary), "/pause"], check=True, capture_output=True)
        subprocess.run(["buildah", "config", "--entrypoint", '["/pause"]', "--user", "65535:65535", ctr_id],
                       check=True, capture_output=True)
        subprocess.run(["buildah", "commit", "--quiet", ctr_id, PAUSE_IMAGE], check=True, capture_output=True)
    finally:
        subprocess.run(["buildah", "rm", ctr_id], capture_output=True, check=False)
    if previous and previous != _image_id(PAUSE_IMAGE):  # the image the tag moved from (each node start makes one)
        subprocess.run(["podman", "rmi", previous], capture_output=True, check=False)
    save_image(PAUSE_IMAGE, archive)


def save_image(image: str, archive: Path) -> None:
    archive.unlink(missing_ok=True)
    subprocess.run(["podman", "save", "--quiet", "--format", "oci-archive", "-o", str(archive), image],
                   check=True, capture_output=True, timeout=300)


def load_image(image: str) -> None:
    """Copy an image from podman's storage into containerd's k8s.io namespace under the same name: `podman save`
    streamed into `ctr images import` (no archive on disk: the trainer image is 5 GB)."""
    import_args = ["images", "import", "--base-name", image.rsplit(":", 1)[0], "--digests"]
    if image == PAUSE_IMAGE:
        archive = node_dir() / "pause.tar"
        build_pause_image(archive)
        ctr(*import_args, str(archive))
        archive.unlink()
    else:
        save = subprocess.Popen(["podman", "save", "--quiet", "--format", "oci-archive", image],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        load = subprocess.run(["ctr", "--address", str(sock()), "--namespace", "k8s.io", *import_args, "-"],
                              stdin=save.stdout, capture_output=True, timeout=900, check=False)
        save.stdout.close()
        saved = save.wait(timeout=60)
        if saved != 0 or load.returncode != 0:
            raise cluster.ClusterError(f"podman save {image} | ctr images import failed (rc {saved}, {load.returncode}): "
                                       f"{save.stderr.read().decode(errors='replace')}"
                                       f"{load.stderr.decode(errors='replace')}")
    # podman's OCI archive names the image by its tag alone; tag it with the full reference too
    names = ctr("images", "list", "--quiet").stdout.decode().split()
    if image not in names:
        candidates = [n for n in names if n.startswith(image.rsplit(":", 1)[0])]
        raise cluster.ClusterError(f"{image} not in containerd after import (have {candidates})")


async def _forward(listen_host: str, port: int, target_port: int) -> None:
    async def pipe(reader, writer):
        with contextlib.suppress(ConnectionError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        writer.close()

    async def handle(reader, writer):
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", target_port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    server = await asyncio.start_server(handle, listen_host, port)
    async with server:
        await server.serve_forever()


def apiserver_endpoint(p: cluster.RunPaths) -> tuple[str, int]:
    """The address the `kubernetes` EndpointSlice advertises (this host's IP, in the serving cert)."""
    out = json.loads(cluster.kubectl(p, "get", "endpointslices", "-n", "default", "-l",
                                     "kubernetes.io/service-name=kubernetes", "-o", "json").stdout)
    eps = out["items"][0]
    return eps["endpoints"][0]["addresses"][0], eps["ports"][0]["port"]


# CoreDNS's rights on a real cluster (the system:coredns ClusterRole of kubeadm and the CoreDNS chart).
COREDNS_RBAC = """
apiVersion: v1
kind: ServiceAccount
metadata: {name: coredns, namespace: kube-system}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: "system:coredns"}
rules:
- apiGroups: [""]
  resources: [endpoints, services, pods, namespaces]
  verbs: [list, watch]
- apiGroups: [discovery.k8s.io]
  resources: [endpointslices]
  verbs: [list, watch]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: "system:coredns"}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: "system:coredns"}
subjects:
- {kind: ServiceAccount, name: coredns, namespace: kube-system}
"""


def dns_service_ip(p: cluster.RunPaths) -> str:
    """kube-dns's ClusterIP: .10 of the /24 the `kubernetes` Service's ClusterIP is in (the API server's range)."""
    ip = cluster.kubectl(p, "get", "service", "kubernetes", "-n", "default", "-o", "jsonpath={.spec.clusterIP}"
                         ).stdout.strip()
    return ".".join([*ip.split(".")[:3], str(DNS_HOST_OCTET)])


def start_dns(p: cluster.RunPaths, d: Path, state: dict) -> str:
    """CoreDNS on kube-dns's ClusterIP with its own identity; returns the ClusterIP once CoreDNS is ready."""
    ip = dns_service_ip(p)
    cluster.kubectl(p, "apply", "--server-side", "-f", "-", input=COREDNS_RBAC)
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {
        "name": "kube-dns", "namespace": "kube-system", "labels": {"k8s-app": "kube-dns"}},
        "spec": {"clusterIP": ip, "selector": {"k8s-app": "kube-dns"}, "ports": [
            {"name": "dns", "port": 53, "protocol": "UDP"}, {"name": "dns-tcp", "port": 53, "protocol": "TCP"}]}}
    cluster.kubectl(p, "apply", "--server-side", "-f", "-", input=json.dumps(service))
    token = cluster.kubectl(p, "create", "token", "coredns", "-n", "kube-system", "--duration=24h").stdout.strip()
    admin = yaml.safe_load(p.kubeconfig.read_text())
    dns = d / "dns"
    dns.mkdir(parents=True, exist_ok=True)
    kubeconfig = {"apiVersion": "v1", "kind": "Config", "current-context": "coredns",
                  "clusters": [{"name": "e2e", "cluster": admin["clusters"][0]["cluster"]}],
                  "users": [{"name": "coredns", "user": {"token": token}}],
                  "contexts": [{"name": "coredns", "context": {"cluster": "e2e", "user": "coredns"}}]}
    (dns / "kubeconfig").write_text(yaml.safe_dump(kubeconfig))
    (dns / "kubeconfig").chmod(0o600)
    # On the loopback device (this kernel has no dummy interfaces): a local address like any other, so a pod's
    # packet to it, routed through the pod's gateway (this host), is delivered to CoreDNS.
    cluster.run(["ip", "addr", "replace", f"{ip}/32", "dev", "lo", "label", DNS_LABEL], timeout=30)
    state["dns_address"] = f"{ip}/32"
    (d / "node.json").write_text(json.dumps(state))  # down removes the address even if what follows fails
    health, ready = cluster.free_port(), cluster.free_port()
    (dns / "Corefile").write_text(f"""\
.:53 {{
    bind {ip}
    health 127.0.0.1:{health}
    ready 127.0.0.1:{ready}
    errors
    log
    cache 5
    kubernetes {CLUSTER_DOMAIN} in-addr.arpa ip6.arpa {{
        kubeconfig {dns / 'kubeconfig'} coredns
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
        ttl 5
    }}
}}
""")
    state["coredns_pid"] = start("coredns", [str(coredns_binary()), "-conf", str(dns / "Corefile")])
    state["dns"] = {"ip": ip, "ready_port": ready}
    (d / "node.json").write_text(json.dumps(state))

    def answering() -> bool:
        if not cluster.pid_alive(state["coredns_pid"]):
            raise cluster.ProcessExited(f"CoreDNS exited:\n{cluster.tail(d / 'coredns.log', 40)}")
        with contextlib.suppress(OSError), urllib.request.urlopen(f"http://127.0.0.1:{ready}/ready", timeout=2) as r:
            return r.status == 200
        return False

    cluster.wait_until(answering, 60, "CoreDNS ready (its kubernetes plugin synced with the API server)")
    return ip


def stop_dns() -> None:
    """Stop the node's CoreDNS (e2e: what a job does when cluster DNS does not answer); restart_dns() brings it back."""
    state = json.loads((node_dir() / "node.json").read_text())
    cluster.stop_pid(state["coredns_pid"], "coredns")


def restart_dns() -> None:
    """CoreDNS again after stop_dns(), on the same address and configuration."""
    d = node_dir()
    state = json.loads((d / "node.json").read_text())
    if cluster.pid_alive(state["coredns_pid"]) and "coredns" in cluster.cmdline(state["coredns_pid"]):
        return
    state["coredns_pid"] = start("coredns", [str(coredns_binary()), "-conf", str(d / "dns" / "Corefile")])
    (d / "node.json").write_text(json.dumps(state))
    port = state["dns"]["ready_port"]

    def answering() -> bool:
        with contextlib.suppress(OSError), urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2) as r:
            return r.status == 200
        return False

    cluster.wait_until(answering, 60, "CoreDNS ready again")


def write_kubelet_config(d: Path, dns_ip: str) -> Path:
    config = {
        "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
        "address": "127.0.0.1", "port": cluster.free_port(), "readOnlyPort": 0, "healthzPort": 0,
        "authentication": {"anonymous": {"enabled": True}, "webhook": {"enabled": False}},
        "authorization": {"mode": "AlwaysAllow"},
        "containerRuntimeEndpoint": f"unix://{sock()}",
        "cgroupDriver": "cgroupfs", "failCgroupV1": False, "failSwapOn": False,
        "cgroupRoot": "/", "cgroupsPerQOS": True,
        "registerWithTaints": [{"key": TAINT_KEY, "value": "true", "effect": "NoSchedule"}],
        "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%", "imagefs.available": "1%"},
        "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
        "serializeImagePulls": False, "resolvConf": "/etc/resolv.conf",
        "staticPodPath": "", "maxPods": 20, "podPidsLimit": 1024, "podLogsDir": str(node_dir() / "pod-logs"),
        "clusterDNS": [dns_ip], "clusterDomain": CLUSTER_DOMAIN,
    }
    path = d / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def up() -> dict:
    check_prerequisites()
    p = cluster.paths()
    if not cluster.is_up(p):
        raise cluster.ClusterError("the local cluster is not up: run `e2e/cluster/cluster.py up` first")
    d = node_dir()
    if (d / "node.json").exists():
        raise cluster.ClusterError(f"{d / 'node.json'} exists: run `node.py down` first")
    for sub in ("containerd", "kubelet", "cni-ipam"):
        (d / sub).mkdir(parents=True, exist_ok=True)
    state: dict = {"node": NODE_NAME}
    t0 = time.monotonic()

    config = write_containerd_config(d / "containerd")
    write_cni_config()
    state["containerd_pid"] = start("containerd", ["containerd", "--config", str(config)])
    (d / "node.json").write_text(json.dumps(state))
    cluster.wait_until(lambda: sock().exists() and ctr("version", timeout=10), 30, "containerd's socket")
    log(f"containerd up in {time.monotonic() - t0:.1f} s")

    for image in (PAUSE_IMAGE, os.environ.get("MEGATRON_OPERATOR_IMAGE", "localhost/megatron-operator:dev")):
        load_image(image)
    log(f"images loaded into containerd in {time.monotonic() - t0:.1f} s")

    host, port = apiserver_endpoint(p)
    state["apiserver"] = {"host": host, "port": port}
    state["forwarder_pid"] = start("forwarder", [sys.executable, str(Path(__file__).resolve()), "forward", host,
                                                 str(port)])
    (d / "node.json").write_text(json.dumps(state))

    dns_ip = start_dns(p, d, state)
    (d / "node.json").write_text(json.dumps(state))
    log(f"CoreDNS answering on {dns_ip}:53 in {time.monotonic() - t0:.1f} s")

    kubelet_config = write_kubelet_config(d / "kubelet", dns_ip)
    state["kubelet_pid"] = start("kubelet", [
        str(kubelet_binary()), f"--config={kubelet_config}", f"--kubeconfig={p.kubeconfig}",
        f"--root-dir={d / 'kubelet' / 'root'}", f"--cert-dir={d / 'kubelet' / 'pki'}",
        f"--hostname-override={NODE_NAME}", f"--node-ip={host}",
        "--node-labels=megatron-operator.io/real-node=true", "--v=2"])
    (d / "node.json").write_text(json.dumps(state))

    def ready() -> bool:
        if not cluster.pid_alive(state["kubelet_pid"]):
            raise cluster.ProcessExited(f"the kubelet exited:\n{cluster.tail(d / 'kubelet.log', 40)}")
        out = cluster.kubectl(p, "get", "node", NODE_NAME, "-o", "json", check=False)
        if out.returncode != 0:
            return False
        conds = {c["type"]: c["status"] for c in json.loads(out.stdout)["status"].get("conditions", [])}
        return conds.get("Ready") == "True"

    cluster.wait_until(ready, READY_TIMEOUT_S, f"node {NODE_NAME} Ready")
    log(f"node {NODE_NAME} Ready in {time.monotonic() - t0:.1f} s")
    return state


def down() -> None:
    d = node_dir()
    state_file = d / "node.json"
    state = json.loads(state_file.read_text()) if state_file.exists() else {}
    if state.get("kubelet_pid") and cluster.pid_alive(state["kubelet_pid"]) and cluster.is_up():
        # the kubelet tears its pods down properly (CNI DEL: addresses, iptables rules, netns)
        p = cluster.paths()
        selector = f"--field-selector=spec.nodeName={state['node']}"
        cluster.kubectl(p, "delete", "pods", "--all-namespaces", selector, "--grace-period=1", "--wait=false",
                        check=False)
        with contextlib.suppress(cluster.ClusterError):
            cluster.wait_until(lambda: not cluster.kubectl(p, "get", "pods", "--all-namespaces", selector,
                                                           "-o", "name").stdout.strip(), 60, "the node's pods to go")
    if state.get("kubelet_pid"):
        cluster.stop_pid(state["kubelet_pid"], "kubelet")
    if state.get("containerd_pid") and sock().exists():
        # the pods' containers outlive containerd (each has a shim): stop them first
        with contextlib.suppress(cluster.ClusterError, subprocess.TimeoutExpired):
            for task in ctr("tasks", "list", "--quiet", timeout=30).stdout.decode().split():
                with contextlib.suppress(cluster.ClusterError):
                    ctr("tasks", "kill", "--signal", "SIGKILL", task, timeout=30)
        cluster.wait_until(lambda: not ctr("tasks", "list", "--quiet", timeout=30).stdout.strip(), 30,
                           "the node's containers to stop")
    if state.get("containerd_pid"):  # also without its socket (a run killed half-way): only if it is still containerd
        cluster.stop_pid(state["containerd_pid"], "containerd")
    if state.get("forwarder_pid"):
        cluster.stop_pid(state["forwarder_pid"], "forward")
    if state.get("coredns_pid"):
        cluster.stop_pid(state["coredns_pid"], "coredns")
    if state.get("dns_address"):
        subprocess.run(["ip", "addr", "del", state["dns_address"], "dev", "lo"], capture_output=True, check=False)
    # kubelet volume and containerd snapshot mounts under the node dir, deepest first
    cluster.unmount_under(d)
    subprocess.run(["ip", "link", "delete", BRIDGE], capture_output=True, check=False)
    remove_cni_nat_rules()
    if d.exists():
        logs = cluster.run_dir() / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        for f in d.glob("*.log"):
            shutil.copy(f, logs / f"node-{f.name}")
        shutil.rmtree(d, ignore_errors=True)
    if state.get("node"):
        cluster.kubectl(cluster.paths(), "delete", "node", state["node"], "--ignore-not-found", check=False)


def remove_cni_nat_rules() -> None:
    """The bridge plugin's masquerade rules of pods that were not torn down (e.g. the kubelet died)."""
    rules = subprocess.run(["iptables", "-t", "nat", "-S"], capture_output=True, text=True, check=False).stdout
    ours = [line for line in rules.splitlines() if 'name: \\"mo-node\\"' in line]
    chains = {m for line in ours for m in re.findall(r"-j (CNI-[0-9a-f]+)", line)}
    for line in ours:
        if line.startswith("-A POSTROUTING"):
            subprocess.run(["iptables", "-t", "nat", "-D", *shlex.split(line)[1:]], capture_output=True, check=False)
    for chain in chains:
        subprocess.run(["iptables", "-t", "nat", "-F", chain], capture_output=True, check=False)
        subprocess.run(["iptables", "-t", "nat", "-X", chain], capture_output=True, check=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("up")
    sub.add_parser("down")
    fwd = sub.add_parser("forward", help="(internal) forward HOST:PORT to 127.0.0.1:PORT")
    fwd.add_argument("host")
    fwd.add_argument("port", type=int)
    args = parser.parse_args(argv)
    try:
        if args.cmd == "up":
            print(json.dumps(up()))
        elif args.cmd == "down":
            down()
        else:
            signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
            asyncio.run(_forward(args.host, args.port, args.port))
    except cluster.ClusterError as e:
        log(f"ERROR: {e}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
