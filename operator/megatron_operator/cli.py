"""``megatron-operator``: validate, render, crd, estimate, hf-config, run.

Bad YAML, bad values or a missing file end with a one-line message per problem and a non-zero
exit code, never a traceback. Exit codes: 0 ok, 1 invalid input, 2 usage error.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

from . import __version__
from .manifest_yaml import MAX_OBJECTS, InputError, load_documents, read_text


def _documents(path: str) -> Iterator[tuple[int, Any]]:
    """(1-based document number, document) for each non-empty YAML document (bounded work:
    manifest_yaml refuses aliases and caps size, documents, nodes, depth and scalars)."""
    text = read_text(path)
    for i, doc in enumerate(load_documents(text), start=1):
        if doc is not None:
            yield i, doc


def _items(path: str, docs: list[tuple[int, Any]], multi: bool) -> Iterator[tuple[str, Any]]:
    """(where, object) for each document, with the items of a ``kind: List`` (``kubectl get -o yaml``);
    InputError beyond MAX_OBJECTS in all."""
    objects: list[tuple[str, Any]] = []
    for num, doc in docs:
        where = f"{path}[{num}]" if multi else path
        if isinstance(doc, dict) and doc.get("kind") == "List" and isinstance(doc.get("items"), list):
            objects += [(f"{where}.items[{i}]", item) for i, item in enumerate(doc["items"])]
        else:
            objects.append((where, doc))
        if len(objects) > MAX_OBJECTS:
            raise InputError(f"more than {MAX_OBJECTS} objects (documents and List items); split the file")
    return iter(objects)


def _describe(doc: Any) -> str:
    from .validation import shorten

    if isinstance(doc, dict):
        name = (doc.get("metadata") or {}).get("name") if isinstance(doc.get("metadata"), dict) else None
        return shorten(f"{doc.get('apiVersion')}/{doc.get('kind')}" + (f" {name}" if name else ""))
    return type(doc).__name__


def _jobs(paths: list[str], err: TextIO) -> tuple[list[tuple[str, Any]], int]:
    """Parse every MegatronJob document; print problems; return (jobs, number of problems)."""
    from .spec import API_VERSION, KIND
    from .validation import SpecError, is_megatronjob, looks_like_megatronjob, parse_job

    jobs: list[tuple[str, Any]] = []
    failures = 0
    for path in paths:
        try:
            docs = list(_documents(path))
            objects = _items(path, docs, len(docs) > 1)
        except InputError as exc:
            print(f"{path}: {exc}", file=err)
            failures += 1
            continue
        if not docs:
            print(f"{path}: no documents", file=err)
            failures += 1
        for where, doc in objects:
            if not is_megatronjob(doc):
                if looks_like_megatronjob(doc):  # a typo in kind or apiVersion must not pass a CI gate
                    print(f"{where}: {_describe(doc)} is not a MegatronJob: use apiVersion: "
                          f"{API_VERSION} and kind: {KIND}", file=err)
                    failures += 1
                else:
                    print(f"{where}: skipped: {_describe(doc)} is not a MegatronJob", file=err)
                continue
            doc = {k: v for k, v in doc.items() if k != "status"}  # `kubectl get` output: the spec is checked
            try:
                jobs.append((where, parse_job(doc)))
            except SpecError as exc:
                for p in exc.problems:
                    print(f"{where}: {p.message}", file=err)
                failures += len(exc.problems)
    return jobs, failures


def cmd_validate(args: argparse.Namespace) -> int:
    from .advice import size_problems, spec_warnings
    from .guardrails import guardrail_problems
    from .memory import fit_report
    from .settings import Settings

    try:  # the cluster's guardrails, as the operator reads them (defaults: the chart's)
        settings = Settings.from_env()
    except ValueError as exc:
        print(f"settings: {exc}", file=sys.stderr)
        return 2
    jobs, failures = _jobs(args.files, sys.stderr)
    for where, job in jobs:
        for p in guardrail_problems(job, settings) + size_problems(job, settings):
            print(f"{where}: {p.message}", file=sys.stderr)
            failures += 1
        for warning in spec_warnings(job):
            print(f"{where}: warning: {warning}", file=sys.stderr)
        report = fit_report(job)
        if report is not None and report.fits is False:
            level = "error" if job.spec.resources.memory_fit == "Reject" else "warning"
            print(f"{where}: {level}: {report.summary()}", file=sys.stderr)
            if level == "error":
                failures += 1
    if failures:
        return 1
    for where, job in jobs:
        print(f"{where}: {job.metadata.name}: valid")
    if not jobs:
        print("no MegatronJob found", file=sys.stderr)
        return 1
    return 0


def cmd_render(args: argparse.Namespace) -> int:
    from .crd import to_yaml
    from .render import render
    from .settings import Settings

    jobs, failures = _jobs(args.files, sys.stderr)
    if failures:
        return 1
    if not jobs:
        print("no MegatronJob found", file=sys.stderr)
        return 1
    try:
        settings = Settings.from_env()
    except ValueError as exc:
        print(f"settings: {exc}", file=sys.stderr)
        return 2
    objects: list[dict[str, Any]] = []
    for _, job in jobs:
        if job.metadata.namespace is None:
            job.metadata.namespace = args.namespace
        objects += render(job, settings)
    if args.output == "json":
        print(json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}, indent=2))
    else:
        print("\n---\n".join(to_yaml(o).rstrip() for o in objects))
    return 0


def cmd_crd(args: argparse.Namespace) -> int:
    from .crd import crd_yaml

    sys.stdout.write(crd_yaml())
    return 0


def checkpoint_figures(job) -> dict:
    """One save's size and what `keep` of them plus the one being written need on the volume."""
    from .memory import checkpoint_bytes, model_parameters

    size = checkpoint_bytes(job) / 2**30
    keep = job.spec.checkpoint.keep if job.spec.checkpoint else 0
    return {"parameters": model_parameters(job), "checkpointGiB": round(size, 2),
            "checkpointVolumeGiB": round((keep + 1) * size, 2) if keep else None}


def cmd_estimate(args: argparse.Namespace) -> int:
    from .memory import CHECKPOINT_BYTES_PER_PARAM, fit_report

    jobs, failures = _jobs(args.files, sys.stderr)
    if failures:
        return 1
    if not jobs:
        print("no MegatronJob found", file=sys.stderr)
        return 1
    results = []
    for where, job in jobs:
        report = fit_report(job, always=True)
        assert report is not None
        results.append((where, job, report))
    if args.output == "json":
        out = [{**r.as_json(), **checkpoint_figures(job)} for _, job, r in results]
        print(json.dumps(out[0] if len(out) == 1 else out, indent=2))
    else:
        for where, job, r in results:
            print(f"{where}: {job.metadata.name}")
            print(r.table())
            c = checkpoint_figures(job)
            keep = job.spec.checkpoint.keep if job.spec.checkpoint else 0
            held = (f"; keep={keep} and the one being written: {c['checkpointVolumeGiB']:.1f} GiB on the volume"
                    if keep else "; keep=0 keeps them all")
            print(f"  checkpoint: {c['checkpointGiB']:.1f} GiB per save ({c['parameters'] / 1e9:.2f} B parameters "
                  f"x {CHECKPOINT_BYTES_PER_PARAM} bytes){held}")
    return 0 if all(r.fits is not False for _, _, r in results) else 1


def cmd_hf_config(args: argparse.Namespace) -> int:
    """Print the spec.model of a Hugging Face config.json, or check manifests' spec.model against it."""
    from pydantic import ValidationError

    from .crd import to_yaml
    from .hf_config import HfConfigError, load_config, mismatches, notes, parse_config, spec_model
    from .rules import resolved_model
    from .spec import ModelSpec
    from .validation import problems_from

    try:
        config = load_config(args.config)
    except HfConfigError as exc:
        print(f"{args.config}: {exc.problems[0]}", file=sys.stderr)
        return 1

    def model_for(seq_length: int | None, from_option: bool = True) -> dict[str, Any] | None:
        try:
            hf = parse_config(config, seq_length)
        except HfConfigError as exc:
            for problem in exc.problems:
                print(f"{args.config}: {problem}", file=sys.stderr)
            return None
        if from_option and seq_length is not None and seq_length > hf.max_position_embeddings:
            print(f"{args.config}: --seq-length {seq_length} is longer than config.json max_position_embeddings "
                  f"{hf.max_position_embeddings}", file=sys.stderr)
            return None
        block = spec_model(hf)
        try:
            ModelSpec.model_validate(block)  # the spec's bounds (e.g. vocabSize, rotaryBase)
        except ValidationError as exc:
            for p in problems_from(exc):
                print(f"{args.config}: spec.model.{p.message}", file=sys.stderr)
            return None
        return {"hf": hf, "block": block}

    if args.check is None:
        found = model_for(args.seq_length)
        if found is None:
            return 1
        hf = found["hf"]
        for note in notes(hf):
            print(f"{args.config}: note: {note}", file=sys.stderr)
        print(f"# spec.model for {hf.architecture} ({Path(args.config).name}); seqLength: "
              f"{'--seq-length' if args.seq_length else 'min(max_position_embeddings, 4096)'}")
        sys.stdout.write(to_yaml({"model": found["block"]}))
        return 0
    jobs, failures = _jobs([args.check], sys.stderr)
    if failures:
        return 1
    if not jobs:
        print(f"{args.check}: no MegatronJob found", file=sys.stderr)
        return 1
    mismatched = 0
    for where, job in jobs:
        wire = job.spec.wire()
        # the fields without a derived default (moeLayerFreq, YaRN's, rotaryPercent) as written, beside the resolved
        model = {**wire.get("model", {}), **resolved_model(wire)}
        found = model_for(model["seqLength"], from_option=False)  # the job's sequence: sliding-window check
        if found is None:
            return 1
        lines = mismatches(model, found["hf"])
        for line in lines:
            print(f"{where}: {line}", file=sys.stderr)
        if lines:
            mismatched += 1
        else:
            print(f"{where}: {job.metadata.name}: spec.model matches {args.config}")
    return 1 if mismatched else 0


def cmd_run(args: argparse.Namespace) -> int:
    from .operator_main import run_operator

    return run_operator(args)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text[:80]!r}") from None
    if not 16 <= value <= 1048576:
        raise argparse.ArgumentTypeError(f"expected 16 to 1048576 (spec.model.seqLength), got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megatron-operator",
                                description="Run Megatron-Core training as Kubernetes MegatronJobs.")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    v = sub.add_parser("validate", help="check MegatronJob manifests (exit 1 on any problem)")
    v.add_argument("files", nargs="+", metavar="FILE", help="YAML files ('-' for stdin); multi-document "
                   "and kind: List ok")
    v.set_defaults(func=cmd_validate)

    r = sub.add_parser("render", help="print every object the operator would create")
    r.add_argument("files", nargs="+", metavar="FILE", help="YAML files ('-' for stdin); multi-document "
                   "and kind: List ok")
    r.add_argument("-n", "--namespace", default="default",
                   help="namespace for manifests that name none (default: default)")
    r.add_argument("-o", "--output", choices=["yaml", "json"], default="yaml")
    r.set_defaults(func=cmd_render)

    c = sub.add_parser("crd", help="print the MegatronJob CustomResourceDefinition")
    c.set_defaults(func=cmd_crd)

    e = sub.add_parser("estimate", help="predict peak GPU memory per GPU and whether it fits")
    e.add_argument("files", nargs="+", metavar="FILE", help="YAML files ('-' for stdin); multi-document "
                   "and kind: List ok")
    e.add_argument("-o", "--output", choices=["table", "json"], default="table")
    e.set_defaults(func=cmd_estimate)

    h = sub.add_parser("hf-config", help="print the spec.model of a Hugging Face config.json, or check a "
                       "MegatronJob against it (exit 1 on any mismatch)")
    h.add_argument("config", metavar="CONFIG_JSON", help="a Hugging Face model's config.json")
    h.add_argument("--seq-length", type=_positive_int, default=None, metavar="N",
                   help="training sequence length (default: min(max_position_embeddings, 4096))")
    h.add_argument("--check", metavar="MANIFEST", default=None,
                   help="check the resolved spec.model of each MegatronJob in MANIFEST against CONFIG_JSON: one "
                        "line per mismatch, naming both values")
    h.set_defaults(func=cmd_hf_config)

    o = sub.add_parser("run", help="run the operator (watches MegatronJobs)")
    o.add_argument("--namespace", action="append", default=None,
                   help="watch only this namespace (repeatable); default: all, or "
                        "MEGATRON_OPERATOR_NAMESPACES")
    o.add_argument("--kubeconfig", default=None, help="kubeconfig file (default: in-cluster, then ~/.kube/config)")
    o.add_argument("--metrics-port", type=int, default=None, help="port of /metrics and /healthz")
    o.set_defaults(func=cmd_run)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0
