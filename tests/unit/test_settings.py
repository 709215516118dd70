"""Settings: defaults, then MEGATRON_OPERATOR_* environment, then the command line's flags."""

from __future__ import annotations

import pytest
from megatron_operator.settings import Settings


def test_flags_win_over_the_environment_and_none_means_unset():
    env = {"MEGATRON_OPERATOR_METRICS_PORT": "9100", "MEGATRON_OPERATOR_NAMESPACES": "a"}
    assert Settings.from_env(env, metrics_port=9200, namespaces=None) == Settings(metrics_port=9200, namespaces="a")
    assert Settings.from_env({}, metrics_port=None) == Settings()


def test_metrics_host_is_a_setting():
    assert Settings.from_env({"MEGATRON_OPERATOR_METRICS_HOST": "127.0.0.1"}).metrics_host == "127.0.0.1"


def test_a_bad_value_names_the_variable():
    with pytest.raises(ValueError, match="MEGATRON_OPERATOR_METRICS_PORT='x'"):
        Settings.from_env({"MEGATRON_OPERATOR_METRICS_PORT": "x"})


def test_boolean_settings_read_true_and_false():
    from megatron_operator.settings import Settings

    assert Settings.from_env({"MEGATRON_OPERATOR_REQUIRE_QUEUE_NAME": "false"}).require_queue_name is False
    assert Settings.from_env({"MEGATRON_OPERATOR_REQUIRE_QUEUE_NAME": "true"}).require_queue_name is True
    import pytest
    with pytest.raises(ValueError, match="use true or false"):
        Settings.from_env({"MEGATRON_OPERATOR_DENY_SECRET_ENV": "maybe"})


def test_kueue_tp_group_topology_must_be_a_label_key():
    assert Settings.from_env({"MEGATRON_OPERATOR_KUEUE_TP_GROUP_TOPOLOGY": "kubernetes.io/hostname"}
                             ).kueue_tp_group_topology == "kubernetes.io/hostname"
    assert Settings.from_env({}).kueue_tp_group_topology == ""
    with pytest.raises(ValueError, match="not a node label key"):
        Settings.from_env({"MEGATRON_OPERATOR_KUEUE_TP_GROUP_TOPOLOGY": "host name"})
