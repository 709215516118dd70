"""Kube's error taxonomy: status codes, not message text, decide what is retried or ignored."""

from __future__ import annotations

import pytest
from kubernetes.client.exceptions import ApiException
from megatron_operator.kube import Kube, NotOwned, PermanentApiError, TransientError, request_label


def kube_answering(status: int, body: str = '{"message": "m"}') -> Kube:
    kube = Kube(api=None)  # type: ignore[arg-type]

    def request(*_a, **_kw):
        exc = ApiException(status=status, reason="r")
        exc.body = body
        raise exc

    kube._request = request  # type: ignore[method-assign]
    return kube


def test_deleting_a_jobset_that_is_gone_is_success():
    kube_answering(404).delete_jobset("ns", "job")


def test_a_message_that_mentions_404_is_not_a_404():
    with pytest.raises(PermanentApiError) as err:
        kube_answering(403, '{"message": "HTTP 404 is not what this is"}').delete_jobset("ns", "job")
    assert err.value.status == 403 and "HTTP 403" in str(err.value)


@pytest.mark.parametrize("status", [409, 429, 500, 503])
def test_retriable_statuses_are_transient(status):
    with pytest.raises(TransientError):
        kube_answering(status).set_jobset_suspend("ns", "job", True)



def sa(owner_uid: str | None) -> dict:
    meta = {"name": "job-trainer", "namespace": "ns"}
    if owner_uid:
        meta["ownerReferences"] = [{"apiVersion": "megatron-operator.io/v1alpha1", "kind": "MegatronJob",
                                    "name": "job", "uid": owner_uid, "controller": True}]
    return {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta}


def kube_with_existing(existing: dict | None, get_status: int = 200) -> Kube:
    """POST answers 409; GET answers ``existing`` (or ``get_status``)."""
    kube = Kube(api=None)  # type: ignore[arg-type]

    def request(method, path, *_a, **_kw):
        status = 409 if method == "POST" else get_status
        if status != 200:
            exc = ApiException(status=status, reason="r")
            exc.body = '{"message": "m"}'
            raise exc
        return existing

    kube._request = request  # type: ignore[method-assign]
    return kube


def test_409_on_an_object_this_job_controls_is_success():
    assert kube_with_existing(sa("u1")).create(sa("u1")) is None


@pytest.mark.parametrize("existing_owner", [None, "u2"])
def test_409_on_an_object_this_job_does_not_control_is_not_owned(existing_owner):
    with pytest.raises(NotOwned) as err:
        kube_with_existing(sa(existing_owner)).create(sa("u1"))
    assert "ServiceAccount ns/job-trainer already exists and is not controlled by this MegatronJob" in str(err.value)
    assert ("no controller" if existing_owner is None else "uid u2") in str(err.value)


def test_an_owner_reference_that_is_not_the_controller_does_not_count():
    existing = sa("u1")
    existing["metadata"]["ownerReferences"][0]["controller"] = False
    with pytest.raises(NotOwned):
        kube_with_existing(existing).create(sa("u1"))


def test_409_then_gone_is_retried():
    with pytest.raises(TransientError):
        kube_with_existing(None, get_status=404).create(sa("u1"))


def test_409_on_our_object_being_deleted_is_retried_not_success():
    existing = sa("u1")
    existing["metadata"]["deletionTimestamp"] = "2026-11-23T05:00:00Z"
    with pytest.raises(TransientError, match="being deleted"):
        kube_with_existing(existing).create(sa("u1"))


@pytest.mark.parametrize(("method", "path", "content_type", "label"), [
    ("POST", "/api/v1/namespaces/ns/serviceaccounts", "application/json", ("POST", "serviceaccounts")),
    ("POST", "/apis/jobset.x-k8s.io/v1alpha2/namespaces/ns/jobsets", "application/json", ("POST", "jobsets")),
    ("GET", "/apis/jobset.x-k8s.io/v1alpha2/namespaces/ns/jobsets/j", "application/json", ("GET", "jobsets")),
    ("GET", "/apis/kueue.x-k8s.io/v1beta2/namespaces/ns/workloads", "application/json", ("LIST", "workloads")),
    ("PATCH", "/apis/megatron-operator.io/v1alpha1/namespaces/ns/megatronjobs/j/status",
     "application/apply-patch+yaml", ("APPLY", "megatronjobs/status")),
    ("PATCH", "/apis/jobset.x-k8s.io/v1alpha2/namespaces/ns/jobsets/j", "application/merge-patch+json",
     ("PATCH", "jobsets")),
    ("DELETE", "/apis/jobset.x-k8s.io/v1alpha2/namespaces/ns/jobsets/j", "application/json", ("DELETE", "jobsets")),
    ("GET", "/apis/jobset.x-k8s.io/v1alpha2", "application/json", ("LIST", "v1alpha2")),
])
def test_requests_are_labelled_as_the_api_server_counts_them(method, path, content_type, label):
    # the benchmark's ledger puts the operator's count beside apiserver_request_total's (verb, resource)
    assert request_label(method, path, content_type) == label


class FakeResponse:
    def __init__(self, status: int, data: bytes = b"{}"):
        self.status, self.reason, self._data, self.headers = status, "r", data, {}

    def read(self) -> bytes:
        return self._data


class FakeApi:
    """Just enough of kubernetes.client.ApiClient for Kube._request."""

    def __init__(self, *answers):
        self.answers = list(answers)

    def param_serialize(self, method, path, **_kw):
        return method, path, {}, None, None

    def call_api(self, *_a, **_kw):
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


def test_every_request_is_counted_with_its_answer_failures_included():
    seen = []
    kube = Kube(FakeApi(FakeResponse(201), FakeResponse(409), FakeResponse(200, b'{"metadata": {}}'),
                        OSError("reset")),  # type: ignore[arg-type]
                on_request=lambda verb, resource, code: seen.append((verb, resource, code)))
    obj = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "a", "namespace": "ns"}}
    kube.create(obj)
    with pytest.raises(NotOwned):  # 409, then the GET finds an object without our owner reference
        kube.create({**obj, "metadata": {**obj["metadata"], "ownerReferences": [{"uid": "u", "controller": True}]}})
    with pytest.raises(TransientError):
        kube.set_jobset_suspend("ns", "j", True)
    assert seen == [("POST", "serviceaccounts", 201), ("POST", "serviceaccounts", 409),
                    ("GET", "serviceaccounts", 200), ("PATCH", "jobsets", 0)]
