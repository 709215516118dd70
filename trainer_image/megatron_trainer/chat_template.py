"""A user's chat template, rendered so that it can fail only its own job, once and clearly.

A chat template is a program the job's author supplies (tokenizer_config.json's ``chat_template``,
chat_template.jinja, or ``spec.data.sft.chatTemplate``). Jinja's ImmutableSandboxedEnvironment keeps it
from Python's internals (no ``_`` attributes, no mutating lists or dicts, ``range`` of at most 100000),
but not from running for hours, allocating gigabytes or recursing until the interpreter gives up. So
the template never runs in the trainer's process. ``TemplateWorker`` starts this file as a worker
(``python -s -P chat_template.py`` with an environment of its own: the standard library and jinja2, nothing
of the trainer's) that compiles the template once and answers one JSON line per request over a pipe:

- **Memory**: the worker's address space is capped (``MAX_WORKER_BYTES``, RLIMIT_AS): an allocation past
  it raises MemoryError where the template made it.
- **Time**: each request has ``RENDER_TIMEOUT_S`` (compiling, ``COMPILE_TIMEOUT_S``); a timer in the worker
  raises inside the template when it runs out. The trainer waits ``WAIT_GRACE_S`` longer for each answer
  and kills a worker that gives none (an operation that never returns to the interpreter).
- **Output**: a rendering is collected piece by piece and stops past ``MAX_RENDER_CHARS``.
- **Inside the sandbox**: ``*``, ``**`` and ``%`` are checked before they run (a string or list repeated
  past ``MAX_RENDER_CHARS``, an integer past ``MAX_INT_BITS``, a printf width past ``MAX_RENDER_CHARS``:
  C loops the timer cannot interrupt, and no longer folded at compile time), and ``tojson``'s indent is
  bounded.
- **Crashes**: whatever the worker does, the trainer sees JSON lines or the pipe closing. A worker that
  dies (a C stack overflow in the compiler, the kernel's OOM killer) is a failure of the template.

A failure names the template's file and line (Jinja's line table maps the compiled code back to the
template). ``TemplateFailure.fatal`` says whether it is the template's fault whatever the data (time,
memory, output, a dead worker, a template that does not compile: the job stops at once) or an error
the template raised for one conversation (``raise_exception``, a division by zero, a self-calling macro:
the line policy decides). This module imports only the standard library and jinja2.
"""

from __future__ import annotations

import json
import os
import queue
import re
import subprocess
import sys
import threading
from pathlib import Path

#: The worker's address space (Python and jinja2 map about 60 MiB of it).
MAX_WORKER_BYTES = 1 << 30
#: One request (one conversation's renderings); a conversation renders in milliseconds.
RENDER_TIMEOUT_S = 30.0
COMPILE_TIMEOUT_S = 30.0
#: How much longer the trainer waits for an answer before it kills the worker.
WAIT_GRACE_S = 15.0
#: One rendering: a JSONL line holds at most 4 MiB (sft.MAX_LINE_BYTES); its rendering 4 times that.
MAX_RENDER_CHARS = 16 << 20
#: An answer on the pipe: a rendering as JSON (ASCII escapes: up to 12 bytes a character) and its spans.
MAX_ANSWER_BYTES = 12 * MAX_RENDER_CHARS + (1 << 20)
#: Integers a template computes (``*``, ``**``): far beyond any token id or length.
MAX_INT_BITS = 1 << 16
#: A chat template is a few kB (Llama 3.1's, with tools, is 5 kB).
MAX_TEMPLATE_BYTES = 1 << 20
MAX_TOJSON_INDENT = 64
#: What the trainer sends the worker (its values rule: tests lower them).
_LIMITS = ("MAX_WORKER_BYTES", "RENDER_TIMEOUT_S", "COMPILE_TIMEOUT_S", "MAX_RENDER_CHARS", "MAX_INT_BITS",
           "MAX_TOJSON_INDENT")


class TemplateFailure(Exception):
    """The template failed: the message names its file and line; ``fatal``: whatever the data (see above)."""

    def __init__(self, message: str, fatal: bool):
        super().__init__(message)
        self.message, self.fatal = message, fatal


# ---------------------------------------------------------------------------------------- the worker side
class _Deadline(BaseException):
    """Raised by the timer inside the template. A BaseException: no ``except Exception`` of Jinja's or a
    filter's can swallow it."""


class _Limit(Exception):
    """A bound of this module, hit inside the template."""


#: The width and precision of each printf-style conversion ("%%" is not one).
_PRINTF_SIZES = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\d+|\*)?(?:\.(\d+|\*))?")


def _sandbox():
    """The sandboxed environment with transformers' globals and this module's bounds."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):  # transformers' {% generation %} block: rendered as its body here
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body, lineno=lineno)

    class Sandbox(ImmutableSandboxedEnvironment):
        # Intercepted operators are also never folded at compile time (nodes.BinExpr.as_const).
        intercepted_binops = frozenset({"*", "**", "%"})

        def call_binop(self, context, operator, left, right):
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_RENDER_CHARS:
                        raise _Limit(f"repeats a {type(seq).__name__} of length {len(seq)} {n} times: more than "
                                     f"{MAX_RENDER_CHARS} items")
                if isinstance(left, int) and isinstance(right, int) and \
                        left.bit_length() + right.bit_length() > MAX_INT_BITS:
                    raise _Limit(f"multiplies integers past {MAX_INT_BITS} bits")
            if operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0 and \
                    abs(left) > 1 and right * (abs(left).bit_length() - 1) > MAX_INT_BITS:
                raise _Limit(f"raises an integer to a power past {MAX_INT_BITS} bits")
            if operator == "%" and isinstance(left, str):  # printf-style: '%0999999999d' % 1
                for spec in _PRINTF_SIZES.finditer(left):
                    if any(n == "*" or (n and int(n) > MAX_RENDER_CHARS) for n in spec.groups()):
                        raise _Limit(f"formats with a width or precision {spec.group(0)[:20]!r}: at most "
                                     f"{MAX_RENDER_CHARS}, and no '*'")
            return super().call_binop(context, operator, left, right)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        if not (indent is None or (isinstance(indent, int) and 0 <= indent <= MAX_TOJSON_INDENT)
                or (isinstance(indent, str) and len(indent) <= MAX_TOJSON_INDENT)):
            raise _Limit(f"tojson indent {str(indent)[:20]!r}: at most {MAX_TOJSON_INDENT}")
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        from datetime import datetime

        return datetime.now().strftime(fmt)

    env = Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


class ChatTemplate:
    """A compiled template in the sandbox (the worker's side: the trainer uses TemplateWorker). Raises
    TemplateFailure naming ``name`` and the template's line."""

    def __init__(self, source: str, name: str, special_tokens: dict[str, str]):
        self.name = name
        self._special = dict(special_tokens)
        self._filename = f"<chat template {name}>"
        self._template = None
        try:
            env = _sandbox()
            code = env.compile(source, name=name, filename=self._filename)
            self._template = env.template_class.from_code(env, code, env.make_globals(None))
        except (_Deadline, Exception) as e:  # TemplateSyntaxError, RecursionError, SyntaxError ("too many
            raise self.failure(e, compiling=True) from None  # statically nested blocks"), MemoryError, ...

    def _line(self, exc: BaseException) -> int | None:
        """The template line the exception was raised at (the innermost frame of the compiled template)."""
        lineno = getattr(exc, "lineno", None) if type(exc).__name__ == "TemplateSyntaxError" else None
        tb = exc.__traceback__
        while tb is not None and self._template is not None:
            if tb.tb_frame.f_code.co_filename == self._filename:
                lineno = self._template.get_corresponding_lineno(tb.tb_lineno)
            tb = tb.tb_next
        return lineno

    def failure(self, exc: BaseException, compiling: bool = False) -> TemplateFailure:
        """The TemplateFailure for an exception raised while compiling or rendering: "the chat template
        (FILE, line N) <what happened>". Fatal unless it is an error the template raised for the data."""
        line = self._line(exc)
        where = f"{self.name}, line {line}" if line else self.name
        doing = "compiling" if compiling else "rendering a conversation"
        if isinstance(exc, _Deadline):
            limit = COMPILE_TIMEOUT_S if compiling else RENDER_TIMEOUT_S
            return TemplateFailure(f"the chat template ({where}) is still {doing} after {limit:g} s (a chat "
                                   "template renders a conversation in milliseconds)", True)
        if isinstance(exc, MemoryError):
            return TemplateFailure(f"the chat template ({where}) needs more than {MAX_WORKER_BYTES >> 20} MiB of "
                                   f"memory {doing}", True)
        if isinstance(exc, _Limit):
            return TemplateFailure(f"the chat template ({where}) {exc}", True)
        if isinstance(exc, RecursionError):
            text = "nested too deeply" if compiling else "recursion too deep (a macro that calls itself without end?)"
        elif isinstance(exc, SyntaxError):  # Python's compiler on the generated code: its line is not the template's
            text = f"Python cannot compile it: {exc.msg}"
        else:
            text = " ".join(str(exc).split())[:300]
            if not (type(exc).__module__.startswith("jinja2") and text):
                text = f"{type(exc).__name__}: {text}"
        if compiling:
            return TemplateFailure(f"the chat template ({where}) does not compile: {text}", True)
        return TemplateFailure(f"the chat template ({where}) does not render this conversation: {text}", False)

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        context = self._template.new_context({"messages": messages, "add_generation_prompt": add_generation_prompt,
                                              "tools": None, "documents": None, **self._special})
        size = 0
        pieces = []
        try:
            for piece in self._template.root_render_func(context):  # Template.render, with the output bounded
                size += len(piece)
                if size > MAX_RENDER_CHARS:
                    raise TemplateFailure(f"the chat template ({self.name}) renders more than {MAX_RENDER_CHARS} "
                                          "characters for one conversation (a JSONL line holds at most 4 MiB)",
                                          True)
                pieces.append(piece)
        except TemplateFailure:
            raise
        except (_Deadline, Exception) as e:  # MemoryError, RecursionError, _Limit, and what the template raised
            raise self.failure(e) from None
        text = "".join(pieces)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # the data and the special tokens are checked: it comes from the template
            raise TemplateFailure(f"the chat template ({self.name}) writes text that is not valid Unicode (an "
                                  f"unpaired surrogate {text[e.start]!r} at character {e.start}), which no "
                                  "tokenizer encodes", True) from None
        return text

    def spans(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and the character spans of the assistant responses (sft.py's rule)."""
        full = self.render(messages, add_generation_prompt=False)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            prefix = self.render(messages[:i], add_generation_prompt=True)
            upto = self.render(messages[: i + 1], add_generation_prompt=False)
            if not upto.startswith(prefix) or not full.startswith(upto):
                raise TemplateFailure(f"the chat template ({self.name}) renders a conversation's earlier turns "
                                      "differently once later turns are added (it is not prefix-stable), so the "
                                      "answer tokens cannot be located; use a template that is, or one assistant "
                                      "turn per line", False)
            start, end = len(prefix), len(upto.rstrip())
            if end <= start:
                raise TemplateFailure(f"the chat template ({self.name}) renders the assistant turn of message {i} "
                                      "as nothing", False)
            spans.append((start, end))
        return full, spans


def _serve() -> int:
    """The worker: limits first, then the template from the first line, then one answer per request line."""
    import resource
    import signal

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    out = os.fdopen(os.dup(sys.stdout.fileno()), "w", encoding="ascii")
    sys.stdout = sys.stderr  # nothing but answers on the pipe

    def on_alarm(_signum, _frame):
        raise _Deadline()

    signal.signal(signal.SIGALRM, on_alarm)

    def answer(payload: dict) -> None:
        out.write(json.dumps(payload, ensure_ascii=True) + "\n")
        out.flush()

    def bounded(seconds: float, call, *args):
        signal.setitimer(signal.ITIMER_REAL, seconds)
        try:
            return call(*args)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)

    first = sys.stdin.readline()
    if not first:
        return 0
    init = json.loads(first)
    globals().update(init["limits"])  # the trainer's values (tests lower them)
    resource.setrlimit(resource.RLIMIT_AS, (MAX_WORKER_BYTES, MAX_WORKER_BYTES))
    try:
        template = bounded(COMPILE_TIMEOUT_S, ChatTemplate, init["source"], init["name"], init["special"])
    except TemplateFailure as e:
        answer({"error": e.message, "fatal": True})
        return 0
    answer({"ok": True})
    for line in sys.stdin:
        request = json.loads(line)
        messages = request["messages"]
        try:
            if request["op"] == "spans":
                text, spans = bounded(RENDER_TIMEOUT_S, template.spans, messages)
                answer({"text": text, "spans": spans})
            else:
                answer({"text": bounded(RENDER_TIMEOUT_S, template.render, messages, request["add_generation_prompt"])})
        except TemplateFailure as e:
            answer({"error": e.message, "fatal": e.fatal})
        except (_Deadline, MemoryError) as e:  # outside the template's frames, e.g. while answering
            answer({"error": template.failure(e).message, "fatal": True})
    return 0


# ---------------------------------------------------------------------------------------- the trainer side
class TemplateWorker:
    """The trainer's handle on a worker running one template (see the module docstring). Requests go out
    through a writer thread and answers come back through a reader thread, so that the worker renders a
    batch while the trainer tokenizes the one before (``submit_spans``, then ``collect_spans``). Used from
    one thread."""

    def __init__(self, source: str, name: str, special_tokens: dict[str, str]):
        self.name = name
        if len(source.encode("utf-8", "surrogatepass")) > MAX_TEMPLATE_BYTES:
            raise TemplateFailure(f"the chat template ({name}) is larger than {MAX_TEMPLATE_BYTES} bytes", True)
        # -s -P: no user site, and not the script's directory on sys.path (this package's modules, e.g.
        # config.py, must not shadow what jinja2 imports); an environment of its own (no PYTHONPATH), the
        # hash seed fixed so that every rank renders alike
        self._proc = subprocess.Popen([sys.executable, "-s", "-P", str(Path(__file__).resolve())],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                      env={"PYTHONHASHSEED": "0", "PATH": os.environ.get("PATH", "/usr/bin:/bin")},
                                      cwd="/")
        self._requests: queue.Queue[bytes | None] = queue.Queue()
        self._answers: queue.Queue[bytes | None] = queue.Queue()  # None: the pipe closed (or an answer too large)
        self._owed = 0  # answers to requests sent and not collected yet
        # the threads hold the pipes and queues, not self: an unused worker is collected (and stopped, __del__)
        threading.Thread(target=_write, args=(self._proc.stdin, self._requests), name="chat-template-writer",
                         daemon=True).start()
        threading.Thread(target=_read, args=(self._proc.stdout, self._answers), name="chat-template-reader",
                         daemon=True).start()
        limits = {k: globals()[k] for k in _LIMITS}
        self._submit([{"source": source, "name": name, "special": special_tokens, "limits": limits}])
        reply = self._collect(COMPILE_TIMEOUT_S + WAIT_GRACE_S, "compiling it")
        if "error" in reply:
            self.close()
            raise TemplateFailure(reply["error"], True)

    def render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        """One rendering (as transformers' apply_chat_template(..., tokenize=False)); TemplateFailure."""
        self._submit([{"op": "render", "messages": messages, "add_generation_prompt": add_generation_prompt}])
        reply = self._collect(RENDER_TIMEOUT_S + WAIT_GRACE_S, "rendering a conversation")
        if "error" in reply:
            raise TemplateFailure(reply["error"], reply["fatal"])
        return reply["text"]

    def spans(self, conversations: list[list[dict]]) -> list[tuple[str, list[tuple[int, int]]] | TemplateFailure]:
        """For each conversation, (rendered text, answer spans) or the TemplateFailure it raised for it
        (``collect_spans``: a fatal one ends the list)."""
        self.submit_spans(conversations)
        return self.collect_spans(len(conversations))

    def submit_spans(self, conversations: list[list[dict]]) -> None:
        """Start rendering; ``collect_spans`` takes the answers, in order."""
        self._submit([{"op": "spans", "messages": m} for m in conversations])

    def collect_spans(self, n: int) -> list[tuple[str, list[tuple[int, int]]] | TemplateFailure]:
        """The next ``n`` answers to ``submit_spans``, in order: (text, spans), or the TemplateFailure the
        template raised. A fatal failure (also a worker that gives no answer in time, or dies) ends the list
        early, as its last item, and stops the worker."""
        out: list = []
        for _ in range(n):
            try:
                reply = self._collect(RENDER_TIMEOUT_S + WAIT_GRACE_S, "rendering a conversation")
            except TemplateFailure as e:
                out.append(e)
                break
            out.append(TemplateFailure(reply["error"], False) if "error" in reply
                       else (reply["text"], [tuple(s) for s in reply["spans"]]))
        return out

    def drain(self) -> None:
        """Take and drop the answers still owed (a caller that stopped between submit_spans and
        collect_spans), so that the next request's answer is its own; a failure stops the worker."""
        try:
            while self._owed > 0 and self._proc.poll() is None:
                self._collect(RENDER_TIMEOUT_S + WAIT_GRACE_S, "rendering a conversation")
        except TemplateFailure:
            pass

    # -- the pipe
    def _submit(self, requests: list[dict]) -> None:
        if self._proc.poll() is not None:
            raise TemplateFailure(f"the chat template ({self.name}) worker is gone", True)
        for r in requests:
            self._requests.put((json.dumps(r, ensure_ascii=True) + "\n").encode())
        self._owed += len(requests)

    def _collect(self, timeout_s: float, doing: str) -> dict:
        """The next answer, waiting at most ``timeout_s``; a fatal answer stops the worker and is raised."""
        try:
            line = self._answers.get(timeout=timeout_s)
        except queue.Empty:
            line = None
            alive = True
        else:
            alive = line is not None
        if line is None:
            raise self._lost(timeout_s, doing, alive)
        self._owed -= 1
        reply = json.loads(line)
        if reply.get("fatal"):
            self.close()  # the rest of the batch would meet the same template
            raise TemplateFailure(reply["error"], True)
        return reply

    def _lost(self, timeout_s: float, doing: str, alive: bool) -> TemplateFailure:
        self.close()
        code = self._proc.returncode
        if alive:
            why = f"gave no answer within {timeout_s:g} s while {doing} (stopped)"
        elif code is not None and code < 0:
            why = f"crashed while {doing} (signal {-code}: e.g. a stack overflow in deep nesting)"
        else:
            why = f"ended while {doing} (exit code {code})"
        return TemplateFailure(f"the chat template ({self.name}) {why}", True)

    def close(self) -> None:
        """Stop the worker (idempotent); the threads then close the pipes and end."""
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait()
        self._requests.put(None)

    def __del__(self):
        if hasattr(self, "_requests"):
            self.close()


def _write(stdin, requests: queue.Queue) -> None:
    """The writer thread: requests to the worker's stdin (a pipe holds 64 kB), until None."""
    try:
        while (line := requests.get()) is not None:
            stdin.write(line)
            if requests.empty():
                stdin.flush()
    except (OSError, ValueError):  # the worker died or was stopped: the reader reports it
        pass
    finally:
        try:
            stdin.close()
        except OSError:
            pass


def _read(stdout, answers: queue.Queue) -> None:
    """The reader thread: answer lines into the queue; None when the pipe closes or an answer is larger than
    MAX_ANSWER_BYTES (the worker is not trusted with the trainer's memory)."""
    partial: list[bytes] = []
    size = 0
    try:
        while (chunk := stdout.read1(1 << 20)) and size <= MAX_ANSWER_BYTES:
            *complete, tail = chunk.split(b"\n")
            for line in complete:
                answers.put(b"".join(partial) + line)
                partial, size = [], 0
            partial.append(tail)
            size += len(tail)
    except (OSError, ValueError):
        pass
    finally:
        answers.put(None)
        stdout.close()


if __name__ == "__main__":
    sys.exit(_serve())
