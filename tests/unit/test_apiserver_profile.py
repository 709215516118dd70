"""bench/apiserver_profile.py: the parser of `go tool pprof -traces` and the categories of a stack. One test
runs the real `go tool pprof` on a real Go CPU profile (skipped without Go)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import apiserver_profile as P

# The shape `go tool pprof -traces` prints (header, then one block per distinct stack, leaf first).
TRACES = """File: kube-apiserver
Type: cpu
Time: 2026-11-27 07:07:05 UTC
Duration: 5s, Total samples = 1.50s (30.00%)
-----------+-------------------------------------------------------
      20ms   runtime.mallocgc
             github.com/google/cel-go/interpreter.(*evalMap).Eval
             k8s.io/apiextensions-apiserver/pkg/apiserver/schema/cel.(*Validator).validate
             k8s.io/apiserver/pkg/endpoints/handlers.CreateResource.func1
             k8s.io/apiserver/pkg/endpoints/filters.WithAuthorization.func1
             net/http.HandlerFunc.ServeHTTP
-----------+-------------------------------------------------------
     1.20s   encoding/json.(*decodeState).object
             sigs.k8s.io/structured-merge-diff/v6/typed.(*ParseableType).FromUnstructured
             k8s.io/apiserver/pkg/endpoints/handlers.UpdateResource.func1
-----------+-------------------------------------------------------
      10ms   runtime.memmove
             encoding/json.(*encodeState).string
             k8s.io/apiserver/pkg/endpoints/handlers/responsewriters.SerializeObject
             k8s.io/apiserver/pkg/endpoints/filters.WithAuthorization.func1
-----------+-------------------------------------------------------
     250us   runtime.scanobject
             runtime.gcDrain
             runtime.gcBgMarkWorker.func2
             runtime.gcBgMarkWorker
-----------+-------------------------------------------------------
      30ms   crypto/internal/fips140/aes/gcm.gcmAesEnc
             crypto/tls.(*Conn).Write
             net/http.(*conn).serve
-----------+-------------------------------------------------------
      40ms   runtime.futex
             runtime.notewakeup
             runtime.schedule
"""


def test_parse_traces_reads_every_block_with_its_unit():
    samples = P.parse_traces(TRACES)
    assert [round(s, 6) for s, _ in samples] == [0.02, 1.2, 0.01, 0.00025, 0.03, 0.04]
    assert samples[0][1][0] == "runtime.mallocgc" and samples[0][1][-1] == "net/http.HandlerFunc.ServeHTTP"
    assert len(samples[1][1]) == 3


def test_a_stack_belongs_to_the_subsystem_nearest_its_leaf_then_to_the_kind_of_work():
    cats = [P.categorize(frames) for _, frames in P.parse_traces(TRACES)]
    # CEL's allocation is CEL's; managed fields' JSON decoding is managed fields'; the response's JSON is JSON
    # (the authorization filter wraps every request and names none); a GC worker; TLS; the scheduler.
    assert cats == ["CEL", "managed fields", "JSON", "garbage collector", "TLS, HTTP", "other"]
    seconds = P.breakdown(P.parse_traces(TRACES))
    assert seconds["managed fields"] == pytest.approx(1.2) and seconds["CEL"] == pytest.approx(0.02)
    assert sum(seconds.values()) == pytest.approx(1.30025) and set(seconds) == set(P.CATEGORIES)


def test_table_is_in_ms_per_job():
    rows = {"ours-100": dict.fromkeys(P.CATEGORIES, 0.0), "peer-100": dict.fromkeys(P.CATEGORIES, 0.0)}
    rows["ours-100"]["CEL"], rows["peer-100"]["JSON"] = 1.0, 0.5
    text = P.table(rows, 100)
    assert "| CEL | 10.0 | 0.0 |" in text and "| JSON | 0.0 | 5.0 |" in text
    assert text.splitlines()[-1] == "| total | **10.0** | **5.0** |"
    assert "managed fields" not in text  # rows that are zero everywhere are left out


@pytest.mark.skipif(shutil.which("go") is None, reason="needs Go for a real profile and `go tool pprof`")
def test_a_real_go_profile_through_go_tool_pprof(tmp_path):
    """A Go program that spends its time in encoding/json, profiled by runtime/pprof: the real tool's output
    parses, the samples add up to most of the 1.5 s the program ran, and JSON is the largest category."""
    (tmp_path / "main.go").write_text("""package main
import ("encoding/json"; "os"; "runtime/pprof"; "time")
func main() {
	f, _ := os.Create(os.Args[1]); pprof.StartCPUProfile(f)
	for t := time.Now(); time.Since(t) < 1500*time.Millisecond; {
		b, _ := json.Marshal(map[string]any{"spec": []int{1, 2, 3}, "name": "job"})
		var m map[string]any; _ = json.Unmarshal(b, &m)
	}
	pprof.StopCPUProfile(); f.Close()
}
""")
    (tmp_path / "go.mod").write_text("module local/prof\n\ngo 1.26\n")
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "megatron-operator" / "test-go-build"
    env = {**os.environ, "GOFLAGS": "-mod=mod", "GOCACHE": str(cache), "GOTOOLCHAIN": "local", "CGO_ENABLED": "0"}
    prof = tmp_path / "cpu.pb.gz"
    subprocess.run(["go", "run", ".", str(prof)], cwd=tmp_path, env=env, check=True, timeout=300)
    samples = P.parse_traces(subprocess.run(["go", "tool", "pprof", "-traces", str(prof)], capture_output=True,
                                            text=True, check=True, env=env, timeout=120).stdout)
    assert samples
    seconds = P.breakdown(samples)
    assert max(seconds, key=seconds.get) == "JSON", seconds
    assert sum(seconds.values()) > 0.5, seconds


def test_the_ledger_prints_the_profile_by_system_with_ours_minus_the_peer():
    import request_ledger as L

    def burst(system, cel, json_s):
        return {"system": system, "jobs": 100, "apiserver_profile": {"cpu_s": {"CEL": cel, "JSON": json_s}}}

    runs = [{"results": [burst("ours", 1.0, 0.4), burst("peer", 0.0, 0.5)]},
            {"results": [burst("ours", 3.0, 0.6), burst("peer", 0.0, 0.3)]}]
    lines = L.profile_lines(runs, 100)
    assert "| CEL | 20.0 | 0.0 | +20.0 |" in lines  # medians over the two runs: 10 and 30 ms per job
    assert "| JSON | 5.0 | 4.0 | +1.0 |" in lines
    assert "| total | 25.0 | 4.0 | +21.0 |" in lines
    assert L.profile_lines([{"results": [{"system": "ours", "jobs": 100}]}], 100) == []
