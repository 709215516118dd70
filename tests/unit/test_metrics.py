from megatron_operator.metrics import Metrics


def test_phase_gauges_follow_jobs():
    m = Metrics()
    m.set_phase("a", "j1", "Running")
    m.set_phase("a", "j2", "Running")
    m.set_phase("a", "j1", "Failed")
    text = m.exposition()[0].decode()
    assert 'megatron_operator_jobs{phase="Running"} 1.0' in text
    assert 'megatron_operator_jobs{phase="Failed"} 1.0' in text
    assert 'megatron_operator_job_phase{name="j1",namespace="a",phase="Failed"} 1.0' in text
    assert 'megatron_operator_job_phase{name="j1",namespace="a",phase="Running"}' not in text
    m.forget("a", "j1")
    text = m.exposition()[0].decode()
    assert 'name="j1"' not in text and 'megatron_operator_jobs{phase="Failed"} 0.0' in text


def test_jobset_latency_histogram():
    m = Metrics()
    m.observe_jobset_created("2026-01-01T00:00:00Z")
    assert "megatron_operator_jobset_creation_seconds_count 1.0" in m.exposition()[0].decode()


def test_goodput_gauges_follow_the_trainers_figures_and_go_with_the_job():
    from megatron_operator.metrics import Metrics

    m = Metrics()
    m.set_goodput("ns", "a", {"ratio": 0.91, "wallSeconds": 480.0, "productiveSeconds": 437.0, "lostSeconds": 12.0,
                              "startupSeconds": "30", "attempts": 3})
    m.set_goodput("ns", "b", "not a dict")
    text = m.exposition()[0].decode()
    assert 'megatron_operator_job_goodput_ratio{name="a",namespace="ns"} 0.91' in text
    assert 'megatron_operator_job_time_seconds{kind="lost",name="a",namespace="ns"} 12.0' in text
    assert 'kind="startup"' not in text  # not a number: skipped
    assert 'name="b"' not in text
    m.forget("ns", "a")
    assert 'name="a"' not in m.exposition()[0].decode()
