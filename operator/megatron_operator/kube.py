"""The one seam between the operator and the Kubernetes API (sync client; handlers are sync).

Creates children (create-only: an existing object is never re-applied, so nothing fights Kueue
or JobSet's own defaulting), server-side-applies the operator's status fields, patches a JobSet's
``suspend`` (or, under Kueue, its Workload's ``spec.active``), deletes a JobSet. Errors are translated into ``kopf``-independent exceptions:
``Conflict``-free creates (409 is success), ``TransientError`` for anything worth a retry.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

import urllib3
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from .names import (
    FIELD_MANAGER,
    GROUP,
    JOBSET_API_VERSION,
    JOBSET_GROUP,
    JOBSET_PLURAL,
    JOBSET_VERSION,
    KIND,
    KUEUE_GROUP,
    KUEUE_JOB_UID_LABEL,
    KUEUE_VERSION,
    KUEUE_WORKLOADS,
    PLURAL,
    VERSION,
)

log = logging.getLogger(__name__)


class TransientError(RuntimeError):
    """Worth retrying: API server unavailable, throttled, conflicts, timeouts."""


class NotOwned(RuntimeError):
    """A child's name is taken by an object this MegatronJob does not control (409 on create, and the
    existing object's controller ownerReference is not this job's UID). It is never used or changed."""

    def __init__(self, kind: str, namespace: str, name: str, owner: str):
        self.kind, self.namespace, self.name, self.owner = kind, namespace, name, owner
        super().__init__(f"{kind} {namespace}/{name} already exists and is not controlled by this MegatronJob "
                         f"({owner}); the operator never uses an object it did not create: delete or rename it, "
                         f"or rename the MegatronJob")


def controller_uid(obj: dict[str, Any]) -> str | None:
    """The UID of the object's controller (the ownerReference with ``controller: true``), if any."""
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("controller"):
            return ref.get("uid")
    return None


def _describe_owner(obj: dict[str, Any]) -> str:
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("controller"):
            return f"its controller is {ref.get('kind')} {ref.get('name')} uid {ref.get('uid')}"
    return "it has no controller"


class PermanentApiError(RuntimeError):
    """A request the API server refuses for good (e.g. validation, forbidden, not found)."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


_PLURALS = {"ServiceAccount": ("", "v1", "serviceaccounts"),
            "Role": ("rbac.authorization.k8s.io", "v1", "roles"),
            "RoleBinding": ("rbac.authorization.k8s.io", "v1", "rolebindings"),
            "JobSet": (JOBSET_GROUP, JOBSET_VERSION, JOBSET_PLURAL)}


# HTTP connections kept open to the API server: at least one per handler thread (kopf's executor),
# or urllib3 discards and re-opens (new TLS handshake) a connection on every call of a busy burst.
POOL_CONNECTIONS = 32


def load_config(kubeconfig: str | None = None) -> client.ApiClient:
    if kubeconfig:
        config.load_kube_config(config_file=kubeconfig)
    else:
        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
    cfg = client.Configuration.get_default_copy()
    cfg.connection_pool_maxsize = POOL_CONNECTIONS
    return client.ApiClient(cfg)


def _path(kind: str, namespace: str, name: str | None = None, sub: str | None = None) -> str:
    group, version, plural = _PLURALS[kind]
    base = f"/api/{version}" if group == "" else f"/apis/{group}/{version}"
    out = f"{base}/namespaces/{namespace}/{plural}"
    if name:
        out += f"/{name}"
    if sub:
        out += f"/{sub}"
    return out


def _raise(exc: ApiException, what: str) -> None:
    if exc.status in (429, 500, 502, 503, 504, 409) or exc.status is None or exc.status == 0:
        raise TransientError(f"{what}: HTTP {exc.status} {exc.reason}") from None
    detail = exc.body
    try:
        detail = json.loads(exc.body).get("message", exc.body)
    except (TypeError, ValueError, AttributeError):
        pass
    raise PermanentApiError(f"{what}: HTTP {exc.status}: {detail}", status=exc.status) from None


def request_label(method: str, path: str, content_type: str) -> tuple[str, str]:
    """(verb, resource) of a request as the API server's ``apiserver_request_total`` names them
    (``APPLY`` for a server-side apply, ``LIST`` for a collection read, ``jobsets/status``), so that
    the operator's own count lines up with the API server's in the benchmark's request ledger."""
    parts = [p for p in path.split("?", 1)[0].split("/") if p]
    if "namespaces" in parts and len(parts) > parts.index("namespaces") + 2:
        rest = parts[parts.index("namespaces") + 2:]
    else:  # discovery (/apis/group/version) or a cluster-scoped collection
        rest = [parts[-1]] if parts else ["/"]
    resource = rest[0] + (f"/{rest[2]}" if len(rest) > 2 else "")
    verb = method.upper()
    if verb == "PATCH" and content_type == "application/apply-patch+yaml":
        verb = "APPLY"
    elif verb == "GET" and len(rest) == 1:
        verb = "LIST"
    return verb, resource


#: Called once per API request the operator makes: (verb, resource, HTTP status, or 0 for no answer).
RequestHook = Callable[[str, str, int], None]


class Kube:
    def __init__(self, api: client.ApiClient, timeout_s: float = 30.0, on_request: RequestHook | None = None):
        self.api = api
        self.timeout_s = timeout_s
        self.on_request = on_request or (lambda verb, resource, code: None)

    def _request(self, method: str, path: str, body: Any = None, content_type: str = "application/json",
                 query: list[tuple[str, str]] | None = None) -> Any:
        """One API call; the decoded JSON body on 2xx, ApiException otherwise."""
        headers = {"Content-Type": content_type, "Accept": "application/json"}
        verb, resource = request_label(method, path, content_type)
        method, url, headers, body, _ = self.api.param_serialize(
            method, path, query_params=query or [], header_params=headers, body=body,
            auth_settings=["BearerToken"])
        try:
            resp = self.api.call_api(method, url, header_params=headers, body=body, _request_timeout=self.timeout_s)
            data = resp.read()
        except BaseException:
            self.on_request(verb, resource, 0)
            raise
        self.on_request(verb, resource, resp.status)
        if not 200 <= resp.status <= 299:
            raise ApiException(status=resp.status, reason=resp.reason, http_resp=resp,
                               body=data.decode("utf-8", "replace") if data else None)
        return json.loads(data) if data else None

    def _call(self, method: str, path: str, body: Any = None, content_type: str = "application/json",
              query: list[tuple[str, str]] | None = None) -> Any:
        try:
            return self._request(method, path, body, content_type, query)
        except ApiException as exc:
            _raise(exc, f"{method} {path}")
        except (OSError, ValueError, urllib3.exceptions.HTTPError) as exc:
            # connection refused / reset / TLS while the API server restarts
            raise TransientError(f"{method} {path}: {exc}") from None

    def create(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        """Create ``obj`` and return it as the API server stored it; None when it already exists and
        is ours (409 is success: creation is idempotent). ``NotOwned`` when the name is taken by an
        object whose controller is not the owner ``obj`` names: a job must never run under, or act
        on, someone else's identity or JobSet."""
        meta = obj["metadata"]
        what = f"create {obj['kind']} {meta['namespace']}/{meta['name']}"
        try:
            return self._request("POST", _path(obj["kind"], meta["namespace"]), body=obj,
                                 query=[("fieldManager", FIELD_MANAGER)]) or dict(obj)
        except ApiException as exc:
            if exc.status != 409:
                _raise(exc, what)
        except (OSError, ValueError, urllib3.exceptions.HTTPError) as exc:
            raise TransientError(f"{what}: {exc}") from None
        try:
            existing = self._call("GET", _path(obj["kind"], meta["namespace"], meta["name"]))
        except PermanentApiError as exc:
            if exc.status == 404:  # deleted between the create and the read: try again
                raise TransientError(f"{what}: 409, then 404 on read") from None
            raise
        if controller_uid(existing) != controller_uid(obj):
            raise NotOwned(obj["kind"], meta["namespace"], meta["name"], _describe_owner(existing))
        if (existing.get("metadata") or {}).get("deletionTimestamp"):
            raise TransientError(f"{what}: the existing one is being deleted; created once it is gone")
        return None

    def apply_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        """Server-side apply of the operator's status fields (the trainer owns status.progress)."""
        body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "metadata": {"name": name, "namespace": namespace},
                "status": status}
        path = f"/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}/{name}/status"
        self._call("PATCH", path, body=body, content_type="application/apply-patch+yaml",
                   query=[("fieldManager", FIELD_MANAGER), ("force", "true")])

    def set_jobset_suspend(self, namespace: str, name: str, suspend: bool) -> None:
        self._call("PATCH", _path("JobSet", namespace, name), body={"spec": {"suspend": suspend}},
                   content_type="application/merge-patch+json", query=[("fieldManager", FIELD_MANAGER)])

    def find_workload(self, namespace: str, jobset_uid: str) -> dict[str, Any] | None:
        """Kueue's Workload of a JobSet; None while there is none (or Kueue is not installed)."""
        path = f"/apis/{KUEUE_GROUP}/{KUEUE_VERSION}/namespaces/{namespace}/{KUEUE_WORKLOADS}"
        try:
            res = self._call("GET", path, query=[("labelSelector", f"{KUEUE_JOB_UID_LABEL}={jobset_uid}")])
        except PermanentApiError as exc:
            if exc.status == 404:
                return None
            raise
        items = sorted((res or {}).get("items") or [], key=lambda w: w["metadata"].get("creationTimestamp", ""))
        return items[-1] if items else None

    def set_workload_active(self, namespace: str, name: str, active: bool) -> None:
        path = f"/apis/{KUEUE_GROUP}/{KUEUE_VERSION}/namespaces/{namespace}/{KUEUE_WORKLOADS}/{name}"
        self._call("PATCH", path, body={"spec": {"active": active}}, content_type="application/merge-patch+json",
                   query=[("fieldManager", FIELD_MANAGER)])

    def delete_jobset(self, namespace: str, name: str) -> None:
        try:
            self._call("DELETE", _path("JobSet", namespace, name),
                       body={"apiVersion": "v1", "kind": "DeleteOptions", "propagationPolicy": "Background"})
        except PermanentApiError as exc:
            if exc.status != 404:  # already gone is what we wanted
                raise

    def missing_apis(self) -> list[str]:
        """API groups the operator needs that the cluster does not serve (JobSet, MegatronJob)."""
        missing = []
        for api_version, plural, what in ((JOBSET_API_VERSION, JOBSET_PLURAL, "the JobSet CRD (sigs.k8s.io/jobset)"),
                                          (f"{GROUP}/{VERSION}", PLURAL, "the MegatronJob CRD (crds/)")):
            try:
                res = self._call("GET", f"/apis/{api_version}")
                names = {r.get("name") for r in (res or {}).get("resources", [])}
                if plural not in names:
                    missing.append(f"{what}: {api_version} does not serve {plural}")
            except PermanentApiError as exc:
                missing.append(f"{what}: {api_version} is not served ({exc})")
        return missing
