"""The spec's blocks: a room for each block of the spec that reaches several stages.

A block module holds, for its part of the spec, what would otherwise be spread over the stage files:

- its schema: the pydantic models (on ``vocab.api.ApiModel``), which ``spec.py`` puts into ``MegatronJobSpec``;
- its admission rules: ``RULES`` (on spec) and, where a rule needs metadata.name, ``OBJECT_RULES`` (on the whole
  MegatronJob): ``vocab.rule.Rule``s, Python and CEL at once;
- its guardrails: ``GUARDRAILS`` (``vocab.guardrail.Guardrail``s) and ``guardrail_violations(part, settings)``,
  their Python twin;
- its part of the rendering: pure builders that take the block's own models (and plain values such as the job's
  name) and return the trainer's flags, env entries and ``(volume, mount)`` pairs, or add to the pod.

The blocks: ``cpu`` (spec.cpu, gpusPerNode 0), ``hf`` (spec.init, spec.export), ``object_store`` (spec.checkpoint.objectStore), ``pod`` (spec.pod),
``wandb`` (spec.logging.wandb).

A block is written in ``vocab/``, ``names``, ``expr`` and ``settings``. It never imports a stage file (``spec``,
``rules``, ``guardrails``, ``render``, or a module above them) nor another block (import-linter's contracts in
pyproject.toml): the stage files import this package and reach a block as ``blocks.<name>``.

Adding a block (``spec.cpu``, say):

1. ``blocks/cpu.py`` with the parts above that the block has, and its name in the import at the end of this file.
2. ``spec.py``: the field on ``MegatronJobSpec``, e.g. ``cpu: blocks.cpu.CpuSpec | None = Field(None,
   description=...)``; its place among the fields is its place in the CRD.
3. ``rules.py``: ``*blocks.cpu.RULES`` at the end of the blocks' list (and ``*blocks.cpu.OBJECT_RULES`` in
   ``OBJECT_RULES``); the list's order is the order of the CRD's rules.
4. ``guardrails.py``: ``GUARDRAILS += blocks.cpu.GUARDRAILS`` and ``yield from blocks.cpu.guardrail_violations(...)``
   in ``_violations``; ``python scripts/gen-chart-guardrails.py`` writes the chart's policy from the table.
5. ``render.py``: one line at each seam the block fills: ``megatron_args`` (flags), ``_env``, ``_volumes``
   (``(volume, mount)`` pairs, in the pod's order), ``_pod_spec`` (what it adds to the pod, as
   ``blocks.pod.add_to_pod``). A block that changes what the core renders (the GPUs a pod asks for, say) gives a
   builder that the core calls where it decides. A flag the trainer gets also goes into ``rules.RENDERED_FLAGS``
   (the contract table tests/test_contract.py holds the rendering to), an operator volume into
   ``names.OPERATOR_VOLUME_MOUNTS``.
6. ``.venv/bin/megatron-operator crd > crds/megatron-operator.io_megatronjobs.yaml`` and
   ``python scripts/gen-chart-crd.py``. The block's tests go where their stage's are: tests/unit/spec_table.py
   for its rules, test_render.py for its rendering, test_chart.py's GUARDRAIL_CASES for its guardrails;
   tests/unit/test_blocks.py fails while a rule or guardrail of a block is not collected.
"""

from . import cpu, hf, object_store, pod, wandb  # noqa: F401  (the stage files reach each block as blocks.<name>)
