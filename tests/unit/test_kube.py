"""Kube's error taxonomy: status codes, not message text, decide what is retried or ignored."""

from __future__ import annotations

import pytest
from kubernetes.client.exceptions import ApiException
from megatron_operator.kube import Kube, PermanentApiError, TransientError


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

