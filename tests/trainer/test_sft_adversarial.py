"""Hostile SFT input (issue 52): chat templates, JSONL lines the tokenizer cannot encode, malformed
tokenizer files. Each corpus runs as the trainer runs it (tests/trainer/bounded.py: a subprocess under a
memory cap and a time limit, classified as main.py classifies): exit 3 (bad data, not retried) with one
line naming the file and line, within bounded time. A Jinja fuzz and a tokenizer-input fuzz (hypothesis)
then check the same properties over generated input."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent))
import bounded
from megatron_trainer import chat_template, sft
from megatron_trainer.chat_template import TemplateFailure, TemplateWorker
from megatron_trainer.exitcodes import NON_RETRIABLE, ExitCode
from sft_fixtures import CHATML, make_tokenizer, write_jsonl

#: Lower bounds for the tests, so that a run-away template is stopped in seconds.
LIMITS = {"RENDER_TIMEOUT_S": 3.0, "COMPILE_TIMEOUT_S": 5.0, "WAIT_GRACE_S": 5.0}
GOOD = {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi there"}]}


@pytest.fixture
def low_limits(monkeypatch):
    for name, value in LIMITS.items():
        monkeypatch.setattr(chat_template, name, value)


def run_sft(tmp_path: Path, template: str | None = CHATML, lines: list | None = None, invalid_lines: str = "error",
            fmt: str = "chat", **tokenizer) -> tuple[int, str, float]:
    tok = tokenizer.pop("tok", None) or make_tokenizer(tmp_path / "tok", template, template_file=True, **tokenizer)
    data = write_jsonl(tmp_path / "train.jsonl", lines if lines is not None else [GOOD, GOOD])
    return bounded.run("sft", str(tok), str(data), fmt, invalid_lines, env={"CHAT_TEMPLATE_LIMITS": json.dumps(LIMITS)})


def assert_bad_data(code: int, stderr: str, *needles: str) -> str:
    assert code == ExitCode.BAD_DATA and ExitCode.BAD_DATA in NON_RETRIABLE, (code, stderr[-3000:])
    line = bounded.reason(stderr)
    assert "Traceback" not in stderr and len(line) < 1500, stderr[-3000:]
    for needle in needles:
        assert needle in line, (needle, line)
    return line


# ------------------------------------------------------------------------------------ chat templates
# name: (template, pieces of the one-line reason). Each is exit 3 with the template's file (chat_template.jinja)
# and, where Python knows it, the template's line; "train.jsonl:1" where the data line matters.
TEMPLATES: dict[str, tuple[str, tuple[str, ...]]] = {
    "division by zero": ("{{ messages[0]['content'] }}\n{{ 1 // 0 }}",
                         ("train.jsonl:1:", "line 2)", "ZeroDivisionError")),
    "the sandbox's range overflow": ("{% for i in range(10 ** 6) %}{% endfor %}",
                                     ("line 1)", "MAX_RANGE")),
    "a macro calling itself": ("{% macro f(x) %}{{ f(x) }}{% endmacro %}\n{{ f(1) }}",
                               ("line 1)", "recursion too deep")),
    "deep nesting at compile time": ("{{ " + "(" * 20000 + "1" + ")" * 20000 + " }}",
                                     ("does not compile", "nested too deeply")),
    "deep if blocks": ("{% if true %}" * 5000 + "{% endif %}" * 5000, ("does not compile", "nested too deeply")),
    "too many statically nested blocks": ("{% for a in messages %}" * 25 + "x" + "{% endfor %}" * 25,
                                          ("does not compile", "too many statically nested blocks")),
    "string multiplication": ("hi\n\n{{ 'x' * 10 ** 10 }}", ("line 3)", "repeats a str")),
    "string multiplication by a variable": ("{% set n = 3000000000 %}{{ 'ab' * n }}", ("repeats a str",)),
    "list multiplication": ("{{ ([1] * 100000000)|length }}", ("repeats a list",)),
    "a huge power": ("{{ 7 ** 100000000 }}", ("line 1)", "power past")),
    "tojson with a huge indent": ("{{ messages|tojson(indent=10 ** 9) }}", ("line 1)", "tojson indent")),
    "tojson with a huge literal indent": ("{{ messages|tojson(indent=999999999) }}", ("tojson indent",)),
    "1e5 x 1e5 loops": ("{% set r = range(100000)|list %}\n{% for i in r %}{% for j in r %}{% endfor %}{% endfor %}",
                        ("train.jsonl:1:", "line 2)", "still rendering a conversation after 3 s")),
    "doubling a string": ("{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
                          "{% endfor %}{{ ns.s|length }}", ("line 1)", "MiB of memory")),
    "center by a billion": ("{{ 'x'.center(2000000000) }}", ("MiB of memory",)),
    "a printf width": ("{{ '%0999999999d' % 1 }}", ("line 1)", "formats with a width")),
    "a format width": ("{{ '{:>1999999999}'.format(1) }}", ("line 1)", "MiB of memory")),
    "output past the bound": ("{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}",
                              ("renders more than 16777216 characters",)),
    "a syntax error": ("{% for m in messages %}\n{{ m.content }}\n{% endfro %}", ("line 3)", "does not compile")),
    "raise_exception": ("{{ raise_exception('no system prompt') }}", ("train.jsonl:1:", "no system prompt")),
    "undefined": ("{{ messages[0].nothing.deeper }}", ("train.jsonl:1:", "line 1)", "has no attribute 'nothing'")),
    "reaching for Python": ("{{ ''.__class__.__mro__[1].__subclasses__() }}", ("train.jsonl:1:", "line 1)")),
    "a lone surrogate from the template": ('{% for m in messages %}{{ m.content }}{{ "\\ud800" }}{% endfor %}',
                                           ("train.jsonl:1:", "not valid Unicode", "'\\ud800'")),
    "not prefix-stable": ("{% for m in messages %}{{ m.content if loop.last else 'a' }}{% endfor %}",
                          ("train.jsonl:1:", "not prefix-stable")),
}


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_hostile_template_exits_3_with_the_template_and_its_line(tmp_path, name):
    template, needles = TEMPLATES[name]
    code, stderr, took_s = run_sft(tmp_path, template)
    line = assert_bad_data(code, stderr, "chat_template.jinja", *needles)
    # bounded: the worker's own limit, the trainer's wait for it, Python and the tokenizer starting
    assert took_s < LIMITS["RENDER_TIMEOUT_S"] + LIMITS["WAIT_GRACE_S"] + 10, (took_s, line)


@pytest.mark.parametrize("name", ["1e5 x 1e5 loops", "doubling a string", "a huge power"])
def test_a_failure_of_the_template_itself_stops_even_under_skip(tmp_path, name):
    template, needles = TEMPLATES[name]
    code, stderr, _ = run_sft(tmp_path, template, lines=[GOOD] * 50, invalid_lines="skip")
    assert_bad_data(code, stderr, "train.jsonl:1:", "stops the job whatever invalidLines says")


def test_a_template_error_on_every_line_under_skip_ends_with_no_usable_sample(tmp_path):
    code, stderr, _ = run_sft(tmp_path, TEMPLATES["division by zero"][0], lines=[GOOD] * 3, invalid_lines="skip")
    assert_bad_data(code, stderr, "train.jsonl: no usable sample", "3 skipped")


def test_a_template_error_on_one_conversation_is_one_skipped_line(tmp_path):
    template = "{% for m in messages %}{{ m.content }}{{ 1 // (m.content|length - 5) }}{% endfor %}"
    five = {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "b"}]}
    ok = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "b"}]}
    code, stderr, _ = run_sft(tmp_path, template, lines=[ok, five, ok], invalid_lines="skip")
    assert code == 0 and "3 lines, 2 used, 1 skipped {'does not render this conversation': 1}" in stderr, stderr
    code, stderr, _ = run_sft(tmp_path, template, lines=[ok, five, ok])
    assert_bad_data(code, stderr, "train.jsonl:2:", "chat_template.jinja, line 1)", "ZeroDivisionError")


def test_the_worker_dying_is_a_failure_of_the_template(tmp_path, low_limits):
    tok = make_tokenizer(tmp_path / "tok", "{% for i in range(100000) %}{% for j in range(100000) %}"
                         "{% endfor %}{% endfor %}")
    t = sft.SFTTokenizer(tok, sft.SFTOptions("chat", 64))
    t.template.submit_spans([GOOD["messages"]])
    time.sleep(0.5)
    os.kill(t.template._proc.pid, signal.SIGKILL)  # as the kernel's OOM killer would, or a segfault
    (failure,) = t.template.collect_spans(1)
    assert isinstance(failure, TemplateFailure) and failure.fatal
    assert "crashed while rendering a conversation (signal 9" in str(failure)


def test_the_worker_stops_with_its_tokenizer(tmp_path):
    t = sft.SFTTokenizer(make_tokenizer(tmp_path / "tok", CHATML), sft.SFTOptions("chat", 64))
    proc = t.template._proc
    assert proc.poll() is None
    t.close()
    assert proc.poll() is not None


def test_the_worker_sees_nothing_of_the_trainers_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "never-in-the-worker")
    probe = "{% for m in messages %}{{ m.content }}{% endfor %}{% if add_generation_prompt %}x{% endif %}"
    w = TemplateWorker(probe, "probe.jinja", {})
    environ = Path(f"/proc/{w._proc.pid}/environ").read_bytes().split(b"\0")
    w.close()
    assert sorted(e.split(b"=")[0] for e in environ if e) == [b"PATH", b"PYTHONHASHSEED"]


# --------------------------------------------------------------------------------- the Jinja fuzz
PIECES = st.sampled_from([
    "{{ messages[0]['content'] }}", "{{ m.content }}", "{{ 1 // 0 }}", "{{ 'ab' * N }}", "{{ [0] * N }}",
    "{{ N ** N }}", "{{ N * N }}", "{% for i in range(N) %}.{% endfor %}", "{{ range(N)|list|length }}",
    "{{ messages|tojson(indent=N) }}", "{{ 'x'|center(N) }}", "{{ '%0Nd' % 1 }}", "{{ '{:>N}'.format(1) }}",
    "{% set ns = namespace(s='x') %}{% for i in range(N) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "{% macro f(x) %}{{ f(x) }}{% endmacro %}{{ f(1) }}", "{{ raise_exception('no') }}", "{{ undefined_name.x }}",
    "{{ messages.__class__ }}", "{{ (messages|first).items() }}", "{{ 'x'|replace('', 'x' * N) }}",
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}", "{{ messages|length }}",
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}",
    "{{ (", ")) }}", "{% for m in messages %}", "{% endfor %}", "{% if true %}", "{% endif %}", "\n",
    "{{ 'x' ~ N }}", "{{ N|string|length }}", "{{ (N|string) * 3 }}", "{{ '\\ud800' }}",
])
NUMBERS = st.sampled_from(["0", "1", "3", "40", "100000", "10 ** 9", "2 ** 64", "-1", "999999999"])


BENIGN = st.sampled_from(["", "", "{{ bos_token }}", "{{ messages|length }}\n", "{% set x = 'a' * 3 %}",
                          "{{ (messages|first)['role']|upper }} ", "{{ range(3)|join(',') }}", "{{ eos_token }}"])
CHATML_LOOP = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
               "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@st.composite
def templates(draw) -> str:
    """A ChatML template with pieces before it: benign ones (it renders) or hostile ones (it fails)."""
    parts = draw(st.lists(PIECES if draw(st.booleans()) else BENIGN, max_size=4))
    return "".join(p.replace("N", draw(NUMBERS)) for p in parts) + CHATML_LOOP


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(source=templates())
def test_jinja_fuzz_every_template_renders_or_fails_with_one_line_in_bounded_time(low_limits, source):
    """The worker (as the trainer starts it) either renders or gives one TemplateFailure naming the template,
    within its time limit plus the trainer's grace; never another exception, never a hang."""
    start = time.monotonic()
    try:
        w = TemplateWorker(source, "fuzz.jinja", {"eos_token": "<|im_end|>"})
        try:
            results = w.spans([GOOD["messages"], GOOD["messages"] * 2])
            w.render(GOOD["messages"], add_generation_prompt=True)
        finally:
            w.close()
    except TemplateFailure as e:
        results = [e]
    took_s = time.monotonic() - start
    for r in results:
        if isinstance(r, TemplateFailure):
            event("fatal" if r.fatal else "per conversation")
            text = str(r)
            assert text.startswith("the chat template (fuzz.jinja") and "\n" not in text and len(text) < 1000, text
        else:
            event("rendered")
            assert isinstance(r[0], str) and all(0 <= s < e <= len(r[0]) for s, e in r[1])
    assert took_s < LIMITS["COMPILE_TIMEOUT_S"] + 2 * (LIMITS["RENDER_TIMEOUT_S"] + LIMITS["WAIT_GRACE_S"]) + 5


# ------------------------------------------------------------------------ data the tokenizer cannot encode
def test_a_lone_surrogate_is_one_bad_line_with_its_number(tmp_path):
    surrogate = '{"messages": [{"role": "user", "content": "a\\ud800b"}, {"role": "assistant", "content": "hi"}]}'
    code, stderr, _ = run_sft(tmp_path, lines=[GOOD, surrogate, GOOD])
    assert_bad_data(code, stderr, "train.jsonl:2:", "message 0: content is not valid Unicode", "'\\ud800'")
    code, stderr, _ = run_sft(tmp_path, lines=[GOOD, surrogate, GOOD], invalid_lines="skip")
    assert code == 0 and "3 lines, 2 used, 1 skipped {'not valid Unicode': 1}" in stderr, stderr[-2000:]


def test_a_lone_surrogate_in_a_prompt_or_completion(tmp_path):
    lines = [{"prompt": "hello", "completion": "hi"}, '{"prompt": "\\udfff", "completion": "hi"}',
             '{"prompt": "hello", "completion": "\\ud83d"}']
    code, stderr, _ = run_sft(tmp_path, lines=lines, fmt="prompt-completion")
    assert_bad_data(code, stderr, "train.jsonl:2:", '"prompt" is not valid Unicode')


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz")
    tok = make_tokenizer(d / "tok", CHATML)
    out = {(fmt, policy): sft.SFTTokenizer(tok, sft.SFTOptions(fmt, 32, invalid_lines=policy))
           for fmt in ("chat", "prompt-completion") for policy in ("error", "skip")}
    yield d, out
    for t in out.values():
        t.close()


TEXT = st.text(st.characters(codec=None, exclude_categories=()), max_size=40)  # surrogates included
WORDS = st.lists(st.sampled_from(["hello", "hi", "there", "what", "is", "1", "2", "?"]), min_size=1, max_size=6).map(" ".join)
JSONISH = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | TEXT,
                       lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
                       max_leaves=8)


@st.composite
def jsonl_lines(draw) -> bytes:
    def message(role=None):
        role = role or draw(st.sampled_from(["user", "assistant", "system"]) if draw(st.integers(0, 5))
                            else st.sampled_from(["tool", "", "ASSISTANT"]) | TEXT)
        content = draw(TEXT | JSONISH) if draw(st.integers(0, 5)) == 0 else draw(WORDS if draw(st.booleans()) else TEXT)
        return {"role": role, "content": content}

    kind = draw(st.integers(0, 9))
    if kind <= 4:
        record = {"messages": [message() for _ in range(draw(st.integers(0, 3)))] + [message("assistant")]}
    elif kind <= 7:
        record = {"prompt": draw(WORDS | TEXT), "completion": draw(WORDS | TEXT)}
    else:
        record = draw(JSONISH)
    text = json.dumps(record, ensure_ascii=True, allow_nan=True)  # \ud800 escapes survive ensure_ascii
    junk = draw(st.sampled_from([b"", b"", b"", b"", b"\xff", b"\xed\xa0\x80", b"[[[[", b"\x00", b"NaN"]))
    return text.encode() + junk


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                    HealthCheck.too_slow])
@given(lines=st.lists(jsonl_lines(), min_size=1, max_size=8), fmt=st.sampled_from(["chat", "prompt-completion"]))
def test_tokenizer_input_fuzz_bad_lines_follow_the_policy(tokenizers, lines, fmt):
    d, by_policy = tokenizers
    path = d / "fuzz.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    # skip: every line is used, dropped or skipped; only a file with no usable line is an error
    try:
        _, stats = by_policy[(fmt, "skip")].tokenize_file(str(path))
    except sft.SFTDataError as e:
        assert str(e).startswith(f"{path}: no usable sample"), e
        event("skip: no usable sample")
    else:
        counted = stats.as_dict()
        assert counted["used"] + counted["skipped"] + counted["dropped_too_long"] == counted["lines"]
        assert all(1 <= n <= len(lines) for ns in counted["skipped_lines"].values() for n in ns)
        event(f"skip: {counted['used']} used")
    # error: the first bad line stops it, with its number
    try:
        by_policy[(fmt, "error")].tokenize_file(str(path))
    except sft.SFTDataError as e:
        text = str(e)
        assert text.startswith(f"{path}:") and "\n" not in text and len(text) < 2000, text
        event("error: stopped")


def test_tokenizer_input_corpus_runs_as_the_trainer_runs(tmp_path):
    lines = [GOOD, b'{"messages": [{"role": "user", "content": "\\ud800"}]}', b"\xff\xfe", b"[" * 100000,
             b'{"prompt": 1e999999}', b'{"messages": ' + b'[{"role": "user", "content": "x"}]' * 2 + b"}",
             b'{"messages": [{"role": "user", "content": "\\u0000\\u001b[2J"}, {"role": "assistant", "content": "ok"}]}']
    data = tmp_path / "train.jsonl"
    data.write_bytes(b"\n".join(json.dumps(x).encode() if isinstance(x, dict) else x for x in lines) + b"\n")
    tok = make_tokenizer(tmp_path / "tok", CHATML)
    code, stderr, _ = bounded.run("sft", str(tok), str(data), "chat", "skip")
    assert code == 0 and "7 lines, 2 used, 5 skipped" in stderr, stderr[-3000:]
    code, stderr, _ = bounded.run("sft", str(tok), str(data), "chat", "error")
    assert_bad_data(code, stderr, "train.jsonl:2:", "not valid Unicode")


# ------------------------------------------------------------------------------------- tokenizer files
def deep(levels: int) -> str:
    return '{"a": ' + "[" * levels + "]" * levels + "}"


TOKENIZER_FILES: dict[str, tuple[dict[str, bytes | str], tuple[str, ...]]] = {
    # name: ({file: content}, pieces of the reason); the tokenizer made by make_tokenizer, then these files over it
    "tokenizer_config.json nested 100000 deep": ({"tokenizer_config.json": deep(100_000)},
                                                 ("tokenizer_config.json", "nested too deeply")),
    "tokenizer_config.json larger than 16 MiB": ({"tokenizer_config.json": '{"a": "' + "x" * (17 << 20) + '"}'},
                                                 ("tokenizer_config.json", "larger than 16777216 bytes")),
    "tokenizer_config.json not UTF-8": ({"tokenizer_config.json": b'{"eos_token": "\xff"}'},
                                        ("tokenizer_config.json", "not UTF-8")),
    "tokenizer_config.json a list": ({"tokenizer_config.json": "[]"}, ("tokenizer_config.json", "not a JSON object")),
    "tokenizer_config.json truncated": ({"tokenizer_config.json": '{"eos_token": '},
                                       ("tokenizer_config.json", "not JSON")),
    "an eos_token with a lone surrogate": ({"tokenizer_config.json": '{"eos_token": "\\ud800"}'},
                                           ("tokenizer_config.json", "unpaired surrogate")),
    "tokenizer.json nested past serde's limit": ({"tokenizer.json": '{"model": ' + "[" * 300 + "]" * 300 + "}"},
                                                 ("tokenizer.json", "the tokenizers library cannot read it")),
    "tokenizer.json garbage": ({"tokenizer.json": b"\x00\x01garbage"}, ("tokenizer.json", "cannot read it")),
    "tokenizer.json missing": ({"tokenizer.json": None}, ("tokenizer.json not found",)),
}
SFT_ONLY: dict[str, tuple[dict[str, bytes | str], tuple[str, ...]]] = {
    "chat_template list with unhashable names": (
        {"chat_template.jinja": None,
         "tokenizer_config.json": json.dumps({"eos_token": "<|im_end|>", "chat_template": [
             {"name": ["default"], "template": "x"}, {"name": {"a": 1}, "template": "y"}]})},
        ("has no chat template",)),
    "chat_template.jinja not UTF-8": ({"chat_template.jinja": b"{{ \xff }}"}, ("chat_template.jinja", "not UTF-8")),
    "chat_template.jinja larger than 1 MiB": ({"chat_template.jinja": "x" * ((1 << 20) + 1)},
                                              ("chat_template.jinja", "larger than 1048576 bytes")),
}


def tokenizer_with(tmp_path: Path, files: dict[str, bytes | str | None]) -> Path:
    tok = make_tokenizer(tmp_path / "tok", CHATML, template_file=True)
    for name, content in files.items():
        path = tok / name
        if content is None:
            path.unlink()
        else:
            path.write_bytes(content if isinstance(content, bytes) else content.encode())
    return tok


@pytest.mark.parametrize("name", sorted(TOKENIZER_FILES))
def test_a_bad_tokenizer_file_exits_3_for_pretraining_and_fine_tuning(tmp_path, name):
    files, needles = TOKENIZER_FILES[name]
    tok = tokenizer_with(tmp_path, files)
    code, stderr, _ = bounded.run("tokenizer", str(tok))  # as the trainer builds --tokenizer-model
    assert_bad_data(code, stderr, "--tokenizer-model", *needles)
    code, stderr, _ = run_sft(tmp_path, tok=tok)  # as load_sft_data reads it
    assert_bad_data(code, stderr, *needles)


@pytest.mark.parametrize("name", sorted(SFT_ONLY))
def test_a_bad_chat_template_file_exits_3(tmp_path, name):
    files, needles = SFT_ONLY[name]
    code, stderr, _ = run_sft(tmp_path, tok=tokenizer_with(tmp_path, files))
    assert_bad_data(code, stderr, *needles)


def test_a_tokenizer_stopped_at_a_bad_line_tokenizes_the_next_file_right(tmp_path):
    """A bad line stops tokenize_file while the next batch is rendering; the next file gets its own answers."""
    t = sft.SFTTokenizer(make_tokenizer(tmp_path / "tok", CHATML), sft.SFTOptions("chat", 64))
    first = write_jsonl(tmp_path / "first.jsonl", [GOOD] * 3 + ["not json"] + [GOOD] * 5)
    with pytest.raises(sft.SFTDataError, match="first.jsonl:4: not JSON"):
        t.tokenize_file(str(first), batch=2)
    other = {"messages": [{"role": "user", "content": "what is 1"}, {"role": "assistant", "content": "2"}]}
    docs, _ = t.tokenize_file(str(write_jsonl(tmp_path / "second.jsonl", [other])), batch=2)
    alone, _ = sft.SFTTokenizer(tmp_path / "tok", sft.SFTOptions("chat", 64)).tokenize_file(
        str(tmp_path / "second.jsonl"))
    assert docs.tokens.tolist() == alone.tokens.tolist()
    t.close()
